"""The USB driver against fake trees in the USB core's shapes, and the captured edge box."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Dict, List

import pytest

from device_plugin_host_testing.machines import load_machine
from drivers.usb import plugin
from drivers.usb.driver import MAX_SHARED, UsbDriver
from drivers.usb.sysfs import port_sort_key
from host.cli.capture import capture_tree
from host.config import load_config
from host.core.capabilities import needs_pre_start
from host.core.driver import SelectorError
from host.core.hostfs import HostFS
from host.core.model import Device, Health, ResourceConfig
from host.sim import fake_usb as fu
from host.sim.tree import FakeTree

REPO = Path(__file__).resolve().parents[2]
ALL = ResourceConfig("example.com/usb", "usb", {})


@pytest.fixture
def tree(tmp_path) -> FakeTree:
    fake = FakeTree(tmp_path / "root")
    fake.numa_nodes(2)
    fu.usb_controller(fake, "0000:00:14.0", numa_node=-1, local_cpulist="0-3", buses=((1, "480"),))
    return fake


@pytest.fixture(scope="module")
def edge(tmp_path_factory) -> FakeTree:
    """Loaded once: the edge-box tests only read it."""
    return load_machine("edge-box", tmp_path_factory.mktemp("edge") / "root")


def discover(tree: FakeTree, *resources: ResourceConfig) -> Dict[str, List[Device]]:
    found = UsbDriver().discover(HostFS(tree.root), resources or (ALL,))
    return {name: list(devices) for name, devices in found.items()}


def devices_of(tree: FakeTree, resource: ResourceConfig = ALL) -> Dict[str, Device]:
    return {d.id: d for d in discover(tree, resource)[resource.name]}


def resource(selectors=None, settings=None) -> ResourceConfig:
    return ResourceConfig("example.com/usb", "usb", selectors or {}, settings or {})


def nodes(device: Device) -> List[str]:
    return [n.host_path for n in device.device_nodes]


def serial_dongle(tree: FakeTree, name: str = "1-2", devnum: int = 3, **kwargs) -> str:
    kwargs.setdefault("serial", "0001")
    return fu.usb_device(
        tree,
        name,
        vendor=0x10C4,
        product=0xEA60,
        devnum=devnum,
        interfaces=[fu.Interface(0xFF, driver="cp210x", tty=["ttyUSB0"])],
        **kwargs,
    )


# -- the captured edge box --------------------------------------------------------------------
def test_edge_box_serves_every_device_but_hubs_with_stable_ids(edge):
    found = devices_of(edge)
    assert sorted(found) == sorted(
        [
            "0403:6001:A50285BI",
            "10c4:ea60:c8f3a4b1e2d5ec11b0a2d4c7a9e1f3b2",
            "046d:082d:A8F4E2BF",
            "1-1.4",
            "1-4",
            "1-6",
            "1-10",
            "2-1.4",
        ]
    )
    for device in found.values():
        assert device.health is Health.HEALTHY, device.health_reason
        assert device.numa_nodes == ()  # the xHCI says numa_node = -1
        assert device.attributes["controller"] == "0000:00:14.0"
        assert device.attributes["local_cpulist"] == "0-7"


def test_edge_box_nodes_of_each_kind(edge):
    found = devices_of(edge)
    assert nodes(found["10c4:ea60:c8f3a4b1e2d5ec11b0a2d4c7a9e1f3b2"]) == [
        "/dev/bus/usb/001/006",
        "/dev/ttyUSB0",
    ]
    assert nodes(found["0403:6001:A50285BI"]) == ["/dev/bus/usb/001/005", "/dev/ttyUSB1"]
    assert nodes(found["046d:082d:A8F4E2BF"]) == [
        "/dev/bus/usb/001/007",
        "/dev/video0",
        "/dev/video1",
    ]
    assert nodes(found["1-4"]) == ["/dev/bus/usb/001/003", "/dev/hidraw0", "/dev/hidraw1"]
    assert nodes(found["2-1.4"]) == ["/dev/bus/usb/002/003"]  # the Coral: libusb only
    camera = found["046d:082d:A8F4E2BF"]
    assert camera.attributes["interface_classes"] == "0x01,0x0e"
    assert camera.attributes["video_nodes"] == "/dev/video0,/dev/video1"
    assert camera.attributes["port"] == "1-1.3"
    assert all(
        n.permissions == "rw" and n.container_path == n.host_path for n in camera.device_nodes
    )


def test_edge_box_example_config_resources(edge):
    coral = resource({"vendor": ["0x1a6e", "0x18d1"], "product": ["0x089a", "0x9302"]})
    zigbee = ResourceConfig(
        "example.com/zigbee", "usb", {"vendor": "0x10c4", "product": "0xea60"}, {"limit": 1}
    )
    plc = ResourceConfig(
        "example.com/plc", "usb", {"vendor": "0x0403", "product": "0x6001", "serial": "A50285BI"}
    )
    camera = ResourceConfig("example.com/camera", "usb", {"interface_class": "0x0e"})
    key = ResourceConfig(
        "example.com/licence-key", "usb", {"vendor": "0x0529", "product": "0x0001"}, {"shared": 4}
    )
    found = discover(edge, coral, zigbee, plc, camera, key)
    assert [d.id for d in found["example.com/licence-key"]] == [
        "1-1.4::0",
        "1-1.4::1",
        "1-1.4::2",
        "1-1.4::3",
    ]
    assert [d.id for d in found["example.com/usb"]] == ["2-1.4"]
    assert [d.attributes["port"] for d in found["example.com/zigbee"]] == ["1-1.2"]
    assert [d.attributes["port"] for d in found["example.com/plc"]] == ["1-1.1"]
    assert [d.attributes["port"] for d in found["example.com/camera"]] == ["1-1.3"]


def test_shipped_edge_example_config_serves_the_edge_box(edge):
    """config/examples/edge-usb.toml, parsed by the host, finds each device on this tree."""
    driver = UsbDriver()
    config = load_config(str(REPO / "config" / "examples" / "edge-usb.toml"), {"usb": driver})
    found = driver.discover(HostFS(edge.root), config.resources)
    for res in config.resources:
        assert found[res.name], f"{res.name} found nothing"
        assert all(d.health is Health.HEALTHY for d in found[res.name])


def test_edge_box_survives_todays_capture(edge, tmp_path):
    """A capture keeps only some attributes (no authorized, no devpath): same devices."""
    lines = list(
        capture_tree(edge.root, ["/dev/bus/usb/*/*", "/dev/tty*", "/dev/hidraw*", "/dev/video*"])
    )
    recaptured = FakeTree(tmp_path / "recaptured")
    recaptured.load("\n".join(lines))
    before = {d.id: nodes(d) for d in devices_of(edge).values()}
    after = {d.id: (nodes(d), d.health) for d in devices_of(recaptured).values()}
    assert {k: v[0] for k, v in after.items()} == before
    assert all(health is Health.HEALTHY for _, health in after.values())


# -- node shapes ------------------------------------------------------------------------------
def test_usb_serial_tty_sits_under_its_port_device(tree):
    path = serial_dongle(tree)
    assert os.path.isdir(tree.real(f"{path}/1-2:1.0/ttyUSB0/tty/ttyUSB0"))
    assert nodes(devices_of(tree)["10c4:ea60:0001"]) == ["/dev/bus/usb/001/003", "/dev/ttyUSB0"]


def test_cdc_acm_and_hid_shapes(tree):
    fu.usb_device(
        tree,
        "1-3",
        vendor=0x2341,
        product=0x0043,
        devnum=4,
        serial="7583",
        device_class=0x02,
        interfaces=[
            fu.Interface(0x02, 0x02, 0x01, driver="cdc_acm", tty=["ttyACM0"]),
            fu.Interface(0x0A, driver="cdc_acm"),
        ],
    )
    fu.usb_device(
        tree,
        "1-4",
        vendor=0x046D,
        product=0xC52B,
        devnum=5,
        interfaces=[
            fu.Interface(0x03, 1, 1, driver="usbhid", hidraw=["hidraw3"]),
            fu.Interface(0x03, 1, 2, driver="usbhid", hidraw=["hidraw4"]),
        ],
    )
    found = devices_of(tree)
    assert nodes(found["2341:0043:7583"]) == ["/dev/bus/usb/001/004", "/dev/ttyACM0"]
    assert nodes(found["1-4"]) == ["/dev/bus/usb/001/005", "/dev/hidraw3", "/dev/hidraw4"]


def test_interface_nodes_do_not_need_sys_class(tree):
    serial_dongle(tree)
    tree.remove("/sys/class/tty")
    assert "/dev/ttyUSB0" in nodes(devices_of(tree)["10c4:ea60:0001"])


def test_links_below_an_interface_are_not_followed(tree):
    path = serial_dongle(tree)
    fu.usb_device(
        tree,
        "1-3",
        vendor=0x0403,
        product=0x6001,
        devnum=4,
        serial="B1",
        interfaces=[fu.Interface(0xFF, driver="ftdi_sio", tty=["ttyUSB1"])],
    )
    other = fu.sys_path(tree, "1-3")
    tree.link(f"{path}/1-2:1.0/peer", f"{other}/1-3:1.0")  # a link into another device
    tree.link(f"{path}/1-2:1.0/loop", f"{path}")  # and one back up (a cycle)
    assert nodes(devices_of(tree)["10c4:ea60:0001"]) == ["/dev/bus/usb/001/003", "/dev/ttyUSB0"]


@pytest.mark.parametrize(
    "kinds, expected",
    [
        (None, ["/dev/bus/usb/001/003", "/dev/ttyUSB0", "/dev/hidraw0", "/dev/video0"]),
        ([], ["/dev/bus/usb/001/003"]),
        (["tty"], ["/dev/bus/usb/001/003", "/dev/ttyUSB0"]),
        (["video", "hidraw"], ["/dev/bus/usb/001/003", "/dev/hidraw0", "/dev/video0"]),
    ],
)
def test_include_interfaces(tree, kinds, expected):
    fu.usb_device(
        tree,
        "1-2",
        vendor=0x1234,
        product=0x5678,
        devnum=3,
        serial="S",
        interfaces=[
            fu.Interface(0xFF, driver="cp210x", tty=["ttyUSB0"]),
            fu.Interface(0x03, driver="usbhid", hidraw=["hidraw0"]),
            fu.Interface(0x0E, 1, driver="uvcvideo", video=["video0"]),
        ],
    )
    settings = {} if kinds is None else {"include_interfaces": kinds}
    (device,) = discover(tree, resource(settings=settings))["example.com/usb"]
    assert nodes(device) == expected


# -- health -----------------------------------------------------------------------------------
def test_missing_usbfs_node_is_unhealthy_then_healthy_again(tree):
    serial_dongle(tree)
    tree.remove("/dev/bus/usb/001/003")
    device = devices_of(tree)["10c4:ea60:0001"]
    assert device.health is Health.UNHEALTHY
    assert "/dev/bus/usb/001/003" in device.health_reason
    assert "/dev/bus/usb/001/003" in nodes(device)  # still described, so the id stays put
    tree.chardev("/dev/bus/usb/001/003", 189, 2)
    assert devices_of(tree)["10c4:ea60:0001"].health is Health.HEALTHY


def test_missing_tty_node_is_unhealthy_only_when_it_is_handed_over(tree, caplog):
    serial_dongle(tree, interface_nodes=False)
    with caplog.at_level(logging.WARNING):
        device = devices_of(tree)["10c4:ea60:0001"]
    assert device.health is Health.UNHEALTHY
    assert "/dev/ttyUSB0" in device.health_reason
    assert "1-2" in caplog.text and "/dev/ttyUSB0" in caplog.text
    bare = discover(tree, resource(settings={"include_interfaces": []}))["example.com/usb"]
    assert bare[0].health is Health.HEALTHY


def test_devnum_is_decimal_and_zero_padded(tree):
    path = serial_dongle(tree, devnum=12)
    tree.attr(f"{path}/uevent", "MAJOR=189\nMINOR=11\nDEVTYPE=usb_device")  # no DEVNAME
    tree.chardev("/dev/bus/usb/001/012", 189, 11)
    assert nodes(devices_of(tree)["10c4:ea60:0001"])[0] == "/dev/bus/usb/001/012"


def test_uevent_devname_wins_but_never_leaves_dev(tree):
    path = serial_dongle(tree, devnum=3)
    tree.attr(f"{path}/uevent", "DEVNAME=../../etc/shadow")
    assert nodes(devices_of(tree)["10c4:ea60:0001"])[0] == "/dev/bus/usb/001/003"


@pytest.mark.parametrize("busnum, devnum", [("garbage", "3"), ("1", ""), ("0", "3"), (None, "3")])
def test_unreadable_bus_numbers_degrade_to_unhealthy(tree, busnum, devnum, caplog):
    path = serial_dongle(tree)
    tree.attr(f"{path}/uevent", "DEVTYPE=usb_device")
    if busnum is None:
        tree.remove(f"{path}/busnum")
    else:
        tree.attr(f"{path}/busnum", busnum)
    tree.attr(f"{path}/devnum", devnum)
    with caplog.at_level(logging.WARNING):
        device = devices_of(tree)["10c4:ea60:0001"]
    assert device.health is Health.UNHEALTHY
    assert "busnum/devnum" in device.health_reason
    assert nodes(device) == ["/dev/ttyUSB0"]
    assert "1-2" in caplog.text


def test_unauthorized_device_is_unhealthy(tree):
    serial_dongle(tree, authorized="0")
    device = devices_of(tree)["10c4:ea60:0001"]
    assert device.health is Health.UNHEALTHY
    assert "authorized" in device.health_reason


@pytest.mark.parametrize("vendor", [None, "zz12", "", "1ffff"])
def test_device_without_usable_ids_is_skipped_and_logged(tree, vendor, caplog):
    path = serial_dongle(tree)
    serial_dongle(tree, "1-3", devnum=4, serial="0002")
    if vendor is None:
        tree.remove(f"{path}/idVendor")
    else:
        tree.attr(f"{path}/idVendor", vendor)
    with caplog.at_level(logging.WARNING):
        found = devices_of(tree)
    assert list(found) == ["10c4:ea60:0002"]
    assert "1-2" in caplog.text


def test_dangling_device_link_is_skipped(tree):
    serial_dongle(tree)
    tree.link("/sys/bus/usb/devices/1-9", "/sys/devices/pci0000:00/0000:00:14.0/usb1/1-9")
    assert list(devices_of(tree)) == ["10c4:ea60:0001"]


def test_interfaces_and_odd_names_are_not_devices(tree):
    serial_dongle(tree)
    fu.root_hub(tree, "/sys/devices/pci0000:00/0000:00:14.0", 2, speed="10000")
    tree.mkdir("/sys/bus/usb/devices/not-a-device")
    found = discover(tree, resource({"device_class": "0x09"}))["example.com/usb"]
    # Root hubs only when asked, never "1-2:1.0"; a root hub's serial is its controller.
    assert [d.attributes["port"] for d in found] == ["usb1", "usb2"]
    assert [d.id for d in found] == ["1d6b:0002:0000_00_14.0", "1d6b:0003:0000_00_14.0"]


# -- selectors --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> FakeTree:
    """Built once: the selector cases only read it."""
    tree = FakeTree(tmp_path_factory.mktemp("mixed") / "root")
    tree.numa_nodes(2)
    fu.usb_controller(tree, "0000:00:14.0")
    fu.hub(tree, "1-1", devnum=2)
    serial_dongle(tree, "1-1.2", devnum=3, serial="AAA")
    fu.usb_device(
        tree,
        "1-1.3",
        vendor=0x0403,
        product=0x6001,
        devnum=4,
        serial="BBB",
        interfaces=[fu.Interface(0xFF, driver="ftdi_sio", tty=["ttyUSB1"])],
    )
    fu.usb_device(
        tree,
        "1-4",
        vendor=0x046D,
        product=0x082D,
        devnum=5,
        device_class=0xEF,
        interfaces=[
            fu.Interface(0x0E, 1, driver="uvcvideo", video=["video0"]),
            fu.Interface(0x01, 1),
        ],
    )
    return tree


@pytest.mark.parametrize(
    "selectors, expected",
    [
        ({}, ["1-1.2", "1-1.3", "1-4"]),
        ({"vendor": "0x10c4"}, ["1-1.2"]),
        ({"vendor": "10C4"}, ["1-1.2"]),
        ({"vendor": 0x10C4, "product": 0xEA60}, ["1-1.2"]),
        ({"vendor": ["0x10c4", "0x0403"]}, ["1-1.2", "1-1.3"]),
        ({"vendor": "0x10c4", "product": "0x6001"}, []),
        ({"serial": "BBB"}, ["1-1.3"]),
        ({"serial": ["AAA", "BBB"]}, ["1-1.2", "1-1.3"]),
        ({"interface_class": "0x0e"}, ["1-4"]),
        ({"interface_class": ["0xff"]}, ["1-1.2", "1-1.3"]),
        ({"interface_class": 1}, ["1-4"]),
        ({"device_class": "0xef"}, ["1-4"]),
        ({"port": "1-1.3"}, ["1-1.3"]),
        ({"port": "1-1"}, ["1-1"]),  # a hub, named explicitly
        ({"port": "usb1"}, ["usb1"]),  # a root hub, named explicitly
        ({"device_class": "0x09"}, ["usb1", "1-1", "usb2"]),
        ({"vendor": "0x05e3"}, []),  # hubs are not handed out by vendor alone
    ],
)
def test_selectors(mixed, selectors, expected):
    found = discover(mixed, resource(selectors))["example.com/usb"]
    assert [d.attributes["port"] for d in found] == expected


@pytest.mark.parametrize(
    "selectors, key",
    [
        ({"vendor": "0xzz"}, "vendor"),
        ({"vendor": "0x10000"}, "vendor"),
        ({"product": ["0x1", "nope"]}, "product"),
        ({"interface_class": "0x100"}, "interface_class"),
        ({"device_class": True}, "device_class"),
        ({"serial": " "}, "serial"),
        ({"port": "1-1:1.0"}, "port"),
        ({"port": "../1"}, "port"),
        ({"pci_address": "0000:00:14.0"}, "pci_address"),
        ({"vendor": []}, "vendor"),
    ],
)
def test_bad_selectors_name_the_key(selectors, key):
    with pytest.raises(SelectorError) as error:
        UsbDriver().check_selectors(selectors)
    assert error.value.key == key


def test_good_selectors_pass():
    UsbDriver().check_selectors(
        {
            "vendor": ["0x10c4", 0x0403],
            "product": "ea60",
            "serial": "A1",
            "interface_class": "0xff",
            "device_class": 0,
            "port": ["1-1.2", "usb3"],
        }
    )


# -- settings ---------------------------------------------------------------------------------
def test_limit_keeps_the_lowest_ports_every_scan(tree):
    fu.hub(tree, "1-1", devnum=2)
    for port, devnum in ((10, 5), (9, 4), (2, 3)):
        serial_dongle(tree, f"1-1.{port}", devnum=devnum, serial=f"S{port}")
    limited = resource({"vendor": "0x10c4"}, {"limit": 2})
    first = [d.attributes["port"] for d in discover(tree, limited)["example.com/usb"]]
    assert first == ["1-1.2", "1-1.9"]  # natural order, not "1-1.10" < "1-1.2"
    assert [d.attributes["port"] for d in discover(tree, limited)["example.com/usb"]] == first


def test_shared_devices_get_one_id_per_slot(tree):
    serial_dongle(tree)
    found = discover(tree, resource(settings={"shared": 3}))["example.com/usb"]
    assert [d.id for d in found] == ["10c4:ea60:0001::0", "10c4:ea60:0001::1", "10c4:ea60:0001::2"]
    assert all(nodes(d) == nodes(found[0]) for d in found)


def test_limit_counts_devices_before_sharing(tree):
    serial_dongle(tree, "1-2", devnum=3, serial="A")
    serial_dongle(tree, "1-3", devnum=4, serial="B")
    found = discover(tree, resource(settings={"limit": 1, "shared": 2}))["example.com/usb"]
    assert [d.id for d in found] == ["10c4:ea60:A::0", "10c4:ea60:A::1"]


@pytest.mark.parametrize(
    "settings, key",
    [
        ({"limit": 0}, "limit"),
        ({"limit": "2"}, "limit"),
        ({"limit": True}, "limit"),
        ({"shared": 0}, "shared"),
        ({"shared": MAX_SHARED + 1}, "shared"),
        ({"include_interfaces": ["tty", "sound"]}, "include_interfaces"),
        ({"include_interfaces": "tty"}, "include_interfaces"),
        ({"count": 2}, "count"),
    ],
)
def test_bad_settings_name_the_key(settings, key):
    with pytest.raises(SelectorError) as error:
        UsbDriver().check_settings(settings)
    assert error.value.key == key


def test_good_settings_pass():
    UsbDriver().check_settings({"limit": 1, "shared": 4, "include_interfaces": []})
    UsbDriver().check_settings({"include_interfaces": ["tty", "hidraw", "video"]})


# -- ids --------------------------------------------------------------------------------------
def test_serial_id_follows_the_device_to_another_port(tree):
    serial_dongle(tree, "1-2", devnum=3)
    before = devices_of(tree)
    tree.remove(fu.sys_path(tree, "1-2"))
    tree.remove("/sys/bus/usb/devices/1-2")
    serial_dongle(tree, "1-5", devnum=9)
    after = devices_of(tree)
    assert list(before) == list(after) == ["10c4:ea60:0001"]
    assert after["10c4:ea60:0001"].attributes["port"] == "1-5"


@pytest.mark.parametrize("serial", [None, "", "   ", "\x00\x00"])
def test_no_serial_means_the_port_path(tree, serial):
    serial_dongle(tree, "1-2", serial=serial)
    assert list(devices_of(tree)) == ["1-2"]


def test_shared_serials_fall_back_to_port_paths(tree, caplog):
    serial_dongle(tree, "1-2", devnum=3, serial="A50285BI")
    serial_dongle(tree, "1-3", devnum=4, serial="A50285BI")
    serial_dongle(tree, "1-4", devnum=5, serial="UNIQUE")
    with caplog.at_level(logging.WARNING):
        found = devices_of(tree)
    assert sorted(found) == ["1-2", "1-3", "10c4:ea60:UNIQUE"]
    assert "A50285BI" in caplog.text


def test_odd_serial_characters_are_made_safe(tree):
    serial_dongle(tree, serial=" ab/c d:é ")
    (device_id,) = devices_of(tree)
    assert device_id == "10c4:ea60:ab_c_d__"
    assert devices_of(tree)[device_id].attributes["serial"] == "ab/c d:é"


# -- NUMA -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "numa_node, expected", [(1, (1,)), (0, (0,)), (-1, ()), (None, ()), (7, ()), ("garbage", ())]
)
def test_numa_from_the_owning_pci_controller(tmp_path, numa_node, expected):
    tree = FakeTree(tmp_path / "root")
    tree.numa_nodes(2)
    fu.usb_controller(tree, "0000:80:14.0", numa_node=None, local_cpulist="4-7")
    if numa_node is not None:
        tree.attr("/sys/devices/pci0000:80/0000:80:14.0/numa_node", str(numa_node))
    fu.hub(tree, "1-1", devnum=2)
    serial_dongle(tree, "1-1.2", devnum=3)
    device = devices_of(tree)["10c4:ea60:0001"]
    assert device.numa_nodes == expected
    assert device.attributes["controller"] == "0000:80:14.0"
    assert device.attributes["local_cpulist"] == "4-7"


def test_controller_without_numa_node_inherits_its_bridges(tmp_path):
    tree = FakeTree(tmp_path / "root")
    tree.numa_nodes(2)
    bridge = tree.pci_bridge("0000:80:01.0", numa_node=1)
    fu.usb_controller(
        tree,
        "0000:81:00.0",
        vendor=0x1B21,
        device=0x2142,
        numa_node=None,
        parent=bridge,
        buses=((1, "480"),),
    )
    serial_dongle(tree)
    device = devices_of(tree)["10c4:ea60:0001"]
    assert device.numa_nodes == (1,)
    assert device.attributes["controller"] == "0000:81:00.0"


def test_platform_controllers_without_pci(tmp_path):
    tree = FakeTree(tmp_path / "root")
    fu.root_hub(tree, "/sys/devices/platform/soc/usb-ctrl0", 1)
    fu.root_hub(tree, "/sys/devices/platform/soc/usb-ctrl1", 2)
    serial_dongle(tree, "1-1", devnum=2, serial="A")
    serial_dongle(tree, "2-1", devnum=2, serial="B")
    found = devices_of(tree)
    assert found["10c4:ea60:A"].attributes["controller"] == "usb-ctrl0"
    assert found["10c4:ea60:B"].attributes["controller"] == "usb-ctrl1"
    assert found["10c4:ea60:A"].numa_nodes == ()
    assert "local_cpulist" not in found["10c4:ea60:A"].attributes


# -- plumbing ---------------------------------------------------------------------------------
def test_attributes_are_strings_and_show_the_device(tree):
    serial_dongle(tree, manufacturer="Silicon Labs", product_name="CP2102N USB to UART")
    device = devices_of(tree)["10c4:ea60:0001"]
    assert all(isinstance(v, str) for v in device.attributes.values())
    assert device.attributes["vendor"] == "0x10c4"
    assert device.attributes["product"] == "0xea60"
    assert device.attributes["busnum"] == "1" and device.attributes["devnum"] == "3"
    assert device.attributes["usb_node"] == "/dev/bus/usb/001/003"
    assert device.attributes["tty_nodes"] == "/dev/ttyUSB0"
    assert device.attributes["product_name"] == "CP2102N USB to UART"
    assert device.env == {} and device.mounts == ()


def test_no_usb_at_all(tmp_path):
    empty = FakeTree(tmp_path / "empty")
    assert discover(empty) == {"example.com/usb": []}


def test_plugin_hook_and_defaults():
    (driver,) = plugin.device_plugin_host_drivers()
    assert isinstance(driver, UsbDriver)
    assert driver.name == "usb"
    assert set(driver.subsystems) == {"usb", "tty", "hidraw", "video4linux"}
    assert driver.default_resources() == ()
    assert not needs_pre_start(driver, ALL)


def test_port_sort_key_is_natural():
    names = ["1-1.10", "usb1", "1-1.2", "1-2", "1-1"]
    assert sorted(names, key=port_sort_key) == ["usb1", "1-1", "1-1.2", "1-1.10", "1-2"]
