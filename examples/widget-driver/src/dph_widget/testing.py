"""Accelerators for fake host trees, in the shapes their kernel drivers leave behind.

Shipped with the package (not only in its tests) so that anyone writing a config or a policy
for these cards can build a machine to try it on. Every piece can be left out to build the odd
cases: a node udev has not created yet, a card in reset, a parent link that is gone.
"""

from __future__ import annotations

from typing import List, Optional

from device_plugin_host_testing import FakeTree

from dph_widget.accel import ACCEL_CLASS, ACCEL_MAJOR

INTEL = 0x8086
HABANA = 0x1DA3
PROCESSING_ACCELERATOR = 0x120000  # PCI base class 0x12
INTEL_NPU_MTL = 0x7D1D  # Core Ultra (Meteor Lake) NPU
GAUDI2 = 0x1020
#: habanalabs takes a dynamic char major for its control nodes; this is a typical one.
HABANA_CONTROL_MAJOR = 508


def add_accel(tree: FakeTree, parent: str, index: int, *, node: bool = True) -> str:
    """The accel minor ``accel<index>`` under ``parent`` (a /sys/devices path), its class link
    and, unless ``node`` is False, its /dev node. Returns the minor's sysfs path."""
    name = f"accel{index}"
    path = f"{parent}/accel/{name}"
    tree.attr(f"{path}/dev", f"{ACCEL_MAJOR}:{index}")
    tree.attr(
        f"{path}/uevent",
        f"MAJOR={ACCEL_MAJOR}\nMINOR={index}\nDEVNAME=accel/{name}\nDEVTYPE=accel_minor",
    )
    tree.link(f"{path}/device", parent)
    tree.link(f"{path}/subsystem", ACCEL_CLASS)
    tree.link(f"{ACCEL_CLASS}/{name}", path)
    if node:
        tree.chardev(f"/dev/accel/{name}", ACCEL_MAJOR, index)
    return path


def add_habana_control(tree: FakeTree, index: int, *, node: bool = True) -> str:
    """habanalabs' control device: same class, no parent, so it lives under virtual/."""
    name = f"accel_controlD{index}"
    path = f"/sys/devices/virtual/accel/{name}"
    tree.attr(f"{path}/dev", f"{HABANA_CONTROL_MAJOR}:{index}")
    tree.attr(
        f"{path}/uevent", f"MAJOR={HABANA_CONTROL_MAJOR}\nMINOR={index}\nDEVNAME=accel/{name}"
    )
    tree.link(f"{path}/subsystem", ACCEL_CLASS)
    tree.link(f"{ACCEL_CLASS}/{name}", path)
    if node:
        tree.chardev(f"/dev/accel/{name}", HABANA_CONTROL_MAJOR, index)
    return path


def add_intel_npu(
    tree: FakeTree,
    address: str = "0000:00:0b.0",
    index: int = 0,
    *,
    device: int = INTEL_NPU_MTL,
    node: bool = True,
    iommu_group: Optional[int] = 7,
) -> str:
    """The NPU built into Core Ultra CPUs: a root-complex PCI function bound to intel_vpu,
    numa_node -1 as on every client platform. Returns the PCI function's path."""
    function = tree.pci_function(
        address,
        vendor=INTEL,
        device=device,
        pci_class=PROCESSING_ACCELERATOR,
        numa_node=-1,
        driver="intel_vpu",
        iommu_group=iommu_group,
        local_cpulist="0-21",
    )
    add_accel(tree, function, index, node=node)
    return function


def add_gaudi(
    tree: FakeTree,
    address: str,
    index: int,
    *,
    numa_node: Optional[int] = 0,
    parent: Optional[str] = None,
    local_cpulist: Optional[str] = None,
    status: Optional[str] = "operational",
    module_id: Optional[int] = None,
    serial: Optional[str] = None,
    device: int = GAUDI2,
    node: bool = True,
    control: bool = True,
) -> str:
    """A Gaudi card bound to habanalabs, with the card facts the driver publishes on the PCI
    function and its control node. ``status=None`` leaves the attribute out (older drivers).
    Returns the PCI function's path."""
    function = tree.pci_function(
        address,
        vendor=HABANA,
        device=device,
        pci_class=PROCESSING_ACCELERATOR,
        numa_node=numa_node,
        driver="habanalabs",
        parent=parent,
        local_cpulist=local_cpulist,
        iommu_group=100 + index,
    )
    tree.attr(f"{function}/device_type", "GAUDI2" if device == GAUDI2 else "GAUDI")
    tree.attr(f"{function}/module_id", str(index if module_id is None else module_id))
    tree.attr(f"{function}/serial_number", serial or f"AN{0x51A0 + index:X}0{index:02d}")
    if status is not None:
        tree.attr(f"{function}/status", status)
    add_accel(tree, function, index, node=node)
    if control:
        add_habana_control(tree, index, node=node)
    return function


def gaudi_server(tree: FakeTree, cards: int = 8) -> List[str]:
    """An HLS-2 style box: two sockets, half the cards behind each socket's root ports.
    Returns the cards' PCI addresses in accel-index order."""
    tree.numa_nodes(2, cpus_per_node=8)
    addresses = []
    per_socket = max(1, cards // 2)
    for index in range(cards):
        socket = 0 if index < per_socket else 1
        slot = index % per_socket
        root_bus = 0x17 if socket == 0 else 0x97
        bus = root_bus + 2 + slot
        bridge = tree.pci_bridge(f"0000:{root_bus:02x}:{slot + 1:02x}.0", numa_node=socket)
        address = f"0000:{bus:02x}:00.0"
        cpus = "0-7" if socket == 0 else "8-15"
        add_gaudi(tree, address, index, numa_node=socket, parent=bridge, local_cpulist=cpus)
        addresses.append(address)
    return addresses
