"""The SR-IOV driver against fake sysfs trees in the kernel's shapes (real files and links)."""

from __future__ import annotations

import logging
from typing import Dict, List, Mapping, Sequence

import pytest

from device_plugin_host_testing.machines import load_machine
from drivers.sriov import plugin
from drivers.sriov.driver import SriovDriver, env_name
from drivers.sriov.selectors import parse_pf, parse_ranges
from host.core.allocation import merge
from host.core.driver import SelectorError
from host.core.hostfs import HostFS
from host.core.model import Device, DeviceNode, Health, ResourceConfig
from host.sim.fake_net import (
    ARPHRD_INFINIBAND,
    net_interface,
    rdma_cm,
    rdma_device,
    sriov_pf,
    vf_address,
    vfio_nodes,
)
from host.sim.tree import FakeTree

RESOURCE = "intel.com/sriov_netdevice"
ENV = "PCIDEVICE_INTEL_COM_SRIOV_NETDEVICE"


@pytest.fixture
def tree(tmp_path) -> FakeTree:
    tree = FakeTree(tmp_path)
    tree.numa_nodes(2)
    return tree


def discover(
    tree: FakeTree, selectors: Mapping[str, object] | None = None, name: str = RESOURCE
) -> List[Device]:
    driver = SriovDriver()
    selectors = dict(selectors or {})
    driver.check_selectors(selectors)
    resource = ResourceConfig(name=name, driver="sriov", selectors=selectors)
    return list(driver.discover(HostFS(tree.root), [resource])[name])


def by_id(devices: Sequence[Device]) -> Dict[str, Device]:
    return {device.id: device for device in devices}


def e810(tree: FakeTree, **overrides: object):
    """An E810 PF at 0000:3b:00.0 with 4 VFs: 0-1 on iavf, 2-3 on vfio-pci."""
    options: Dict[str, object] = {
        "numvfs": 4,
        "vfio": (2, 3),
        "ifname": "ens1f0",
        "iommu_group": 30,
        "vf_iommu_group": 100,
        "numa_node": 1,
        "local_cpulist": "4-7",
    }
    options.update(overrides)
    return sriov_pf(tree, "0000:3b:00.0", **options)  # type: ignore[arg-type]


# -- discovery ---------------------------------------------------------------------------------
def test_vf_addresses_follow_offset_and_stride() -> None:
    assert vf_address("0000:3b:00.0", 8, 1, 0) == "0000:3b:01.0"
    assert vf_address("0000:3b:00.0", 8, 1, 9) == "0000:3b:02.1"
    assert vf_address("0000:98:00.0", 2, 1, 6) == "0000:98:01.0"


def test_each_vf_is_a_device_with_pf_facts(tree: FakeTree) -> None:
    pf = e810(tree)
    devices = discover(tree)
    assert [d.id for d in devices] == pf.vf_addresses
    first = devices[0]
    assert first.id == "0000:3b:01.0"
    assert first.healthy
    attributes = first.attributes
    assert attributes["pf_pci_address"] == "0000:3b:00.0"
    assert attributes["pf_name"] == "ens1f0"
    assert attributes["vf_index"] == "0"
    assert attributes["netdev"] == "ens1f0v0"
    assert attributes["vendor"] == "0x8086"
    assert attributes["device"] == "0x1889"
    assert attributes["kernel_driver"] == "iavf"
    assert attributes["iommu_group"] == "100"
    assert attributes["local_cpulist"] == "4-7"
    assert attributes["link_type"] == "ether"
    assert attributes["pf_operstate"] == "up"
    assert attributes["pf_carrier"] == "1"
    assert attributes["vf_mode"] == "netdevice"
    assert all(isinstance(v, str) for d in devices for v in d.attributes.values())
    # A vfio VF has no netdev.
    assert "netdev" not in by_id(devices)["0000:3b:01.2"].attributes


def test_pfs_without_vfs_and_plain_functions_give_nothing(tree: FakeTree) -> None:
    sriov_pf(tree, "0000:3b:00.0", numvfs=0)
    tree.pci_function("0000:00:1f.6", vendor=0x8086, device=0x15BC, pci_class=0x020000)
    assert discover(tree) == []


def test_env_names_every_non_alphanumeric_as_underscore() -> None:
    assert env_name("intel.com/sriov_netdevice") == ENV
    assert env_name("nvidia.com/cx6-dx.vfs") == "PCIDEVICE_NVIDIA_COM_CX6_DX_VFS"


# -- allocation data ---------------------------------------------------------------------------
def test_netdev_vf_carries_its_address_and_no_nodes(tree: FakeTree) -> None:
    e810(tree)
    device = by_id(discover(tree))["0000:3b:01.1"]
    assert device.env == {ENV: "0000:3b:01.1"}
    assert device.device_nodes == ()


def test_vfio_vf_carries_container_and_group_nodes(tree: FakeTree) -> None:
    e810(tree)
    device = by_id(discover(tree))["0000:3b:01.2"]
    assert device.attributes["vf_mode"] == "vfio"
    assert device.device_nodes == (
        DeviceNode("/dev/vfio/vfio", "/dev/vfio/vfio", "rw"),
        DeviceNode("/dev/vfio/102", "/dev/vfio/102", "rw"),
    )
    # DPDK needs the address of a vfio VF too.
    assert device.env == {ENV: "0000:3b:01.2"}
    assert not any(node.host_path.startswith(tree.root) for node in device.device_nodes)


def test_vfio_variant_driver_is_vfio(tree: FakeTree) -> None:
    pf = e810(tree, vfio=())
    tree.bind_driver(pf.vf_paths[1], "mlx5_vfio_pci")
    vfio_nodes(tree, 101)
    device = by_id(discover(tree))[pf.vf_addresses[1]]
    assert device.attributes["vf_mode"] == "vfio"
    assert [n.host_path for n in device.device_nodes] == ["/dev/vfio/vfio", "/dev/vfio/101"]


def test_vfio_noiommu_group_node(tree: FakeTree) -> None:
    pf = e810(tree, dev_nodes=False)
    tree.chardev("/dev/vfio/vfio", 10, 196)
    tree.chardev("/dev/vfio/noiommu-102", 243, 0)
    device = by_id(discover(tree))[pf.vf_addresses[2]]
    assert device.healthy
    assert device.device_nodes[1].host_path == "/dev/vfio/noiommu-102"


def test_uio_vf_carries_its_uio_node(tree: FakeTree) -> None:
    pf = e810(tree, vfio=())
    tree.bind_driver(pf.vf_paths[0], "igb_uio")
    tree.attr(f"{pf.vf_paths[0]}/uio/uio3/name", "uio_pci_generic")
    tree.chardev("/dev/uio3", 240, 3)
    device = by_id(discover(tree))[pf.vf_addresses[0]]
    assert device.attributes["vf_mode"] == "uio"
    assert [n.host_path for n in device.device_nodes] == ["/dev/uio3"]
    tree.remove("/dev/uio3")
    device = by_id(discover(tree))[pf.vf_addresses[0]]
    assert device.health is Health.UNHEALTHY
    assert "/dev/uio3" in device.health_reason


def test_merged_allocation_joins_addresses_and_shares_the_container_node(tree: FakeTree) -> None:
    e810(tree)
    devices = by_id(discover(tree))
    out = merge([devices["0000:3b:01.2"], devices["0000:3b:01.0"], devices["0000:3b:01.3"]])
    assert [n.host_path for n in out.device_nodes] == [
        "/dev/vfio/vfio",
        "/dev/vfio/102",
        "/dev/vfio/103",
    ]
    assert out.envs == {ENV: "0000:3b:01.2,0000:3b:01.0,0000:3b:01.3"}


# -- health ------------------------------------------------------------------------------------
def test_missing_group_node_is_unhealthy_and_recovers(tree: FakeTree) -> None:
    e810(tree)
    tree.remove("/dev/vfio/103")
    devices = by_id(discover(tree))
    broken = devices["0000:3b:01.3"]
    assert broken.health is Health.UNHEALTHY
    assert "/dev/vfio/103" in broken.health_reason
    assert devices["0000:3b:01.2"].healthy
    tree.chardev("/dev/vfio/103", 243, 3)
    assert by_id(discover(tree))["0000:3b:01.3"].healthy


def test_missing_vfio_container_node_fails_every_vfio_vf(tree: FakeTree) -> None:
    e810(tree)
    tree.remove("/dev/vfio/vfio")
    devices = by_id(discover(tree))
    for address in ("0000:3b:01.2", "0000:3b:01.3"):
        assert devices[address].health is Health.UNHEALTHY
        assert "/dev/vfio/vfio" in devices[address].health_reason
    assert devices["0000:3b:01.0"].healthy


def test_vfio_vf_without_iommu_group_is_unhealthy(tree: FakeTree, caplog) -> None:
    pf = e810(tree, vf_iommu_group=None, dev_nodes=False)
    caplog.set_level(logging.WARNING)
    devices = by_id(discover(tree))
    vfio_vf = devices[pf.vf_addresses[2]]
    assert vfio_vf.health is Health.UNHEALTHY
    assert "iommu_group" in vfio_vf.health_reason
    assert pf.vf_addresses[2] in caplog.text
    netdev_vf = devices[pf.vf_addresses[0]]
    assert netdev_vf.healthy
    assert "iommu_group" not in netdev_vf.attributes


def test_unbound_vf_is_unhealthy(tree: FakeTree) -> None:
    pf = e810(tree, vfio=(), unbound=(1,))
    device = by_id(discover(tree))[pf.vf_addresses[1]]
    assert device.health is Health.UNHEALTHY
    assert "not bound" in device.health_reason
    assert device.attributes["vf_mode"] == "unbound"
    assert "kernel_driver" not in device.attributes


def test_pf_link_down_makes_its_vfs_unhealthy_until_it_comes_up(tree: FakeTree) -> None:
    pf = e810(tree, operstate="down", carrier=None)
    devices = discover(tree)
    assert devices and not any(d.healthy for d in devices)
    assert all("link of PF ens1f0 is down" in d.health_reason for d in devices)
    assert devices[0].attributes["pf_operstate"] == "down"
    assert "pf_carrier" not in devices[0].attributes
    tree.attr(f"{pf.path}/net/ens1f0/operstate", "up")
    assert all(d.healthy for d in discover(tree))


def test_pf_link_down_is_one_warning_per_pf_not_one_per_vf_or_per_scan(tree, caplog) -> None:
    """A PF with 64 VFs whose link is down logs one line, not 64 identical lines per
    scan. One line names the PF and how many VFs it takes down; the next scan of the
    same driver says nothing new; once the link is back and down again, it is said again."""
    pf = e810(tree, operstate="down", carrier=None)
    driver = SriovDriver()
    resource = ResourceConfig(name=RESOURCE, driver="sriov", selectors={})

    def scan() -> List[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            driver.discover(HostFS(tree.root), [resource])
        return [r.getMessage() for r in caplog.records if "ens1f0" in r.getMessage()]

    first = scan()
    assert len(first) == 1, first
    assert "4 VF(s)" in first[0], first
    assert scan() == []
    tree.attr(f"{pf.path}/net/ens1f0/operstate", "up")
    assert scan() == []
    tree.attr(f"{pf.path}/net/ens1f0/operstate", "down")
    assert len(scan()) == 1


# -- selectors ---------------------------------------------------------------------------------
def build_two_pfs(tree: FakeTree):
    """The E810 above and a ConnectX PF on InfiniBand (ib0) with 4 mlx5_core VFs, NUMA 0."""
    first = e810(tree)
    second = sriov_pf(
        tree,
        "0000:86:00.0",
        vendor=0x15B3,
        device=0x101D,
        vf_device=0x101E,
        driver="mlx5_core",
        vf_driver="mlx5_core",
        numvfs=4,
        ifname="ib0",
        vf_ifname="ib0v{index}",
        link_type=ARPHRD_INFINIBAND,
        vf_offset=2,
        vf_iommu_group=200,
        numa_node=0,
    )
    return first, second


@pytest.fixture(scope="module")
def two_pfs(tmp_path_factory):
    """Built once for the read-only selector tests: fake trees cost file-system time."""
    tree = FakeTree(tmp_path_factory.mktemp("two_pfs"))
    tree.numa_nodes(2)
    return (tree, *build_two_pfs(tree))


def ids(tree: FakeTree, selectors: Mapping[str, object]) -> List[str]:
    return [d.id for d in discover(tree, selectors)]


def test_select_by_pf_name_and_ranges(two_pfs) -> None:
    tree, first, second = two_pfs
    assert ids(tree, {"pf_name": "ens1f0"}) == first.vf_addresses
    assert ids(tree, {"pf_name": "ens1f0#1-2"}) == first.vf_addresses[1:3]
    assert ids(tree, {"pf_name": "ens1f0#0,3"}) == [first.vf_addresses[0], first.vf_addresses[3]]
    assert ids(tree, {"pf_name": ["ens1f0#3", "ib0#0"]}) == [
        first.vf_addresses[3],
        second.vf_addresses[0],
    ]
    assert ids(tree, {"pf_name": "ens9f9"}) == []


def test_select_by_vf_index(two_pfs) -> None:
    tree, first, second = two_pfs
    assert ids(tree, {"vf_index": 2}) == [first.vf_addresses[2], second.vf_addresses[2]]
    assert ids(tree, {"vf_index": "0-1", "pf_name": "ib0"}) == second.vf_addresses[:2]
    assert ids(tree, {"vf_index": [0, "3"], "pf_name": "ens1f0"}) == [
        first.vf_addresses[0],
        first.vf_addresses[3],
    ]
    # pf_name's range and vf_index both apply.
    assert ids(tree, {"pf_name": "ens1f0#0-1", "vf_index": "1-3"}) == [first.vf_addresses[1]]


def test_select_by_pf_pci_address(two_pfs) -> None:
    tree, first, second = two_pfs
    assert ids(tree, {"pf_pci_address": "0000:86:00.0"}) == second.vf_addresses
    assert ids(tree, {"pf_pci_address": "3b:00.0#2-3"}) == first.vf_addresses[2:]


def test_select_by_pci_facts(two_pfs) -> None:
    tree, first, second = two_pfs
    assert ids(tree, {"vendor": "0x15b3"}) == second.vf_addresses
    assert ids(tree, {"vendor": "8086", "device": "0x1889"}) == first.vf_addresses
    assert ids(tree, {"device": 0x101E}) == second.vf_addresses
    assert ids(tree, {"kernel_driver": "vfio-pci"}) == first.vf_addresses[2:]
    assert ids(tree, {"kernel_driver": ["iavf", "mlx5_core"]}) == (
        first.vf_addresses[:2] + second.vf_addresses
    )
    assert ids(tree, {"pci_address": ["0000:3b:01.1", "86:00.3"]}) == [
        first.vf_addresses[1],
        second.vf_addresses[1],
    ]


def test_select_by_link_type(two_pfs) -> None:
    tree, first, second = two_pfs
    assert ids(tree, {"link_type": "infiniband"}) == second.vf_addresses
    assert ids(tree, {"link_type": "Ether"}) == first.vf_addresses


def test_select_by_rdma(tree: FakeTree) -> None:
    _, second = build_two_pfs(tree)
    rdma_device(tree, second.vf_paths[0], "mlx5_2", uverbs=2, umad=None)
    assert ids(tree, {"rdma": True}) == [second.vf_addresses[0]]
    assert second.vf_addresses[0] not in ids(tree, {"rdma": False})
    assert len(ids(tree, {"rdma": False})) == 7


@pytest.mark.parametrize(
    ("selectors", "key"),
    [
        ({"pf_name": "ens1f0#a-b"}, "pf_name"),
        ({"pf_name": "ens1f0#3-1"}, "pf_name"),
        ({"pf_name": "ens1f0#"}, "pf_name"),
        ({"pf_name": "#0-3"}, "pf_name"),
        ({"pf_name": "ens1f0#0#1"}, "pf_name"),
        ({"pf_pci_address": "0000:3b:00.0#1-"}, "pf_pci_address"),
        ({"vf_index": "two"}, "vf_index"),
        ({"vf_index": -1}, "vf_index"),
        ({"vf_index": True}, "vf_index"),
        ({"link_type": "wifi"}, "link_type"),
        ({"vendor": "zz"}, "vendor"),
        ({"rdma": "yes"}, "rdma"),
        ({"numa": 0}, "numa"),
    ],
)
def test_bad_selectors_name_their_key(selectors: Mapping[str, object], key: str) -> None:
    with pytest.raises(SelectorError) as error:
        SriovDriver().check_selectors(selectors)
    assert error.value.key == key


def test_range_parsing() -> None:
    ranges = parse_ranges("0-3, 6")
    assert [i for i in range(8) if i in ranges] == [0, 1, 2, 3, 6]
    assert parse_pf("ens1f0").ranges is None
    assert parse_pf("ens1f0#5").name == "ens1f0"
    assert 5 in parse_pf("ens1f0#5").ranges  # type: ignore[operator]


# -- NUMA --------------------------------------------------------------------------------------
def test_numa_from_the_vf(tree: FakeTree) -> None:
    e810(tree, numa_node=1)
    assert {d.numa_nodes for d in discover(tree)} == {(1,)}


def test_numa_minus_one_is_no_topology(tree: FakeTree) -> None:
    e810(tree, numa_node=-1)
    assert {d.numa_nodes for d in discover(tree)} == {()}


def test_vf_without_numa_uses_the_pf(tree: FakeTree) -> None:
    e810(tree, numa_node=1, vf_numa_node=None)
    assert {d.numa_nodes for d in discover(tree)} == {(1,)}


def test_numa_the_machine_lacks_is_no_topology(tree: FakeTree) -> None:
    e810(tree, numa_node=6)
    assert {d.numa_nodes for d in discover(tree)} == {()}


# -- odd values --------------------------------------------------------------------------------
def test_dangling_virtfn_link_skips_that_vf(tree: FakeTree, caplog) -> None:
    pf = e810(tree)
    tree.remove(pf.vf_paths[1])
    caplog.set_level(logging.WARNING)
    assert ids(tree, {}) == [pf.vf_addresses[0], *pf.vf_addresses[2:]]
    assert "virtfn1" in caplog.text
    assert "0000:3b:00.0" in caplog.text


def test_vf_whose_pf_does_not_list_it_is_skipped(tree: FakeTree, caplog) -> None:
    pf = e810(tree)
    tree.remove(pf.vf_link(3))
    caplog.set_level(logging.WARNING)
    assert ids(tree, {}) == pf.vf_addresses[:3]
    assert pf.vf_addresses[3] in caplog.text


def test_vf_whose_physfn_disagrees_is_skipped(tree: FakeTree) -> None:
    pf = e810(tree)
    other = sriov_pf(tree, "0000:86:00.0", numvfs=0, ifname="ens2f0")
    tree.link(f"{pf.vf_paths[0]}/physfn", other.path)
    assert ids(tree, {}) == pf.vf_addresses[1:]


def test_vfs_found_when_numvfs_is_unreadable_or_stale(tree: FakeTree) -> None:
    pf = e810(tree)
    tree.remove(f"{pf.path}/sriov_numvfs")
    tree.mkdir(f"{pf.path}/sriov_numvfs")  # reading a directory fails like an EIO attribute
    assert ids(tree, {}) == pf.vf_addresses
    tree.remove(f"{pf.path}/sriov_numvfs")
    tree.attr(f"{pf.path}/sriov_numvfs", "8")
    assert ids(tree, {}) == pf.vf_addresses


def test_pf_without_netdev_matches_no_pf_name(tree: FakeTree) -> None:
    pf = e810(tree, ifname=None)
    devices = discover(tree)
    assert [d.id for d in devices] == pf.vf_addresses
    assert "pf_name" not in devices[0].attributes
    assert "link_type" not in devices[0].attributes
    assert ids(tree, {"pf_name": "ens1f0"}) == []
    assert ids(tree, {"pf_pci_address": "0000:3b:00.0"}) == pf.vf_addresses


def test_unreadable_pf_type_falls_back_to_the_vf_netdev(tree: FakeTree) -> None:
    pf = e810(tree, vfio=())
    tree.remove(f"{pf.path}/net/ens1f0/type")
    devices = discover(tree)
    assert devices[0].attributes["link_type"] == "ether"


def test_switchdev_pf_name_is_the_uplink(tree: FakeTree) -> None:
    pf = e810(tree, ifname="ens1f0np0", vf_ifname=None)
    tree.attr(f"{pf.path}/net/ens1f0np0/phys_port_name", "p0")
    for index in range(2):
        rep = net_interface(tree, pf.path, f"eth{index}")
        tree.attr(f"{rep}/phys_port_name", f"pf0vf{index}")
    devices = discover(tree)
    assert {d.attributes["pf_name"] for d in devices} == {"ens1f0np0"}
    assert ids(tree, {"pf_name": "ens1f0np0#0"}) == [pf.vf_addresses[0]]


# -- RDMA VFs ----------------------------------------------------------------------------------
@pytest.fixture
def rdma_vfs(tree: FakeTree):
    pf = sriov_pf(
        tree,
        "0000:98:00.0",
        vendor=0x15B3,
        device=0x101D,
        vf_device=0x101E,
        driver="mlx5_core",
        vf_driver="mlx5_core",
        numvfs=2,
        ifname="ens2f0np0",
        vf_ifname="ens2f0v{index}",
        vf_offset=2,
        vf_iommu_group=200,
    )
    hcas = [
        rdma_device(
            tree,
            pf.vf_paths[i],
            f"mlx5_{2 + i}",
            link_layers=("Ethernet",),
            uverbs=2 + i,
            umad=2 + i,
        )
        for i in range(2)
    ]
    rdma_cm(tree)
    return pf, hcas


def test_rdma_vf_carries_its_char_devices(tree: FakeTree, rdma_vfs) -> None:
    pf, _ = rdma_vfs
    device = by_id(discover(tree))[pf.vf_addresses[1]]
    assert device.healthy
    assert [n.host_path for n in device.device_nodes] == [
        "/dev/infiniband/uverbs3",
        "/dev/infiniband/umad3",
        "/dev/infiniband/rdma_cm",
    ]
    assert device.attributes["rdma_device"] == "mlx5_3"
    assert device.env == {ENV: pf.vf_addresses[1]}


def test_rdma_vf_missing_verbs_node_is_unhealthy(tree: FakeTree, rdma_vfs) -> None:
    pf, hcas = rdma_vfs
    tree.remove(hcas[0].uverbs)
    devices = by_id(discover(tree))
    assert devices[pf.vf_addresses[0]].health is Health.UNHEALTHY
    assert "/dev/infiniband/uverbs2" in devices[pf.vf_addresses[0]].health_reason
    assert devices[pf.vf_addresses[1]].healthy


def test_rdma_vf_with_unreadable_ibdev_matches_by_parent(tree: FakeTree, rdma_vfs) -> None:
    pf, hcas = rdma_vfs
    tree.remove(f"{hcas[0].uverbs_class}/ibdev")
    tree.mkdir(f"{hcas[0].uverbs_class}/ibdev")
    device = by_id(discover(tree))[pf.vf_addresses[0]]
    assert "/dev/infiniband/uverbs2" in [n.host_path for n in device.device_nodes]
    assert "/dev/infiniband/uverbs3" not in [n.host_path for n in device.device_nodes]


def test_rdma_vf_without_verbs_is_netdev_only_unless_rdma_asked(tree: FakeTree, rdma_vfs) -> None:
    pf, hcas = rdma_vfs
    tree.remove(hcas[0].uverbs_class)
    tree.remove("/sys/class/infiniband_verbs/uverbs2")
    plain = by_id(discover(tree))[pf.vf_addresses[0]]
    assert plain.healthy
    assert "uverbs" not in " ".join(n.host_path for n in plain.device_nodes)
    asked = by_id(discover(tree, {"rdma": True}))[pf.vf_addresses[0]]
    assert asked.health is Health.UNHEALTHY
    assert "mlx5_2" in asked.health_reason


# -- packaging and the captured machine ------------------------------------------------------
def test_plugin_hook_and_no_default_resources() -> None:
    drivers = plugin.device_plugin_host_drivers()
    assert [d.name for d in drivers] == ["sriov"]
    assert drivers[0].subsystems == ("pci", "net")
    assert list(drivers[0].default_resources()) == []


def test_sriov_network_node(tmp_path) -> None:
    tree = load_machine("sriov-network-node", tmp_path)
    devices = discover(tree)
    assert len(devices) == 16
    assert all(d.healthy for d in devices), [d.health_reason for d in devices if not d.healthy]
    assert sum(1 for d in devices if d.numa_nodes == (0,)) == 8
    assert sum(1 for d in devices if d.numa_nodes == (1,)) == 8

    dpdk = discover(tree, {"pf_name": "ens1f0#4-7", "kernel_driver": "vfio-pci"})
    assert [d.id for d in dpdk] == [f"0000:31:01.{i}" for i in range(4, 8)]
    assert dpdk[0].device_nodes == (DeviceNode("/dev/vfio/vfio"), DeviceNode("/dev/vfio/184"))

    roce = discover(tree, {"vendor": "0x15b3", "rdma": True}, name="nvidia.com/cx6_roce")
    assert [d.id for d in roce] == [f"0000:98:00.{i}" for i in range(2, 6)]
    assert roce[0].env == {"PCIDEVICE_NVIDIA_COM_CX6_ROCE": "0000:98:00.2"}
    assert [n.host_path for n in roce[0].device_nodes] == [
        "/dev/infiniband/uverbs4",
        "/dev/infiniband/umad2",
        "/dev/infiniband/rdma_cm",
    ]
    assert roce[0].attributes["pf_name"] == "ens2f0np0"
    assert discover(tree, {"pf_name": "ens1f1"}) == []
