"""USB devices as the kernel's USB core shows them under /sys/bus/usb/devices, read once.

Names there are of three kinds: root hubs ("usb1"), devices by port path ("1-1", "1-1.2") and
interfaces ("1-1.2:1.0"). Only the first two are devices; an interface is read as part of its
device, because what a pod needs (the tty, hidraw or video node a kernel driver made) hangs
below an interface, at a driver-specific depth: usb-serial puts ``ttyUSB0/tty/ttyUSB0`` under
the interface, cdc_acm ``tty/ttyACM0``, usbhid ``<hid-id>/hidraw/hidraw0``, uvcvideo
``video4linux/video0``. Walking the interface directories (links never followed) finds all of
them without depending on /sys/class, which a partial capture may lack.
"""

from __future__ import annotations

import logging
import posixpath
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from device_plugin_host import HostFS

log = logging.getLogger(__name__)

USB_DEVICES = "/sys/bus/usb/devices"

#: Class directory name below an interface -> the node kind a config names.
NODE_CLASSES: Dict[str, str] = {"tty": "tty", "hidraw": "hidraw", "video4linux": "video"}
NODE_KINDS: Tuple[str, ...] = ("tty", "hidraw", "video")
_WALK_DEPTH = 3
_SKIP_DIRS = frozenset({"power", "driver", "subsystem", "firmware_node", "port", "physical_node"})
_ROOT_HUB = re.compile(r"usb\d+\Z")
_PORT_PATH = re.compile(r"\d+-\d+(\.\d+)*\Z")
_HUB_CLASS = 0x09


@dataclass(frozen=True)
class InterfaceNode:
    """A /dev node an interface driver created: ``present`` says whether /dev has it now."""

    kind: str  # "tty", "hidraw" or "video"
    name: str  # ttyUSB0
    dev_path: str  # /dev/ttyUSB0 (host path)
    present: bool


@dataclass(frozen=True)
class UsbInterface:
    name: str  # 1-1.2:1.0
    interface_class: Optional[int]
    driver: Optional[str]
    nodes: Tuple[InterfaceNode, ...]


@dataclass(frozen=True)
class UsbDevice:
    name: str  # "1-1.2", or "usb1" for a root hub
    path: str  # canonical /sys/devices/... host path
    vendor: int
    product: int
    serial: Optional[str]
    busnum: Optional[int]
    devnum: Optional[int]
    device_class: Optional[int]
    manufacturer: Optional[str]
    product_name: Optional[str]
    speed: Optional[str]
    authorized: Optional[bool]
    interfaces: Tuple[UsbInterface, ...]
    controller: Optional[str]  # the host controller: a PCI address, or its platform name
    numa_nodes: Tuple[int, ...]
    local_cpulist: Optional[str]
    bus_node: Optional[str]  # /dev/bus/usb/001/005
    bus_node_present: bool

    @property
    def is_root_hub(self) -> bool:
        return bool(_ROOT_HUB.match(self.name))

    @property
    def is_hub(self) -> bool:
        return self.is_root_hub or self.device_class == _HUB_CLASS

    @property
    def interface_classes(self) -> Tuple[int, ...]:
        return tuple(
            sorted({i.interface_class for i in self.interfaces if i.interface_class is not None})
        )

    def nodes(self, kinds: Sequence[str]) -> Tuple[InterfaceNode, ...]:
        """The interface nodes of the given kinds, in interface order, each once."""
        seen = set()
        out = []
        for interface in self.interfaces:
            for node in interface.nodes:
                if node.kind in kinds and node.dev_path not in seen:
                    seen.add(node.dev_path)
                    out.append(node)
        return tuple(out)


def port_sort_key(name: str) -> Tuple:
    """Natural order of port paths ("1-1.10" after "1-1.9"); root hubs first on their bus."""
    return tuple(
        int(part) if part.isdigit() else -1
        for part in re.split(r"[-.]", name[3:] if name.startswith("usb") else name)
    )


def scan_usb(host: HostFS) -> List[UsbDevice]:
    """Every USB device and root hub of the host, in bus / port order."""
    valid_numa = host.machine_numa_nodes()
    controllers: Dict[str, Tuple[Optional[str], Tuple[int, ...], Optional[str]]] = {}
    out = []
    for name in host.listdir(USB_DEVICES):
        if ":" in name:
            continue  # an interface: read with its device
        if not (_ROOT_HUB.match(name) or _PORT_PATH.match(name)):
            log.debug("usb: ignoring %s: not a device name the USB core makes", name)
            continue
        device = _read_device(host, name, valid_numa, controllers)
        if device is not None:
            out.append(device)
    out.sort(key=lambda d: (d.busnum if d.busnum is not None else 1 << 20, port_sort_key(d.name)))
    return out


def _read_device(
    host: HostFS,
    name: str,
    valid_numa: Optional[Sequence[int]],
    controllers: Dict[str, Tuple[Optional[str], Tuple[int, ...], Optional[str]]],
) -> Optional[UsbDevice]:
    path = host.resolve(f"{USB_DEVICES}/{name}")
    if path is None:
        log.info(
            "usb device %s: its sysfs link dangles (unplugged during the scan?); skipped", name
        )
        return None
    vendor = host.read_int(f"{path}/idVendor", 16)
    product = host.read_int(f"{path}/idProduct", 16)
    if vendor is None or product is None or not (0 <= vendor <= 0xFFFF and 0 <= product <= 0xFFFF):
        log.warning(
            "usb device %s: idVendor/idProduct missing or not hex (%r:%r); skipped",
            name,
            host.read(f"{path}/idVendor"),
            host.read(f"{path}/idProduct"),
        )
        return None
    busnum = host.read_int(f"{path}/busnum", 10)
    devnum = host.read_int(f"{path}/devnum", 10)
    uevent = _uevent(host, f"{path}/uevent")
    bus_node = _bus_node(name, busnum, devnum, uevent.get("DEVNAME"))
    controller, numa_nodes, cpulist = _controller(host, path, name, valid_numa, controllers)
    authorized = host.read(f"{path}/authorized")
    return UsbDevice(
        name=name,
        path=path,
        vendor=vendor,
        product=product,
        serial=_clean(host.read(f"{path}/serial")),
        busnum=busnum,
        devnum=devnum,
        device_class=host.read_int(f"{path}/bDeviceClass", 16),
        manufacturer=_clean(host.read(f"{path}/manufacturer")),
        product_name=_clean(host.read(f"{path}/product")),
        speed=_clean(host.read(f"{path}/speed")),
        authorized=None if authorized is None else authorized != "0",
        interfaces=tuple(_interfaces(host, path, name)),
        controller=controller,
        numa_nodes=numa_nodes,
        local_cpulist=cpulist,
        bus_node=bus_node,
        bus_node_present=bus_node is not None and host.exists(bus_node),
    )


def _clean(text: Optional[str]) -> Optional[str]:
    """A string descriptor as shown, or None when absent or blank (firmware pads with spaces
    or NULs, which the kernel passes through)."""
    if text is None:
        return None
    text = text.replace("\x00", "").strip()
    return text or None


def _uevent(host: HostFS, path: str) -> Dict[str, str]:
    out = {}
    for line in (host.read(path) or "").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


def _safe_devname(devname: Optional[str]) -> Optional[str]:
    """A uevent DEVNAME as a /dev path, or None when it is absent or could leave /dev."""
    if not devname or devname.startswith("/") or ".." in devname.split("/"):
        return None
    return "/dev/" + devname


def _bus_node(
    name: str, busnum: Optional[int], devnum: Optional[int], devname: Optional[str]
) -> Optional[str]:
    """/dev/bus/usb/BBB/DDD. busnum and devnum are *decimal* in sysfs; the node name pads
    them to three digits. The uevent's DEVNAME wins when it is sane (it is what udev made)."""
    from_uevent = _safe_devname(devname)
    if from_uevent is not None and from_uevent.startswith("/dev/bus/usb/"):
        return from_uevent
    if busnum is None or devnum is None or not (0 < busnum <= 999 and 0 < devnum <= 999):
        log.warning(
            "usb device %s: busnum/devnum missing or out of range (%r/%r)", name, busnum, devnum
        )
        return None
    return f"/dev/bus/usb/{busnum:03d}/{devnum:03d}"


def _controller(
    host: HostFS,
    path: str,
    name: str,
    valid_numa: Optional[Sequence[int]],
    cache: Dict[str, Tuple[Optional[str], Tuple[int, ...], Optional[str]]],
) -> Tuple[Optional[str], Tuple[int, ...], Optional[str]]:
    """The host controller owning a device (the directory above its root hub), with its NUMA
    node and local CPUs.

    USB devices have no numa_node of their own: HostFS.numa_of walks up to the controller's
    (or, on a platform without one there, the nearest ancestor's). -1 means unknown, and so
    does a node the machine does not have (firmware tables on single-socket boards).
    """
    pci = host.pci_ancestor(path)
    key = pci or _controller_path(path) or path
    if key not in cache:
        numa = host.numa_of(path)
        if numa and valid_numa is not None and numa[0] not in valid_numa:
            log.info(
                "usb device %s: numa_node %d is not a node of this machine; unknown", name, numa[0]
            )
            numa = ()
        if pci is not None:
            controller: Optional[str] = posixpath.basename(pci)
            cpulist = host.read(f"{pci}/local_cpulist") or None
        else:
            above = _controller_path(path)
            controller = posixpath.basename(above) if above else None
            cpulist = None
            if controller is None:
                log.debug("usb device %s: no host controller found above %s", name, path)
        cache[key] = (controller, numa, cpulist)
    return cache[key]


def _controller_path(path: str) -> Optional[str]:
    """The directory holding the root hub: an SoC's ".../fe980000.usb"."""
    parts = path.split("/")
    for index, part in enumerate(parts):
        if _ROOT_HUB.match(part) and index > 1:
            return "/".join(parts[:index])
    return None


def _interfaces(host: HostFS, path: str, name: str) -> List[UsbInterface]:
    prefix = name + ":" if not _ROOT_HUB.match(name) else name[3:] + "-0:"
    out = []
    for child in host.listdir(path):
        if not child.startswith(prefix) or host.readlink(f"{path}/{child}") is not None:
            continue
        intf = f"{path}/{child}"
        nodes: List[InterfaceNode] = []
        _walk_nodes(host, intf, 0, nodes)
        out.append(
            UsbInterface(
                name=child,
                interface_class=host.read_int(f"{intf}/bInterfaceClass", 16),
                driver=host.link_name(f"{intf}/driver"),
                nodes=tuple(sorted(nodes, key=lambda n: (n.kind, port_sort_key_name(n.name)))),
            )
        )
    out.sort(key=lambda i: port_sort_key_name(i.name))
    return out


def port_sort_key_name(name: str) -> Tuple:
    """Natural order for names with numbers in them (video2 before video10)."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def _walk_nodes(host: HostFS, directory: str, depth: int, out: List[InterfaceNode]) -> None:
    """Find class directories (tty/, hidraw/, video4linux/) below an interface, links never
    followed (``driver`` and ``subsystem`` lead all over sysfs), a few levels deep at most."""
    if depth > _WALK_DEPTH:
        return
    for child in host.listdir(directory):
        full = f"{directory}/{child}"
        if child in _SKIP_DIRS or child.startswith("ep_") or host.readlink(full) is not None:
            continue
        if not host.is_dir(full):
            continue
        kind = NODE_CLASSES.get(child)
        if kind is None:
            _walk_nodes(host, full, depth + 1, out)
            continue
        for node in host.listdir(full):
            node_dir = f"{full}/{node}"
            if host.readlink(node_dir) is not None or not host.is_dir(node_dir):
                continue
            dev_path = _safe_devname(_uevent(host, f"{node_dir}/uevent").get("DEVNAME"))
            if dev_path is None:
                if ".." in node or "/" in node:
                    continue
                dev_path = f"/dev/{node}"
            out.append(InterfaceNode(kind, node, dev_path, host.exists(dev_path)))
