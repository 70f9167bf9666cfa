"""The driver base class, which makes the common case short.

The host calls ``discover`` off the event loop, under a timeout, once per rescan of the
driver, with every resource configured for it. A driver returns *whole snapshots*; the host
diffs them, so a driver never keeps state about what it reported before. Allocate is a merge
of what is carried on each Device (device nodes, mounts, env, annotations, CDI names).

Everything beyond that is an optional capability, a small protocol of host/core/capabilities.py
that a driver has by defining its method: ``allocate`` when a response depends on the *set*
of devices, ``preferred`` when it has a better policy than NUMA-compact, ``pre_start`` when a
device must be prepared before each container start. This class defines none of them.

Selectors are configuration the host matches: the default ``select`` keeps the scanned
devices whose ``attributes`` satisfy every selector (host/core/selectors.py has the rules), so a
driver that reports its facts as attributes implements only ``scan``. It overrides
``selector_test`` for a key whose meaning is more than a fact (an SR-IOV PF with a VF range,
MIG placement), and ``select`` when a resource's settings shape its devices.
"""

from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Mapping, Optional, Sequence, Tuple

from host.core.hostfs import HostFS
from host.core.model import Device, ResourceConfig
from host.core.selectors import AttributeTest, all_of, attribute_test


class SelectorError(ValueError):
    """A bad selector in config; ``key`` names it (relative to ``selectors``)."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


class Driver:
    """Base class for drivers. Subclasses set ``name`` and ``subsystems`` and implement
    ``scan`` (returning Devices; the host matches selectors against their attributes), or
    ``discover`` itself.

    The optional capabilities (``allocate``, ``preferred`` and ``preferred_useful``,
    ``pre_start`` and ``needs_pre_start``) are not defined here: a subclass has one by
    defining its method (host/core/capabilities.py). Without ``preferred`` a resource gets the
    host's NUMA-compact policy; without ``pre_start`` it advertises
    ``pre_start_required = False``.
    """

    #: Unique driver name, used as ``driver = "..."`` in config.
    name: ClassVar[str] = ""
    #: udev subsystems whose events may change this driver's devices (pci, usb, net, ...).
    subsystems: ClassVar[Tuple[str, ...]] = ()
    #: Glob patterns of the /dev nodes this driver hands out (``/dev/accel/*``): what
    #: ``device-plugin-host capture`` records, so a captured tree has this driver's nodes.
    device_globs: ClassVar[Tuple[str, ...]] = ()
    #: Selector keys this driver accepts, with the Python types allowed for each value.
    selector_types: ClassVar[Mapping[str, Tuple[type, ...]]] = {}
    #: Setting keys (``[resource.settings]``) this driver accepts, with their value types.
    setting_types: ClassVar[Mapping[str, Tuple[type, ...]]] = {}
    #: Selector keys matched against an attribute of another name (``{"index":
    #: "neuron_index"}``); every other key is matched against the attribute of its own name.
    selector_attributes: ClassVar[Mapping[str, str]] = {}

    # -- discovery (required) ---------------------------------------------------------
    def discover(
        self, host: HostFS, resources: Sequence[ResourceConfig]
    ) -> Mapping[str, Sequence[Device]]:
        """Devices per resource name, for every resource given. Side-effect free; blocking
        reads are fine (this runs in a worker thread). The default scans once and selects
        per resource."""
        inventory = self.scan(host)
        return {resource.name: list(self.select(inventory, resource)) for resource in resources}

    def scan(self, host: HostFS) -> Any:
        """Read the host tree once; return the Devices (or whatever an own ``select`` needs)."""
        raise NotImplementedError

    # -- selection (optional: the host matches selectors against Device.attributes) ------
    def select(self, inventory: Any, resource: ResourceConfig) -> Sequence[Device]:
        """The devices of one resource: by default the scanned Devices whose attributes
        satisfy every selector. Override when settings change the devices themselves."""
        matches = self.matcher(resource.selectors)
        return [device for device in inventory if matches(device.attributes)]

    def matcher(self, selectors: Mapping[str, object]) -> AttributeTest:
        """A test of a device's attributes against all ``selectors``, built once per
        resource and scan (values parsed once, not per device)."""
        tests: List[AttributeTest] = []
        for key in selectors:
            values = selector_values(selectors, key) or []
            tests.append(self.selector_test(key, values))
        return all_of(tests)

    def selector_test(self, key: str, values: Sequence[object]) -> AttributeTest:
        """The test for one selector key and its values (any of them). Override for the keys
        whose meaning is more than an attribute, calling super() for the others."""
        return attribute_test(key, values, self.selector_attributes.get(key, key))

    # -- configuration (optional) --------------------------------------------------------
    def check_selectors(self, selectors: Mapping[str, object]) -> None:
        """Raise SelectorError for a selector this driver cannot use. The default checks keys
        and value types against ``selector_types`` (a list of allowed values is accepted
        wherever a single value is); override to add value checks, calling super() first."""
        check_types(selectors, self.selector_types, f"selector for driver {self.name!r}", True)

    def check_settings(self, settings: Mapping[str, object]) -> None:
        """Raise SelectorError for a bad ``[resource.settings]`` entry (keys, types, values)."""
        check_types(settings, self.setting_types, f"setting for driver {self.name!r}", False)

    def default_resources(self) -> Sequence[ResourceConfig]:
        """Resources served when no config file exists. Each registers once it has a device."""
        return ()


class UnavailableDriver(Driver):
    """Stands in for a configured driver that failed to load: its resources still serve (with
    no devices, the failure in logs and ``discover``) and every other resource is unaffected."""

    def __init__(self, name: str, reason: str) -> None:
        self.name = name  # type: ignore[misc]
        self.reason = reason

    def discover(
        self, host: HostFS, resources: Sequence[ResourceConfig]
    ) -> Mapping[str, Sequence[Device]]:
        raise RuntimeError(f"driver {self.name!r} is not available: {self.reason}")

    def check_selectors(self, selectors: Mapping[str, object]) -> None:
        """Unknown: the driver that would judge them did not load."""

    def check_settings(self, settings: Mapping[str, object]) -> None:
        """Unknown: the driver that would judge them did not load."""


def driver_of(drivers: Mapping[str, Driver], resource: ResourceConfig) -> Driver:
    """The driver that serves ``resource``, or an UnavailableDriver where none is installed."""
    return drivers.get(resource.driver) or UnavailableDriver(resource.driver, "not installed")


def selector_values(selectors: Mapping[str, object], key: str) -> Optional[list]:
    """A selector as a list (a single value is a one-element list); None when not given."""
    if key not in selectors:
        return None
    value = selectors[key]
    return list(value) if isinstance(value, list) else [value]


def check_types(
    table: Mapping[str, object],
    types: Mapping[str, Tuple[type, ...]],
    what: str,
    lists_allowed: bool,
) -> None:
    """Check a config table's keys and value types; raise SelectorError naming the key."""
    for key, value in table.items():
        allowed = types.get(key)
        if allowed is None:
            known = ", ".join(sorted(types)) or "none"
            raise SelectorError(key, f"unknown {what} (known: {known})")
        if isinstance(value, list) and lists_allowed:
            if not value:
                raise SelectorError(key, "empty list")
            values = value
        else:
            values = [value]
        for item in values:
            if isinstance(item, bool) and bool not in allowed:
                raise SelectorError(key, f"expected {_type_names(allowed)}, got a boolean")
            if not isinstance(item, allowed):
                raise SelectorError(
                    key, f"expected {_type_names(allowed)}, got {type(item).__name__}"
                )


def _type_names(types: Tuple[type, ...]) -> str:
    names: Dict[type, str] = {str: "string", int: "integer", bool: "boolean", float: "number"}
    return " or ".join(names.get(t, t.__name__) for t in types)
