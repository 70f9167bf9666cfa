"""SR-IOV virtual functions, each its own device: vfio-pci VFs for DPDK/VMs, netdev VFs for CNIs,
and the VFs of any other PF (QAT crypto/compression, NVMe, GPUs).

A pool is always configuration (which PF, which VF indexes, which driver), so nothing is served
by default; the selectors mirror the SR-IOV network device plugin's so its configs translate.
"""
