"""PCI functions as the kernel shows them in sysfs, read once, shared by every PCI driver.

GPU, SR-IOV, FPGA (Alveo) and RDMA drivers all start from the same facts about a function;
reading them here keeps discovery to one pass with os.open/os.read and one place to get the
kernel's odd values right (numa_node = -1, a missing driver link, an unreadable attribute).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from host.core.driver import SelectorError, selector_values
from host.core.hostfs import HostFS
from host.core.selectors import all_of, attribute_test, normalise_hex_ids

PCI_DEVICES = "/sys/bus/pci/devices"
# The host bridge directory the kernel names pci<domain>:<bus> (drivers/pci/probe.c,
# pci_register_host_bridge: dev_set_name(&bridge->dev, "pci%04x:%02x", ...)); upstream's
# resource.kubernetes.io/pcieRoot attribute carries exactly this name.
_PCI_ROOT = re.compile(r"pci[0-9a-f]{4,8}:[0-9a-f]{2}\Z")  # VMD domains have 5 digits


def pcie_root(path: str) -> Optional[str]:
    """The root complex a canonical /sys/devices path hangs under, or None (not PCI-rooted)."""
    # Jump between "/pci" components (the root is the third of /sys/devices/pci...): this
    # runs for every device of every select, and splitting the whole path was most of it.
    if not path.startswith("/"):
        path = "/" + path  # (a relative path's first component counts too)
    start = path.find("/pci")
    while start >= 0:
        end = path.find("/", start + 1)
        part = path[start + 1:] if end < 0 else path[start + 1:end]
        if _PCI_ROOT.match(part):
            return part
        start = path.find("/pci", start + 1)
    return None


@dataclass(frozen=True)
class PciFunction:
    address: str  # 0000:3b:00.0
    path: str  # canonical /sys/devices/... host path
    vendor: Optional[int]
    device: Optional[int]
    pci_class: Optional[int]
    kernel_driver: Optional[str]
    numa_nodes: Tuple[int, ...]
    local_cpulist: Optional[str]
    iommu_group: Optional[str]
    enabled: Optional[bool]

    @property
    def base_class(self) -> Optional[int]:
        return None if self.pci_class is None else self.pci_class >> 16

    def selector_facts(self) -> Dict[str, str]:
        """The facts the PCI selectors (``PCI_SELECTOR_TYPES``) are matched against."""
        out = {"pci_address": self.address}
        if self.vendor is not None:
            out["vendor"] = f"0x{self.vendor:04x}"
        if self.device is not None:
            out["device"] = f"0x{self.device:04x}"
        if self.pci_class is not None:
            out["class"] = f"0x{self.pci_class:06x}"
        if self.kernel_driver:
            out["kernel_driver"] = self.kernel_driver
        return out

    def attributes(self) -> Dict[str, str]:
        """The facts every PCI device reports in ``discover`` and carries for policies."""
        out = self.selector_facts()
        if self.local_cpulist:
            out["local_cpulist"] = self.local_cpulist
        if self.iommu_group is not None:
            out["iommu_group"] = self.iommu_group
        root = pcie_root(self.path)
        if root:
            out["pcie_root"] = root
        return out


def read_function(
    host: HostFS, address: str, valid_numa: Optional[Sequence[int]] = None
) -> Optional[PciFunction]:
    """Read one function; None when its sysfs entry is gone (unplugged mid-scan)."""
    link = f"{PCI_DEVICES}/{address}"
    path = host.resolve(link)
    if path is None:
        return None
    enable = host.read(f"{path}/enable")
    numa = host.read_int(f"{path}/numa_node", 10)
    numa_nodes: Tuple[int, ...] = (numa,) if numa is not None and numa >= 0 else ()
    if numa_nodes and valid_numa is not None and numa_nodes[0] not in valid_numa:
        numa_nodes = ()  # firmware reporting a node the machine does not have
    return PciFunction(
        address=address,
        path=path,
        vendor=host.read_int(f"{path}/vendor", 16),
        device=host.read_int(f"{path}/device", 16),
        pci_class=host.read_int(f"{path}/class", 16),
        kernel_driver=host.link_name(f"{path}/driver"),
        numa_nodes=numa_nodes,
        local_cpulist=host.read(f"{path}/local_cpulist") or None,
        iommu_group=host.link_name(f"{path}/iommu_group"),
        # ``enable`` is a reference count (it can read 2), not a flag.
        # isdigit() alone accepts digits int() refuses, such as a superscript one.
        enabled=None if enable is None or not (enable.isascii() and enable.isdigit())
        else int(enable) > 0,
    )


def list_functions(host: HostFS) -> List[PciFunction]:
    """Every PCI function of the host, in address order."""
    valid_numa = host.machine_numa_nodes()
    out = []
    for address in host.listdir(PCI_DEVICES):
        function = read_function(host, address, valid_numa)
        if function is not None:
            out.append(function)
    return out


#: Selector keys shared by the PCI drivers, with the value types config may use.
PCI_SELECTOR_TYPES: Mapping[str, Tuple[type, ...]] = {
    "vendor": (str, int),
    "device": (str, int),
    "kernel_driver": (str,),
    "pci_address": (str,),
}


def check_pci_selectors(selectors: Mapping[str, object]) -> None:
    """Reject vendor/device ids that are not hex numbers, with the key named."""
    for key in ("vendor", "device"):
        try:
            ids = normalise_hex_ids(selector_values(selectors, key))
        except ValueError:
            raise SelectorError(key, "must be hex PCI ids like \"0x10de\"") from None
        if ids and any(not 0 <= value <= 0xFFFF for value in ids):
            raise SelectorError(key, "PCI ids are 16-bit (0x0000 to 0xffff)")


def pci_matcher(selectors: Mapping[str, object]) -> Callable[[PciFunction], bool]:
    """A test of a function against the PCI selectors given (``PCI_SELECTOR_TYPES``; absent
    ones match all), with the host's selector rules (host/core/selectors.py). Build it once per
    resource and scan: values are parsed here, not per function."""
    tests = [attribute_test(key, selector_values(selectors, key) or [])
             for key in PCI_SELECTOR_TYPES if key in selectors]
    if not tests:
        return lambda function: True
    matches = all_of(tests)
    return lambda function: matches(function.selector_facts())


def matches_pci(function: PciFunction, selectors: Mapping[str, object]) -> bool:
    """True when the function satisfies every PCI selector given (absent ones match all)."""
    return pci_matcher(selectors)(function)
