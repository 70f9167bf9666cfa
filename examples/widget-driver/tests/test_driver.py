"""The widget driver on fake accel trees: real files, directories and symlinks, odd ones too."""

from __future__ import annotations

import logging

import pytest
from device_plugin_host import Health, HostFS, ResourceConfig, SelectorError
from device_plugin_host_testing import default_config, load_drivers

from dph_widget.driver import SUGGESTED, WidgetDriver
from dph_widget.testing import add_accel, add_gaudi, add_intel_npu, gaudi_server

GAUDI = ResourceConfig("habana.ai/gaudi", "widget", {"kernel_driver": "habanalabs"})
NPU = ResourceConfig("npu.intel.com/accel", "widget", {"kernel_driver": "intel_vpu"})


def discover(root, *resources):
    found = WidgetDriver().discover(HostFS(str(root)), list(resources))
    return {name: list(devices) for name, devices in found.items()}


def test_eight_gaudi_cards_by_pci_address_with_numa_nodes_and_both_device_nodes(fake_tree):
    tree = fake_tree
    addresses = gaudi_server(tree)
    devices = discover(tree.root, GAUDI, NPU)
    assert discover(tree.root, NPU)["npu.intel.com/accel"] == []
    cards = devices["habana.ai/gaudi"]
    assert [d.id for d in cards] == addresses
    assert all(d.health is Health.HEALTHY for d in cards)
    assert [d.numa_nodes for d in cards] == [(0,)] * 4 + [(1,)] * 4
    first = cards[0]
    assert [n.host_path for n in first.device_nodes] == [
        "/dev/accel/accel0",
        "/dev/accel/accel_controlD0",
    ]
    assert all(not n.host_path.startswith(tree.root) for d in cards for n in d.device_nodes)
    assert first.env == {"HABANA_VISIBLE_DEVICES": "0"}
    attrs = first.attributes
    assert attrs["pci_address"] == addresses[0] and attrs["vendor"] == "0x1da3"
    assert attrs["kernel_driver"] == "habanalabs" and attrs["class"] == "0x120000"
    assert attrs["local_cpulist"] == "0-7" and attrs["device_type"] == "GAUDI2"
    assert attrs["accel"] == "accel0" and attrs["dev"] == "261:0" and attrs["bus"] == "pci"
    assert attrs["status"] == "operational" and attrs["module_id"] == "0"


def test_intel_npu_has_no_numa_node_and_only_its_accel_node(fake_tree):
    tree = fake_tree
    add_intel_npu(tree)
    devices = discover(tree.root, GAUDI, NPU)
    assert devices["habana.ai/gaudi"] == []
    (npu,) = devices["npu.intel.com/accel"]
    assert npu.id == "0000:00:0b.0" and npu.numa_nodes == ()  # numa_node = -1
    assert [n.host_path for n in npu.device_nodes] == ["/dev/accel/accel0"]
    assert npu.env == {} and npu.healthy
    assert npu.attributes["device"] == "0x7d1d" and npu.attributes["iommu_group"] == "7"


def test_missing_device_node_is_unhealthy_and_comes_back_when_the_node_returns(fake_tree):
    tree = fake_tree
    gaudi_server(tree, cards=2)
    tree.remove("/dev/accel/accel_controlD1")
    cards = discover(tree.root, GAUDI)["habana.ai/gaudi"]
    assert cards[0].healthy
    assert cards[1].health is Health.UNHEALTHY
    assert "/dev/accel/accel_controlD1" in cards[1].health_reason
    tree.chardev("/dev/accel/accel_controlD1", 508, 1)
    assert all(d.healthy for d in discover(tree.root, GAUDI)["habana.ai/gaudi"])


@pytest.mark.parametrize("status", ["in reset", "needs reset", "disabled"])
def test_card_not_operational_is_unhealthy_with_its_status(fake_tree, status):
    tree = fake_tree
    add_gaudi(tree, "0000:19:00.0", 0, status=status)
    (card,) = discover(tree.root, GAUDI)["habana.ai/gaudi"]
    assert card.health is Health.UNHEALTHY and repr(status) in card.health_reason


def test_disabled_pci_function_is_unhealthy(fake_tree):
    tree = fake_tree
    function = add_gaudi(tree, "0000:19:00.0", 0)
    tree.attr(f"{function}/enable", "0")
    (card,) = discover(tree.root, GAUDI)["habana.ai/gaudi"]
    assert not card.healthy and "enable = 0" in card.health_reason


def test_odd_attributes_degrade_instead_of_crashing(fake_tree):
    tree = fake_tree
    function = add_gaudi(tree, "0000:19:00.0", 0, status=None, numa_node=None)
    tree.remove(f"{function}/serial_number")
    tree.mkdir(f"{function}/serial_number")  # unreadable: a directory, not a file
    tree.attr(f"{function}/accel/accel0/uevent", "MAJOR=261\nDEVNAME=../../etc/passwd")
    (card,) = discover(tree.root, GAUDI)["habana.ai/gaudi"]
    assert card.healthy and card.numa_nodes == ()
    assert "serial_number" not in card.attributes and "status" not in card.attributes
    assert card.device_nodes[0].host_path == "/dev/accel/accel0"


def test_numa_node_the_machine_does_not_have_gives_no_topology(fake_tree):
    tree = fake_tree
    tree.numa_nodes(2)
    add_gaudi(tree, "0000:19:00.0", 0, numa_node=7)
    (card,) = discover(tree.root, GAUDI)["habana.ai/gaudi"]
    assert card.numa_nodes == ()


def test_dangling_entries_are_skipped_with_the_device_named(fake_tree, caplog):
    tree = fake_tree
    gaudi_server(tree, cards=2)
    tree.link("/sys/class/accel/accel5", "/sys/devices/pci0000:99/0000:99:00.0/accel/accel5")
    orphan = "/sys/devices/pci0000:98/0000:98:00.0/accel/accel6"
    tree.attr(f"{orphan}/dev", "261:6")
    tree.link("/sys/class/accel/accel6", orphan)  # no device link
    with caplog.at_level(logging.WARNING):
        cards = discover(tree.root, GAUDI)["habana.ai/gaudi"]
    assert len(cards) == 2
    assert "accel5" in caplog.text and "dangling" in caplog.text
    assert "accel6" in caplog.text and "no parent" in caplog.text


def test_platform_npu_is_identified_by_its_device_tree_name(fake_tree):
    tree = fake_tree
    parent = "/sys/devices/platform/fdab0000.npu"
    tree.link(f"{parent}/subsystem", "/sys/bus/platform")
    tree.bind_driver(parent, "rocket", bus="platform")
    add_accel(tree, parent, 0)
    rocket = ResourceConfig("rockchip.com/npu", "widget", {"kernel_driver": "rocket"})
    by_vendor = ResourceConfig("x.example/npu", "widget", {"vendor": "0x8086"})
    devices = discover(tree.root, rocket, by_vendor, GAUDI)
    (npu,) = devices["rockchip.com/npu"]
    assert npu.id == "fdab0000.npu" and npu.numa_nodes == ()
    assert npu.attributes["parent"] == "fdab0000.npu" and npu.attributes["bus"] == "platform"
    assert devices["x.example/npu"] == [] and devices["habana.ai/gaudi"] == []


def test_two_minors_on_one_parent_get_distinct_ids(fake_tree):
    tree = fake_tree
    function = add_gaudi(tree, "0000:19:00.0", 0, control=False)
    add_accel(tree, function, 1)
    ids = [d.id for d in discover(tree.root, GAUDI)["habana.ai/gaudi"]]
    assert ids == ["0000:19:00.0-accel0", "0000:19:00.0-accel1"]


def test_selectors_pick_cards(fake_tree):
    tree = fake_tree
    addresses = gaudi_server(tree, cards=4)
    add_intel_npu(tree, index=4)
    one = ResourceConfig("x.example/one", "widget", {"pci_address": addresses[2][5:]})
    gaudi2 = ResourceConfig("x.example/g2", "widget", {"device_type": "GAUDI2"})
    intel = ResourceConfig("x.example/intel", "widget", {"vendor": "0x8086"})
    devices = discover(tree.root, one, gaudi2, intel)
    assert [d.id for d in devices["x.example/one"]] == [addresses[2]]
    assert [d.id for d in devices["x.example/g2"]] == addresses
    assert [d.id for d in devices["x.example/intel"]] == ["0000:00:0b.0"]


def test_index_env_setting_names_the_variable_carrying_the_accel_index(fake_tree):
    tree = fake_tree
    gaudi_server(tree, cards=2)
    add_intel_npu(tree, index=2)
    qaic_style = ResourceConfig("x.example/npu", "widget", {"kernel_driver": "intel_vpu"},
                                settings={"index_env": "NPU_VISIBLE_DEVICES"})
    quiet = ResourceConfig("x.example/gaudi", "widget", {"kernel_driver": "habanalabs"},
                           settings={"index_env": ""})
    devices = discover(tree.root, qaic_style, quiet)
    assert [d.env for d in devices["x.example/npu"]] == [{"NPU_VISIBLE_DEVICES": "2"}]
    assert [d.env for d in devices["x.example/gaudi"]] == [{}, {}]


@pytest.mark.parametrize(
    ("selectors", "key"),
    [
        ({"colour": "red"}, "colour"),
        ({"vendor": "0xzz"}, "vendor"),
        ({"vendor": "0x1ffff"}, "vendor"),
        ({"device_type": " "}, "device_type"),
        ({"kernel_driver": 5}, "kernel_driver"),
    ],
)
def test_bad_selectors_are_rejected_naming_the_key(selectors, key):
    with pytest.raises(SelectorError) as error:
        WidgetDriver().check_selectors(selectors)
    assert error.value.key == key


@pytest.mark.parametrize("settings", [{"index_env": "1BAD"}, {"index_env": "A-B"},
                                      {"index_env": 3}, {"index_env": True}, {"shared": 2}])
def test_bad_settings_are_rejected(settings):
    with pytest.raises(SelectorError):
        WidgetDriver().check_settings(settings)


def test_installed_package_is_found_through_its_entry_point():
    registry = load_drivers()
    assert "widget" in registry.drivers, registry.failures
    assert "dph-widget 0.1.0" in registry.sources["widget"]
    # No defaults: the host's built-in accel driver serves these cards under the vendors'
    # names; the widget driver is used where config names it, so nothing is advertised twice.
    assert WidgetDriver().default_resources() == ()
    assert all(r.driver != "widget" for r in default_config(registry.drivers).resources)


def test_suggested_entries_are_valid_config_for_the_driver():
    for resource in SUGGESTED:
        assert resource.driver == "widget"
        WidgetDriver().check_selectors(resource.selectors)
