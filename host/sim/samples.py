"""The sample machine ``demo`` runs on: a small two-socket server with devices of several kinds
(GPUs of two vendors, SR-IOV VFs, an RDMA HCA, a USB serial dongle), laid out as real
sysfs/dev/proc files under a temporary root, and the config that serves them."""

from __future__ import annotations

from typing import Tuple

from host.core.model import ResourceConfig
from host.sim import fake_gpu, fake_net, fake_usb
from host.sim.tree import FakeTree


def build_demo_tree(root: str) -> FakeTree:
    tree = FakeTree(root)
    tree.numa_nodes(2, cpus_per_node=8)
    fake_gpu.add_nvidia_control_nodes(tree)
    for index, (address, node) in enumerate(
        [("0000:18:00.0", 0), ("0000:3b:00.0", 0), ("0000:86:00.0", 1), ("0000:af:00.0", 1)]
    ):
        fake_gpu.add_nvidia_gpu(
            tree, address, minor=index, numa_node=node, iommu_group=20 + index,
            local_cpulist="0-7" if node == 0 else "8-15",
        )
    fake_gpu.add_amd_gpu(tree, "0000:c1:00.0", card=1, render=128, numa_node=1,
                         iommu_group=40)
    fake_net.sriov_pf(tree, "0000:5e:00.0", numvfs=4, vfio=(2, 3), ifname="ens1f0",
                      iommu_group=50, vf_iommu_group=60, numa_node=0)
    fake_net.mellanox_hca(tree, "0000:d8:00.0", "mlx5_0", numa_node=1, iommu_group=70)
    fake_net.rdma_cm(tree)
    fake_usb.usb_controller(tree, buses=((1, "480"),))
    fake_usb.usb_device(
        tree, "1-2", vendor=0x10C4, product=0xEA60, devnum=3, serial="0001",
        interfaces=[fake_usb.Interface(0xFF, driver="cp210x", tty=("ttyUSB0",))],
        product_name="CP2102 USB to UART Bridge Controller",
    )
    return tree


def demo_resources() -> Tuple[ResourceConfig, ...]:
    """What an operator would configure for this box (GPU defaults plus the rest)."""
    return (
        ResourceConfig("nvidia.com/gpu", "gpu", {"vendor": "0x10de"}),
        ResourceConfig("amd.com/gpu", "gpu", {"vendor": "0x1002"}),
        ResourceConfig("intel.com/sriov_netdevice", "sriov",
                       {"pf_name": "ens1f0", "kernel_driver": "iavf"}),
        ResourceConfig("intel.com/sriov_dpdk", "sriov",
                       {"pf_name": "ens1f0", "kernel_driver": "vfio-pci"}),
        ResourceConfig("rdma/hca", "rdma", {"ib_device": "mlx5_0"}),
        ResourceConfig("example.com/zigbee", "usb", {"vendor": "0x10c4", "product": "0xea60"}),
    )
