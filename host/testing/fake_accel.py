"""Compute accelerators of the kernel's accel class for fake trees, in their drivers' shapes.

* Every accel minor (drivers/accel/drm_accel.c): class ``accel``, name ``accel<index>``,
  DEVNAME ``accel/accel<index>``, DEVTYPE ``accel_minor``, major 261 (ACCEL_MAJOR,
  include/drm/drm_accel.h), minor = index, parent = the driver's device (the PCI function).
* habanalabs (drivers/accel/habanalabs/common/device.c, ``cdev_sysfs_debugfs_add``): a control
  device ``accel_controlD<index>`` in the accel class with no parent (so under
  /sys/devices/virtual/accel/), on the driver's own dynamic major (508 here, as an example);
  card facts on the PCI function (habanalabs/common/sysfs.c, ABI sysfs-driver-habanalabs):
  ``status`` (habanalabs_drv.c's strings: "operational", "in reset", "disabled",
  "needs reset", ...), ``device_type`` ("GAUDI2"), ``serial_number``, ``module_id``. PCI ids
  from habanalabs' pci_ids: vendor 0x1da3, Gaudi 0x1000, Gaudi2 0x1020; class 0x1200.
* Intel NPU (drivers/accel/ivpu/ivpu_drv.h ids): 8086:7d1d Meteor Lake (also 7d20 Arrow
  Lake, 7750 Lunar Lake, 7d2a Panther Lake), a root-complex function at 00:0b.0 bound to
  intel_vpu; class 0x1200 as lspci shows it (the driver matches by id only).
* AMD XDNA (drivers/accel/amdxdna/amdxdna_pci_drv.c ids): 1022:1502 Phoenix, 1022:17f0
  Strix; class 0x1180, PCI_CLASS_SP_OTHER ("Signal processing"), which amdxdna's
  out-of-tree predecessor matched on.
* Qualcomm Cloud AI 100 (drivers/accel/qaic/qaic_drv.c): 17cb:a100 (PCI_DEV_AIC100), one
  accel minor per PCI function; the class is a stand-in (qaic matches by id only).
"""

from __future__ import annotations

from typing import List, Optional

from host.testing.fake_chardev import add_class_chardev
from host.testing.tree import FakeTree

ACCEL_MAJOR = 261
HABANA_CONTROL_MAJOR = 508
PROCESSING_ACCELERATOR = 0x120000
SIGNAL_PROCESSING = 0x118000
HABANA = 0x1DA3
GAUDI = 0x1000
GAUDI2 = 0x1020
INTEL = 0x8086
INTEL_NPU_MTL = 0x7D1D
AMD = 0x1022
XDNA_STRIX = 0x17F0
QUALCOMM = 0x17CB
AIC100 = 0xA100


def add_accel_minor(tree: FakeTree, parent: str, index: int, *, node: bool = True) -> str:
    """``accel<index>`` under ``parent``; returns the minor's sysfs path."""
    return add_class_chardev(
        tree, parent, "accel", f"accel{index}", ACCEL_MAJOR, index,
        devname=f"accel/accel{index}", devtype="accel_minor", node=node,
    )


def add_habana_control(tree: FakeTree, index: int, *, node: bool = True) -> str:
    return add_class_chardev(
        tree, None, "accel", f"accel_controlD{index}", HABANA_CONTROL_MAJOR, index,
        devname=f"accel/accel_controlD{index}", node=node,
    )


def add_gaudi(
    tree: FakeTree,
    address: str,
    index: int,
    *,
    numa_node: Optional[int] = 0,
    parent: Optional[str] = None,
    local_cpulist: Optional[str] = None,
    status: Optional[str] = "operational",
    device: int = GAUDI2,
    module_id: Optional[int] = None,
    node: bool = True,
    control: bool = True,
    iommu_group: Optional[int] = None,
) -> str:
    """A Gaudi card bound to habanalabs; ``status=None`` leaves the attribute out. Returns
    the PCI function's path."""
    function = tree.pci_function(
        address, vendor=HABANA, device=device, pci_class=PROCESSING_ACCELERATOR,
        numa_node=numa_node, driver="habanalabs", parent=parent, local_cpulist=local_cpulist,
        iommu_group=iommu_group,
    )
    tree.attr(f"{function}/device_type", "GAUDI2" if device == GAUDI2 else "GAUDI")
    tree.attr(f"{function}/module_id", str(index if module_id is None else module_id))
    tree.attr(f"{function}/serial_number", f"AN{0x51A0 + index:X}{index:03d}")
    if status is not None:
        tree.attr(f"{function}/status", status)
    add_accel_minor(tree, function, index, node=node)
    if control:
        add_habana_control(tree, index, node=node)
    return function


def gaudi_server(tree: FakeTree, cards: int = 8) -> List[str]:
    """An HLS-2 style box: two sockets, half the cards behind each socket's root ports, accel
    indexes in probe order. Returns the cards' PCI addresses in accel-index order."""
    tree.numa_nodes(2, cpus_per_node=8)
    addresses = []
    per_socket = max(1, cards // 2)
    for index in range(cards):
        socket = 0 if index < per_socket else 1
        slot = index % per_socket
        root_bus = 0x17 if socket == 0 else 0x97
        bridge = tree.pci_bridge(f"0000:{root_bus:02x}:{slot + 1:02x}.0", numa_node=socket)
        address = f"0000:{root_bus + 2 + slot:02x}:00.0"
        add_gaudi(tree, address, index, numa_node=socket, parent=bridge,
                  local_cpulist="0-7" if socket == 0 else "8-15", iommu_group=100 + index)
        addresses.append(address)
    return addresses


def add_intel_npu(
    tree: FakeTree, address: str = "0000:00:0b.0", index: int = 0, *,
    device: int = INTEL_NPU_MTL, node: bool = True,
) -> str:
    """The NPU of a Core Ultra laptop: numa_node -1 as on every client platform."""
    function = tree.pci_function(
        address, vendor=INTEL, device=device, pci_class=PROCESSING_ACCELERATOR, numa_node=-1,
        driver="intel_vpu", iommu_group=7, local_cpulist="0-21",
    )
    add_accel_minor(tree, function, index, node=node)
    return function


def add_amd_xdna(
    tree: FakeTree, address: str = "0000:c5:00.1", index: int = 0, *,
    device: int = XDNA_STRIX, node: bool = True,
) -> str:
    function = tree.pci_function(
        address, vendor=AMD, device=device, pci_class=SIGNAL_PROCESSING, numa_node=-1,
        driver="amdxdna", iommu_group=21,
    )
    add_accel_minor(tree, function, index, node=node)
    return function


def add_qaic(
    tree: FakeTree, address: str, index: int, *, numa_node: Optional[int] = 0,
    parent: Optional[str] = None, node: bool = True,
) -> str:
    function = tree.pci_function(
        address, vendor=QUALCOMM, device=AIC100, pci_class=PROCESSING_ACCELERATOR,
        numa_node=numa_node, driver="qaic", parent=parent,
    )
    add_accel_minor(tree, function, index, node=node)
    return function
