"""The public API for driver authors: every name a driver package needs, from one import.

    from device_plugin_host import Device, DeviceNode, Driver, Health, HostFS, hookimpl

The names here are the stable surface: they keep their meaning and signatures across minor
releases, while the host's internal modules (``host.*``) may be split or moved at any time.
Each one is documented in docs/drivers.md. Importing this package does no I/O and changes no
process state (no environment variables, no grpc import), so a driver package, a test or a
tool can import it freely.
"""

from __future__ import annotations

from host import __version__
from host.chardev import CharDevice, CharIndex, dev_node_path
from host.driver import (
    Driver,
    SelectorError,
    check_types,
    implements,
    selector_values,
)
from host.hookspecs import ENTRY_POINT_GROUP, hookimpl
from host.hostfs import HostFS, is_pci_address
from host.model import (
    ContainerAllocation,
    Device,
    DeviceNode,
    Health,
    Mount,
    PreferredRequest,
    ResourceConfig,
)
from host.pci import (
    PCI_SELECTOR_TYPES,
    PciFunction,
    check_pci_selectors,
    list_functions,
    matches_pci,
    read_function,
)
from host.pci_class import check_class_selector, class_patterns
from host.selectors import AttributeTest, attribute_test, class_matches, normalise_hex_ids

__all__ = [
    "ENTRY_POINT_GROUP",
    "PCI_SELECTOR_TYPES",
    "AttributeTest",
    "CharDevice",
    "CharIndex",
    "ContainerAllocation",
    "Device",
    "DeviceNode",
    "Driver",
    "Health",
    "HostFS",
    "Mount",
    "PciFunction",
    "PreferredRequest",
    "ResourceConfig",
    "SelectorError",
    "__version__",
    "attribute_test",
    "check_class_selector",
    "check_pci_selectors",
    "check_types",
    "class_matches",
    "class_patterns",
    "dev_node_path",
    "hookimpl",
    "implements",
    "is_pci_address",
    "list_functions",
    "matches_pci",
    "normalise_hex_ids",
    "read_function",
    "selector_values",
]
