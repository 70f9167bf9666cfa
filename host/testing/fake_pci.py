"""PCI boards with char devices of their own, for the generic pci driver's fake trees.

* Hailo-8 (hailort-drivers, linux/pcie/src/pcie.c): PCI 1e60:2864, "Co-processor" class
  0x0b4000, bound to ``hailo_pci``; the driver allocates a dynamic major
  (``alloc_chrdev_region(..., "hailo")``) and creates ``hailo<board index>`` in the class
  ``hailo_chardev`` with the PCI function as parent, so /dev/hailo0 and
  .../0000:02:00.0/hailo_chardev/hailo0.
* A custom FPGA board on Xilinx's XDMA reference driver (dma_ip_drivers, xdma/xdma_cdev.c):
  ``device_create(g_xdma_class, &pdev->dev, ..., "xdma%d_%s", ...)`` makes several nodes per
  function in the class ``xdma`` (``xdma0_user``, ``xdma0_control``, ``xdma0_h2c_0``,
  ``xdma0_c2h_0``, ``xdma0_events_0``); PCI 10ee:9038, class 0x058000.
* Class devices of either follow host/testing/fake_chardev.py (drivers/base/core.c).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from host.testing.fake_chardev import add_class_chardev
from host.testing.tree import FakeTree

HAILO = 0x1E60
HAILO8 = 0x2864
COPROCESSOR = 0x0B4000
HAILO_MAJOR = 511  # dynamic (alloc_chrdev_region); a stand-in
XILINX = 0x10EE
XDMA_BOARD = 0x9038
XDMA_MAJOR = 508  # dynamic; a stand-in
XDMA_NODES = ("user", "control", "h2c_0", "c2h_0", "events_0")


def add_hailo8(
    tree: FakeTree, address: str, index: int = 0, *, numa_node: Optional[int] = -1,
    parent: Optional[str] = None, driver: Optional[str] = "hailo_pci", node: bool = True,
    iommu_group: Optional[int] = None,
) -> str:
    """A Hailo-8 M.2 module; ``driver=None`` builds it with hailo_pci not loaded (no char
    device). Returns the PCI function's path."""
    function = tree.pci_function(
        address, vendor=HAILO, device=HAILO8, pci_class=COPROCESSOR, numa_node=numa_node,
        driver=driver, parent=parent, iommu_group=iommu_group,
    )
    if driver == "hailo_pci":
        add_class_chardev(tree, function, "hailo_chardev", f"hailo{index}", HAILO_MAJOR, index,
                          node=node)
    return function


def add_xdma_board(
    tree: FakeTree, address: str, index: int = 0, *, numa_node: Optional[int] = 0,
    nodes: Sequence[str] = XDMA_NODES, parent: Optional[str] = None,
) -> List[str]:
    """A custom board on the XDMA driver; returns the /dev paths of its nodes."""
    function = tree.pci_function(
        address, vendor=XILINX, device=XDMA_BOARD, pci_class=0x058000, numa_node=numa_node,
        driver="xdma", parent=parent,
    )
    out = []
    for number, suffix in enumerate(nodes):
        name = f"xdma{index}_{suffix}"
        add_class_chardev(tree, function, "xdma", name, XDMA_MAJOR, index * 32 + number)
        out.append(f"/dev/{name}")
    return out
