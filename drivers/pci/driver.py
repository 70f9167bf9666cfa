"""The generic pci driver: a PCI function and the character devices its kernel driver made.

For hardware no built-in driver knows (a Hailo-8 NPU, a capture card, a custom FPGA board),
an operator names the functions by selectors and gets each one served with its own nodes,
without code. Rules:

* It serves only what config names: no default resources, and a resource must give at least
  one of ``vendor``, ``device``, ``class``, ``kernel_driver``, ``pci_address``.
* ``kernel_driver`` names the PCI driver (the ``driver`` link, what ``discover`` shows) or
  the module it comes from (/sys/bus/pci/drivers/<name>/module, ``kernel_module`` in
  ``discover``; ``-`` and ``_`` alike, as modprobe takes them): Hailo's module hailo_pci
  registers the driver ``hailo``, and either name selects its boards.
* The id is the PCI address. The nodes are the function's class devices: every
  /sys/dev/char entry whose nearest PCI ancestor is the function (host/sysfs/chardev.py), at the
  /dev path of its uevent DEVNAME (``hailo0`` -> /dev/hailo0). A function that owns none
  takes the parentless (/sys/devices/virtual) char devices whose ``board_location``
  attribute names it: hailo_pci up to v4.22.0 makes ``hailo0`` with no parent and says
  which board it drives only there. ``settings.char_classes`` keeps only some classes
  (``["hailo_chardev"]``); a card that also exposes, say, a tty does not hand it out then.
* Unhealthy, with the reason: no kernel driver bound, a bound driver that made no char
  device (of the wanted classes), a node missing from /dev, ``enable`` = 0.
* A function bound to vfio-pci (or a vfio variant, or pci-stub) is VM passthrough: it is
  served only when ``kernel_driver`` names that driver, then with /dev/vfio/vfio and
  /dev/vfio/<iommu group>.
* NUMA is the function's own ``numa_node`` (-1: no topology).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

from device_plugin_host import (
    PCI_SELECTOR_TYPES,
    AttributeTest,
    CharDevice,
    CharIndex,
    Device,
    DeviceNode,
    Driver,
    Health,
    HostFS,
    PciFunction,
    ResourceConfig,
    SelectorError,
    check_class_selector,
    check_pci_selectors,
    dev_node_path,
    is_pci_address,
    list_functions,
    selector_values,
)

log = logging.getLogger(__name__)

IDENTIFYING = ("vendor", "device", "class", "kernel_driver", "pci_address")
PASSTHROUGH_DRIVERS = ("vfio-pci", "pci-stub")
VFIO_CONTAINER = "/dev/vfio/vfio"
PCI_DRIVERS = "/sys/bus/pci/drivers"
VIRTUAL = "/sys/devices/virtual/"
#: The attribute naming a parentless char device's PCI function (hailo_pci's sysfs.c).
BOARD_LOCATION = "board_location"


@dataclass(frozen=True)
class CharNode:
    device: CharDevice
    dev_node: str
    subsystem: Optional[str]
    present: bool


@dataclass
class PciInventory:
    """One scan: every function and the char index. The nodes of a function (DEVNAME, class,
    presence in /dev) are read only once a resource selects it, and kept for the scan: most
    of a host's char devices (ttys, NVMe, USB) belong to functions no resource names."""

    host: HostFS
    functions: Tuple[PciFunction, ...]
    index: CharIndex
    _nodes: Dict[str, Tuple[CharNode, ...]] = field(default_factory=dict)
    _exists: Dict[str, bool] = field(default_factory=dict)
    _modules: Dict[str, Optional[str]] = field(default_factory=dict)
    _located: Optional[Dict[str, List[CharDevice]]] = None

    def nodes(self, function: PciFunction) -> Tuple[CharNode, ...]:
        cached = self._nodes.get(function.address)
        if cached is None:
            chars: Sequence[CharDevice] = self.index.of_function(function.address)
            if not chars and function.kernel_driver is not None:
                chars = self.located(function.address)
            cached = tuple(
                CharNode(char, node, char.subsystem(self.host), self.exists(node))
                for char in chars
                for node in (dev_node_path(self.host, char.path, char.name),)
            )
            self._nodes[function.address] = cached
        return cached

    def located(self, address: str) -> List[CharDevice]:
        """Parentless char devices whose ``board_location`` is ``address``, by name. The
        attribute is read once per scan and device, and only once some selected function
        owns no char device (most hosts never ask)."""
        if self._located is None:
            located: Dict[str, List[CharDevice]] = {}
            for char in self.index.devices:
                if not char.path.startswith(VIRTUAL):
                    continue
                where = self.host.read(f"{char.path}/{BOARD_LOCATION}")
                if where and is_pci_address(where):
                    located.setdefault(where, []).append(char)
            for chars in located.values():
                chars.sort(key=lambda c: (len(c.name), c.name))
            self._located = located
        return self._located.get(address, [])

    def module(self, driver: str) -> Optional[str]:
        """The module a PCI driver comes from (None for one built into the kernel)."""
        if driver not in self._modules:
            self._modules[driver] = self.host.link_name(f"{PCI_DRIVERS}/{driver}/module")
        return self._modules[driver]

    def exists(self, path: str) -> bool:
        known = self._exists.get(path)
        if known is None:
            known = self._exists[path] = self.host.exists(path)
        return known


class PciDriver(Driver):
    name = "pci"
    subsystems = ("pci",)
    device_globs = ("/dev/hailo*", "/dev/xdma*")
    selector_types = {**PCI_SELECTOR_TYPES, "class": (str,)}
    setting_types = {"char_classes": (list,)}

    def check_selectors(self, selectors: Mapping[str, object]) -> None:
        super().check_selectors(selectors)
        check_pci_selectors(selectors)
        check_class_selector(selectors)
        if not any(key in selectors for key in IDENTIFYING):
            raise SelectorError(
                "",
                "the pci driver serves only what config names: give at least one of "
                + ", ".join(IDENTIFYING),
            )

    def check_settings(self, settings: Mapping[str, object]) -> None:
        super().check_settings(settings)
        classes = settings.get("char_classes")
        if classes is not None and (
            not isinstance(classes, list)
            or not classes
            or not all(isinstance(c, str) and c.strip() for c in classes)
        ):
            raise SelectorError("char_classes", 'a non-empty list of class names ("hailo_chardev")')

    def selector_test(self, key: str, values: Sequence[object]) -> AttributeTest:
        if key != "kernel_driver":
            return super().selector_test(key, values)
        names = frozenset(str(v) for v in values)
        modules = frozenset(_module_name(n) for n in names)
        return lambda attributes: (attributes.get("kernel_driver") in names
                                   or attributes.get("kernel_module") in modules)

    def scan(self, host: HostFS) -> PciInventory:
        return PciInventory(host, tuple(list_functions(host)), CharIndex.read(host))

    def select(self, inventory: PciInventory, resource: ResourceConfig) -> List[Device]:
        selectors = resource.selectors
        if not any(key in selectors for key in IDENTIFYING):
            return []  # rejected by check_selectors; never "every PCI function"
        named = [str(v) for v in selector_values(selectors, "kernel_driver") or ()]
        named_modules = {_module_name(n) for n in named}
        # vendor, device, kernel_driver, pci_address and class are matched by the host
        # against each function's standard attributes.
        matches = self.matcher(selectors)
        classes = resource.settings.get("char_classes")
        wanted = frozenset(str(c) for c in classes) if isinstance(classes, list) else None
        out = []
        for fn in inventory.functions:
            module = inventory.module(fn.kernel_driver) if fn.kernel_driver else None
            if _is_passthrough(fn) and fn.kernel_driver not in named and (
                    module is None or module not in named_modules):
                continue
            attributes = fn.attributes()
            if module:
                attributes["kernel_module"] = module
            if not matches(attributes):
                continue
            out.append(_device(inventory, fn, wanted, attributes))
        return out


def _module_name(name: str) -> str:
    """A module as /sys/module spells it: modprobe takes ``-`` and ``_`` alike."""
    return name.replace("-", "_")


def _is_passthrough(fn: PciFunction) -> bool:
    name = fn.kernel_driver or ""
    return name in PASSTHROUGH_DRIVERS or "vfio" in name


def _device(
    inventory: PciInventory, fn: PciFunction, wanted: Optional[FrozenSet[str]],
    attributes: Dict[str, str],
) -> Device:
    """``attributes``: the function's standard ones, already made for matching (this adds
    to them)."""
    problems: List[str] = []
    if _is_passthrough(fn):
        paths = [VFIO_CONTAINER]
        if fn.iommu_group is None:
            problems.append("bound to a passthrough driver but has no IOMMU group")
        else:
            paths.append(f"/dev/vfio/{fn.iommu_group}")
        attributes["passthrough"] = "true"
    else:
        chosen = [n for n in inventory.nodes(fn) if wanted is None or n.subsystem in wanted]
        paths = [n.dev_node for n in chosen]
        if fn.kernel_driver is None:
            problems.append("no kernel driver bound")
        elif not chosen:
            which = "" if wanted is None else " of class " + ", ".join(sorted(wanted))
            problems.append(f"{fn.kernel_driver} made no character device{which} under {fn.path}")
        if fn.enabled is False and fn.kernel_driver is not None:
            problems.append("PCI function disabled (enable = 0)")
        if chosen:
            attributes["char_devices"] = ",".join(
                f"{n.device.name}:{n.subsystem or '?'}:{n.device.numbers}" for n in chosen
            )
    problems.extend(f"device node {p} missing" for p in paths if not inventory.exists(p))
    reason = "; ".join(dict.fromkeys(problems))
    if reason:
        log.warning("pci %s: unhealthy: %s", fn.address, reason)
    return Device(
        id=fn.address,
        health=Health.UNHEALTHY if reason else Health.HEALTHY,
        health_reason=reason,
        numa_nodes=fn.numa_nodes,
        device_nodes=tuple(DeviceNode(p, p, "rw") for p in dict.fromkeys(paths)),
        attributes=attributes,
    )
