"""The FPGA driver (Intel DFL, AMD/Xilinx XRT) against fake trees and the captured FPGA node,
and its pre-start program runner with real tiny programs."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Dict, List

import pytest

from device_plugin_host_testing import fake_fpga as ff
from device_plugin_host_testing.machines import load_machine
from drivers.fpga import plugin
from drivers.fpga.dfl import normalise_uuid
from drivers.fpga.driver import (
    DEFAULT_PRE_START_TIMEOUT_S,
    FpgaDriver,
    pci_env_name,
    pre_start_env,
)
from drivers.fpga.prestart import PreStartError
from drivers.fpga.xrt import xrt_instance
from host.cli.capture import capture_tree
from host.config import load_config
from host.core.driver import SelectorError
from host.core.hostfs import HostFS
from host.core.model import Device, DeviceNode, Health, ResourceConfig
from host.sim.tree import FakeTree

REPO = Path(__file__).resolve().parents[2]
DFL = ResourceConfig("fpga.intel.com/dfl-port", "fpga", {"kind": "dfl"})
XRT = ResourceConfig("amd.com/alveo", "fpga", {"kind": "xrt"})
ANY = ResourceConfig("example.com/fpga", "fpga", {})
D5005_INTERFACE = "bfac4d851ee856fe8c95865ce1bbaa2d"


@pytest.fixture
def tree(tmp_path) -> FakeTree:
    fake = FakeTree(tmp_path / "root")
    fake.numa_nodes(2)
    return fake


@pytest.fixture(scope="module")
def node(tmp_path_factory) -> FakeTree:
    """The captured FPGA node, loaded once: its tests only read it."""
    return load_machine("fpga-node", tmp_path_factory.mktemp("fpga") / "root")


def discover(tree: FakeTree, *resources: ResourceConfig) -> Dict[str, List[Device]]:
    found = FpgaDriver().discover(HostFS(tree.root), resources or (ANY,))
    return {name: list(devices) for name, devices in found.items()}


def devices_of(tree: FakeTree, resource: ResourceConfig = ANY) -> Dict[str, Device]:
    return {d.id: d for d in discover(tree, resource)[resource.name]}


def with_(base: ResourceConfig, selectors=None, settings=None) -> ResourceConfig:
    return ResourceConfig(
        base.name, "fpga", {**base.selectors, **(selectors or {})}, settings or {}
    )


def nodes(device: Device) -> List[str]:
    return [n.host_path for n in device.device_nodes]


# -- the captured FPGA node ------------------------------------------------------------------
def test_fpga_node_default_resources(node):
    found = discover(node, *FpgaDriver().default_resources())
    ports = {d.id: d for d in found["fpga.intel.com/dfl-port"]}
    cards = {d.id: d for d in found["amd.com/alveo"]}
    assert sorted(ports) == ["0000:3b:00.0-port0", "0000:b1:00.0-port0"]
    assert sorted(cards) == ["0000:5e:00.1", "0000:d8:00.1"]
    a10 = ports["0000:3b:00.0-port0"]
    assert nodes(a10) == ["/dev/dfl-port.0"]
    assert a10.numa_nodes == (0,)
    assert a10.attributes["afu_id"] == ff.NLB0_AFU
    assert a10.attributes["interface_id"] == ff.DCP12_INTERFACE
    assert a10.attributes["device"] == "0x09c4"
    assert a10.attributes["kernel_driver"] == "dfl-pci"
    assert a10.attributes["local_cpulist"] == "0-23"
    assert a10.env == {"PCIDEVICE_FPGA_INTEL_COM_DFL_PORT": "0000:3b:00.0"}
    n3000 = ports["0000:b1:00.0-port0"]
    assert n3000.numa_nodes == (1,)
    assert n3000.attributes["dfl_feature_ids"] == "0xd"
    assert n3000.attributes["fme"] == "dfl-fme.1" and n3000.attributes["region"] == "region2"
    u250 = cards["0000:5e:00.1"]
    assert nodes(u250) == ["/dev/dri/renderD128", "/dev/xclmgmt24064"]
    assert u250.numa_nodes == (0,)
    assert u250.attributes["mgmt_address"] == "0000:5e:00.0"
    assert u250.attributes["shell"] == "xilinx_u250_gen3x16_xdma_shell_4_1"
    assert u250.attributes["serial"] == "XFL1RT5PHT31"
    assert u250.env == {"PCIDEVICE_AMD_COM_ALVEO": "0000:5e:00.1"}
    assert nodes(cards["0000:d8:00.1"]) == ["/dev/dri/renderD129", "/dev/xclmgmt55296"]
    for device in [*ports.values(), *cards.values()]:
        assert device.health is Health.HEALTHY, device.health_reason
        assert all(isinstance(v, str) for v in device.attributes.values())
        assert all(n.permissions == "rw" for n in device.device_nodes)


def test_fpga_node_example_config(node):
    nlb0 = ResourceConfig(
        "fpga.intel.com/arria10.dcp1.2-nlb0",
        "fpga",
        {
            "kind": "dfl",
            "vendor": "0x8086",
            "device": "0x09c4",
            "kernel_driver": "dfl-pci",
            "interface_id": "69528db6eb31577a8c3668f9faa081f6",
            "afu_id": "d8424dc4a4a3c413f89e433683f9040b",
        },
    )
    u250 = ResourceConfig(
        "xilinx.com/fpga-u250",
        "fpga",
        {"kind": "xrt", "vendor": "0x10ee", "device": "0x5005", "kernel_driver": "xocl"},
        {"pre_start": ["/opt/xilinx/xrt/bin/xbutil", "reset", "--force"]},
    )
    FpgaDriver().check_selectors(nlb0.selectors)
    FpgaDriver().check_settings(u250.settings)
    found = discover(node, nlb0, u250)
    assert [d.id for d in found[nlb0.name]] == ["0000:3b:00.0-port0"]
    assert [d.id for d in found[u250.name]] == ["0000:5e:00.1"]
    assert FpgaDriver().needs_pre_start(u250) and not FpgaDriver().needs_pre_start(nlb0)


def test_shipped_fpga_example_config_serves_the_fpga_node(node):
    """config/examples/fpga-node.toml, parsed by the host, finds its cards on this tree."""
    driver = FpgaDriver()
    config = load_config(str(REPO / "config" / "examples" / "fpga-node.toml"), {"fpga": driver})
    found = driver.discover(HostFS(node.root), config.resources)
    for res in config.resources:
        assert found[res.name], f"{res.name} found nothing"
        assert all(d.health is Health.HEALTHY for d in found[res.name])


def test_fpga_node_survives_todays_capture(node, tmp_path):
    """Today's capture keeps no compat_id, mgmt_pf, user_pf or instance: same devices, same
    nodes (roles from the driver links, the mgmt node from its class directory)."""
    lines = list(capture_tree(node.root, ["/dev/dfl-*", "/dev/xclmgmt*", "/dev/dri/*"]))
    recaptured = FakeTree(tmp_path / "recaptured")
    recaptured.load("\n".join(lines))
    before = {d.id: nodes(d) for d in devices_of(node).values()}
    after = devices_of(recaptured)
    assert {k: nodes(d) for k, d in after.items()} == before
    assert all(d.health is Health.HEALTHY for d in after.values())


# -- DFL modes ---------------------------------------------------------------------------------
@pytest.fixture
def two_port(tree) -> FakeTree:
    """A D5005-class card whose FME manages two ports."""
    ff.dfl_card(
        tree,
        "0000:3b:00.0",
        device=0x0B2B,
        numa_node=1,
        interface_id=D5005_INTERFACE,
        ports=[
            ff.DflPortSpec(0, port_id=0),
            ff.DflPortSpec(1, afu_id="0b4d2f3a5c6e7f8091a2b3c4d5e6f708", port_id=1),
        ],
        fme_features=[(0, 0xE), (1, 0x9)],
    )
    return tree


def test_af_mode_is_one_device_per_port(two_port):
    found = devices_of(two_port, DFL)
    assert sorted(found) == ["0000:3b:00.0-port0", "0000:3b:00.0-port1"]
    assert nodes(found["0000:3b:00.0-port1"]) == ["/dev/dfl-port.1"]
    assert found["0000:3b:00.0-port1"].attributes["port_id"] == "1"
    assert found["0000:3b:00.0-port0"].attributes["dfl_feature_ids"] == "0x9,0xe"
    assert all(d.numa_nodes == (1,) for d in found.values())


def test_region_mode_is_one_device_per_card(two_port):
    (device,) = discover(two_port, with_(DFL, settings={"mode": "region"}))[DFL.name]
    assert device.id == "0000:3b:00.0"
    assert nodes(device) == ["/dev/dfl-port.0", "/dev/dfl-port.1"]
    assert device.attributes["ports"] == "dfl-port.0,dfl-port.1"
    assert device.attributes["afu_ids"] == f"{ff.NLB0_AFU},0b4d2f3a5c6e7f8091a2b3c4d5e6f708"


def test_regiondevel_mode_adds_the_fme(two_port):
    (device,) = discover(two_port, with_(DFL, settings={"mode": "regiondevel"}))[DFL.name]
    assert nodes(device) == ["/dev/dfl-port.0", "/dev/dfl-port.1", "/dev/dfl-fme.0"]


def test_afu_and_interface_selectors(two_port):
    second = "0B4D2F3A-5C6E-7F80-91A2-B3C4D5E6F708"  # UUID form, upper case
    assert list(devices_of(two_port, with_(DFL, {"afu_id": second}))) == ["0000:3b:00.0-port1"]
    assert len(devices_of(two_port, with_(DFL, {"interface_id": D5005_INTERFACE}))) == 2
    assert devices_of(two_port, with_(DFL, {"interface_id": ff.DCP12_INTERFACE})) == {}
    region = with_(DFL, {"afu_id": second}, {"mode": "region"})
    assert list(devices_of(two_port, region)) == ["0000:3b:00.0"]  # any port's AFU counts


def test_vf_port_borrows_the_pf_fme(tree):
    pf = ff.dfl_card(
        tree,
        "0000:3b:00.0",
        device=0x0B2B,
        numa_node=0,
        region=0,
        interface_id=D5005_INTERFACE,
        ports=[],
        pr_ports=[0],
        sriov_totalvfs=1,
    )
    ff.dfl_vf(
        tree,
        pf,
        "0000:3b:00.1",
        device=0x0B2C,
        region=2,
        numa_node=0,
        port=ff.DflPortSpec(0, port_id=0),
    )
    found = devices_of(tree, DFL)
    assert list(found) == ["0000:3b:00.1-port0"]  # the PF has no port left
    vf = found["0000:3b:00.1-port0"]
    assert vf.attributes["interface_id"] == D5005_INTERFACE
    assert vf.attributes["pf_address"] == "0000:3b:00.0"
    assert vf.attributes["device"] == "0x0b2c"
    devel = discover(tree, with_(DFL, settings={"mode": "regiondevel"}))[DFL.name]
    assert [nodes(d) for d in devel] == [["/dev/dfl-port.0", "/dev/dfl-fme.0"]]


def test_opae_out_of_tree_driver_layout(tree):
    fn = tree.pci_function(
        "0000:5e:00.0",
        vendor=0x8086,
        device=0x09C4,
        pci_class=0x120000,
        numa_node=0,
        driver="intel-fpga-pci",
    )
    dev = f"{fn}/fpga/intel-fpga-dev.0"
    tree.link("/sys/class/fpga/intel-fpga-dev.0", dev)
    tree.attr(f"{dev}/intel-fpga-fme.0/pr/interface_id", ff.DCP12_INTERFACE)
    tree.attr(f"{dev}/intel-fpga-fme.0/dev", "235:0")
    tree.attr(f"{dev}/intel-fpga-port.0/afu_id", ff.NLB0_AFU)
    tree.attr(f"{dev}/intel-fpga-port.0/dev", "236:0")
    tree.chardev("/dev/intel-fpga-port.0", 236, 0)
    tree.chardev("/dev/intel-fpga-fme.0", 235, 0)
    (device,) = discover(tree, DFL)[DFL.name]
    assert device.id == "0000:5e:00.0-port0"  # no ``id`` file: its index on the card
    assert nodes(device) == ["/dev/intel-fpga-port.0"]
    assert device.attributes["stack"] == "intel-fpga"
    assert device.attributes["interface_id"] == ff.DCP12_INTERFACE
    assert device.health is Health.HEALTHY


# -- DFL health and odd values ------------------------------------------------------------------
def test_missing_port_node_is_unhealthy_then_healthy(tree, caplog):
    ff.dfl_card(tree, "0000:3b:00.0", ports=[ff.DflPortSpec(0, dev_node=False)])
    with caplog.at_level(logging.WARNING):
        device = devices_of(tree, DFL)["0000:3b:00.0-port0"]
    assert device.health is Health.UNHEALTHY
    assert "/dev/dfl-port.0" in device.health_reason and "dfl-port.0" in caplog.text
    tree.chardev("/dev/dfl-port.0", 238, 0)
    assert devices_of(tree, DFL)["0000:3b:00.0-port0"].health is Health.HEALTHY


def test_missing_fme_node_matters_only_when_handed_over(tree):
    ff.dfl_card(tree, "0000:3b:00.0", fme_dev_node=False)
    assert devices_of(tree, DFL)["0000:3b:00.0-port0"].health is Health.HEALTHY
    (devel,) = discover(tree, with_(DFL, settings={"mode": "regiondevel"}))[DFL.name]
    assert devel.health is Health.UNHEALTHY and "/dev/dfl-fme.0" in devel.health_reason


@pytest.mark.parametrize(
    "afu_id, interface_id, reason",
    [
        ("f" * 32, ff.DCP12_INTERFACE, "AFU id reads all ones"),
        (ff.NLB0_AFU, "F" * 32, "interface id reads all ones"),
    ],
)
def test_all_ones_ids_mean_crashed_firmware(tree, afu_id, interface_id, reason):
    ff.dfl_card(
        tree, "0000:3b:00.0", interface_id=interface_id, ports=[ff.DflPortSpec(0, afu_id=afu_id)]
    )
    device = devices_of(tree, DFL)["0000:3b:00.0-port0"]
    assert device.health is Health.UNHEALTHY and reason in device.health_reason


@pytest.mark.parametrize("afu_id", [None, "not-a-uuid", "", "d8424dc4"])
def test_unreadable_or_garbage_afu_id_is_left_out(tree, afu_id, caplog):
    ff.dfl_card(tree, "0000:3b:00.0", ports=[ff.DflPortSpec(0, afu_id=afu_id)])
    with caplog.at_level(logging.INFO):
        device = devices_of(tree, DFL)["0000:3b:00.0-port0"]
    assert device.health is Health.HEALTHY
    assert "afu_id" not in device.attributes
    assert "dfl-port.0" in caplog.text
    assert devices_of(tree, with_(DFL, {"afu_id": ff.NLB0_AFU})) == {}


def test_missing_compat_id_leaves_the_interface_unknown(tree):
    ff.dfl_card(tree, "0000:3b:00.0", interface_id=None)
    device = devices_of(tree, DFL)["0000:3b:00.0-port0"]
    assert device.health is Health.HEALTHY and "interface_id" not in device.attributes
    assert devices_of(tree, with_(DFL, {"interface_id": ff.DCP12_INTERFACE})) == {}


def test_port_without_id_file_uses_its_index_and_clashing_ids_stay_unique(tree, caplog):
    ff.dfl_card(
        tree,
        "0000:3b:00.0",
        ports=[ff.DflPortSpec(0, port_id=None), ff.DflPortSpec(1, port_id=None)],
    )
    assert sorted(devices_of(tree, DFL)) == ["0000:3b:00.0-port0", "0000:3b:00.0-port1"]
    ff.dfl_card(
        tree,
        "0000:5e:00.0",
        region=2,
        fme=1,
        ports=[ff.DflPortSpec(2, port_id=0), ff.DflPortSpec(3, port_id=0)],
    )
    with caplog.at_level(logging.WARNING):
        found = devices_of(tree, DFL)
    assert len(found) == 4
    assert {"0000:5e:00.0-dfl-port.2", "0000:5e:00.0-dfl-port.3"} <= set(found)
    assert "claimed twice" in caplog.text


def test_dangling_region_link_and_foreign_regions_are_skipped(tree):
    ff.dfl_card(tree, "0000:3b:00.0")
    tree.link("/sys/class/fpga_region/region9", "/sys/devices/gone/fpga_region/region9")
    tree.mkdir("/sys/devices/platform/soc/ff200000.bridge/fpga_region/region7")
    tree.link(
        "/sys/class/fpga_region/region7",
        "/sys/devices/platform/soc/ff200000.bridge/fpga_region/region7",
    )
    assert list(devices_of(tree, DFL)) == ["0000:3b:00.0-port0"]


def test_dfl_without_a_pci_parent(tree):
    region = "/sys/devices/platform/dfl-platform.0/fpga_region/region0"
    tree.link("/sys/class/fpga_region/region0", region)
    ff.dfl_port(tree, region, ff.DflPortSpec(4, port_id=0))
    assert list(devices_of(tree, DFL)) == ["dfl-port.4"]
    assert devices_of(tree, with_(DFL, {"vendor": "0x8086"})) == {}


@pytest.mark.parametrize("numa_node, expected", [(1, (1,)), (-1, ()), (None, ()), (5, ())])
def test_dfl_numa(tree, numa_node, expected):
    ff.dfl_card(tree, "0000:3b:00.0", numa_node=numa_node)
    assert devices_of(tree, DFL)["0000:3b:00.0-port0"].numa_nodes == expected


def test_normalise_uuid():
    assert normalise_uuid(" 0xD8424DC4A4A3C413F89E433683F9040B\n") == ff.NLB0_AFU
    assert normalise_uuid("d8424dc4-a4a3-c413-f89e-433683f9040b") == ff.NLB0_AFU
    assert normalise_uuid("d8424dc4a4a3c413f89e433683f9040") is None
    assert normalise_uuid("g8424dc4a4a3c413f89e433683f9040b") is None
    assert normalise_uuid(None) is None


# -- XRT ----------------------------------------------------------------------------------------
def test_xrt_instance_rule():
    assert xrt_instance("0000:d8:00.0") == 55296
    assert xrt_instance("0000:5e:00.1") == 0x5E01
    assert xrt_instance("0001:3b:02.3") == (1 << 16) | (0x3B << 8) | (2 << 3) | 3
    assert xrt_instance("garbage") is None


@pytest.mark.parametrize(
    "markers, instance_file, class_dir",
    [
        (True, True, True),
        (False, True, True),
        (False, False, True),
        (False, False, False),
    ],
)
def test_xrt_card_from_any_generation_of_xrt_sysfs(tree, markers, instance_file, class_dir):
    ff.xrt_card(
        tree,
        "0001:3b:00",
        numa_node=1,
        markers=markers,
        instance_file=instance_file,
        mgmt_class_dir=class_dir,
    )
    (device,) = discover(tree, XRT)[XRT.name]
    assert device.id == "0001:3b:00.1"
    assert nodes(device) == ["/dev/dri/renderD128", f"/dev/xclmgmt{(1 << 16) | 0x3B00}"]
    assert device.health is Health.HEALTHY and device.numa_nodes == (1,)


def test_xrt_old_shell_with_swapped_functions_trusts_the_markers(tree):
    ff.xrt_card(tree, "0000:3b:00", mgmt_function=1, user_function=0)
    (device,) = discover(tree, XRT)[XRT.name]
    assert device.id == "0000:3b:00.0"
    assert device.attributes["mgmt_address"] == "0000:3b:00.1"
    assert nodes(device)[1] == f"/dev/xclmgmt{0x3B01}"


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        ({"mgmt_dev_node": False}, "/dev/xclmgmt15104 missing"),
        ({"render_dev_node": False}, "/dev/dri/renderD128 missing"),
        ({"drm": False}, "no DRM render node under 0000:3b:00.1"),
        ({"user_driver": None, "markers": False, "drm": False}, "not bound to xocl"),
    ],
)
def test_xrt_unhealthy_cases_name_the_problem(tree, kwargs, reason, caplog):
    ff.xrt_card(tree, "0000:3b:00", **kwargs)
    with caplog.at_level(logging.WARNING):
        (device,) = discover(tree, XRT)[XRT.name]
    assert device.health is Health.UNHEALTHY
    assert reason in device.health_reason
    assert "0000:3b:00.1" in caplog.text


def test_xrt_user_function_given_to_a_vm_or_absent_is_not_served(tree):
    ff.xrt_card(tree, "0000:3b:00", user_driver="vfio-pci", markers=False)
    ff.xrt_card(tree, "0000:5e:00", user=False)
    assert discover(tree, XRT)[XRT.name] == []


def test_xrt_user_function_alone_is_served_without_a_mgmt_node(tree):
    ff.xrt_card(tree, "0000:3b:00", mgmt=False, vendor=0x1D0F, user_device=0xF010)
    (device,) = discover(tree, XRT)[XRT.name]
    assert nodes(device) == ["/dev/dri/renderD128"]
    assert device.health is Health.HEALTHY and "mgmt_address" not in device.attributes


def test_plain_rom_file_is_not_a_shell(tree):
    card = ff.xrt_card(tree, "0000:3b:00", shell=None)
    tree.attr(f"{card.user}/rom", "")  # the PCI expansion ROM attribute
    (device,) = discover(tree, XRT)[XRT.name]
    assert "shell" not in device.attributes


def test_other_xilinx_functions_are_not_xrt_cards(tree):
    tree.pci_function(
        "0000:3b:00.0", vendor=0x10EE, device=0x9038, pci_class=0x058000, driver="xdma"
    )
    tree.pci_function("0000:3c:00.0", vendor=0x10EE, device=0x5005, pci_class=0x120000)
    assert discover(tree)[ANY.name] == []


@pytest.fixture(scope="module")
def alveos(tmp_path_factory) -> FakeTree:
    """Built once: the selector cases only read it."""
    tree = FakeTree(tmp_path_factory.mktemp("alveos") / "root")
    tree.numa_nodes(2)
    ff.xrt_card(tree, "0000:3b:00", numa_node=0)
    ff.xrt_card(
        tree,
        "0000:d8:00",
        mgmt_device=0x500C,
        user_device=0x500D,
        numa_node=1,
        render_minor=129,
        card_minor=2,
        shell="xilinx_u280_xdma_201920_3",
    )
    ff.dfl_card(tree, "0000:5e:00.0")
    return tree


@pytest.mark.parametrize(
    "selectors, expected",
    [
        ({}, ["0000:5e:00.0-port0", "0000:3b:00.1", "0000:d8:00.1"]),
        ({"kind": "xrt"}, ["0000:3b:00.1", "0000:d8:00.1"]),
        ({"kind": "alveo"}, ["0000:3b:00.1", "0000:d8:00.1"]),
        ({"kind": ["dfl", "xrt"], "vendor": "0x10ee"}, ["0000:3b:00.1", "0000:d8:00.1"]),
        ({"device": "0x5004"}, ["0000:3b:00.1"]),  # the card by its management PF
        ({"device": "0x500d", "kernel_driver": "xocl"}, ["0000:d8:00.1"]),
        ({"device": "0x5005", "kernel_driver": "xclmgmt"}, []),  # no one function has both
        ({"pci_address": "d8:00.0"}, ["0000:d8:00.1"]),
        ({"shell": "xilinx_u280_xdma_201920_3"}, ["0000:d8:00.1"]),
        ({"afu_id": ff.NLB0_AFU}, ["0000:5e:00.0-port0"]),
        ({"kind": "dfl", "vendor": "0x10ee"}, []),
    ],
)
def test_selectors(alveos, selectors, expected):
    found = discover(alveos, ResourceConfig("example.com/fpga", "fpga", selectors))
    assert [d.id for d in found["example.com/fpga"]] == expected


# -- configuration -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "selectors, key",
    [
        ({"kind": "intel"}, "kind"),
        ({"kind": ["dfl", "gpu"]}, "kind"),
        ({"afu_id": "nope"}, "afu_id"),
        ({"interface_id": "1234"}, "interface_id"),
        ({"kind": "xrt", "afu_id": ff.NLB0_AFU}, "afu_id"),
        ({"kind": "dfl", "shell": "xilinx_u250"}, "shell"),
        ({"vendor": "0xnope"}, "vendor"),
        ({"device": "0x12345"}, "device"),
        ({"serial": "x"}, "serial"),
    ],
)
def test_bad_selectors_name_the_key(selectors, key):
    with pytest.raises(SelectorError) as error:
        FpgaDriver().check_selectors(selectors)
    assert error.value.key == key


@pytest.mark.parametrize(
    "settings, key",
    [
        ({"mode": "afu"}, "mode"),
        ({"pre_start": "/bin/true"}, "pre_start"),
        ({"pre_start": []}, "pre_start"),
        ({"pre_start": ["bin/true"]}, "pre_start"),
        ({"pre_start": ["/opt/../bin/true"]}, "pre_start"),
        ({"pre_start": ["/bin/true", 3]}, "pre_start"),
        ({"pre_start": ["/bin/true", "a\x00b"]}, "pre_start"),
        ({"pre_start": ["/bin/true"], "pre_start_timeout_s": 0}, "pre_start_timeout_s"),
        ({"pre_start": ["/bin/true"], "pre_start_timeout_s": 29}, "pre_start_timeout_s"),
        ({"pre_start": ["/bin/true"], "pre_start_timeout_s": True}, "pre_start_timeout_s"),
        ({"pre_start_timeout_s": 5}, "pre_start_timeout_s"),
        ({"shared": 2}, "shared"),
    ],
)
def test_bad_settings_name_the_key(settings, key):
    with pytest.raises(SelectorError) as error:
        FpgaDriver().check_settings(settings)
    assert error.value.key == key


def test_good_configuration_passes():
    driver = FpgaDriver()
    driver.check_selectors(
        {
            "kind": "dfl",
            "afu_id": "D8424DC4-A4A3-C413-F89E-433683F9040B",
            "interface_id": ff.DCP12_INTERFACE,
            "pci_address": "3b:00.0",
        }
    )
    driver.check_selectors({"kind": "alveo", "shell": "xilinx_u250_gen3x16_xdma_shell_4_1"})
    driver.check_settings(
        {
            "mode": "regiondevel",
            "pre_start": ["/usr/bin/fpgaconf", "-v"],
            "pre_start_timeout_s": 12.5,
        }
    )


def test_default_resources_and_plugin_hook():
    (driver,) = plugin.device_plugin_host_drivers()
    assert isinstance(driver, FpgaDriver)
    assert driver.name == "fpga"
    assert {"dfl", "pci", "fpga_region", "platform", "drm"} <= set(driver.subsystems)
    defaults = {r.name: r for r in driver.default_resources()}
    assert set(defaults) == {"fpga.intel.com/dfl-port", "amd.com/alveo"}
    assert all(not r.register_when_empty for r in defaults.values())
    assert not any(driver.needs_pre_start(r) for r in defaults.values())
    for r in defaults.values():
        driver.check_selectors(r.selectors)


def test_no_fpga_at_all(tmp_path):
    assert discover(FakeTree(tmp_path / "empty")) == {ANY.name: []}


def test_pci_env_name():
    assert pci_env_name("fpga.intel.com/af-695.d84.aVKNtusx") == (
        "PCIDEVICE_FPGA_INTEL_COM_AF_695_D84_AVKNTUSX"
    )


# -- pre-start -------------------------------------------------------------------------------------
def script(tmp_path, body: str, name: str = "prep.sh") -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body, encoding="utf-8")
    os.chmod(path, 0o755)
    return str(path)


def port(device_id: str, address: str, node: str, afu: str = ff.NLB0_AFU) -> Device:
    return Device(
        id=device_id,
        device_nodes=(DeviceNode(node),),
        attributes={"pci_address": address, "afu_id": afu, "interface_id": ff.DCP12_INTERFACE},
    )


PORTS = [
    port("0000:3b:00.0-port0", "0000:3b:00.0", "/dev/dfl-port.0"),
    port("0000:3b:00.0-port1", "0000:3b:00.0", "/dev/dfl-port.1"),
]


def test_pre_start_runs_the_program_without_a_shell_with_the_devices_in_env(tmp_path):
    out = tmp_path / "out"
    program = script(tmp_path, f'printf "%s\\n" "$@" > {out}\nenv | sort >> {out}\n')
    tricky = f"$(touch {tmp_path}/pwned); rm -rf /"
    res = with_(DFL, settings={"pre_start": [program, "--mode", tricky]})
    FpgaDriver().pre_start(res, PORTS)
    lines = out.read_text(encoding="utf-8").splitlines()
    assert lines[:2] == ["--mode", tricky]  # exactly the configured argv, nothing appended
    assert not (tmp_path / "pwned").exists()
    env = dict(line.split("=", 1) for line in lines[2:] if "=" in line)
    assert env["FPGA_RESOURCE"] == "fpga.intel.com/dfl-port"
    assert env["FPGA_DEVICE_IDS"] == "0000:3b:00.0-port0,0000:3b:00.0-port1"
    assert env["FPGA_PCI_ADDRESSES"] == "0000:3b:00.0"
    assert env["FPGA_DEVICE_NODES"] == "/dev/dfl-port.0,/dev/dfl-port.1"
    assert env["FPGA_AFU_IDS"] == ff.NLB0_AFU
    assert env["FPGA_INTERFACE_IDS"] == ff.DCP12_INTERFACE


def test_pre_start_failure_carries_status_and_output(tmp_path):
    program = script(tmp_path, 'echo "xbutil: card 0000:3b:00.1 is busy" >&2\nexit 3\n')
    res = with_(XRT, settings={"pre_start": [program]})
    with pytest.raises(PreStartError) as error:
        FpgaDriver().pre_start(res, PORTS[:1])
    message = str(error.value)
    assert "exit status 3" in message and "is busy" in message
    assert "0000:3b:00.0-port0" in message and program in message


def test_pre_start_killed_by_a_signal(tmp_path):
    program = script(tmp_path, "kill -TERM $$\n")
    with pytest.raises(PreStartError, match="killed by SIGTERM"):
        FpgaDriver().pre_start(with_(DFL, settings={"pre_start": [program]}), PORTS)


def test_pre_start_timeout_kills_the_whole_group(tmp_path):
    pid_file = tmp_path / "child.pid"
    program = script(tmp_path, f"sleep 30 &\necho $! > {pid_file}\nwait\n")
    res = with_(DFL, settings={"pre_start": [program], "pre_start_timeout_s": 0.5})
    started = time.monotonic()
    with pytest.raises(PreStartError, match=r"did not finish within 0.5 s"):
        FpgaDriver().pre_start(res, PORTS)
    assert time.monotonic() - started < 5
    child = int(pid_file.read_text(encoding="utf-8"))
    for _ in range(50):  # the orphaned sleep must be gone (or a zombie awaiting its reaper)
        try:
            with open(f"/proc/{child}/stat", encoding="utf-8") as handle:
                state = handle.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state in ("Z", "X"):
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the pre-start program's child {child} survived the timeout")


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda tmp: str(tmp / "missing"), "not found"),
        (lambda tmp: (tmp / "plain").write_text("x") and str(tmp / "plain"), "not executable"),
    ],
)
def test_pre_start_program_that_cannot_run(tmp_path, make, reason):
    res = with_(DFL, settings={"pre_start": [make(tmp_path)]})
    with pytest.raises(PreStartError, match=reason):
        FpgaDriver().pre_start(res, PORTS)


def test_pre_start_without_a_program_is_a_no_op_and_not_advertised(tmp_path):
    driver = FpgaDriver()
    assert driver.pre_start(DFL, PORTS) is None
    assert not driver.needs_pre_start(DFL)
    assert driver.needs_pre_start(with_(DFL, settings={"pre_start": ["/bin/true"]}))
    assert DEFAULT_PRE_START_TIMEOUT_S < 28


def test_pre_start_env_for_xrt_cards_has_no_afu_ids():
    card = Device(
        id="0000:5e:00.1",
        device_nodes=(DeviceNode("/dev/dri/renderD128"), DeviceNode("/dev/xclmgmt24064")),
        attributes={"pci_address": "0000:5e:00.1", "mgmt_address": "0000:5e:00.0"},
    )
    env = pre_start_env("amd.com/alveo", [card])
    assert env == {
        "FPGA_RESOURCE": "amd.com/alveo",
        "FPGA_DEVICE_IDS": "0000:5e:00.1",
        "FPGA_PCI_ADDRESSES": "0000:5e:00.1",
        "FPGA_DEVICE_NODES": "/dev/dri/renderD128,/dev/xclmgmt24064",
    }


def test_pre_start_with_a_discovered_device(alveos, tmp_path):
    out = tmp_path / "addr"
    program = script(tmp_path, f'echo "$FPGA_PCI_ADDRESSES" > {out}\n')
    res = with_(XRT, {"shell": "xilinx_u280_xdma_201920_3"}, {"pre_start": [program]})
    devices = discover(alveos, res)[res.name]
    FpgaDriver().pre_start(res, devices)
    assert out.read_text(encoding="utf-8").strip() == "0000:d8:00.1"
