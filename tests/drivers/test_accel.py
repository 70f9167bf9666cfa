"""The accel driver on fake trees in the accel drivers' own shapes
(testkit/device_plugin_host_testing/fake_accel)."""

from __future__ import annotations

import logging
from typing import Dict, List

import pytest

from device_plugin_host_testing import fake_accel as fa
from device_plugin_host_testing.fake_chardev import add_class_chardev
from drivers.accel.driver import AccelDriver
from host.core.driver import SelectorError
from host.core.hostfs import HostFS
from host.core.model import Device, Health, ResourceConfig
from host.sim.tree import FakeTree

GAUDI = ResourceConfig("habana.ai/gaudi", "accel", {"kernel_driver": "habanalabs"})
NPU = ResourceConfig("npu.intel.com/accel", "accel", {"kernel_driver": "intel_vpu"})
ALL = ResourceConfig("example.com/any-accel", "accel", {})


@pytest.fixture
def tree(tmp_path) -> FakeTree:
    return FakeTree(tmp_path / "root")


def devices(tree: FakeTree, resource: ResourceConfig = ALL) -> Dict[str, Device]:
    found = AccelDriver().discover(HostFS(tree.root), [resource])
    return {d.id: d for d in found[resource.name]}


def nodes(device: Device) -> List[str]:
    return [n.host_path for n in device.device_nodes]


def test_a_gaudi_server_serves_each_card_with_its_accel_and_control_node(tree):
    addresses = fa.gaudi_server(tree)
    found = devices(tree, GAUDI)
    assert list(found) == addresses
    for index, address in enumerate(addresses):
        device = found[address]
        assert device.health is Health.HEALTHY, device.health_reason
        assert nodes(device) == [f"/dev/accel/accel{index}", f"/dev/accel/accel_controlD{index}"]
        assert all(n.permissions == "rw" and n.container_path == n.host_path
                   for n in device.device_nodes)
        assert device.env == {"HABANA_VISIBLE_DEVICES": str(index)}
        assert device.numa_nodes == ((0,) if index < 4 else (1,))
        assert device.attributes["kernel_driver"] == "habanalabs"
        assert device.attributes["device_type"] == "GAUDI2"
        assert device.attributes["accel_index"] == str(index)
        assert device.attributes["dev"] == f"261:{index}"
        assert device.attributes["vendor"] == "0x1da3"


def test_accel_index_is_not_the_id_when_probe_order_differs_from_pci_order(tree):
    tree.numa_nodes(1)
    fa.add_gaudi(tree, "0000:1a:00.0", 1)
    fa.add_gaudi(tree, "0000:9a:00.0", 0)
    found = devices(tree, GAUDI)
    assert found["0000:1a:00.0"].env == {"HABANA_VISIBLE_DEVICES": "1"}
    assert nodes(found["0000:1a:00.0"])[0] == "/dev/accel/accel1"
    assert nodes(found["0000:9a:00.0"])[0] == "/dev/accel/accel0"


@pytest.mark.parametrize("status", ["needs reset", "in reset", "disabled", "in device creation"])
def test_a_gaudi_whose_driver_reports_a_bad_status_is_unhealthy_with_it(tree, status):
    tree.numa_nodes(1)
    function = fa.add_gaudi(tree, "0000:1a:00.0", 0, status=status)
    device = devices(tree, GAUDI)["0000:1a:00.0"]
    assert device.health is Health.UNHEALTHY
    assert f"habanalabs reports status {status!r}" in device.health_reason
    tree.attr(f"{function}/status", "operational")  # after the reset
    assert devices(tree, GAUDI)["0000:1a:00.0"].health is Health.HEALTHY


def test_an_unreadable_or_absent_status_claims_nothing(tree):
    tree.numa_nodes(1)
    fa.add_gaudi(tree, "0000:1a:00.0", 0, status=None)
    assert devices(tree, GAUDI)["0000:1a:00.0"].health is Health.HEALTHY


def test_missing_nodes_and_a_disabled_function_are_unhealthy_with_the_reason(tree):
    tree.numa_nodes(1)
    fa.add_gaudi(tree, "0000:1a:00.0", 0)
    fa.add_gaudi(tree, "0000:1b:00.0", 1, control=False)
    second = fa.add_gaudi(tree, "0000:1c:00.0", 2)
    tree.remove("/dev/accel/accel0")
    tree.attr(f"{second}/enable", "0")
    found = devices(tree, GAUDI)
    assert found["0000:1a:00.0"].health_reason == "device node /dev/accel/accel0 missing"
    assert "no control node accel_controlD1" in found["0000:1b:00.0"].health_reason
    assert found["0000:1c:00.0"].health_reason == "PCI function disabled (enable = 0)"


def test_intel_npu_laptop_has_no_topology_and_no_env(tree):
    fa.add_intel_npu(tree)
    device = devices(tree, NPU)["0000:00:0b.0"]
    assert device.health is Health.HEALTHY
    assert device.numa_nodes == ()
    assert nodes(device) == ["/dev/accel/accel0"]
    assert dict(device.env) == {}


def test_defaults_name_the_vendor_plugins_resources_and_leave_xdna_to_config(tree):
    defaults = AccelDriver().default_resources()
    assert {r.name: r.health_interval_s for r in defaults}["habana.ai/gaudi"] == 30
    names = {r.name: dict(r.selectors) for r in defaults}
    assert names == {
        "habana.ai/gaudi": {"kernel_driver": "habanalabs"},
        "npu.intel.com/accel": {"kernel_driver": "intel_vpu"},
        "qualcomm.com/qaic": {"kernel_driver": "qaic"},
    }
    fa.add_amd_xdna(tree)
    xdna = ResourceConfig("amd.com/xdna", "accel", {"class": "0x1180"})
    assert list(devices(tree, xdna)) == ["0000:c5:00.1"]
    assert devices(tree, ResourceConfig("x.com/a", "accel", {"class": "0x12"})) == {}


def test_qaic_cards_each_function_one_device_with_its_numa(tree):
    tree.numa_nodes(2)
    fa.add_qaic(tree, "0000:41:00.0", 0, numa_node=0)
    fa.add_qaic(tree, "0000:c1:00.0", 1, numa_node=1)
    qaic = ResourceConfig("qualcomm.com/qaic", "accel", {"kernel_driver": "qaic"})
    found = devices(tree, qaic)
    assert {k: v.numa_nodes for k, v in found.items()} == {"0000:41:00.0": (0,),
                                                          "0000:c1:00.0": (1,)}


def test_a_numa_node_the_machine_lacks_means_no_topology(tree):
    tree.numa_nodes(1)
    fa.add_gaudi(tree, "0000:1a:00.0", 0, numa_node=3)
    assert devices(tree, GAUDI)["0000:1a:00.0"].numa_nodes == ()


def test_a_platform_npu_is_served_by_driver_but_never_by_a_pci_selector(tree):
    tree.numa_nodes(1)
    parent = "/sys/devices/platform/fdab0000.npu"
    tree.mkdir(parent)
    tree.bind_driver(parent, "rocket", bus="platform")
    fa.add_accel_minor(tree, parent, 0)
    found = devices(tree, ResourceConfig("rockchip.com/npu", "accel", {"kernel_driver": "rocket"}))
    assert list(found) == ["fdab0000.npu"]
    assert found["fdab0000.npu"].attributes["parent"] == "fdab0000.npu"
    assert devices(tree, ResourceConfig("x.com/a", "accel", {"vendor": "0x8086"})) == {}


def test_a_minor_without_parent_or_with_a_dangling_link_is_skipped(tree, caplog):
    add_class_chardev(tree, None, "accel", "accel3", 261, 3, devname="accel/accel3")
    tree.link("/sys/class/accel/accel4", "/sys/devices/gone/accel/accel4")
    with caplog.at_level(logging.WARNING):
        assert devices(tree) == {}
    assert "accel3 has no parent device" in caplog.text
    assert "accel4 is dangling" in caplog.text


def test_device_type_selector_and_index_env_setting(tree):
    tree.numa_nodes(1)
    fa.add_gaudi(tree, "0000:1a:00.0", 0, device=fa.GAUDI)
    fa.add_gaudi(tree, "0000:1b:00.0", 1)
    gaudi2 = ResourceConfig("habana.ai/gaudi2", "accel", {"device_type": "GAUDI2"},
                            settings={"index_env": "MY_CARDS"})
    found = devices(tree, gaudi2)
    assert list(found) == ["0000:1b:00.0"]
    assert found["0000:1b:00.0"].env == {"MY_CARDS": "1"}
    none = ResourceConfig("habana.ai/gaudi-x", "accel", {}, settings={"index_env": ""})
    assert all(dict(d.env) == {} for d in devices(tree, none).values())


@pytest.mark.parametrize(("selectors", "key"), [
    ({"class": "0x1"}, "class"), ({"class": "zz"}, "class"), ({"device_type": " "}, "device_type"),
    ({"vendor": "0xgg"}, "vendor"), ({"numa": 1}, "numa"),
])
def test_bad_selectors_are_rejected_naming_the_key(selectors, key):
    with pytest.raises(SelectorError) as error:
        AccelDriver().check_selectors(selectors)
    assert error.value.key == key


@pytest.mark.parametrize("settings", [{"index_env": "1BAD"}, {"index_env": 3}, {"shared": 1}])
def test_bad_settings_are_rejected(settings):
    with pytest.raises(SelectorError):
        AccelDriver().check_settings(settings)


# -- Gaudi 3: each card's own scale-out RDMA NIC ---------------------------------------------
GAUDI3 = ResourceConfig("habana.ai/gaudi", "accel",
                        {"kernel_driver": "habanalabs", "device_type": "GAUDI3"})


def test_each_gaudi3_card_gets_the_verbs_node_of_its_own_rdma_device(tree):
    registration = (1, 0, 3, 2, 5, 4, 7, 6)
    addresses = fa.gaudi3_server(tree, registration=registration)
    found = devices(tree, GAUDI3)
    assert list(found) == addresses
    uverbs_of = {card: 2 + order for order, card in enumerate(registration)}
    for index, address in enumerate(addresses):
        device = found[address]
        assert device.health is Health.HEALTHY, device.health_reason
        assert nodes(device) == [f"/dev/accel/accel{index}", f"/dev/accel/accel_controlD{index}",
                                 f"/dev/infiniband/uverbs{uverbs_of[index]}"]
        assert device.attributes["rdma_devices"] == f"hbl_{index}"
        assert device.attributes["rdma_verbs"] == f"/dev/infiniband/uverbs{uverbs_of[index]}"
        assert device.env == {"HABANA_VISIBLE_DEVICES": str(index)}
    # The host's own ConnectX NICs (uverbs0, uverbs1) belong to no card.
    handed_out = {n for d in found.values() for n in nodes(d)}
    assert not handed_out & {"/dev/infiniband/uverbs0", "/dev/infiniband/uverbs1"}


def test_the_cdi_spec_of_a_gaudi3_card_carries_its_verbs_node(tree):
    from host.core.cdi import build_spec

    fa.gaudi3_server(tree, cards=2, registration=(0, 1))
    found = devices(tree, GAUDI3)
    spec = build_spec("habana.ai/gaudi", list(found.values()))
    assert spec is not None
    paths = {d["name"]: [n["path"] for n in d["containerEdits"]["deviceNodes"]]
             for d in spec["devices"]}
    assert sorted(paths.values()) == [
        ["/dev/accel/accel0", "/dev/accel/accel_controlD0", "/dev/infiniband/uverbs2"],
        ["/dev/accel/accel1", "/dev/accel/accel_controlD1", "/dev/infiniband/uverbs3"]]


# One Gaudi 3 card as sysfs shows it with habanalabs, hbl and ib_uverbs loaded, beside a host
# NIC that registered first (relative links as the kernel makes them; ports cut to two).
GAUDI3_CARD = """\
f /sys/devices/system/node/node0/cpulist "0-15"
f /sys/devices/system/node/possible "0"
f /sys/devices/pci0000:16/0000:16:02.0/0000:19:00.0/vendor "0x1da3"
f /sys/devices/pci0000:16/0000:16:02.0/0000:19:00.0/device "0x1060"
f /sys/devices/pci0000:16/0000:16:02.0/0000:19:00.0/class "0x120000"
f /sys/devices/pci0000:16/0000:16:02.0/0000:19:00.0/enable "1"
f /sys/devices/pci0000:16/0000:16:02.0/0000:19:00.0/numa_node "0"
f /sys/devices/pci0000:16/0000:16:02.0/0000:19:00.0/status "operational"
f /sys/devices/pci0000:16/0000:16:02.0/0000:19:00.0/device_type "GAUDI3"
f /sys/devices/pci0000:16/0000:16:02.0/0000:19:00.0/module_id "2"
l /sys/devices/pci0000:16/0000:16:02.0/0000:19:00.0/driver -> ../../../../bus/pci/drivers/habanalabs
l /sys/bus/pci/devices/0000:19:00.0 -> ../../../devices/pci0000:16/0000:16:02.0/0000:19:00.0
f /sys/devices/pci0000:16/0000:16:02.0/0000:19:00.0/accel/accel0/dev "261:0"
f /sys/devices/pci0000:16/0000:16:02.0/0000:19:00.0/accel/accel0/uevent "MAJOR=261\\nMINOR=0\\n\
DEVNAME=accel/accel0\\nDEVTYPE=accel_minor"
l /sys/devices/pci0000:16/0000:16:02.0/0000:19:00.0/accel/accel0/device -> ../../../0000:19:00.0
l /sys/class/accel/accel0 -> ../../devices/pci0000:16/0000:16:02.0/0000:19:00.0/accel/accel0
f /sys/devices/virtual/accel/accel_controlD0/dev "509:0"
f /sys/devices/virtual/accel/accel_controlD0/uevent "MAJOR=509\\nMINOR=0\\n\
DEVNAME=accel/accel_controlD0"
l /sys/class/accel/accel_controlD0 -> ../../devices/virtual/accel/accel_controlD0
f /sys/devices/pci0000:16/0000:16:02.0/0000:19:00.0/infiniband/hbl_0/node_type "7: unspecified"
f /sys/devices/pci0000:16/0000:16:02.0/0000:19:00.0/infiniband/hbl_0/ports/1/link_layer \
"Ethernet"
f /sys/devices/pci0000:16/0000:16:02.0/0000:19:00.0/infiniband/hbl_0/ports/2/link_layer \
"Ethernet"
l /sys/devices/pci0000:16/0000:16:02.0/0000:19:00.0/infiniband/hbl_0/device -> ../../../0000:19:00.0
l /sys/class/infiniband/hbl_0 -> \
../../devices/pci0000:16/0000:16:02.0/0000:19:00.0/infiniband/hbl_0
f /sys/devices/pci0000:16/0000:16:02.0/0000:19:00.0/infiniband_verbs/uverbs1/dev "231:193"
f /sys/devices/pci0000:16/0000:16:02.0/0000:19:00.0/infiniband_verbs/uverbs1/ibdev "hbl_0"
f /sys/devices/pci0000:16/0000:16:02.0/0000:19:00.0/infiniband_verbs/uverbs1/uevent \
"MAJOR=231\\nMINOR=193\\nDEVNAME=infiniband/uverbs1"
l /sys/devices/pci0000:16/0000:16:02.0/0000:19:00.0/infiniband_verbs/uverbs1/device -> \
../../../0000:19:00.0
l /sys/class/infiniband_verbs/uverbs1 -> \
../../devices/pci0000:16/0000:16:02.0/0000:19:00.0/infiniband_verbs/uverbs1
f /sys/class/infiniband_verbs/abi_version "6"
f /sys/devices/pci0000:00/0000:00:03.0/0000:0c:00.0/vendor "0x15b3"
f /sys/devices/pci0000:00/0000:00:03.0/0000:0c:00.0/device "0x1021"
f /sys/devices/pci0000:00/0000:00:03.0/0000:0c:00.0/class "0x020000"
l /sys/devices/pci0000:00/0000:00:03.0/0000:0c:00.0/driver -> ../../../../bus/pci/drivers/mlx5_core
l /sys/bus/pci/devices/0000:0c:00.0 -> ../../../devices/pci0000:00/0000:00:03.0/0000:0c:00.0
l /sys/devices/pci0000:00/0000:00:03.0/0000:0c:00.0/infiniband/mlx5_0/device -> \
../../../0000:0c:00.0
l /sys/class/infiniband/mlx5_0 -> \
../../devices/pci0000:00/0000:00:03.0/0000:0c:00.0/infiniband/mlx5_0
f /sys/devices/pci0000:00/0000:00:03.0/0000:0c:00.0/infiniband_verbs/uverbs0/ibdev "mlx5_0"
f /sys/devices/pci0000:00/0000:00:03.0/0000:0c:00.0/infiniband_verbs/uverbs0/uevent \
"MAJOR=231\\nMINOR=192\\nDEVNAME=infiniband/uverbs0"
l /sys/class/infiniband_verbs/uverbs0 -> \
../../devices/pci0000:00/0000:00:03.0/0000:0c:00.0/infiniband_verbs/uverbs0
c /dev/accel/accel0 261:0
c /dev/accel/accel_controlD0 509:0
c /dev/infiniband/uverbs0 231:192
c /dev/infiniband/uverbs1 231:193
"""


def test_a_real_gaudi3_card_tree_hands_out_its_scale_out_verbs_node(tree):
    tree.load(GAUDI3_CARD)
    device = devices(tree, GAUDI3)["0000:19:00.0"]
    assert device.health is Health.HEALTHY, device.health_reason
    assert nodes(device) == ["/dev/accel/accel0", "/dev/accel/accel_controlD0",
                             "/dev/infiniband/uverbs1"]
    assert device.numa_nodes == (0,)


def test_a_missing_verbs_node_makes_the_card_unhealthy(tree):
    tree.load(GAUDI3_CARD)
    tree.remove("/dev/infiniband/uverbs1")
    device = devices(tree, GAUDI3)["0000:19:00.0"]
    assert device.health is Health.UNHEALTHY
    assert device.health_reason == "device node /dev/infiniband/uverbs1 missing"


def test_without_ib_uverbs_the_card_is_served_with_its_accel_nodes(tree):
    tree.numa_nodes(1)
    function = fa.add_gaudi(tree, "0000:19:00.0", 0, device=fa.GAUDI3)
    fa.add_hbl_nic(tree, function, 0, None)
    device = devices(tree, GAUDI3)["0000:19:00.0"]
    assert device.health is Health.HEALTHY, device.health_reason
    assert nodes(device) == ["/dev/accel/accel0", "/dev/accel/accel_controlD0"]
    assert device.attributes["rdma_devices"] == "hbl_0"
    assert device.attributes["rdma_verbs"] == ""


def test_a_gaudi2_without_rdma_devices_is_unchanged(tree):
    fa.gaudi_server(tree, cards=2)
    assert all("rdma_devices" not in d.attributes and len(d.device_nodes) == 2
               for d in devices(tree, GAUDI).values())
