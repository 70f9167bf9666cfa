"""AWS Neuron devices (Inferentia, Trainium) for fake trees, in the aws-neuron-driver's shape.

* PCI functions (neuron_device.h): vendor 0x1d0f (AMZN_VENDOR_ID), Inf1 0x7064-0x7067,
  Inf2 0x7264, Trn1 0x7164, Trn2 0x7364, bound to the PCI driver ``neuron-driver``
  (neuron_pci.c ``neuron_pci_driver.name``) of the module ``neuron`` (Kbuild), so
  /sys/bus/pci/drivers/neuron-driver/module -> ../../../../module/neuron.
* One char device per Neuron device (neuron_cdev.c, ``ncdev_init_device_node``):
  ``device_create(neuron_dev_class, NULL, ...)`` with *no parent*, class ``neuron_device``,
  name ``neuron<device_index>``, minor = device_index, on a dynamic major
  (``alloc_chrdev_region(..., "neuron")``): so /sys/devices/virtual/neuron_device/neuronN,
  with no link back to the PCI function, and /dev/neuronN.
* ``device_index`` is the driver's numbering, not PCI order (neuron_pci.c): probe order on
  Inf1, and on Inf2/Trn1/Trn2 the firmware routing id read from BAR0
  (``neuron_pci_get_device_id_v2/v3``, Trn1 remapped by ``neuron_pci_routing_id_to_user_id``).
* Attributes on the class device (neuron_cdev.c): ``reset`` (S_IRUSR; prints device_state:
  0 RESET, 1 READY, 2 INVALID, neuron_device.h), ``core_count`` (no newline),
  ``connected_devices`` ("1, 3, 4, 12"); and the sysfs metrics tree
  (neuron_sysfs_metrics.c) with ``info/architecture/{arch_type,instance_type,device_name}``
  and one ``neuron_core<K>/`` folder per core; class attributes (``node_id_2``,
  ``server_id_4``, ``ultraserver_mode``, ...) sit beside the devices in the class folder.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from device_plugin_host_testing.fake_chardev import add_class_chardev
from host.sim.tree import FakeTree

AMAZON = 0x1D0F
INF2 = 0x7264
TRN1 = 0x7164
TRN2 = 0x7364
#: The major is dynamic (alloc_chrdev_region); any free number stands in for it.
NEURON_MAJOR = 239
#: The driver matches on vendor/device only and the host never reads the class: a stand-in.
NEURON_CLASS = 0x088000
NEURON_PCI_DRIVER = "neuron-driver"
NEURON_MODULE = "neuron"


def add_neuron_function(
    tree: FakeTree, address: str, *, device: int = TRN1, numa_node: Optional[int] = 0,
    driver: Optional[str] = NEURON_PCI_DRIVER, parent: Optional[str] = None,
) -> str:
    function = tree.pci_function(
        address, vendor=AMAZON, device=device, pci_class=NEURON_CLASS, numa_node=numa_node,
        driver=driver, parent=parent,
    )
    if driver == NEURON_PCI_DRIVER:
        tree.link(f"/sys/bus/pci/drivers/{driver}/module", f"/sys/module/{NEURON_MODULE}")
        tree.mkdir(f"/sys/module/{NEURON_MODULE}/drivers")
    return function


def add_neuron_device(
    tree: FakeTree, index: int, *, core_count: int = 2, state: Optional[int] = 1,
    connected: Sequence[int] = (), device_name: str = "Trainium", arch: str = "v2",
    instance_type: str = "trn1.32xlarge", node: bool = True,
) -> str:
    """The class device neuron<index> (virtual: no parent). ``state=None`` leaves ``reset``
    out. Returns its sysfs path."""
    path = add_class_chardev(tree, None, "neuron_device", f"neuron{index}", NEURON_MAJOR,
                             index, node=node)
    if state is not None:
        tree.attr(f"{path}/reset", str(state))
    tree.attr(f"{path}/core_count", str(core_count))
    tree.attr(f"{path}/connected_devices", ", ".join(str(i) for i in connected))
    info = f"{path}/info/architecture"
    tree.attr(f"{info}/arch_type", f"ND{arch}")
    tree.attr(f"{info}/instance_type", instance_type)
    tree.attr(f"{info}/device_name", device_name)
    for core in range(core_count):
        tree.attr(f"{path}/neuron_core{core}/info/architecture/arch_type", f"NC{arch}")
    return path


def add_neuron_class_attrs(tree: FakeTree) -> None:
    """The class attributes neuron_cdev.c puts beside the devices (``ncdev_class_attrs``):
    plain files in /sys/class/neuron_device that a scan must not take for devices."""
    for name in ("node_id_2", "node_id_4", "server_id_2", "server_id_4"):
        tree.attr(f"/sys/class/neuron_device/{name}", "-1")
    tree.attr("/sys/class/neuron_device/ultraserver_mode", "0")


#: A trn1.32xlarge-like numbering: which neuron index each PCI function got (routing ids
#: follow the 4x4 torus, not the bus numbers), 16 devices over two sockets.
TRN1_INDEX_OF_SLOT: Sequence[int] = (0, 1, 4, 5, 2, 3, 6, 7, 12, 13, 8, 9, 14, 15, 10, 11)


def trn1_node(tree: FakeTree) -> Dict[int, str]:
    """16 Trainium devices, 8 per NUMA node, numbered the driver's way. Returns
    {neuron index: PCI address} (known to the test, not to the host: sysfs never says)."""
    tree.numa_nodes(2, cpus_per_node=8)
    add_neuron_class_attrs(tree)
    out: Dict[int, str] = {}
    for slot, index in enumerate(TRN1_INDEX_OF_SLOT):
        socket = 0 if slot < 8 else 1
        address = f"0000:{0x10 + slot * 0x10 if socket == 0 else 0x90 + (slot - 8) * 0x8:02x}:1e.0"
        add_neuron_function(tree, address, numa_node=socket)
        out[index] = address
    for index in range(len(TRN1_INDEX_OF_SLOT)):
        row, col = divmod(index, 4)
        neighbours = sorted({row * 4 + (col + 1) % 4, row * 4 + (col - 1) % 4,
                             ((row + 1) % 4) * 4 + col, ((row - 1) % 4) * 4 + col})
        add_neuron_device(tree, index, connected=neighbours)
    return out


def inf2_xlarge(tree: FakeTree) -> List[str]:
    """One Inferentia2 on one NUMA node: the one shape where the node is provable."""
    tree.numa_nodes(1, cpus_per_node=4)
    add_neuron_class_attrs(tree)
    address = "0000:00:1f.0"
    add_neuron_function(tree, address, device=INF2, numa_node=0)
    add_neuron_device(tree, 0, core_count=2, device_name="Inferentia2",
                      instance_type="inf2.xlarge")
    return [address]
