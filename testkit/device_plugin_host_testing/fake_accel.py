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
  from habanalabs' pci_ids: vendor 0x1da3, Gaudi 0x1000, Gaudi2 0x1020, Gaudi 3 0x1060
  (HL-325L OAM; Intel's Gaudi DRA driver's model table); class 0x1200.
* Gaudi 3 scale-out NIC (habanalabs' hbl InfiniBand driver, ``hbl_ib_dev_init``):
  ``ibdev->dev.parent = &pdev->dev`` and ``ib_register_device(ibdev, "hbl_%d", ...)``, so
  /sys/class/infiniband/hbl_<id> -> <card function>/infiniband/hbl_<id> with its ``device``
  link to the card, node type RDMA_NODE_UNSPECIFIED ("7: unspecified"), one Ethernet port
  per enabled NIC port (24 on Gaudi 3); ib_uverbs puts ``uverbsN`` under the same parent
  (uverbs_main.c: ``uverbs_dev->dev.parent = device->dev.parent``), class
  ``infiniband_verbs``, major 231 minor 192 + N, DEVNAME infiniband/uverbsN, ``ibdev`` =
  hbl_<id>; N in registration order over the host's RDMA devices. Intel's Gaudi DRA driver
  finds it the same way (<function>/infiniband_verbs/uverbs*).
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

from typing import List, Optional, Sequence

from device_plugin_host_testing.fake_chardev import add_class_chardev
from host.sim.fake_net import RdmaDevice, mellanox_hca, rdma_device
from host.sim.tree import FakeTree

ACCEL_MAJOR = 261
HABANA_CONTROL_MAJOR = 508
PROCESSING_ACCELERATOR = 0x120000
SIGNAL_PROCESSING = 0x118000
HABANA = 0x1DA3
GAUDI = 0x1000
GAUDI2 = 0x1020
GAUDI3 = 0x1060
GAUDI3_NIC_PORTS = 24
DEVICE_TYPES = {GAUDI: "GAUDI", GAUDI2: "GAUDI2", GAUDI3: "GAUDI3"}
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
    tree.attr(f"{function}/device_type", DEVICE_TYPES[device])
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


def add_hbl_nic(
    tree: FakeTree, function: str, card_id: int, uverbs: Optional[int], *,
    ports: int = GAUDI3_NIC_PORTS, dev_node: bool = True,
) -> RdmaDevice:
    """A Gaudi 3's own RDMA device ``hbl_<card_id>`` under its PCI function, with
    ``uverbs<uverbs>`` (None: ib_uverbs not loaded)."""
    device = rdma_device(tree, function, f"hbl_{card_id}", link_layers=("Ethernet",) * ports,
                         uverbs=uverbs, umad=None, dev_nodes=dev_node,
                         node_guid=f"b0fd:0bff:fe{card_id:02x}:0000")
    tree.attr(f"{device.path}/node_type", "7: unspecified")
    return device


def gaudi3_server(
    tree: FakeTree, cards: int = 8, *,
    registration: Sequence[int] = (1, 0, 3, 2, 5, 4, 7, 6),
) -> List[str]:
    """An HLS-3 style box: eight Gaudi 3 cards over two sockets, each with its hbl_<index>
    RDMA device, and two ConnectX-7 host NICs that registered first (uverbs0, uverbs1). The
    cards' RDMA devices register in ``registration`` order (asynchronous probing), so
    uverbsN follows neither the accel index nor PCI order. Returns the cards' PCI
    addresses in accel-index order."""
    tree.numa_nodes(2, cpus_per_node=8)
    mellanox_hca(tree, "0000:0c:00.0", "mlx5_0", device=0x1021, numa_node=0, uverbs=0,
                 umad=0, link_layers=("Ethernet",), ifname="ens1f0np0")
    mellanox_hca(tree, "0000:8c:00.0", "mlx5_1", device=0x1021, numa_node=1, uverbs=1,
                 umad=1, link_layers=("Ethernet",), ifname="ens2f0np0")
    addresses = []
    functions = []
    per_socket = max(1, cards // 2)
    for index in range(cards):
        socket = 0 if index < per_socket else 1
        slot = index % per_socket
        root_bus = 0x17 if socket == 0 else 0x97
        bridge = tree.pci_bridge(f"0000:{root_bus:02x}:{slot + 1:02x}.0", numa_node=socket)
        address = f"0000:{root_bus + 2 + slot:02x}:00.0"
        functions.append(add_gaudi(
            tree, address, index, numa_node=socket, parent=bridge, device=GAUDI3,
            local_cpulist="0-7" if socket == 0 else "8-15", iommu_group=100 + index))
        addresses.append(address)
    for order, index in enumerate(i for i in registration if i < cards):
        add_hbl_nic(tree, functions[index], index, 2 + order)
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
