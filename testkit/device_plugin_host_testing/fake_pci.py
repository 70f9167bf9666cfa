"""PCI boards with char devices of their own, for the generic pci driver's fake trees.

* Hailo-8 (hailort-drivers, linux/pcie/src/pcie.c): PCI 1e60:2864, "Co-processor" class
  0x0b4000. The module is ``hailo_pci.ko`` (linux/pcie/Makefile) but the PCI driver it
  registers is named ``hailo`` (common/pcie_common.h ``DRIVER_NAME``, every 4.x release), so
  the function's ``driver`` links to /sys/bus/pci/drivers/hailo, whose ``module`` links to
  /sys/module/hailo_pci. ``register_chrdev(0, "hailo", ...)`` takes a dynamic major and
  ``device_create_with_groups`` makes ``hailo<board index>`` in the class ``hailo_chardev``
  with the attributes ``board_location`` (``pci_name()``, "0000:02:00.0"), ``device_id``
  ("1e60:2864") and ``accelerator_type`` (linux/pcie/src/sysfs.c; printed without a
  newline). Up to v4.22.0 (and again in v5.0.0) the parent is NULL: the device lands in
  /sys/devices/virtual/hailo_chardev/hailo0 with no ``device`` link, and only
  ``board_location`` names its function; v4.23.0 and v5.0.1 on pass the PCI device as
  parent (.../0000:02:00.0/hailo_chardev/hailo0). Either way /dev/hailo0.
* A custom FPGA board on Xilinx's XDMA reference driver (dma_ip_drivers, xdma/xdma_cdev.c):
  ``device_create(g_xdma_class, &pdev->dev, ..., "xdma%d_%s", ...)`` makes several nodes per
  function in the class ``xdma`` (``xdma0_user``, ``xdma0_control``, ``xdma0_h2c_0``,
  ``xdma0_c2h_0``, ``xdma0_events_0``); PCI 10ee:9038, class 0x058000.
* Class devices of either follow testkit/device_plugin_host_testing/fake_chardev.py
(drivers/base/core.c).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from device_plugin_host_testing.fake_chardev import add_class_chardev
from host.sim.tree import FakeTree

HAILO = 0x1E60
HAILO8 = 0x2864
COPROCESSOR = 0x0B4000
HAILO_MAJOR = 511  # dynamic (register_chrdev(0, ...)); a stand-in
HAILO_PCI_DRIVER = "hailo"  # DRIVER_NAME, the name in /sys/bus/pci/drivers
HAILO_MODULE = "hailo_pci"  # the .ko, the name in /sys/module
HAILO_ACCELERATOR_NNC = 0  # hailo_ioctl_common.h HAILO_ACCELERATOR_TYPE_NNC (Hailo-8)
XILINX = 0x10EE
XDMA_BOARD = 0x9038
XDMA_MAJOR = 508  # dynamic; a stand-in
XDMA_NODES = ("user", "control", "h2c_0", "c2h_0", "events_0")


def add_hailo8(
    tree: FakeTree, address: str, index: int = 0, *, numa_node: Optional[int] = -1,
    parent: Optional[str] = None, driver: Optional[str] = HAILO_PCI_DRIVER, node: bool = True,
    iommu_group: Optional[int] = None, parented: bool = False,
) -> str:
    """A Hailo-8 M.2 module; ``driver=None`` builds it with hailo_pci not loaded (no char
    device). ``parented=False`` is the layout of driver releases up to v4.22.0 (hailo0
    virtual, tied to the function by ``board_location`` only); True the v4.23.0 one. Returns
    the PCI function's path."""
    function = tree.pci_function(
        address, vendor=HAILO, device=HAILO8, pci_class=COPROCESSOR, numa_node=numa_node,
        driver=None, parent=parent, iommu_group=iommu_group,
    )
    if driver == HAILO_PCI_DRIVER:
        load_hailo_driver(tree, function, index, node=node, parented=parented)
    elif driver is not None:
        tree.bind_driver(function, driver)
    return function


def load_hailo_driver(
    tree: FakeTree, function: str, index: int = 0, *, node: bool = True, parented: bool = False,
) -> str:
    """``modprobe hailo_pci`` for one board: the function bound to ``hailo`` (module
    hailo_pci) and its char device made. Returns the char device's sysfs path."""
    tree.bind_driver(function, HAILO_PCI_DRIVER)
    tree.link(f"/sys/bus/pci/drivers/{HAILO_PCI_DRIVER}/module", f"/sys/module/{HAILO_MODULE}")
    tree.mkdir(f"/sys/module/{HAILO_MODULE}/drivers")
    path = add_class_chardev(tree, function if parented else None, "hailo_chardev",
                             f"hailo{index}", HAILO_MAJOR, index, node=node)
    address = function.rpartition("/")[2]
    # sysfs.c prints these with sprintf("%s") / ("%x:%x") / ("%d"): no trailing newline.
    for name, value in (("board_location", address), ("device_id", f"{HAILO:x}:{HAILO8:x}"),
                        ("accelerator_type", str(HAILO_ACCELERATOR_NNC))):
        with open(tree.real(f"{path}/{name}"), "w", encoding="utf-8") as handle:
            handle.write(value)
    return path


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
