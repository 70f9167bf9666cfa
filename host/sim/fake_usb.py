"""USB controllers, hubs and devices for fake trees, in the shapes the kernel's USB core leaves.

A host controller is a PCI function (class 0x0c0330 for xHCI) with one root hub ``usbN`` per
bus under it (an xHCI has two: USB 2 and USB 3). Devices are named by port path ("1-1",
"1-1.2") and nest under their parent hub's directory; each has interfaces named
"<device>:<config>.<n>" with ``bInterfaceClass``. The nodes an interface driver creates sit
where the real drivers put them:

- usb-serial (cp210x, ftdi_sio, ch341): ``<intf>/ttyUSB0/tty/ttyUSB0`` (major 188)
- cdc_acm: ``<intf>/tty/ttyACM0`` (major 166)
- usbhid: ``<intf>/<bus>:<vid>:<pid>.<n>/hidraw/hidraw0`` (a dynamic major)
- uvcvideo: ``<intf>/video4linux/video0`` (major 81)

with the /sys/class/{tty,hidraw,video4linux} links, /sys/bus/usb/devices links and the /dev
nodes (/dev/bus/usb/BBB/DDD, major 189). Every piece can be left out for the odd cases.

One builder per kernel driver's layout.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

from host.sim.tree import FakeTree

USB_DEVICE_MAJOR = 189
USB_SERIAL_MAJOR = 188
ACM_MAJOR = 166
HIDRAW_MAJOR = 241
VIDEO_MAJOR = 81
USB_DEVICES = "/sys/bus/usb/devices"


@dataclass
class Interface:
    """One interface of a device's active configuration and the nodes its driver made."""

    interface_class: int
    subclass: int = 0
    protocol: int = 0
    driver: Optional[str] = None
    tty: Sequence[str] = ()  # "ttyUSB0" (usb-serial shape) or "ttyACM0" (cdc_acm shape)
    hidraw: Sequence[str] = ()
    video: Sequence[str] = ()
    hid_id: str = ""  # the HID device dir name, "0003:1050:0407.0001"; made up when empty
    extra: Dict[str, str] = field(default_factory=dict)


def _minor(name: str) -> int:
    digits = "".join(ch for ch in name if ch.isdigit())
    return int(digits) if digits else 0


def usb_controller(
    tree: FakeTree,
    address: str = "0000:00:14.0",
    *,
    buses: Sequence[Tuple[int, str]] = ((1, "480"), (2, "10000")),
    vendor: int = 0x8086,
    device: int = 0xA0ED,
    pci_class: int = 0x0C0330,
    numa_node: Optional[int] = -1,
    local_cpulist: Optional[str] = None,
    iommu_group: Optional[int] = None,
    parent: Optional[str] = None,
    driver: str = "xhci_hcd",
    dev_nodes: bool = True,
) -> str:
    """A PCI USB host controller and its root hubs; returns the function's /sys path.

    ``buses`` lists (bus number, root hub speed in Mb/s): 480 is a USB 2 root hub, 5000 or
    10000 the USB 3 one an xHCI registers beside it.
    """
    path = tree.pci_function(
        address,
        vendor=vendor,
        device=device,
        pci_class=pci_class,
        numa_node=numa_node,
        driver=driver,
        iommu_group=iommu_group,
        parent=parent,
        local_cpulist=local_cpulist,
    )
    for busnum, speed in buses:
        root_hub(tree, path, busnum, speed=speed, dev_node=dev_nodes)
    return path


def root_hub(
    tree: FakeTree, controller_path: str, busnum: int, *, speed: str = "480", dev_node: bool = True
) -> str:
    """``usbN`` under its controller: the Linux Foundation hub (1d6b:0002 / 0003)."""
    name = f"usb{busnum}"
    usb3 = speed not in ("1.5", "12", "480")
    path = f"{controller_path}/{name}"
    _device_attrs(
        tree,
        path,
        name=name,
        vendor=0x1D6B,
        product=0x0003 if usb3 else 0x0002,
        busnum=busnum,
        devnum=1,
        device_class=0x09,
        serial=posixpath.basename(controller_path),
        manufacturer="Linux 6.5.0-41-generic xhci-hcd",
        product_name="xHCI Host Controller",
        speed=speed,
        devpath="0",
        dev_node=dev_node,
    )
    tree.attr(f"{path}/maxchild", "4")
    intf = f"{path}/{busnum}-0:1.0"
    _interface_attrs(tree, intf, Interface(0x09, driver="hub"), number=0)
    tree.link(f"{USB_DEVICES}/{busnum}-0:1.0", intf)
    return path


def usb_device(
    tree: FakeTree,
    name: str,
    *,
    vendor: int,
    product: int,
    devnum: int,
    serial: Optional[str] = None,
    device_class: int = 0x00,
    interfaces: Sequence[Interface] = (),
    manufacturer: Optional[str] = None,
    product_name: Optional[str] = None,
    speed: str = "480",
    authorized: Optional[str] = "1",
    dev_node: bool = True,
    interface_nodes: bool = True,
    extra: Optional[Dict[str, str]] = None,
) -> str:
    """A device at port path ``name`` ("1-1.2") under its parent hub; returns its /sys path.

    The parent ("1-1", or the root hub "usb1" for "1-1") must exist already. ``dev_node``
    makes /dev/bus/usb/BBB/DDD; ``interface_nodes`` the /dev nodes of the interfaces.
    """
    busnum = int(name.split("-", 1)[0])
    ports = name.split("-", 1)[1]
    parent_name = f"usb{busnum}" if "." not in ports else name.rsplit(".", 1)[0]
    parent_path = sys_path(tree, parent_name)
    path = f"{parent_path}/{name}"
    _device_attrs(
        tree,
        path,
        name=name,
        vendor=vendor,
        product=product,
        busnum=busnum,
        devnum=devnum,
        device_class=device_class,
        serial=serial,
        manufacturer=manufacturer,
        product_name=product_name,
        speed=speed,
        devpath=ports,
        dev_node=dev_node,
        authorized=authorized,
    )
    tree.attr(f"{path}/bNumInterfaces", f"{len(interfaces):2d}")
    for number, interface in enumerate(interfaces):
        intf = f"{path}/{name}:1.{number}"
        _interface_attrs(tree, intf, interface, number)
        tree.link(f"{USB_DEVICES}/{name}:1.{number}", intf)
        _interface_nodes(tree, intf, interface, vendor, product, number, interface_nodes)
    for key, value in (extra or {}).items():
        tree.attr(f"{path}/{key}", value)
    return path


def hub(
    tree: FakeTree,
    name: str,
    *,
    devnum: int,
    vendor: int = 0x05E3,
    product: int = 0x0610,
    speed: str = "480",
    product_name: str = "USB2.1 Hub",
    dev_node: bool = True,
) -> str:
    """An external hub (bDeviceClass 9), like the Genesys Logic ones on most boards."""
    path = usb_device(
        tree,
        name,
        vendor=vendor,
        product=product,
        devnum=devnum,
        device_class=0x09,
        interfaces=[Interface(0x09, driver="hub")],
        manufacturer="GenesysLogic",
        product_name=product_name,
        speed=speed,
        dev_node=dev_node,
    )
    tree.attr(f"{path}/maxchild", "4")
    return path


def bus_node(busnum: int, devnum: int) -> str:
    return f"/dev/bus/usb/{busnum:03d}/{devnum:03d}"


def sys_path(tree: FakeTree, name: str) -> str:
    """The /sys/devices path of a device already in the tree, by its kernel name."""
    real = os.path.realpath(tree.real(f"{USB_DEVICES}/{name}"))
    root = os.path.realpath(tree.root)
    if not real.startswith(root + "/") or not os.path.isdir(real):
        raise ValueError(f"no USB device {name!r} in the tree: add its hub first")
    return real[len(root) :]


# -- internals ----------------------------------------------------------------------------
def _device_attrs(
    tree: FakeTree,
    path: str,
    *,
    name: str,
    vendor: int,
    product: int,
    busnum: int,
    devnum: int,
    device_class: int,
    serial: Optional[str],
    manufacturer: Optional[str],
    product_name: Optional[str],
    speed: str,
    devpath: str,
    dev_node: bool,
    authorized: Optional[str] = "1",
) -> None:
    minor = (busnum - 1) * 128 + (devnum - 1)
    tree.attr(f"{path}/idVendor", f"{vendor:04x}")
    tree.attr(f"{path}/idProduct", f"{product:04x}")
    tree.attr(f"{path}/bDeviceClass", f"{device_class:02x}")
    tree.attr(f"{path}/bDeviceSubClass", "00")
    tree.attr(f"{path}/bDeviceProtocol", "01" if device_class == 0x09 else "00")
    tree.attr(f"{path}/bConfigurationValue", "1")
    tree.attr(f"{path}/busnum", str(busnum))
    tree.attr(f"{path}/devnum", str(devnum))
    tree.attr(f"{path}/devpath", devpath)
    tree.attr(f"{path}/speed", speed)
    tree.attr(f"{path}/removable", "unknown" if name.startswith("usb") else "removable")
    tree.attr(f"{path}/dev", f"{USB_DEVICE_MAJOR}:{minor}")
    tree.attr(
        f"{path}/uevent",
        f"MAJOR={USB_DEVICE_MAJOR}\nMINOR={minor}\nDEVNAME=bus/usb/{busnum:03d}/{devnum:03d}\n"
        f"DEVTYPE=usb_device\nDRIVER=usb\nPRODUCT={vendor:x}/{product:x}/100\n"
        f"TYPE={device_class}/0/0\nBUSNUM={busnum:03d}\nDEVNUM={devnum:03d}",
    )
    if authorized is not None:
        tree.attr(f"{path}/authorized", authorized)
    if serial is not None:
        tree.attr(f"{path}/serial", serial)
    if manufacturer is not None:
        tree.attr(f"{path}/manufacturer", manufacturer)
    if product_name is not None:
        tree.attr(f"{path}/product", product_name)
    tree.link(f"{path}/subsystem", "/sys/bus/usb")
    tree.bind_driver(path, "usb", bus="usb")
    tree.link(f"{USB_DEVICES}/{name}", path)
    if dev_node:
        tree.chardev(bus_node(busnum, devnum), USB_DEVICE_MAJOR, minor)


def _interface_attrs(tree: FakeTree, path: str, interface: Interface, number: int) -> None:
    tree.attr(f"{path}/bInterfaceClass", f"{interface.interface_class:02x}")
    tree.attr(f"{path}/bInterfaceSubClass", f"{interface.subclass:02x}")
    tree.attr(f"{path}/bInterfaceProtocol", f"{interface.protocol:02x}")
    tree.attr(f"{path}/bInterfaceNumber", f"{number:02x}")
    tree.attr(f"{path}/bAlternateSetting", " 0")
    tree.attr(f"{path}/bNumEndpoints", "02")
    tree.mkdir(f"{path}/ep_81")
    tree.link(f"{path}/subsystem", "/sys/bus/usb")
    if interface.driver:
        tree.bind_driver(path, interface.driver, bus="usb")
    for key, value in interface.extra.items():
        tree.attr(f"{path}/{key}", value)


def _class_node(
    tree: FakeTree,
    node_dir: str,
    name: str,
    klass: str,
    major: int,
    make_node: bool,
    devname: Optional[str] = None,
) -> None:
    minor = _minor(name)
    tree.attr(f"{node_dir}/dev", f"{major}:{minor}")
    tree.attr(f"{node_dir}/uevent", f"MAJOR={major}\nMINOR={minor}\nDEVNAME={devname or name}")
    tree.link(f"{node_dir}/subsystem", f"/sys/class/{klass}")
    tree.link(f"/sys/class/{klass}/{name}", node_dir)
    if make_node:
        tree.chardev(f"/dev/{devname or name}", major, minor)


def _interface_nodes(
    tree: FakeTree,
    intf: str,
    interface: Interface,
    vendor: int,
    product: int,
    number: int,
    make_nodes: bool,
) -> None:
    for name in interface.tty:
        if name.startswith("ttyUSB"):
            port = f"{intf}/{name}"  # the usb-serial port device, the tty under it
            tree.attr(f"{port}/port_number", "0")
            tree.link(f"{port}/subsystem", "/sys/bus/usb-serial")
            tree.link(f"/sys/bus/usb-serial/devices/{name}", port)
            if interface.driver:
                tree.bind_driver(port, interface.driver, bus="usb-serial")
            _class_node(tree, f"{port}/tty/{name}", name, "tty", USB_SERIAL_MAJOR, make_nodes)
        else:
            _class_node(tree, f"{intf}/tty/{name}", name, "tty", ACM_MAJOR, make_nodes)
    if interface.hidraw:
        hid_id = interface.hid_id or f"0003:{vendor:04X}:{product:04X}.{number + 1:04X}"
        hid = f"{intf}/{hid_id}"
        tree.attr(f"{hid}/country", "00")
        tree.link(f"{hid}/subsystem", "/sys/bus/hid")
        tree.link(f"/sys/bus/hid/devices/{hid_id}", hid)
        for name in interface.hidraw:
            _class_node(tree, f"{hid}/hidraw/{name}", name, "hidraw", HIDRAW_MAJOR, make_nodes)
    for name in interface.video:
        node = f"{intf}/video4linux/{name}"
        tree.attr(f"{node}/name", "HD Pro Webcam C920")
        tree.attr(f"{node}/index", str(_minor(name) % 2))
        _class_node(tree, node, name, "video4linux", VIDEO_MAJOR, make_nodes)
