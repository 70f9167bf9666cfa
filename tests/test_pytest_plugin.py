"""The test kit's pytest plugin (testkit/device_plugin_host_testing/pytest_plugin.py) as a driver
package meets it: registered by the installed entry point, its fixtures usable with no conftest
import."""

from __future__ import annotations

import os
from importlib.metadata import entry_points

import pytest

from device_plugin_host_testing.drivers import MemoryDriver, make_devices
from device_plugin_host_testing.harness import make_config, running_host
from host.core.model import ResourceConfig
from host.sim.kubelet import KubeletSimulator
from host.sim.tree import FakeTree


def test_the_plugin_is_registered_by_the_pytest11_entry_point(pytestconfig):
    found = entry_points()
    # Python 3.9's entry_points() is a dict of groups; select(group=) came in 3.10.
    group = found.select(group="pytest11") if hasattr(found, "select") else found["pytest11"]
    # An editable install lists its distribution twice there (egg-info and dist-info).
    (point,) = {(e.name, e.value): e for e in group if e.name == "device_plugin_host"}.values()
    assert point.value == "device_plugin_host_testing.pytest_plugin"
    assert pytestconfig.pluginmanager.has_plugin("device_plugin_host")


def test_fake_tree_is_an_empty_root_under_tmp_path(fake_tree, tmp_path):
    assert isinstance(fake_tree, FakeTree) and fake_tree.root == str(tmp_path / "root")
    assert os.listdir(fake_tree.root) == []


@pytest.mark.kubelet(topology_policy="single-numa-node", numa_nodes=[0, 1])
def test_kubelet_is_serving_with_the_marker_options_and_a_host_registers(kubelet, aio):
    assert isinstance(kubelet, KubeletSimulator) and kubelet.serving
    assert kubelet.topology_policy == "single-numa-node" and kubelet.numa_nodes == (0, 1)
    assert os.path.exists(kubelet.socket_path)
    driver = MemoryDriver("m", {"example.com/x": make_devices("x", 2)})
    config = make_config(kubelet.plugin_dir, [ResourceConfig("example.com/x", "m")])

    async def scenario():
        async with running_host(config, {"m": driver}):
            await kubelet.wait_for(lambda k: "example.com/x" in k.resources
                                   and k.resources["example.com/x"].allocatable == 2,
                                   what="2 devices allocatable")

    aio.run(scenario())
    # The loop lives on between aio.run calls: the simulator still serves.
    assert aio.run(_serving(kubelet))


async def _serving(kubelet: KubeletSimulator) -> bool:
    return kubelet.serving
