"""The neuron driver on fake trees in the aws-neuron-driver's shape
(testkit/device_plugin_host_testing/fake_neuron)."""

from __future__ import annotations

from typing import Dict

import pytest

from device_plugin_host_testing import fake_neuron as fn
from drivers.neuron.driver import NeuronDriver
from host.core.driver import SelectorError
from host.core.hostfs import HostFS
from host.core.model import Device, Health, ResourceConfig
from host.sim.tree import FakeTree

NEURON = ResourceConfig("aws.amazon.com/neuron", "neuron", {})
CORES = ResourceConfig("aws.amazon.com/neuroncore", "neuron", {}, settings={"unit": "core"})


@pytest.fixture
def tree(tmp_path) -> FakeTree:
    return FakeTree(tmp_path / "root")


def devices(tree: FakeTree, resource: ResourceConfig = NEURON) -> Dict[str, Device]:
    found = NeuronDriver().discover(HostFS(tree.root), [resource])
    return {d.id: d for d in found[resource.name]}


def test_a_trainium_node_serves_the_drivers_numbering_and_claims_no_numa(tree):
    by_index = fn.trn1_node(tree)
    found = devices(tree)
    assert list(found) == [f"neuron{i}" for i in range(16)]
    for index in range(16):
        device = found[f"neuron{index}"]
        assert device.health is Health.HEALTHY, device.health_reason
        assert [n.host_path for n in device.device_nodes] == [f"/dev/neuron{index}"]
        assert device.env == {"AWS_NEURON_VISIBLE_DEVICES": str(index)}
        # Two sockets, and nothing in sysfs ties neuronN to a function: no topology, and no
        # PCI address guessed from position either.
        assert device.numa_nodes == ()
        assert "pci_address" not in device.attributes
        assert device.attributes["numa_source"].startswith("unknown: neuron PCI functions span")
    # The fixture's PCI order is not the index order, so a positional guess would be wrong.
    assert sorted(by_index.values()) != [by_index[i] for i in range(16)]
    assert found["neuron5"].attributes["connected_devices"] == "1, 4, 6, 9"


def test_one_device_on_one_numa_node_is_proven(tree):
    fn.inf2_xlarge(tree)
    device = devices(tree)["neuron0"]
    assert device.numa_nodes == (0,)
    assert device.attributes["numa_source"] == "every neuron PCI function is on this node"
    assert device.attributes["device_name"] == "Inferentia2"


def test_an_inf2_xlarge_bound_the_way_the_real_driver_binds_it_is_on_node_0(tree):
    """aws-neuron-driver's PCI driver is ``neuron-driver`` (module ``neuron``): the tree as an
    inf2.xlarge shows it, built here by hand, not through the fixture's defaults."""
    tree.numa_nodes(1, cpus_per_node=4)
    tree.pci_function("0000:00:1f.0", vendor=fn.AMAZON, device=fn.INF2,
                      pci_class=fn.NEURON_CLASS, numa_node=0, driver="neuron-driver")
    tree.link("/sys/bus/pci/drivers/neuron-driver/module", "/sys/module/neuron")
    fn.add_neuron_device(tree, 0, device_name="Inferentia2", instance_type="inf2.xlarge")
    device = devices(tree)["neuron0"]
    assert device.numa_nodes == (0,)
    assert device.attributes["numa_source"] == "every neuron PCI function is on this node"


def test_a_function_counts_by_its_drivers_module_and_vfio_functions_do_not(tree):
    tree.numa_nodes(2)
    tree.pci_function("0000:00:1f.0", vendor=fn.AMAZON, device=fn.INF2,
                      pci_class=fn.NEURON_CLASS, numa_node=1, driver="neuron_pci")
    tree.link("/sys/bus/pci/drivers/neuron_pci/module", "/sys/module/neuron")
    fn.add_neuron_device(tree, 0)
    assert devices(tree)["neuron0"].numa_nodes == (1,)
    # A second Inferentia handed to a VM (vfio-pci) is not the host driver's: the one
    # function still proves the one device's node.
    tree.pci_function("0000:00:1e.0", vendor=fn.AMAZON, device=fn.INF2,
                      pci_class=fn.NEURON_CLASS, numa_node=0, driver="vfio-pci")
    tree.link("/sys/bus/pci/drivers/vfio-pci/module", "/sys/module/vfio_pci")
    assert devices(tree)["neuron0"].numa_nodes == (1,)


def test_all_functions_on_one_socket_prove_the_node_but_a_count_mismatch_does_not(tree):
    tree.numa_nodes(2)
    fn.add_neuron_function(tree, "0000:10:1e.0", numa_node=1)
    fn.add_neuron_function(tree, "0000:20:1e.0", numa_node=1)
    fn.add_neuron_device(tree, 1)
    fn.add_neuron_device(tree, 0)
    assert {d.numa_nodes for d in devices(tree).values()} == {(1,)}
    fn.add_neuron_function(tree, "0000:30:1e.0", numa_node=1)  # a third, with no device yet
    found = devices(tree)
    assert {d.numa_nodes for d in found.values()} == {()}
    assert "3 neuron PCI functions for 2 devices" in found["neuron0"].attributes["numa_source"]


def test_numa_minus_one_on_the_functions_is_no_topology(tree):
    tree.numa_nodes(1)
    fn.add_neuron_function(tree, "0000:00:1f.0", numa_node=-1)
    fn.add_neuron_device(tree, 0)
    assert devices(tree)["neuron0"].numa_nodes == ()


def test_a_class_device_linked_to_its_function_takes_that_functions_numa(tree):
    tree.numa_nodes(2)
    first = fn.add_neuron_function(tree, "0000:10:1e.0", numa_node=0)
    fn.add_neuron_function(tree, "0000:90:1e.0", numa_node=1)
    path = fn.add_neuron_device(tree, 0)
    fn.add_neuron_device(tree, 1)
    tree.link(f"{path}/device", first)
    found = devices(tree)
    assert found["neuron0"].numa_nodes == (0,)
    assert found["neuron0"].attributes["pci_address"] == "0000:10:1e.0"
    assert found["neuron1"].numa_nodes == ()


@pytest.mark.parametrize(("state", "reason"), [("0", "in reset"), ("2", "invalid (reset failed)")])
def test_the_drivers_device_state_decides_health(tree, state, reason):
    fn.inf2_xlarge(tree)
    tree.attr("/sys/devices/virtual/neuron_device/neuron0/reset", state)
    device = devices(tree)["neuron0"]
    assert device.health is Health.UNHEALTHY
    assert device.health_reason == f"neuron driver reports device state {state} ({reason})"


def test_a_missing_node_is_unhealthy_and_an_unreadable_state_claims_nothing(tree):
    tree.numa_nodes(1)
    fn.add_neuron_function(tree, "0000:00:1e.0")
    fn.add_neuron_function(tree, "0000:00:1f.0")
    fn.add_neuron_device(tree, 0, node=False)
    fn.add_neuron_device(tree, 1, state=None)
    found = devices(tree)
    assert found["neuron0"].health_reason == "device node /dev/neuron0 missing"
    assert found["neuron1"].health is Health.HEALTHY


def test_core_unit_advertises_each_core_with_the_runtimes_global_number(tree):
    tree.numa_nodes(1)
    for index in range(2):
        fn.add_neuron_function(tree, f"0000:{0x10 + index:02x}:1e.0")
        fn.add_neuron_device(tree, index, core_count=2)
    found = devices(tree, CORES)
    assert list(found) == ["neuron0-core0", "neuron0-core1", "neuron1-core0", "neuron1-core1"]
    assert found["neuron1-core1"].env == {"NEURON_RT_VISIBLE_CORES": "3"}
    assert [n.host_path for n in found["neuron1-core0"].device_nodes] == ["/dev/neuron1"]


def test_index_and_name_selectors(tree):
    fn.trn1_node(tree)
    picked = ResourceConfig("x.com/n", "neuron", {"index": [3, 12], "device_name": "Trainium"})
    assert list(devices(tree, picked)) == ["neuron3", "neuron12"]
    assert devices(tree, ResourceConfig("x.com/n", "neuron", {"device_name": "Inferentia2"})) == {}


def test_no_neuron_devices_is_an_empty_list_without_reading_pci(tree):
    tree.numa_nodes(1)
    assert devices(tree) == {}


@pytest.mark.parametrize(("selectors", "key"), [({"index": -1}, "index"), ({"index": "0"}, "index"),
                                                ({"vendor": "0x1d0f"}, "vendor")])
def test_bad_selectors_are_rejected(selectors, key):
    with pytest.raises(SelectorError) as error:
        NeuronDriver().check_selectors(selectors)
    assert error.value.key == key


@pytest.mark.parametrize("settings", [{"unit": "chip"}, {"unit": 1}])
def test_bad_settings_are_rejected(settings):
    with pytest.raises(SelectorError):
        NeuronDriver().check_settings(settings)


# -- preferred allocation over the device links -------------------------------------------------
def _request(found: Dict[str, Device], available, must=(), size=1):
    from host.core.model import PreferredRequest

    return PreferredRequest(available=[found[i] for i in available],
                            must_include=[found[i] for i in must], size=size)


def _linked(found: Dict[str, Device], ids) -> bool:
    links = {d.id: {f"neuron{p.strip()}" for p in d.attributes["connected_devices"].split(",")}
             for d in found.values()}
    members = set(ids)
    seen, stack = {ids[0]}, [ids[0]]
    while stack:
        for other in links[stack.pop()] & members:
            if other not in seen:
                seen.add(other)
                stack.append(other)
    return seen == members


@pytest.mark.parametrize("size", [2, 4, 8, 16])
def test_preferred_sets_are_connected_over_the_torus(tree, size):
    fn.trn1_node(tree)
    found = devices(tree)
    picked = NeuronDriver().preferred(NEURON, _request(found, list(found), size=size))
    assert picked is not None and len(picked) == size == len(set(picked))
    assert _linked(found, list(picked))


def test_preferred_grows_from_the_must_include_device_and_skips_taken_ones(tree):
    fn.trn1_node(tree)
    found = devices(tree)
    available = [i for i in found if i not in ("neuron1", "neuron4")]  # held by another pod
    picked = NeuronDriver().preferred(NEURON, _request(found, available, ["neuron5"], 3))
    assert picked is not None and picked[0] == "neuron5" and len(picked) == 3
    assert not {"neuron1", "neuron4"} & set(picked)
    assert _linked(found, list(picked))


def test_no_connected_set_leaves_the_choice_to_the_host(tree):
    fn.trn1_node(tree)
    found = devices(tree)
    # neuron0 and neuron10 are not neighbours, and nothing else is available.
    request = _request(found, ["neuron0", "neuron10"], size=2)
    assert NeuronDriver().preferred(NEURON, request) is None
    assert NeuronDriver().preferred(
        ResourceConfig("aws.amazon.com/neuron", "neuron", {}, replicas=2), request) is None


def test_cores_are_packed_onto_few_devices(tree):
    tree.numa_nodes(1)
    for index in range(3):
        fn.add_neuron_function(tree, f"0000:{0x10 + index:02x}:1e.0")
        fn.add_neuron_device(tree, index, core_count=4)
    found = devices(tree, CORES)
    available = [i for i in found if i not in ("neuron0-core0", "neuron0-core1")]
    picked = NeuronDriver().preferred(CORES, _request(found, available, size=4))
    assert picked == [f"neuron1-core{k}" for k in range(4)]  # a whole device, not 0's leftovers
    picked = NeuronDriver().preferred(CORES, _request(found, available, ["neuron0-core2"], 2))
    assert picked == ["neuron0-core2", "neuron0-core3"]
