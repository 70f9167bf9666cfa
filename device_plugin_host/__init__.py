"""The public API for driver authors: every name a driver package needs, from one import.

    from device_plugin_host import Device, DeviceNode, Driver, Health, HostFS, hookimpl

The names here are the stable surface: they keep their meaning and signatures across minor
releases, while the host's internal modules (``host.*``) may be split or moved at any time.
Each one is documented in docs/drivers.md. Importing this package does no I/O and changes no
process state (no environment variables, no grpc import), so a driver package, a test or a
tool can import it freely.
"""

from __future__ import annotations

from typing import Sequence

from host import __version__
from host.core.allocation import natural_key, replicate
from host.core.capabilities import (
    Allocator,
    Capabilities,
    ContainerPreStarter,
    DefaultsProvider,
    DeviceDriver,
    PreferredAllocator,
    PreferredGate,
    PreStartGate,
    SelectorChecker,
    SettingsChecker,
)
from host.core.driver import Driver, SelectorError, check_types, selector_values
from host.core.health import TransitionLog
from host.core.hookspecs import ENTRY_POINT_GROUP, hookimpl
from host.core.hostfs import HostFS, is_pci_address
from host.core.model import (
    ContainerAllocation,
    Device,
    DeviceNode,
    Health,
    Mount,
    PreferredRequest,
    ResourceConfig,
)
from host.core.selectors import (
    AttributeTest,
    IndexRanges,
    attribute_test,
    class_matches,
    normalise_hex_ids,
    parse_ranges,
)
from host.sysfs.chardev import CharDevice, CharIndex, dev_node_path, parent_device
from host.sysfs.pci import (
    PCI_DEVICES,
    PCI_SELECTOR_TYPES,
    PciFunction,
    check_pci_selectors,
    list_functions,
    matches_pci,
    pci_matcher,
    read_function,
)
from host.sysfs.pci_class import check_class_selector, class_patterns
from host.sysfs.rdma_chardev import RdmaCharDevice, RdmaCharIndex, parent_of, scan_char_devices


def write_device_info(resource: ResourceConfig, devices: Sequence[Device]) -> None:
    """With the resource's ``device_info = true``, write the NPWG device-info file of each
    device (host/outputs/devinfo.py, which also removes them); raises RuntimeError naming the device
    and directory of a file that cannot be written. Loads its module on first use."""
    from host.outputs.devinfo import write_all

    write_all(resource, devices)


__all__ = [
    "ENTRY_POINT_GROUP",
    "PCI_DEVICES",
    "PCI_SELECTOR_TYPES",
    "Allocator",
    "AttributeTest",
    "Capabilities",
    "CharDevice",
    "CharIndex",
    "ContainerAllocation",
    "ContainerPreStarter",
    "DefaultsProvider",
    "Device",
    "DeviceDriver",
    "DeviceNode",
    "Driver",
    "Health",
    "HostFS",
    "IndexRanges",
    "Mount",
    "PciFunction",
    "PreStartGate",
    "PreferredAllocator",
    "PreferredGate",
    "PreferredRequest",
    "RdmaCharDevice",
    "RdmaCharIndex",
    "ResourceConfig",
    "SelectorChecker",
    "SelectorError",
    "SettingsChecker",
    "TransitionLog",
    "__version__",
    "attribute_test",
    "check_class_selector",
    "check_pci_selectors",
    "check_types",
    "class_matches",
    "class_patterns",
    "dev_node_path",
    "hookimpl",
    "is_pci_address",
    "list_functions",
    "matches_pci",
    "natural_key",
    "normalise_hex_ids",
    "parent_device",
    "parent_of",
    "parse_ranges",
    "pci_matcher",
    "read_function",
    "replicate",
    "scan_char_devices",
    "selector_values",
    "write_device_info",
]
