"""The widget driver served by the real host to the kubelet simulator, as a node would run it:
drivers from the installed entry points, the resources a config file names, real gRPC."""

from __future__ import annotations

import pytest
from device_plugin_host_testing import InjectedSource, load_drivers, make_config, running_host

from dph_widget.driver import SUGGESTED
from dph_widget.testing import gaudi_server

GAUDI = "habana.ai/gaudi"


@pytest.mark.kubelet(topology_policy="single-numa-node")
def test_a_pod_asking_for_two_gaudi_cards_gets_both_nodes_of_each_on_one_numa_node(
    fake_tree, kubelet, aio
):
    tree = fake_tree
    addresses = gaudi_server(tree)
    registry = load_drivers()
    # What a config file with the two SUGGESTED [[resource]] entries gives: only these
    # resources, served by the widget driver (the built-in accel driver serves nothing).
    config = make_config(kubelet.plugin_dir, SUGGESTED, host_root=tree.root)

    events = InjectedSource()
    sim = kubelet  # the test kit's simulator, already serving kubelet.sock

    async def scenario():
        async with running_host(config, registry.drivers, events) as app:
            await sim.wait_for(lambda s: s.resources[GAUDI].allocatable == 8,
                               what="8 Gaudi cards allocatable")
            assert set(app.served()) == {GAUDI, "npu.intel.com/accel"}
            result = await sim.allocate(GAUDI, 2, pod="train")
            assert len(result.numa_nodes) == 1
            assert set(result.device_ids) <= set(addresses)
            nodes = sorted(d.host_path for d in result.response.devices)
            indexes = sorted(addresses.index(i) for i in result.device_ids)
            expected = [f"/dev/accel/accel{i}" for i in indexes]
            expected += [f"/dev/accel/accel_controlD{i}" for i in indexes]
            assert nodes == sorted(expected)
            assert all(d.permissions == "rw" for d in result.response.devices)
            visible = result.response.envs["HABANA_VISIBLE_DEVICES"].split(",")
            assert sorted(int(i) for i in visible) == indexes

            # A card losing its node turns Unhealthy for the kubelet: the driver watches
            # the accel subsystem, so udev's remove event rescans it.
            tree.remove("/dev/accel/accel7")
            events.inject("accel")
            await sim.wait_for(lambda s: s.resources[GAUDI].allocatable == 7,
                               what="7 cards allocatable once accel7 lost its node")
            assert addresses[7] in sim.resources[GAUDI].unhealthy

    aio.run(scenario())
