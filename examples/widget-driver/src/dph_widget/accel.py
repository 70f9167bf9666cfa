"""The kernel's compute-accelerator class as sysfs shows it, read once per scan.

Every driver of ``drivers/accel`` (Intel NPU ``intel_vpu``, Habana Gaudi ``habanalabs``,
Qualcomm Cloud AI ``qaic``, AMD XDNA ``amdxdna``, Rockchip ``rocket``, Arm ``ethosu``) registers
its devices the same way, which is why one driver can serve them all::

    /sys/class/accel/accel0 -> ../../devices/pci0000:00/0000:00:0b.0/accel/accel0
    /sys/devices/pci0000:00/0000:00:0b.0/accel/accel0/dev       "261:0"
    /sys/devices/pci0000:00/0000:00:0b.0/accel/accel0/uevent    "MAJOR=261 ... DEVNAME=accel/accel0"
    /sys/devices/pci0000:00/0000:00:0b.0/accel/accel0/device -> ../../../0000:00:0b.0
    /dev/accel/accel0                                            c 261:0

Facts about the card live on the parent device (``.../accel0/device/``), not on the accel
minor: Habana publishes ``status``, ``serial_number``, ``module_id`` and ``device_type`` there.
habanalabs also makes a control node per card, ``accel_controlD<N>`` in the same class but with
no parent (/sys/devices/virtual/accel/...), which the user-space stack opens next to
``accel<N>``; it is found by its index, never on its own.

Nothing here decides health or ids: this module only reports what the kernel shows, with
``None`` where an attribute is missing or unreadable.
"""

from __future__ import annotations

import logging
import posixpath
import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from device_plugin_host import HostFS, PciFunction, is_pci_address, read_function

log = logging.getLogger(__name__)

ACCEL_CLASS = "/sys/class/accel"
ACCEL_MAJOR = 261  # include/drm/drm_accel.h; udev names the nodes /dev/accel/<name>
#: Card facts some accel drivers publish on the parent device (habanalabs' sysfs ABI).
PARENT_FACTS = ("status", "device_type", "serial_number", "module_id")

_MINOR = re.compile(r"accel(\d+)\Z")


@dataclass(frozen=True)
class AccelDevice:
    """One accel minor and the device it belongs to, as found in sysfs."""

    name: str  # accel0
    index: int  # 0
    path: str  # canonical /sys/devices/.../accel/accel0
    dev_node: str  # host path of its device node, /dev/accel/accel0
    dev_numbers: Optional[str]  # "261:0" from the ``dev`` attribute
    parent: str  # canonical /sys/devices/... path of the PCI function or platform device
    parent_name: str  # 0000:00:0b.0, fdab0000.npu
    bus: Optional[str]  # pci, platform, ...
    pci: Optional[PciFunction]
    kernel_driver: Optional[str]
    numa_nodes: Tuple[int, ...]
    local_cpulist: Optional[str]
    control_node: Optional[str]  # /dev/accel/accel_controlD0 where the driver makes one
    facts: Mapping[str, str]  # PARENT_FACTS that are present, stripped


def scan_accel(host: HostFS) -> List[AccelDevice]:
    """Every accel minor of the host, in index order. Entries that cannot be tied to a parent
    device are skipped with a logged reason: without a parent there is no stable id."""
    valid_numa = host.machine_numa_nodes()
    found = []
    for name in host.listdir(ACCEL_CLASS):
        match = _MINOR.match(name)
        if match is None:
            continue  # accel_controlD<N> and anything else are companions, not devices
        device = read_accel(host, name, int(match.group(1)), valid_numa)
        if device is not None:
            found.append(device)
    return sorted(found, key=lambda d: d.index)


def read_accel(
    host: HostFS, name: str, index: int, valid_numa: Optional[Sequence[int]] = None
) -> Optional[AccelDevice]:
    """One ``/sys/class/accel/<name>`` entry; None (logged) when it is dangling or has no
    parent device."""
    path = host.resolve(f"{ACCEL_CLASS}/{name}")
    if path is None:
        log.warning("accel %s: /sys/class/accel/%s is dangling; skipped", name, name)
        return None
    parent = host.resolve(f"{path}/device")
    if parent is None:
        log.warning(
            "accel %s: no parent device (%s/device missing or dangling); skipped, since the"
            " parent is what gives it a stable id",
            name,
            path,
        )
        return None
    parent_name = posixpath.basename(parent)
    pci = read_function(host, parent_name, valid_numa) if is_pci_address(parent_name) else None
    if pci is not None:
        kernel_driver = pci.kernel_driver
        numa_nodes = pci.numa_nodes
        local_cpulist = pci.local_cpulist
    else:
        kernel_driver = host.link_name(f"{parent}/driver")
        numa_nodes = _known_numa(host.numa_of(parent), valid_numa)
        local_cpulist = host.read(f"{parent}/local_cpulist") or None
    facts: Dict[str, str] = {}
    for fact in PARENT_FACTS:
        value = host.read(f"{parent}/{fact}")
        if value:
            facts[fact] = value
    control = f"accel_controlD{index}"
    control_node = None
    if host.exists(f"{ACCEL_CLASS}/{control}"):
        control_node = dev_node_path(host, f"{ACCEL_CLASS}/{control}", control)
    return AccelDevice(
        name=name,
        index=index,
        path=path,
        dev_node=dev_node_path(host, path, name),
        dev_numbers=host.read(f"{path}/dev") or None,
        parent=parent,
        parent_name=parent_name,
        bus=host.link_name(f"{parent}/subsystem"),
        pci=pci,
        kernel_driver=kernel_driver,
        numa_nodes=numa_nodes,
        local_cpulist=local_cpulist,
        control_node=control_node,
        facts=facts,
    )


def dev_node_path(host: HostFS, sysfs_path: str, name: str) -> str:
    """The /dev path udev gives a class device: ``DEVNAME`` from its uevent (the kernel's own
    answer, which accel sets to ``accel/<name>``), or that default when uevent is unreadable or
    names something outside /dev."""
    default = f"/dev/accel/{name}"
    text = host.read(f"{sysfs_path}/uevent")
    if text is None:
        return default
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key.strip() != "DEVNAME":
            continue
        value = value.strip()
        parts = value.split("/")
        if not value or value.startswith("/") or ".." in parts or "" in parts:
            log.warning("accel %s: ignoring odd DEVNAME %r in %s/uevent", name, value, sysfs_path)
            return default
        return "/dev/" + value
    return default


def _known_numa(
    nodes: Tuple[int, ...], valid_numa: Optional[Sequence[int]]
) -> Tuple[int, ...]:
    """Drop a NUMA node the machine does not have (firmware garbage), as host.sysfs.pci does."""
    if nodes and valid_numa is not None and any(n not in valid_numa for n in nodes):
        return ()
    return nodes
