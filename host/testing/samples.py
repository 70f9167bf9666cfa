"""The sample machine ``demo`` runs on: a small two-socket server with devices of several kinds,
laid out as real sysfs/dev/proc files under a temporary root."""

from __future__ import annotations

from host.testing import fake_gpu
from host.testing.tree import FakeTree


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
    return tree
