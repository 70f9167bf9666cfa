"""Intel QAT (QuickAssist, Gen4 "4xxx") endpoints for FakeTree, laid out as the kernel shows them.

Where each detail comes from:

* PCI ids: PF 8086:4940 (4xxx), 4942 (401xx), 4944 (402xx); their VFs 4941/4943/4945
  (drivers/crypto/intel/qat/qat_common/adf_accel_devices.h, and the VF-id -> driver map of
  Intel's QAT device plugin). Class 0x0b4000 (co-processor), as lspci shows them.
* The PF is bound to ``4xxx`` (qat_4xxx/adf_drv.c, ADF_4XXX_DEVICE_NAME); its VFs to vfio-pci
  (mainline has no Gen4 VF crypto driver: VFs are meant for userspace/VMs) or to ``4xxxvf``,
  the VF driver of Intel's out-of-tree QAT package, which the device plugin also knows.
* SR-IOV: ``sriov_numvfs``/``sriov_totalvfs``, VFs at the PF's routing id + 1 (First VF
  Offset 1, stride 1, so VFs of 0000:6b:00.0 are 6b:00.1, 6b:00.2, ...), each with its own
  IOMMU group, ``physfn`` and ``virtfnN`` links (drivers/pci/iov.c). Gen4 silicon has 16 VFs
  per endpoint; the default here is 16, the scale shapes ask for more.
* ``<pf>/qat/``: ``state`` ("up"/"down"), ``cfg_services`` ("sym;asym", "dc", ...),
  ``pm_idle_enabled``, ``num_rps`` and ``rp2srv``, whose read fails with EINVAL until a ring
  pair is chosen (adf_sysfs.c); the unreadable file is a directory here, which fails the same
  way for the reader.
* debugfs ``/sys/kernel/debug/qat_4xxx_<pf address>/heartbeat/{status,queries_sent,
  queries_failed,config}`` (adf_heartbeat_dbgfs.c, named by adf_dbgfs.c); ``status`` holds
  "0" or "-1", a newline and the terminating NUL the kernel copies out (``len + 1``).
* Optionally the vfio device cdev of each vfio VF (fake_net.vfio_cdev) for iommufd.
"""

from __future__ import annotations

import os
from typing import Collection, Optional

from host.sim.fake_net import SriovPf, sriov_pf, vfio_cdev
from host.sim.tree import FakeTree

QAT_4XXX = (0x4940, 0x4941)
QAT_401XX = (0x4942, 0x4943)
QAT_402XX = (0x4944, 0x4945)
QAT_CLASS = 0x0B4000


def heartbeat_status(tree: FakeTree, pf_address: str, value: Optional[str],
                     driver: str = "4xxx") -> str:
    """Write (or, with None, remove) the PF's debugfs heartbeat status; returns its path."""
    base = f"/sys/kernel/debug/qat_{driver}_{pf_address}/heartbeat"
    path = f"{base}/status"
    if value is None:
        tree.remove(base)
        return path
    tree.mkdir(base)
    with open(tree.real(path), "wb") as handle:
        handle.write(value.encode() + b"\n\0")
    for name, text in (("queries_sent", "120"), ("queries_failed", "0"), ("config", "500")):
        with open(tree.real(f"{base}/{name}"), "wb") as handle:
            handle.write(text.encode() + b"\n\0")
    return path


def qat_pf(
    tree: FakeTree,
    address: str,
    *,
    ids: tuple = QAT_4XXX,
    numvfs: int = 16,
    totalvfs: Optional[int] = None,
    services: Optional[str] = "sym;asym",
    state: str = "up",
    heartbeat: Optional[str] = "0",
    driver: str = "4xxx",
    vf_driver: Optional[str] = "4xxxvf",
    vfio: Collection[int] = (),
    unbound: Collection[int] = (),
    numa_node: Optional[int] = 0,
    local_cpulist: Optional[str] = None,
    parent: Optional[str] = None,
    iommu_group: Optional[int] = None,
    vf_iommu_group: Optional[int] = None,
    dev_nodes: bool = True,
    cdev_base: Optional[int] = None,
) -> SriovPf:
    """One QAT endpoint with ``numvfs`` VFs: those in ``vfio`` on vfio-pci (group nodes unless
    ``dev_nodes`` is False; device cdevs numbered from ``cdev_base`` when given), those in
    ``unbound`` on no driver, the rest on ``vf_driver``. ``heartbeat=None`` leaves debugfs
    out (not mounted, or not readable in a container)."""
    pf = sriov_pf(
        tree,
        address,
        vendor=0x8086,
        device=ids[0],
        vf_device=ids[1],
        pci_class=QAT_CLASS,
        numvfs=numvfs,
        totalvfs=totalvfs if totalvfs is not None else max(numvfs, 16),
        driver=driver,
        vf_driver=vf_driver,
        vfio=vfio,
        unbound=unbound,
        ifname=None,
        vf_ifname=None,
        numa_node=numa_node,
        local_cpulist=local_cpulist,
        parent=parent,
        iommu_group=iommu_group,
        vf_iommu_group=vf_iommu_group,
        vf_offset=1,
        vf_stride=1,
        dev_nodes=dev_nodes,
    )
    qat = f"{pf.path}/qat"
    tree.attr(f"{qat}/state", state)
    if services is not None:
        tree.attr(f"{qat}/cfg_services", services)
    tree.attr(f"{qat}/pm_idle_enabled", "1")
    tree.attr(f"{qat}/num_rps", "64")
    tree.mkdir(f"{qat}/rp2srv")  # EINVAL until a ring pair is written: unreadable
    if heartbeat is not None:
        heartbeat_status(tree, address, heartbeat, driver)
    if cdev_base is not None:
        index = cdev_base
        for number in sorted(vfio):
            vfio_cdev(tree, pf.vf_paths[number], index, dev_node=dev_nodes)
            index += 1
    return pf


def remove_debugfs(tree: FakeTree) -> None:
    """debugfs unmounted (or hidden from a container): the whole tree gone."""
    if os.path.isdir(tree.real("/sys/kernel/debug")):
        tree.remove("/sys/kernel/debug")
