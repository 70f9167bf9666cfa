"""The RDMA driver against fake sysfs trees in the kernel's shapes (real files and links)."""

from __future__ import annotations

import logging
from typing import Dict, List, Mapping, Optional, Sequence

import pytest

from device_plugin_host_testing.machines import load_machine, machine_names
from drivers.rdma import plugin
from drivers.rdma.driver import MAX_SHARED_COUNT, RdmaDriver
from host.core.allocation import merge
from host.core.driver import SelectorError
from host.core.hostfs import HostFS
from host.core.model import Device, Health, ResourceConfig
from host.sim.fake_net import mellanox_hca, rdma_cm, rdma_device
from host.sim.tree import FakeTree

EXCLUSIVE = "rdma/hca"
SHARED = "rdma/hca_shared_devices_a"


@pytest.fixture
def tree(tmp_path) -> FakeTree:
    tree = FakeTree(tmp_path)
    tree.numa_nodes(2)
    return tree


def build_two_hcas(tree: FakeTree):
    """mlx5_0 (IB, NUMA 0, behind a bridge) and mlx5_1 (RoCE, NUMA 1), with rdma_cm."""
    bridge = tree.pci_bridge("0000:3a:00.0", numa_node=0)
    first = mellanox_hca(
        tree,
        "0000:3b:00.0",
        "mlx5_0",
        numa_node=0,
        parent=bridge,
        iommu_group=40,
        ifname="ibp59s0",
        uverbs=0,
        umad=0,
        node_guid="0c42:a103:005e:1a60",
    )
    second = mellanox_hca(
        tree,
        "0000:86:00.0",
        "mlx5_1",
        device=0x101D,
        numa_node=1,
        iommu_group=80,
        ifname="ens2f0np0",
        link_layers=("Ethernet",),
        uverbs=1,
        umad=1,
        node_guid="1070:fd03:00c1:8a00",
    )
    rdma_cm(tree)
    return first, second


@pytest.fixture
def two_hcas(tree: FakeTree):
    return build_two_hcas(tree)


@pytest.fixture(scope="module")
def ro_tree(tmp_path_factory) -> FakeTree:
    """The same two HCAs built once for tests that only read: fake trees cost file-system time."""
    tree = FakeTree(tmp_path_factory.mktemp("two_hcas"))
    tree.numa_nodes(2)
    build_two_hcas(tree)
    return tree


def discover(
    tree: FakeTree,
    selectors: Optional[Mapping[str, object]] = None,
    settings: Optional[Mapping[str, object]] = None,
    name: str = EXCLUSIVE,
) -> List[Device]:
    driver = RdmaDriver()
    selectors = dict(selectors or {})
    settings = dict(settings or {})
    driver.check_selectors(selectors)
    driver.check_settings(settings)
    resource = ResourceConfig(name=name, driver="rdma", selectors=selectors, settings=settings)
    return list(driver.discover(HostFS(tree.root), [resource])[name])


def shared(tree: FakeTree, count: int = 3, **selectors: object) -> List[Device]:
    return discover(tree, selectors, {"mode": "shared", "shared_count": count}, SHARED)


def by_id(devices: Sequence[Device]) -> Dict[str, Device]:
    return {device.id: device for device in devices}


def paths(device: Device) -> List[str]:
    return [node.host_path for node in device.device_nodes]


# -- exclusive discovery -----------------------------------------------------------------------
def test_exclusive_ids_are_pci_addresses(ro_tree: FakeTree) -> None:
    tree = ro_tree
    devices = discover(tree)
    assert [d.id for d in devices] == ["0000:3b:00.0", "0000:86:00.0"]
    assert all(d.healthy for d in devices)


def test_exclusive_device_carries_its_nodes_and_rdma_cm(ro_tree: FakeTree) -> None:
    tree = ro_tree
    device = by_id(discover(tree))["0000:86:00.0"]
    assert paths(device) == [
        "/dev/infiniband/uverbs1",
        "/dev/infiniband/umad1",
        "/dev/infiniband/rdma_cm",
    ]
    assert all(node.permissions == "rw" for node in device.device_nodes)
    assert all(node.container_path == node.host_path for node in device.device_nodes)
    assert device.env == {}


def test_exclusive_attributes(ro_tree: FakeTree) -> None:
    tree = ro_tree
    devices = by_id(discover(tree))
    first = devices["0000:3b:00.0"].attributes
    assert first["ib_device"] == "mlx5_0"
    assert first["link_layer"] == "InfiniBand"
    assert first["netdev"] == "ibp59s0"
    assert first["node_guid"] == "0c42:a103:005e:1a60"
    assert first["port_state"] == "1:ACTIVE"
    assert first["uverbs"] == "uverbs0"
    assert first["vendor"] == "0x15b3"
    assert first["device"] == "0x1021"
    assert first["kernel_driver"] == "mlx5_core"
    assert first["iommu_group"] == "40"
    assert devices["0000:86:00.0"].attributes["link_layer"] == "Ethernet"


def test_merged_allocation_has_rdma_cm_once(ro_tree: FakeTree) -> None:
    tree = ro_tree
    out = merge(discover(tree))
    assert [n.host_path for n in out.device_nodes] == [
        "/dev/infiniband/uverbs0",
        "/dev/infiniband/umad0",
        "/dev/infiniband/rdma_cm",
        "/dev/infiniband/uverbs1",
        "/dev/infiniband/umad1",
    ]


def test_issm_is_never_handed_out(ro_tree: FakeTree) -> None:
    tree = ro_tree
    for device in discover(tree) + shared(tree):
        assert not any("issm" in path for path in paths(device))


def test_without_rdma_cm_the_rest_is_served(tree: FakeTree, two_hcas) -> None:
    tree.remove("/dev/infiniband/rdma_cm")
    devices = discover(tree)
    assert all(d.healthy for d in devices)
    assert not any("/dev/infiniband/rdma_cm" in paths(d) for d in devices)


def test_hca_without_umad_is_healthy(tree: FakeTree) -> None:
    mellanox_hca(tree, "0000:3b:00.0", "mlx5_0", uverbs=0, umad=None)
    device = discover(tree)[0]
    assert device.healthy
    assert paths(device) == ["/dev/infiniband/uverbs0"]


# -- selectors ---------------------------------------------------------------------------------
def ids(tree: FakeTree, selectors: Mapping[str, object]) -> List[str]:
    return [d.id for d in discover(tree, selectors)]


def test_selectors(ro_tree: FakeTree) -> None:
    tree = ro_tree
    both = ["0000:3b:00.0", "0000:86:00.0"]
    assert ids(tree, {"vendor": "0x15b3"}) == both
    assert ids(tree, {"vendor": "0x8086"}) == []
    assert ids(tree, {"device": "101d"}) == ["0000:86:00.0"]
    assert ids(tree, {"kernel_driver": "mlx5_core"}) == both
    assert ids(tree, {"pci_address": "3b:00.0"}) == ["0000:3b:00.0"]
    assert ids(tree, {"ib_device": ["mlx5_1"]}) == ["0000:86:00.0"]
    assert ids(tree, {"link_layer": "infiniband"}) == ["0000:3b:00.0"]
    assert ids(tree, {"link_layer": "Ethernet"}) == ["0000:86:00.0"]
    assert ids(tree, {"netdev": "ens2f0np0"}) == ["0000:86:00.0"]
    assert ids(tree, {"netdev": "eth9"}) == []
    assert ids(tree, {"ib_device": "mlx5_0", "link_layer": "ethernet"}) == []


def test_dual_port_hca_matches_either_link_layer(tree: FakeTree) -> None:
    mellanox_hca(tree, "0000:3b:00.0", "mlx4_0", link_layers=("InfiniBand", "Ethernet"), umad=0)
    assert ids(tree, {"link_layer": "Ethernet"}) == ["0000:3b:00.0"]
    device = discover(tree)[0]
    assert device.attributes["link_layer"] == "InfiniBand,Ethernet"
    assert paths(device) == [
        "/dev/infiniband/uverbs0",
        "/dev/infiniband/umad0",
        "/dev/infiniband/umad1",
    ]


@pytest.mark.parametrize(
    ("selectors", "key"),
    [
        ({"link_layer": "roce"}, "link_layer"),
        ({"vendor": "0x1ffff"}, "vendor"),
        ({"ib_device": 3}, "ib_device"),
        ({"hca": "mlx5_0"}, "hca"),
    ],
)
def test_bad_selectors_name_their_key(selectors: Mapping[str, object], key: str) -> None:
    with pytest.raises(SelectorError) as error:
        RdmaDriver().check_selectors(selectors)
    assert error.value.key == key


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({"mode": "pooled"}, "mode"),
        ({"mode": "shared"}, "shared_count"),
        ({"mode": "shared", "shared_count": 0}, "shared_count"),
        ({"mode": "shared", "shared_count": MAX_SHARED_COUNT + 1}, "shared_count"),
        ({"mode": "shared", "shared_count": True}, "shared_count"),
        ({"mode": "shared", "shared_count": "10"}, "shared_count"),
        ({"shared_count": 4}, "shared_count"),
        ({"rdmaHcaMax": 4}, "rdmaHcaMax"),
    ],
)
def test_bad_settings_name_their_key(settings: Mapping[str, object], key: str) -> None:
    with pytest.raises(SelectorError) as error:
        RdmaDriver().check_settings(settings)
    assert error.value.key == key


def test_good_settings_pass() -> None:
    driver = RdmaDriver()
    driver.check_settings({})
    driver.check_settings({"mode": "exclusive"})
    driver.check_settings({"mode": "shared", "shared_count": MAX_SHARED_COUNT})


# -- shared mode -------------------------------------------------------------------------------
def test_shared_ids_carry_every_selected_hca(ro_tree: FakeTree) -> None:
    tree = ro_tree
    devices = shared(tree, count=3)
    assert [d.id for d in devices] == [f"hca_shared_devices_a-{i}" for i in range(3)]
    for device in devices:
        assert device.healthy
        assert paths(device) == [
            "/dev/infiniband/uverbs0",
            "/dev/infiniband/umad0",
            "/dev/infiniband/uverbs1",
            "/dev/infiniband/umad1",
            "/dev/infiniband/rdma_cm",
        ]
        assert device.numa_nodes == (0, 1)
        assert device.attributes["ib_devices"] == "mlx5_0,mlx5_1"
        assert device.attributes["pci_addresses"] == "0000:3b:00.0,0000:86:00.0"


def test_shared_selectors_narrow_the_set(ro_tree: FakeTree) -> None:
    tree = ro_tree
    devices = shared(tree, count=2, link_layer="Ethernet")
    assert len(devices) == 2
    assert paths(devices[0]) == [
        "/dev/infiniband/uverbs1",
        "/dev/infiniband/umad1",
        "/dev/infiniband/rdma_cm",
    ]
    assert devices[0].numa_nodes == (1,)


def test_shared_with_no_hca_offers_nothing(ro_tree: FakeTree) -> None:
    tree = ro_tree
    assert shared(tree, ib_device="mlx5_9") == []


def test_shared_leaves_a_broken_hca_out(tree: FakeTree, two_hcas, caplog) -> None:
    first, _ = two_hcas
    tree.remove(first.uverbs)
    caplog.set_level(logging.WARNING)
    devices = shared(tree, count=2)
    assert all(d.healthy for d in devices)
    assert "/dev/infiniband/uverbs0" not in paths(devices[0])
    assert "/dev/infiniband/uverbs1" in paths(devices[0])
    assert devices[0].numa_nodes == (1,)
    assert "mlx5_0" in caplog.text


def test_shared_all_broken_is_unhealthy(tree: FakeTree, two_hcas) -> None:
    first, second = two_hcas
    tree.remove(first.uverbs)
    tree.remove(second.uverbs)
    devices = shared(tree, count=2)
    assert len(devices) == 2
    for device in devices:
        assert device.health is Health.UNHEALTHY
        assert "/dev/infiniband/uverbs0" in device.health_reason
        assert "/dev/infiniband/uverbs1" in device.health_reason
        assert device.device_nodes == ()


def test_two_resources_one_scan(ro_tree: FakeTree) -> None:
    tree = ro_tree
    driver = RdmaDriver()
    resources = [
        ResourceConfig(EXCLUSIVE, "rdma", selectors={"link_layer": "InfiniBand"}),
        ResourceConfig(SHARED, "rdma", settings={"mode": "shared", "shared_count": 5}),
    ]
    out = driver.discover(HostFS(tree.root), resources)
    assert [d.id for d in out[EXCLUSIVE]] == ["0000:3b:00.0"]
    assert len(out[SHARED]) == 5


# -- health ------------------------------------------------------------------------------------
def test_missing_verbs_node_is_unhealthy_and_recovers(tree: FakeTree, two_hcas) -> None:
    first, _ = two_hcas
    tree.remove(first.uverbs)
    devices = by_id(discover(tree))
    broken = devices["0000:3b:00.0"]
    assert broken.health is Health.UNHEALTHY
    assert "/dev/infiniband/uverbs0" in broken.health_reason
    assert "/dev/infiniband/uverbs0" not in paths(broken)
    assert devices["0000:86:00.0"].healthy
    tree.chardev("/dev/infiniband/uverbs0", 231, 192)
    assert by_id(discover(tree))["0000:3b:00.0"].healthy


def test_no_uverbs_entry_is_unhealthy(tree: FakeTree) -> None:
    mellanox_hca(tree, "0000:3b:00.0", "mlx5_0", uverbs=None)
    device = discover(tree)[0]
    assert device.health is Health.UNHEALTHY
    assert "ib_uverbs" in device.health_reason
    assert "mlx5_0" in device.health_reason


def test_missing_umad_node_is_left_out(tree: FakeTree, two_hcas, caplog) -> None:
    first, _ = two_hcas
    tree.remove(first.umad[0])
    caplog.set_level(logging.WARNING)
    device = by_id(discover(tree))["0000:3b:00.0"]
    assert device.healthy
    assert "/dev/infiniband/umad0" not in paths(device)
    assert "mlx5_0" in caplog.text


def test_port_down_is_unhealthy_and_recovers(tree: FakeTree) -> None:
    hca = mellanox_hca(tree, "0000:3b:00.0", "mlx5_0")
    tree.attr(f"{hca.path}/ports/1/state", "1: DOWN")
    device = discover(tree)[0]
    assert not device.healthy
    assert device.health_reason == "no port of mlx5_0 is ACTIVE (port 1 DOWN)"
    assert device.attributes["port_state"] == "1:DOWN"
    tree.attr(f"{hca.path}/ports/1/state", "4: ACTIVE")
    assert discover(tree)[0].healthy


# -- NUMA --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("numa", "expected"), [(1, (1,)), (-1, ()), (None, ()), (7, ())])
def test_numa(tree: FakeTree, numa: Optional[int], expected: tuple) -> None:
    mellanox_hca(tree, "0000:3b:00.0", "mlx5_0", numa_node=numa)
    assert discover(tree)[0].numa_nodes == expected


def test_shared_numa_ignores_unknown(tree: FakeTree) -> None:
    mellanox_hca(tree, "0000:3b:00.0", "mlx5_0", numa_node=-1, uverbs=0, umad=0)
    mellanox_hca(tree, "0000:86:00.0", "mlx5_1", numa_node=1, uverbs=1, umad=1)
    assert shared(tree)[0].numa_nodes == (1,)


# -- odd values --------------------------------------------------------------------------------
def test_unreadable_ibdev_matches_by_parent(tree: FakeTree, two_hcas, caplog) -> None:
    first, _ = two_hcas
    tree.remove(f"{first.uverbs_class}/ibdev")
    tree.mkdir(f"{first.uverbs_class}/ibdev")  # a read that fails, as EIO would
    caplog.set_level(logging.WARNING)
    devices = by_id(discover(tree))
    assert devices["0000:3b:00.0"].healthy
    assert "/dev/infiniband/uverbs0" in paths(devices["0000:3b:00.0"])
    assert "/dev/infiniband/uverbs0" not in paths(devices["0000:86:00.0"])
    assert "uverbs0" in caplog.text


def test_unreadable_ibdev_on_a_shared_parent_stays_unmatched(tree: FakeTree) -> None:
    path = tree.pci_function(
        "0000:3b:00.0", vendor=0x15B3, device=0x1021, pci_class=0x020700, driver="mlx5_core"
    )
    rdma_device(tree, path, "mlx5_0", uverbs=0)
    second = rdma_device(tree, path, "mlx5_9", uverbs=1)
    tree.remove(f"{second.uverbs_class}/ibdev")
    devices = by_id(discover(tree))
    # Two RDMA devices on one function: ids fall back to the names, and the verbs node
    # whose owner is unknown is given to neither.
    assert set(devices) == {"0000:3b:00.0-mlx5_0", "0000:3b:00.0-mlx5_9"}
    assert devices["0000:3b:00.0-mlx5_0"].healthy
    assert devices["0000:3b:00.0-mlx5_9"].health is Health.UNHEALTHY
    assert "/dev/infiniband/uverbs1" not in paths(devices["0000:3b:00.0-mlx5_0"])


def test_dangling_class_links_are_skipped(tree: FakeTree, two_hcas, caplog) -> None:
    tree.link("/sys/class/infiniband/mlx5_7", "/sys/devices/pci0000:00/0000:00:09.0/infiniband/x")
    tree.link("/sys/class/infiniband_verbs/uverbs7", "/sys/devices/pci0000:00/gone/uverbs7")
    caplog.set_level(logging.WARNING)
    assert [d.id for d in discover(tree)] == ["0000:3b:00.0", "0000:86:00.0"]
    assert "mlx5_7" in caplog.text
    assert "uverbs7" in caplog.text


def test_software_rdma_is_skipped(tree: FakeTree, two_hcas) -> None:
    rxe = tree.mkdir("/sys/devices/virtual/infiniband/rxe0")
    tree.attr(f"{rxe}/node_type", "1: CA")
    tree.attr(f"{rxe}/parent", "eth0")
    tree.link("/sys/class/infiniband/rxe0", rxe)
    assert [d.id for d in discover(tree)] == ["0000:3b:00.0", "0000:86:00.0"]


def test_missing_port_files_degrade(tree: FakeTree) -> None:
    hca = mellanox_hca(tree, "0000:3b:00.0", "mlx5_0")
    tree.remove(f"{hca.path}/ports/1/link_layer")
    tree.remove(f"{hca.path}/node_guid")
    device = discover(tree)[0]
    assert device.healthy
    assert "link_layer" not in device.attributes
    assert "node_guid" not in device.attributes
    assert ids(tree, {"link_layer": "InfiniBand"}) == []


def test_sub_function_gets_its_own_id(tree: FakeTree) -> None:
    hca = mellanox_hca(tree, "0000:3b:00.0", "mlx5_0", link_layers=("Ethernet",))
    sf = tree.mkdir(f"{hca.parent}/mlx5_core.sf.2")
    rdma_device(tree, sf, "mlx5_2", link_layers=("Ethernet",), uverbs=2)
    devices = by_id(discover(tree))
    assert set(devices) == {"0000:3b:00.0", "0000:3b:00.0-mlx5_core.sf.2"}
    sf_device = devices["0000:3b:00.0-mlx5_core.sf.2"]
    assert paths(sf_device) == ["/dev/infiniband/uverbs2"]
    assert sf_device.attributes["pci_address"] == "0000:3b:00.0"
    assert ids(tree, {"ib_device": "mlx5_2"}) == ["0000:3b:00.0-mlx5_core.sf.2"]


def test_devname_from_uevent_is_used(tree: FakeTree) -> None:
    hca = mellanox_hca(tree, "0000:3b:00.0", "mlx5_0")
    tree.attr(f"{hca.uverbs_class}/uevent", "MAJOR=231\nMINOR=192\nDEVNAME=infiniband/verbs-a")
    tree.chardev("/dev/infiniband/verbs-a", 231, 192)
    tree.attr(f"{hca.umad_class[0]}/uevent", "DEVNAME=../../etc/passwd")
    device = discover(tree)[0]
    assert paths(device) == ["/dev/infiniband/verbs-a", "/dev/infiniband/umad0"]


# -- packaging and captured machines ---------------------------------------------------------
def test_plugin_hook_and_no_default_resources() -> None:
    drivers = plugin.device_plugin_host_drivers()
    assert [d.name for d in drivers] == ["rdma"]
    assert drivers[0].subsystems == ("infiniband", "pci", "net")
    assert list(drivers[0].default_resources()) == []


def test_sriov_network_node(tmp_path) -> None:
    tree = load_machine("sriov-network-node", tmp_path)
    devices = by_id(discover(tree))
    assert len(devices) == 8
    irdma = devices["0000:31:00.1"]  # its only port is DOWN: no RDMA traffic can pass
    assert [d.id for d in devices.values() if not d.healthy] == ["0000:31:00.1"]
    assert "no port of irdma1 is ACTIVE" in irdma.health_reason
    assert irdma.attributes["ib_device"] == "irdma1"
    assert irdma.attributes["port_state"] == "1:DOWN"
    assert paths(irdma) == ["/dev/infiniband/uverbs1", "/dev/infiniband/rdma_cm"]
    mellanox_pfs = discover(tree, {"vendor": "0x15b3", "device": "0x101d"})
    assert [d.id for d in mellanox_pfs] == ["0000:98:00.0", "0000:98:00.1"]
    assert [d.numa_nodes for d in mellanox_pfs] == [(1,), (1,)]
    assert paths(mellanox_pfs[0]) == [
        "/dev/infiniband/uverbs2",
        "/dev/infiniband/umad0",
        "/dev/infiniband/rdma_cm",
    ]
    pooled = shared(tree, count=4, vendor="0x15b3", device="0x101d")
    assert len(pooled) == 4
    assert pooled[0].numa_nodes == (1,)


@pytest.mark.skipif(
    "gpu-server-8x" not in machine_names(), reason="gpu-server-8x.tree not written yet"
)
def test_gpu_server_8x(tmp_path) -> None:
    tree = load_machine("gpu-server-8x", tmp_path)
    devices = discover(tree, {"vendor": "0x15b3", "device": "0x1021"})
    assert len(devices) == 8, [d.attributes.get("ib_device") for d in devices]
    assert all(d.healthy for d in devices), [d.health_reason for d in devices]
    assert sum(1 for d in devices if d.numa_nodes == (0,)) == 4
    assert sum(1 for d in devices if d.numa_nodes == (1,)) == 4
    pooled = shared(tree, count=2, vendor="0x15b3", device="0x1021")
    assert pooled[0].numa_nodes == (0, 1)
    assert sum(1 for p in paths(pooled[0]) if "uverbs" in p) == 8
