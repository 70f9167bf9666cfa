"""GetPreferredAllocation is advertised only where it can change the kubelet's choice (issue
15): the kubelet calls it before every Allocate when the option is set, so a resource whose
devices are interchangeable to the host pays one round trip per pod for nothing. A change of
the option reaches the kubelet only through a new registration."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from device_plugin_host_testing.drivers import MemoryDriver, ReversePreferenceDriver, make_devices
from device_plugin_host_testing.harness import kubelet_and_host
from device_plugin_host_testing.harness import make_config as _make_config
from host.core.model import Device, ResourceConfig
from host.kubelet.service import preferred_allocation_useful
from host.sim.tree import FakeTree

NAME = "example.com/gpu"


def make_config(plugin_dir, resources, root):
    """A fake two-socket machine (devices on node 1 are real there); a device that vanishes
    goes at once (by default it stays Unhealthy for a grace period, still on its node)."""
    FakeTree(str(root)).numa_nodes(2)
    return _make_config(plugin_dir, resources, host_root=str(root), vanished_grace_s=0)


def _useful(devices, replicas=1, driver=None):
    resource = ResourceConfig(NAME, "m", replicas=replicas)
    return preferred_allocation_useful(resource, driver or MemoryDriver("m"), devices)


def test_the_option_rule():
    assert not _useful(make_devices("g", 4, (0,)))  # one NUMA node: any pick is as good
    assert not _useful(make_devices("g", 4, ()))  # no topology (numa_node = -1)
    assert not _useful([])
    assert _useful(make_devices("g", 4, (0, 1)))  # NUMA-compact can do better
    assert _useful([Device("g0", numa_nodes=(0, 1))])  # one device spanning two nodes
    assert _useful(make_devices("g", 1, (0,)), replicas=4)  # pack / spread
    assert _useful(make_devices("g", 2, (0,)), driver=ReversePreferenceDriver("m", {}))


def test_a_device_on_a_second_numa_node_re_registers_with_the_option(short_dir, run, tmp_path):
    driver = MemoryDriver("m", {NAME: make_devices("gpu", 4, (0,))})

    async def scenario():
        config = make_config(short_dir, [ResourceConfig(NAME, "m")], tmp_path / "root")
        async with kubelet_and_host(config, {"m": driver}) as (sim, app):
            await sim.wait_for(lambda s: NAME in s.resources and s.resources[NAME].live,
                               what="registered")
            state = sim.resources[NAME]
            first = state.registrations
            assert not state.options.get_preferred_allocation_available
            assert (await sim.call_options(NAME)).get_preferred_allocation_available is False
            result = await sim.allocate(NAME, 1, pod="a")
            assert result.preferred is None  # a choice among 4 aligned ids, yet no call

            driver.devices[NAME] = [*driver.devices[NAME],
                                    replace(make_devices("gpu", 1, (1,))[0], id="gpu4")]
            await app.rescan(["m"])
            await sim.wait_for(
                lambda s: s.resources[NAME].registrations > first and s.resources[NAME].live
                and s.resources[NAME].options.get_preferred_allocation_available
                and len(s.resources[NAME].devices) == 5, what="registered again")
            assert sim.resources[NAME].options.get_preferred_allocation_available
            result = await sim.allocate(NAME, 1, pod="b")
            assert result.preferred is not None  # now it asks, and the host answers

            second = sim.resources[NAME].registrations
            driver.devices[NAME] = driver.devices[NAME][:4]  # back to one node
            await app.rescan(["m"])
            await sim.wait_for(
                lambda s: s.resources[NAME].registrations > second and s.resources[NAME].live
                and not s.resources[NAME].options.get_preferred_allocation_available
                and len(s.resources[NAME].devices) == 4, what="registered a third time")
            assert not sim.resources[NAME].options.get_preferred_allocation_available
            third = sim.resources[NAME].registrations
            await asyncio.sleep(0.3)  # the replaced stream's end must not start a loop
            assert sim.resources[NAME].registrations == third

    run(scenario())


def test_a_change_of_devices_on_the_same_nodes_keeps_the_registration(short_dir, run,
                                                                     tmp_path):
    driver = MemoryDriver("m", {NAME: make_devices("gpu", 4, (0, 1))})

    async def scenario():
        config = make_config(short_dir, [ResourceConfig(NAME, "m")], tmp_path / "root")
        async with kubelet_and_host(config, {"m": driver}) as (sim, app):
            await sim.wait_for(lambda s: NAME in s.resources and s.resources[NAME].live,
                               what="registered")
            first = sim.resources[NAME].registrations
            assert sim.resources[NAME].options.get_preferred_allocation_available
            driver.devices[NAME] = driver.devices[NAME][:3]
            await app.rescan(["m"])
            await sim.wait_for(lambda s: len(s.resources[NAME].devices) == 3,
                               what="the new snapshot")
            assert sim.resources[NAME].registrations == first

    run(scenario())


def test_a_driver_policy_counts_only_where_it_has_something_to_go_by():
    from drivers.gpu.driver import GpuDriver
    from drivers.neuron.driver import NeuronDriver

    gpu, neuron = GpuDriver(), NeuronDriver()
    plain = [Device(f"g{i}", numa_nodes=(0,), attributes={"pci_address": f"0000:1{i}:00.0"})
             for i in range(4)]
    assert not _useful(plain, driver=gpu)  # no links, one device per GPU: NUMA says it all
    linked = [replace(plain[0], attributes={**plain[0].attributes,
                                            "nvlink_peers": "0000:11:00.0"}), *plain[1:]]
    assert _useful(linked, driver=gpu)
    partitions = [Device(f"mig{i}", numa_nodes=(0,), attributes={"pci_address": "0000:10:00.0"})
                  for i in range(2)]
    assert _useful(partitions, driver=gpu)  # slices of one GPU are kept together
    ring = [Device(f"neuron{i}", numa_nodes=(0,), attributes={"connected_devices": "1, 3"})
            for i in range(4)]
    assert _useful(ring, driver=neuron)
    assert not _useful([Device("neuron0", numa_nodes=(0,))], driver=neuron)
    cores = ResourceConfig(NAME, "neuron", settings={"unit": "core"})
    assert preferred_allocation_useful(cores, neuron, [Device("neuron0-core0")])
