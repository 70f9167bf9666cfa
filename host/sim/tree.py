"""Fake host trees: real directories, attribute files and symlinks laid out the way the kernel
lays out /sys, /dev and /proc, under a temporary root. No mocks: the real HostFS reads them.

Also the text format for whole-machine trees (``*.tree``), one entry a line::

    d /sys/devices/system/node/node0
    f /sys/bus/pci/devices/0000:01:00.0/vendor "0x10de"
    l /sys/bus/pci/devices/0000:01:00.0 -> ../../../devices/pci0000:00/0000:01:00.0
    c /dev/nvidia0 195:0

``f`` values are JSON strings; ``c`` is a character device (a plain file in a fake tree, its
numbers kept in the text). ``host.cli.capture.capture_tree`` writes this format from a real machine.
"""

from __future__ import annotations

import json
import os
import posixpath
from pathlib import Path
from typing import Iterable, List, Optional, Union

PathLike = Union[str, "os.PathLike[str]"]


class FakeTree:
    """Builds a host tree under ``root``. Every method takes *host* paths ("/sys/...")."""

    def __init__(self, root: PathLike) -> None:
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)

    def real(self, host_path: str) -> str:
        return self.root + host_path

    def mkdir(self, host_path: str) -> str:
        os.makedirs(self.real(host_path), exist_ok=True)
        return host_path

    def attr(self, host_path: str, value: Union[str, int]) -> str:
        """Write an attribute file, with a trailing newline as sysfs prints it."""
        real = self.real(host_path)
        os.makedirs(os.path.dirname(real), exist_ok=True)
        text = str(value)
        with open(real, "w", encoding="utf-8") as handle:
            handle.write(text if text.endswith("\n") or text == "" else text + "\n")
        return host_path

    def link(self, host_path: str, target: str) -> str:
        """Create a symlink; an absolute host-path target becomes relative, as in sysfs."""
        real = self.real(host_path)
        os.makedirs(os.path.dirname(real), exist_ok=True)
        if target.startswith("/"):
            target = posixpath.relpath(target, posixpath.dirname(host_path))
        if os.path.lexists(real):
            os.unlink(real)
        os.symlink(target, real)
        return host_path

    def chardev(self, host_path: str, major: int = 0, minor: int = 0) -> str:
        """A device node. A plain file stands in for it: the host only checks presence."""
        real = self.real(host_path)
        os.makedirs(os.path.dirname(real), exist_ok=True)
        with open(real, "w", encoding="utf-8") as handle:
            handle.write(f"{major}:{minor}\n")
        return host_path

    def remove(self, host_path: str) -> None:
        """Remove a file, link or whole directory (a device unplugged)."""
        real = self.real(host_path)
        if os.path.islink(real) or os.path.isfile(real):
            os.unlink(real)
        elif os.path.isdir(real):
            for dirpath, dirnames, filenames in os.walk(real, topdown=False):
                for name in filenames:
                    os.unlink(os.path.join(dirpath, name))
                for name in dirnames:
                    full = os.path.join(dirpath, name)
                    if os.path.islink(full):
                        os.unlink(full)
                    else:
                        os.rmdir(full)
            os.rmdir(real)

    # -- machine-level shapes ------------------------------------------------------------
    def numa_nodes(self, count: int, cpus_per_node: int = 4) -> List[str]:
        """/sys/devices/system/node/nodeN with cpulist, as on a multi-socket server."""
        paths = []
        for node in range(count):
            base = f"/sys/devices/system/node/node{node}"
            first = node * cpus_per_node
            self.attr(f"{base}/cpulist", f"{first}-{first + cpus_per_node - 1}")
            paths.append(base)
        self.attr("/sys/devices/system/node/possible", f"0-{count - 1}" if count > 1 else "0")
        return paths

    def pci_function(
        self,
        address: str,
        *,
        vendor: int,
        device: int,
        pci_class: int,
        numa_node: Optional[int] = -1,
        driver: Optional[str] = None,
        iommu_group: Optional[int] = None,
        parent: Optional[str] = None,
        local_cpulist: Optional[str] = None,
        subsystem_vendor: Optional[int] = None,
        subsystem_device: Optional[int] = None,
        extra: Optional[dict] = None,
    ) -> str:
        """A PCI function the way the kernel shows it; returns its /sys/devices path.

        ``parent`` is the host path of an upstream bridge; by default the function sits
        directly under its root complex ``/sys/devices/pciDDDD:BB``. ``numa_node=None``
        leaves the attribute out (old kernels, odd platforms).
        """
        domain, bus = address.split(":")[:2]
        base = parent or self.mkdir(f"/sys/devices/pci{domain}:{bus}")
        path = f"{base}/{address}"
        self.attr(f"{path}/vendor", f"0x{vendor:04x}")
        self.attr(f"{path}/device", f"0x{device:04x}")
        self.attr(f"{path}/class", f"0x{pci_class:06x}")
        self.attr(f"{path}/enable", "1")
        self.attr(f"{path}/subsystem_vendor", f"0x{(subsystem_vendor or vendor):04x}")
        self.attr(f"{path}/subsystem_device", f"0x{(subsystem_device or 0):04x}")
        if numa_node is not None:
            self.attr(f"{path}/numa_node", str(numa_node))
        if local_cpulist is not None:
            self.attr(f"{path}/local_cpulist", local_cpulist)
        self.link(f"{path}/subsystem", "/sys/bus/pci")
        self.link(f"/sys/bus/pci/devices/{address}", path)
        if driver:
            self.bind_driver(path, driver)
        if iommu_group is not None:
            self.mkdir(f"/sys/kernel/iommu_groups/{iommu_group}/devices")
            self.link(f"{path}/iommu_group", f"/sys/kernel/iommu_groups/{iommu_group}")
            self.link(f"/sys/kernel/iommu_groups/{iommu_group}/devices/{address}", path)
        for name, value in (extra or {}).items():
            self.attr(f"{path}/{name}", value)
        return path

    def bind_driver(self, device_path: str, driver: str, bus: str = "pci") -> None:
        """Bind (or rebind) a device to a kernel driver, both link directions."""
        name = posixpath.basename(device_path)
        drivers = f"/sys/bus/{bus}/drivers/{driver}"
        self.mkdir(drivers)
        self.link(f"{device_path}/driver", drivers)
        self.link(f"{drivers}/{name}", device_path)

    def pci_bridge(self, address: str, *, numa_node: Optional[int] = -1) -> str:
        """A PCIe root port / switch port that functions can sit behind."""
        return self.pci_function(
            address, vendor=0x8086, device=0x2030, pci_class=0x060400, numa_node=numa_node,
            driver="pcieport",
        )

    # -- text trees --------------------------------------------------------------------
    def load(self, text: str) -> None:
        """Materialise a ``.tree`` text under this root."""
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            kind, _, rest = line.partition(" ")
            try:
                if kind == "d":
                    self.mkdir(rest.strip())
                elif kind == "f":
                    path, _, value = rest.partition(" ")
                    self.attr(path, json.loads(value) if value else "")
                elif kind == "l":
                    path, _, target = rest.partition(" -> ")
                    real = self.real(path.strip())
                    os.makedirs(os.path.dirname(real), exist_ok=True)
                    if os.path.lexists(real):
                        os.unlink(real)
                    os.symlink(target.strip(), real)
                elif kind == "c":
                    path, _, numbers = rest.partition(" ")
                    major, _, minor = numbers.partition(":")
                    self.chardev(path, int(major or 0), int(minor or 0))
                else:
                    raise ValueError(f"unknown entry kind {kind!r}")
            except (ValueError, json.JSONDecodeError) as error:
                raise ValueError(f"line {number}: {error}: {line!r}") from error


def write_tree(lines: Iterable[str], path: PathLike) -> None:
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
