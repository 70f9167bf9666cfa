"""The USB driver: whole USB devices, with the /dev nodes their interfaces expose.

A USB device is handed to a container as its usbfs node (/dev/bus/usb/BBB/DDD, what libusb
opens) plus, by default, every tty / hidraw / video node its interfaces' kernel drivers made:
a Zigbee stick is used through /dev/ttyUSB0 and a camera through /dev/video0, and the usbfs
node alone cannot reach an interface a kernel driver has claimed. The device is allocated
whole, so handing over all its nodes gives the pod nothing it was not already given.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from device_plugin_host import (
    Device,
    DeviceNode,
    Driver,
    Health,
    HostFS,
    ResourceConfig,
    SelectorError,
    normalise_hex_ids,
    replicate,
    selector_values,
)
from drivers.usb.sysfs import NODE_KINDS, UsbDevice, port_sort_key, scan_usb

log = logging.getLogger(__name__)

#: The most replicas ``shared`` may ask for: far above any real sharing, low enough that a
#: typo (100000) cannot make the kubelet track millions of ids.
MAX_SHARED = 1024
_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(frozen=True)
class UsbInventory:
    devices: Tuple[UsbDevice, ...]
    ids: Mapping[str, str]  # kernel name -> device id


class UsbDriver(Driver):
    name = "usb"
    # The host rescans on an event once udevd has handled it, and udevd makes /dev/ttyUSB0,
    # /dev/hidraw0 and /dev/video0 in the tty / hidraw / video4linux events that follow the
    # USB ones: watching only "usb" would leave a new dongle Unhealthy until the next timed
    # rescan.
    subsystems = ("usb", "tty", "hidraw", "video4linux")
    device_globs = (
        "/dev/bus/usb/*/*", "/dev/ttyUSB*", "/dev/ttyACM*", "/dev/hidraw*", "/dev/video*",
    )
    selector_types = {
        "vendor": (str, int),
        "product": (str, int),
        "serial": (str,),
        "interface_class": (str, int),
        "device_class": (str, int),
        "port": (str,),
    }
    setting_types = {
        "limit": (int,),
        "shared": (int,),
        "include_interfaces": (list,),
    }

    # -- configuration -----------------------------------------------------------------
    def check_selectors(self, selectors: Mapping[str, object]) -> None:
        super().check_selectors(selectors)
        for key, bits in (
            ("vendor", 16),
            ("product", 16),
            ("interface_class", 8),
            ("device_class", 8),
        ):
            try:
                ids = normalise_hex_ids(selector_values(selectors, key))
            except ValueError:
                raise SelectorError(key, 'must be hex ids like "0x10c4"') from None
            if ids and any(not 0 <= value < (1 << bits) for value in ids):
                raise SelectorError(key, f"USB {key} values are {bits}-bit")
        for value in selector_values(selectors, "serial") or ():
            if not str(value).strip():
                raise SelectorError("serial", "empty serial number")
        for value in selector_values(selectors, "port") or ():
            if not re.fullmatch(r"usb\d+|\d+-\d+(\.\d+)*", str(value)):
                raise SelectorError("port", f'{value!r} is not a USB port path like "1-1.2"')

    def check_settings(self, settings: Mapping[str, object]) -> None:
        super().check_settings(settings)
        limit = settings.get("limit")
        if isinstance(limit, int) and limit < 1:
            raise SelectorError("limit", "must be at least 1")
        shared = settings.get("shared")
        if isinstance(shared, int) and not 1 <= shared <= MAX_SHARED:
            raise SelectorError("shared", f"must be 1 to {MAX_SHARED}")
        kinds = settings.get("include_interfaces")
        if isinstance(kinds, list):
            for kind in kinds:
                if kind not in NODE_KINDS:
                    raise SelectorError(
                        "include_interfaces", f"{kind!r} is not one of {', '.join(NODE_KINDS)}"
                    )

    def default_resources(self) -> Sequence[ResourceConfig]:
        """None: a USB box holds keyboards, BMC virtual media and hubs next to the dongle a
        workload wants, and which one that is only the operator knows."""
        return ()

    # -- discovery -----------------------------------------------------------------------
    def scan(self, host: HostFS) -> UsbInventory:
        devices = tuple(scan_usb(host))
        return UsbInventory(devices, _stable_ids(devices))

    def select(self, inventory: UsbInventory, resource: ResourceConfig) -> List[Device]:
        selectors = resource.selectors
        settings = resource.settings
        raw_kinds = settings.get("include_interfaces", NODE_KINDS)
        kinds = tuple(str(k) for k in raw_kinds) if isinstance(raw_kinds, list) else NODE_KINDS
        shared = settings.get("shared", 1)
        shared = shared if isinstance(shared, int) else 1
        limit = settings.get("limit")
        matched = [d for d in inventory.devices if _matches(d, selectors)]
        if isinstance(limit, int) and len(matched) > limit:
            # Lowest ports first: the choice is the same on every scan, so ids stay put.
            dropped = matched[limit:]
            matched = matched[:limit]
            log.info(
                "resource %s: limit %s leaves out %s",
                resource.name,
                limit,
                ", ".join(d.name for d in dropped),
            )
        out: List[Device] = []
        for usb in matched:
            device = _device(usb, inventory.ids[usb.name], kinds)
            if shared > 1:
                out.extend(replicate(device, shared))
            else:
                out.append(device)
        return out


def _stable_ids(devices: Sequence[UsbDevice]) -> Dict[str, str]:
    """vendor:product:serial when the serial is there and unique, else the port path.

    A serial number follows the device to any port and survives reboots and re-plugs. Without
    one (CH340s, many HID devices) the port path is the only stable fact: the same physical
    port gets the same path every boot. Cheap adapters sometimes share one serial (FTDI clones
    ship "A50285BI" by the thousand); those fall back to their port path too, since two devices
    must never carry one id.
    """
    keys = {}
    for device in devices:
        if device.serial:
            keys[device.name] = (
                f"{device.vendor:04x}:{device.product:04x}:{_ID_UNSAFE.sub('_', device.serial)}"
            )
    counts = Counter(keys.values())
    out = {}
    for device in devices:
        key = keys.get(device.name)
        if key is not None and counts[key] > 1:
            log.warning(
                "usb device %s: serial %r is shared with another device; using the "
                "port path as its id",
                device.name,
                device.serial,
            )
            key = None
        out[device.name] = key or device.name
    return out


def _matches(device: UsbDevice, selectors: Mapping[str, object]) -> bool:
    ports = selector_values(selectors, "port")
    classes = normalise_hex_ids(selector_values(selectors, "device_class"))
    if device.is_hub:
        # Hubs (root hubs above all) are infrastructure: only an explicit port or the hub
        # device class hands one out.
        named = ports is not None and device.name in ports
        if not named and not (classes is not None and 0x09 in classes):
            return False
    if ports is not None and device.name not in ports:
        return False
    if classes is not None and device.device_class not in classes:
        return False
    vendors = normalise_hex_ids(selector_values(selectors, "vendor"))
    if vendors is not None and device.vendor not in vendors:
        return False
    products = normalise_hex_ids(selector_values(selectors, "product"))
    if products is not None and device.product not in products:
        return False
    serials = selector_values(selectors, "serial")
    if serials is not None and device.serial not in [str(s).strip() for s in serials]:
        return False
    interface_classes = normalise_hex_ids(selector_values(selectors, "interface_class"))
    return interface_classes is None or bool(interface_classes & set(device.interface_classes))


def _device(usb: UsbDevice, device_id: str, kinds: Sequence[str]) -> Device:
    nodes: List[DeviceNode] = []
    missing: List[str] = []
    problems: List[str] = []
    if usb.bus_node is None:
        problems.append("busnum/devnum unreadable, so its /dev/bus/usb node is unknown")
    else:
        nodes.append(DeviceNode(usb.bus_node))
        if not usb.bus_node_present:
            missing.append(usb.bus_node)
    interface_nodes = usb.nodes(kinds)
    for node in interface_nodes:
        nodes.append(DeviceNode(node.dev_path))
        if not node.present:
            missing.append(node.dev_path)
    if missing:
        problems.append("device node " + ", ".join(missing) + " missing")
    if usb.authorized is False:
        problems.append("not authorized (authorized = 0; USBGuard or a policy blocks it)")
    attributes = _attributes(usb, interface_nodes)
    if problems:
        reason = "; ".join(problems)
        log.warning("usb device %s (%s): unhealthy: %s", usb.name, device_id, reason)
        health = Health.UNHEALTHY
    else:
        reason = ""
        health = Health.HEALTHY
    return Device(
        id=device_id,
        health=health,
        health_reason=reason,
        numa_nodes=usb.numa_nodes,
        device_nodes=tuple(nodes),
        attributes=attributes,
    )


def _attributes(usb: UsbDevice, interface_nodes: Sequence) -> Dict[str, str]:
    out = {
        "port": usb.name,
        "vendor": f"0x{usb.vendor:04x}",
        "product": f"0x{usb.product:04x}",
    }
    optional: Dict[str, Optional[str]] = {
        "serial": usb.serial,
        "busnum": None if usb.busnum is None else str(usb.busnum),
        "devnum": None if usb.devnum is None else str(usb.devnum),
        "device_class": None if usb.device_class is None else f"0x{usb.device_class:02x}",
        "interface_classes": ",".join(f"0x{c:02x}" for c in usb.interface_classes) or None,
        "manufacturer": usb.manufacturer,
        "product_name": usb.product_name,
        "speed": usb.speed,
        "controller": usb.controller,
        "local_cpulist": usb.local_cpulist,
        "usb_node": usb.bus_node,
    }
    for kind in NODE_KINDS:
        paths = [n.dev_path for n in interface_nodes if n.kind == kind]
        optional[f"{kind}_nodes"] = ",".join(paths) or None
    out.update({key: value for key, value in optional.items() if value})
    return out


__all__ = ["UsbDriver", "UsbInventory", "port_sort_key"]
