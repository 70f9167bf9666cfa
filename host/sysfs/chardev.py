"""Character devices found the way the kernel indexes them: ``/sys/dev/char/MAJOR:MINOR``.

Every char device the kernel registers with a ``struct device`` (``device_create``,
``cdev_device_add``) gets a link ``/sys/dev/char/<major>:<minor>`` to its sysfs folder
(drivers/base/core.c, ``device_create_sys_dev_entry``). That folder sits under its parent
device, so the nodes a PCI function owns are the entries whose nearest PCI ancestor is that
function: ``/sys/devices/pci0000:00/0000:00:1c.0/0000:02:00.0/hailo_chardev/hailo0``. A device
created with no parent lands under ``/sys/devices/virtual/`` instead and belongs to no function.

The /dev name is the kernel's own answer, ``DEVNAME`` in the device's ``uevent`` (what udev and
devtmpfs use; a class ``devnode`` callback such as accel's ``accel/%s`` shows up there), falling
back to the folder name. The index is read once per scan and is shared by drivers that need
it (accel, neuron, pci).
"""

from __future__ import annotations

import logging
import posixpath
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from host.core.hostfs import HostFS, is_pci_address

log = logging.getLogger(__name__)

SYS_DEV_CHAR = "/sys/dev/char"


@dataclass(frozen=True)
class CharDevice:
    numbers: str  # "261:0", as named in /sys/dev/char
    path: str  # canonical /sys/devices/... host path of the class device
    name: str  # hailo0

    def subsystem(self, host: HostFS) -> Optional[str]:
        """The device's class (hailo_chardev, accel, video4linux): the last component of its
        ``subsystem`` link. Read on demand: most of a host's char devices are never asked."""
        return host.link_name(f"{self.path}/subsystem")

    @property
    def pci_parent(self) -> Optional[str]:
        """The PCI address of the nearest PCI function above this device, if any."""
        return nearest_pci(self.path)


def nearest_pci(path: str) -> Optional[str]:
    """The last component of a sysfs path that is a PCI address (a function, not a bridge
    further up: ``.../0000:00:1c.0/0000:02:00.0/x`` -> ``0000:02:00.0``)."""
    for part in reversed(path.split("/")):
        if is_pci_address(part):
            return part
    return None


def dev_node_path(host: HostFS, sysfs_path: str, name: str, default_dir: str = "/dev") -> str:
    """The /dev path of a class device: ``DEVNAME`` from its uevent, else ``default_dir/name``.
    A DEVNAME that is absolute or climbs out of /dev is ignored (logged): the path is handed
    to the kubelet as is."""
    default = posixpath.join(default_dir, name)
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
            log.warning("%s: ignoring odd DEVNAME %r in its uevent", sysfs_path, value)
            return default
        return "/dev/" + value
    return default


def parent_device(host: HostFS, device_path: str) -> Optional[str]:
    """The canonical path of a class device's parent (its ``device`` link), None when it has
    none (a virtual device). The kernel's link is relative and points into /sys/devices, so
    one readlink and one stat answer it; anything else falls back to a full resolve."""
    link = f"{device_path}/device"
    target = host.readlink(link)
    if target is None:
        return None
    if not target.startswith("/"):
        candidate = posixpath.normpath(posixpath.join(device_path, target))
        if candidate.startswith("/sys/devices/") and host.is_dir(candidate):
            return candidate
    return host.resolve(link)


class CharIndex:
    """Every char device of the host, by owning PCI function; built once per scan."""

    def __init__(self, devices: List[CharDevice]) -> None:
        self.devices = devices
        by_pci: Dict[str, List[CharDevice]] = {}
        for device in devices:
            parent = device.pci_parent
            if parent is not None:
                by_pci.setdefault(parent, []).append(device)
        self._by_pci = by_pci

    @classmethod
    def read(cls, host: HostFS) -> CharIndex:
        devices = []
        for numbers in host.listdir(SYS_DEV_CHAR):
            device = _read_entry(host, numbers)
            if device is not None:
                devices.append(device)
        return cls(devices)

    def of_function(self, address: str) -> Tuple[CharDevice, ...]:
        """The char devices whose nearest PCI ancestor is ``address``, by name."""
        return tuple(sorted(self._by_pci.get(address, ()), key=lambda d: _natural(d.name)))


def _read_entry(host: HostFS, numbers: str) -> Optional[CharDevice]:
    link = f"{SYS_DEV_CHAR}/{numbers}"
    target = host.readlink(link)
    if target is None:
        return None
    if target.startswith("/"):
        path: Optional[str] = host.resolve(link)
    else:  # the kernel's own relative link: no need to stat every component
        path = posixpath.normpath(posixpath.join(SYS_DEV_CHAR, target))
        if not host.is_dir(path):
            path = None
    if path is None or not path.startswith("/sys/devices/"):
        return None
    return CharDevice(numbers=numbers, path=path, name=posixpath.basename(path))


def _natural(name: str) -> Tuple[str, int]:
    """hailo2 before hailo10."""
    stem = name.rstrip("0123456789")
    digits = name[len(stem):]
    return stem, int(digits) if digits else -1
