"""What the aws-neuron-driver shows in sysfs, read once per scan (no health decisions here).

Each Neuron device is a class device ``/sys/class/neuron_device/neuron<N>`` created with no
parent (neuron_cdev.c: ``device_create(neuron_dev_class, NULL, ...)``), so it lives under
/sys/devices/virtual/ and nothing in sysfs ties ``neuron<N>`` to its PCI function. ``N`` is the
driver's device index: probe order on Inf1, the firmware routing id on Inf2/Trn1/Trn2
(neuron_pci.c), never something to derive from PCI addresses. The PCI functions bound to
the driver are read separately; they prove a NUMA node only when all of them share one.
The PCI driver registers as ``neuron-driver`` (neuron_pci.c, ``struct pci_driver``'s
``.name``, in every release) from the module ``neuron`` (Kbuild ``obj-m += neuron.o``), so
/sys/bus/pci/drivers/neuron-driver/module links to /sys/module/neuron: a function counts when
its driver has that name or comes from that module.
"""

from __future__ import annotations

import logging
import posixpath
import re
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from device_plugin_host import (
    HostFS,
    PciFunction,
    dev_node_path,
    is_pci_address,
    list_functions,
    parent_device,
    read_function,
)

log = logging.getLogger(__name__)

NEURON_CLASS = "/sys/class/neuron_device"
AMAZON = 0x1D0F
NEURON_PCI_DRIVER = "neuron-driver"
NEURON_MODULE = "neuron"
PCI_DRIVERS = "/sys/bus/pci/drivers"

_NAME = re.compile(r"neuron(\d+)\Z")


@dataclass(frozen=True)
class NeuronDevice:
    name: str  # neuron3
    index: int  # 3, the driver's device_index
    path: str  # /sys/devices/virtual/neuron_device/neuron3
    dev_node: str  # /dev/neuron3
    dev_numbers: Optional[str]
    state: Optional[str]  # the ``reset`` attribute: device_state 0/1/2
    core_count: Optional[int]
    connected: Optional[str]  # "1, 3, 4, 12"
    arch_type: Optional[str]
    instance_type: Optional[str]
    device_name: Optional[str]
    pci: Optional[PciFunction]  # only where the class device links to its function


@dataclass(frozen=True)
class NeuronScan:
    devices: Tuple[NeuronDevice, ...]
    functions: Tuple[PciFunction, ...]  # PCI functions bound to the aws-neuron-driver


def scan(host: HostFS) -> NeuronScan:
    valid_numa = host.machine_numa_nodes()
    devices = []
    for name in host.listdir(NEURON_CLASS):
        match = _NAME.match(name)
        if match is None:
            continue
        device = _read_device(host, name, int(match.group(1)), valid_numa)
        if device is not None:
            devices.append(device)
    devices.sort(key=lambda d: d.index)
    functions: Tuple[PciFunction, ...] = ()
    if devices:
        ours: Dict[str, bool] = {}
        functions = tuple(
            fn for fn in list_functions(host)
            if fn.vendor == AMAZON and fn.kernel_driver is not None
            and _is_neuron_driver(host, fn.kernel_driver, ours)
        )
    return NeuronScan(tuple(devices), functions)


def _is_neuron_driver(host: HostFS, name: str, known: Dict[str, bool]) -> bool:
    """``name`` is the aws-neuron-driver's PCI driver: by its registered name, or by the
    module it comes from (the ``module`` link of /sys/bus/pci/drivers/<name>)."""
    answer = known.get(name)
    if answer is None:
        answer = known[name] = name == NEURON_PCI_DRIVER or (
            host.link_name(f"{PCI_DRIVERS}/{name}/module") == NEURON_MODULE)
    return answer


def _read_device(
    host: HostFS, name: str, index: int, valid_numa: Optional[Tuple[int, ...]]
) -> Optional[NeuronDevice]:
    path = host.resolve(f"{NEURON_CLASS}/{name}")
    if path is None:
        log.warning("neuron: %s/%s is dangling; skipped", NEURON_CLASS, name)
        return None
    pci = None
    parent = parent_device(host, path)  # absent in every driver version we know
    if parent is not None and is_pci_address(posixpath.basename(parent)):
        pci = read_function(host, posixpath.basename(parent), valid_numa)
    info = f"{path}/info/architecture"
    return NeuronDevice(
        name=name,
        index=index,
        path=path,
        dev_node=dev_node_path(host, path, name),
        dev_numbers=host.read(f"{path}/dev") or None,
        state=host.read(f"{path}/reset"),
        core_count=host.read_int(f"{path}/core_count", 10),
        connected=host.read(f"{path}/connected_devices"),
        arch_type=host.read(f"{info}/arch_type") or None,
        instance_type=host.read(f"{info}/instance_type") or None,
        device_name=host.read(f"{info}/device_name") or None,
        pci=pci,
    )
