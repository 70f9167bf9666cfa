"""The generic pci driver on fake trees: boards whose kernel drivers make char devices under
their PCI function (testkit/device_plugin_host_testing/fake_pci, fake_chardev)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import pytest

from device_plugin_host_testing import fake_pci as fp
from device_plugin_host_testing.fake_chardev import add_class_chardev
from drivers.pci.driver import PciDriver
from host.core.driver import SelectorError
from host.core.hostfs import HostFS
from host.core.model import Device, Health, ResourceConfig
from host.sim.tree import FakeTree

HAILO = ResourceConfig("hailo.ai/npu", "pci", {"vendor": "0x1e60", "device": "0x2864"})


@pytest.fixture
def tree(tmp_path) -> FakeTree:
    fake = FakeTree(tmp_path / "root")
    fake.numa_nodes(2)
    return fake


def devices(tree: FakeTree, resource: ResourceConfig = HAILO) -> Dict[str, Device]:
    found = PciDriver().discover(HostFS(tree.root), [resource])
    return {d.id: d for d in found[resource.name]}


def nodes(device: Device) -> List[str]:
    return [n.host_path for n in device.device_nodes]


def test_a_hailo8_behind_a_root_port_is_served_with_its_char_node(tree):
    bridge = tree.pci_bridge("0000:00:1c.0", numa_node=-1)
    fp.add_hailo8(tree, "0000:02:00.0", parent=bridge)
    found = devices(tree)
    assert list(found) == ["0000:02:00.0"]
    device = found["0000:02:00.0"]
    assert device.health is Health.HEALTHY, device.health_reason
    assert nodes(device) == ["/dev/hailo0"]
    assert device.numa_nodes == ()
    assert device.attributes["char_devices"] == "hailo0:hailo_chardev:511:0"
    assert device.attributes["kernel_driver"] == "hailo"
    assert device.attributes["kernel_module"] == "hailo_pci"
    # The bridge above it owns no char device: selecting it says so instead of taking hailo0.
    bridge_only = ResourceConfig("x.com/b", "pci", {"pci_address": "00:1c.0"})
    bridge_device = devices(tree, bridge_only)["0000:00:1c.0"]
    assert bridge_device.health is Health.UNHEALTHY
    assert "pcieport made no character device" in bridge_device.health_reason
    assert nodes(bridge_device) == []


def test_numa_comes_from_the_function(tree):
    fp.add_hailo8(tree, "0000:81:00.0", numa_node=1)
    assert devices(tree)["0000:81:00.0"].numa_nodes == (1,)


def test_a_board_with_several_nodes_and_a_class_filter(tree):
    expected = fp.add_xdma_board(tree, "0000:3b:00.0")
    add_class_chardev(tree, "/sys/devices/pci0000:3b/0000:3b:00.0", "tty", "ttyXR0", 4, 70)
    board = ResourceConfig("example.com/fpga-board", "pci", {"kernel_driver": "xdma"})
    assert nodes(devices(tree, board)["0000:3b:00.0"]) == [
        "/dev/ttyXR0", "/dev/xdma0_c2h_0", "/dev/xdma0_control", "/dev/xdma0_events_0",
        "/dev/xdma0_h2c_0", "/dev/xdma0_user"]
    only = ResourceConfig("example.com/fpga-board", "pci", {"kernel_driver": "xdma"},
                          settings={"char_classes": ["xdma"]})
    assert sorted(nodes(devices(tree, only)["0000:3b:00.0"])) == sorted(expected)
    wrong = ResourceConfig("example.com/fpga-board", "pci", {"kernel_driver": "xdma"},
                           settings={"char_classes": ["video4linux"]})
    device = devices(tree, wrong)["0000:3b:00.0"]
    assert device.health_reason.startswith("xdma made no character device of class video4linux")


def test_the_node_path_is_the_uevent_devname(tree):
    function = tree.pci_function("0000:05:00.0", vendor=0x1cd7, device=0x0017,
                                 pci_class=0x048000, driver="mwcap", numa_node=0)
    add_class_chardev(tree, function, "mwcap", "mwcap0", 240, 0, devname="mwcap/card0")
    found = devices(tree, ResourceConfig("magewell.com/capture", "pci", {"vendor": "0x1cd7"}))
    assert nodes(found["0000:05:00.0"]) == ["/dev/mwcap/card0"]


def test_class_selector_matches_by_prefix(tree):
    fp.add_hailo8(tree, "0000:02:00.0")
    assert list(devices(tree, ResourceConfig("x.com/c", "pci", {"class": "0x0b40"}))) == [
        "0000:02:00.0"]
    assert devices(tree, ResourceConfig("x.com/c", "pci", {"class": "0x12"})) == {}


@pytest.mark.parametrize(("kind", "reason"), [
    ("no-driver", "no kernel driver bound"),
    ("no-node", "device node /dev/hailo0 missing"),
    ("disabled", "PCI function disabled (enable = 0)"),
])
def test_what_cannot_be_used_is_unhealthy_with_the_reason(tree, kind, reason):
    function = fp.add_hailo8(tree, "0000:02:00.0", driver=None if kind == "no-driver" else
                             "hailo", node=kind != "no-node")
    if kind == "disabled":
        tree.attr(f"{function}/enable", "0")
    device = devices(tree)["0000:02:00.0"]
    assert device.health is Health.UNHEALTHY
    assert device.health_reason == reason


def test_passthrough_functions_only_where_the_driver_is_named(tree):
    function = fp.add_hailo8(tree, "0000:02:00.0", driver=None, iommu_group=17)
    tree.bind_driver(function, "vfio-pci")
    tree.chardev("/dev/vfio/vfio", 10, 196)
    tree.chardev("/dev/vfio/17", 242, 0)
    assert devices(tree) == {}
    vm = ResourceConfig("hailo.ai/npu-vm", "pci", {"vendor": "0x1e60", "kernel_driver": "vfio-pci"})
    device = devices(tree, vm)["0000:02:00.0"]
    assert device.health is Health.HEALTHY, device.health_reason
    assert nodes(device) == ["/dev/vfio/vfio", "/dev/vfio/17"]


def test_virtual_char_devices_belong_to_no_function(tree):
    fp.add_hailo8(tree, "0000:02:00.0")
    add_class_chardev(tree, None, "misc", "hailo_ctl", 10, 120)
    assert nodes(devices(tree)["0000:02:00.0"]) == ["/dev/hailo0"]


def test_a_stale_sys_dev_char_link_is_ignored(tree):
    fp.add_hailo8(tree, "0000:02:00.0")
    tree.link("/sys/dev/char/511:9", "/sys/devices/pci0000:02/0000:02:00.0/hailo_chardev/hailo9")
    assert nodes(devices(tree)["0000:02:00.0"]) == ["/dev/hailo0"]


def test_selectors_must_name_the_hardware():
    with pytest.raises(SelectorError) as error:
        PciDriver().check_selectors({})
    assert error.value.key == "" and "serves only what config names" in error.value.reason
    assert PciDriver().default_resources() == ()


@pytest.mark.parametrize(("selectors", "key"), [({"class": "0x1"}, "class"),
                                                ({"vendor": "nope"}, "vendor"),
                                                ({"subsystem": "x"}, "subsystem")])
def test_bad_selectors_are_rejected(selectors, key):
    with pytest.raises(SelectorError) as error:
        PciDriver().check_selectors(selectors)
    assert error.value.key == key


@pytest.mark.parametrize("settings", [{"char_classes": []}, {"char_classes": "xdma"},
                                      {"char_classes": [""]}, {"char_classes": [1]}, {"x": 1}])
def test_bad_settings_are_rejected(settings):
    with pytest.raises(SelectorError):
        PciDriver().check_settings(settings)


# A Hailo-8 box on hailort-drivers v4.20.0 as sysfs shows it (relative links as the kernel
# makes them): the PCI driver is "hailo" from the module hailo_pci, and hailo0 has no parent
# (device_create_with_groups(chardev_class, NULL, ...)); board_location (pci_name(), no
# newline) is the only tie to its function.
HAILO_V4_20_BOX = """\
f /sys/devices/system/node/node0/cpulist "0-7"
f /sys/devices/system/node/possible "0"
f /sys/devices/pci0000:00/0000:00:1c.0/vendor "0x8086"
f /sys/devices/pci0000:00/0000:00:1c.0/device "0x7ab8"
f /sys/devices/pci0000:00/0000:00:1c.0/class "0x060400"
f /sys/devices/pci0000:00/0000:00:1c.0/numa_node "-1"
l /sys/devices/pci0000:00/0000:00:1c.0/driver -> ../../../bus/pci/drivers/pcieport
l /sys/bus/pci/devices/0000:00:1c.0 -> ../../../devices/pci0000:00/0000:00:1c.0
f /sys/devices/pci0000:00/0000:00:1c.0/0000:02:00.0/vendor "0x1e60"
f /sys/devices/pci0000:00/0000:00:1c.0/0000:02:00.0/device "0x2864"
f /sys/devices/pci0000:00/0000:00:1c.0/0000:02:00.0/class "0x0b4000"
f /sys/devices/pci0000:00/0000:00:1c.0/0000:02:00.0/enable "1"
f /sys/devices/pci0000:00/0000:00:1c.0/0000:02:00.0/numa_node "-1"
f /sys/devices/pci0000:00/0000:00:1c.0/0000:02:00.0/local_cpulist "0-7"
l /sys/devices/pci0000:00/0000:00:1c.0/0000:02:00.0/driver -> ../../../../bus/pci/drivers/hailo
l /sys/devices/pci0000:00/0000:00:1c.0/0000:02:00.0/subsystem -> ../../../../bus/pci
l /sys/bus/pci/devices/0000:02:00.0 -> ../../../devices/pci0000:00/0000:00:1c.0/0000:02:00.0
l /sys/bus/pci/drivers/hailo/0000:02:00.0 -> ../../../../devices/pci0000:00/0000:00:1c.0/\
0000:02:00.0
l /sys/bus/pci/drivers/hailo/module -> ../../../../module/hailo_pci
d /sys/module/hailo_pci/drivers
f /sys/devices/virtual/hailo_chardev/hailo0/dev "236:0"
f /sys/devices/virtual/hailo_chardev/hailo0/uevent "MAJOR=236\\nMINOR=0\\nDEVNAME=hailo0"
f /sys/devices/virtual/hailo_chardev/hailo0/board_location "0000:02:00.0"
f /sys/devices/virtual/hailo_chardev/hailo0/device_id "1e60:2864"
f /sys/devices/virtual/hailo_chardev/hailo0/accelerator_type "0"
l /sys/devices/virtual/hailo_chardev/hailo0/subsystem -> ../../../../class/hailo_chardev
l /sys/class/hailo_chardev/hailo0 -> ../../devices/virtual/hailo_chardev/hailo0
l /sys/dev/char/236:0 -> ../../devices/virtual/hailo_chardev/hailo0
c /dev/hailo0 236:0
"""

EDGE_NPU_EXAMPLE = ResourceConfig("hailo.ai/npu", "pci", {
    "vendor": "0x1e60", "device": "0x2864", "kernel_driver": "hailo"},
    settings={"char_classes": ["hailo_chardev"]})


def test_a_real_hailo8_tree_is_served_by_the_example_selectors(tree):
    tree.load(HAILO_V4_20_BOX)
    device = devices(tree, EDGE_NPU_EXAMPLE)["0000:02:00.0"]
    assert device.health is Health.HEALTHY, device.health_reason
    assert nodes(device) == ["/dev/hailo0"]
    assert device.attributes["kernel_driver"] == "hailo"
    assert device.attributes["kernel_module"] == "hailo_pci"
    assert device.attributes["char_devices"] == "hailo0:hailo_chardev:236:0"


@pytest.mark.parametrize("spelling", ["hailo", "hailo_pci", "hailo-pci", ["vfio-pci", "hailo"]])
def test_kernel_driver_selects_by_the_driver_or_its_module(tree, spelling):
    tree.load(HAILO_V4_20_BOX)
    resource = ResourceConfig("hailo.ai/npu", "pci", {"kernel_driver": spelling})
    assert list(devices(tree, resource)) == ["0000:02:00.0"]


@pytest.mark.parametrize("spelling", ["hailo_pc", "hailo1x", "hailo_pci.ko"])
def test_other_names_select_nothing(tree, spelling):
    tree.load(HAILO_V4_20_BOX)
    assert devices(tree, ResourceConfig("hailo.ai/npu", "pci", {"kernel_driver": spelling})) == {}


def test_the_shipped_example_serves_the_real_tree(tree):
    from host.config import load_config
    from host.config.plugins import load_drivers

    tree.load(HAILO_V4_20_BOX)
    registry = load_drivers()
    config = load_config(str(Path(__file__).resolve().parents[2] / "config" / "examples"
                             / "edge-npu.toml"), registry.drivers)
    (resource,) = [r for r in config.resources if r.name == "hailo.ai/npu"]
    device = devices(tree, resource)["0000:02:00.0"]
    assert device.health is Health.HEALTHY, device.health_reason
    assert nodes(device) == ["/dev/hailo0"]


@pytest.mark.parametrize("parented", [False, True])
def test_each_board_gets_the_node_its_board_location_names(tree, parented):
    """Two boards, hailo0 and hailo1 numbered by probe order (not PCI order), in the layout
    of v4.22.0 and earlier (no parent) and of v4.23.0 (the function as parent)."""
    first = tree.pci_function("0000:03:00.0", vendor=fp.HAILO, device=fp.HAILO8,
                              pci_class=fp.COPROCESSOR, numa_node=1)
    second = tree.pci_function("0000:02:00.0", vendor=fp.HAILO, device=fp.HAILO8,
                               pci_class=fp.COPROCESSOR, numa_node=0)
    fp.load_hailo_driver(tree, first, 0, parented=parented)
    fp.load_hailo_driver(tree, second, 1, parented=parented)
    found = devices(tree)
    assert {a: nodes(d) for a, d in found.items()} == {
        "0000:03:00.0": ["/dev/hailo0"], "0000:02:00.0": ["/dev/hailo1"]}
    assert all(d.health is Health.HEALTHY for d in found.values())
    assert found["0000:03:00.0"].numa_nodes == (1,)


def test_a_board_location_naming_another_or_no_function_ties_nothing(tree):
    function = fp.add_hailo8(tree, "0000:02:00.0", driver=None)
    tree.bind_driver(function, "hailo")
    other = add_class_chardev(tree, None, "hailo_chardev", "hailo0", fp.HAILO_MAJOR, 0)
    tree.attr(f"{other}/board_location", "0000:09:00.0")
    junk = add_class_chardev(tree, None, "hailo_chardev", "hailo1", fp.HAILO_MAJOR, 1)
    tree.attr(f"{junk}/board_location", "../../0000:02:00.0")
    device = devices(tree)["0000:02:00.0"]
    assert device.health is Health.UNHEALTHY
    assert device.health_reason.startswith("hailo made no character device")
    assert nodes(device) == []


def test_a_function_with_its_own_nodes_takes_no_virtual_ones(tree):
    function = fp.add_hailo8(tree, "0000:02:00.0", parented=True)
    extra = add_class_chardev(tree, None, "hailo_chardev", "hailo5", fp.HAILO_MAJOR, 5)
    tree.attr(f"{extra}/board_location", "0000:02:00.0")
    assert function.endswith("0000:02:00.0")
    assert nodes(devices(tree)["0000:02:00.0"]) == ["/dev/hailo0"]


def test_passthrough_named_by_its_module(tree):
    function = fp.add_hailo8(tree, "0000:02:00.0", driver=None, iommu_group=17)
    tree.bind_driver(function, "vfio-pci")
    tree.link("/sys/bus/pci/drivers/vfio-pci/module", "/sys/module/vfio_pci")
    tree.chardev("/dev/vfio/vfio", 10, 196)
    tree.chardev("/dev/vfio/17", 242, 0)
    vm = ResourceConfig("hailo.ai/npu-vm", "pci", {"vendor": "0x1e60", "kernel_driver": "vfio_pci"})
    device = devices(tree, vm)["0000:02:00.0"]
    assert device.health is Health.HEALTHY, device.health_reason
    assert nodes(device) == ["/dev/vfio/vfio", "/dev/vfio/17"]
