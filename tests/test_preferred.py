"""GetPreferredAllocation refuses what the kubelet never sends, with a reason: a must-include
id outside the available list, or a size larger than that list (the kubelet's own requests
always list must-include ids among the available ones and never ask for more than it has
candidates for)."""

from __future__ import annotations

import grpc
import pytest

from device_plugin_host_testing.drivers import MemoryDriver, make_devices
from device_plugin_host_testing.harness import kubelet_and_host
from device_plugin_host_testing.harness import make_config as _make_config
from host.core.model import ResourceConfig
from host.sim.tree import FakeTree

GPU = "example.com/gpu"


def make_config(plugin_dir, resources, root):
    FakeTree(root).numa_nodes(2)  # the devices' NUMA nodes 0 and 1 exist
    return _make_config(plugin_dir, resources, host_root=str(root))


def _registered(sim):
    return lambda s: GPU in s.resources and s.resources[GPU].connected \
        and s.resources[GPU].snapshots > 0


@pytest.mark.parametrize(("available", "must", "size", "words"), [
    (["gpu0", "gpu1"], ["gpu3"], 2, "must-include id 'gpu3' is not in available_deviceIDs"),
    (["gpu0"], ["gpu2", "gpu3"], 2, "'gpu2' is not in available_deviceIDs (and 1 more)"),
    (["gpu0", "gpu1"], [], 3, "allocation_size 3 is larger than the 2 available ids"),
    (["gpu0", "gpu0", "gpu1"], [], 3, "larger than the 2 available ids"),  # duplicates once
    ([], [], 1, "larger than the 0 available ids"),
])
def test_requests_the_kubelet_never_sends_are_refused_with_a_reason(short_dir, run, tmp_path,
                                                                    available, must, size,
                                                                    words):
    driver = MemoryDriver("m", {GPU: make_devices("gpu", 4, (0, 1))})

    async def scenario():
        config = make_config(short_dir, [ResourceConfig(GPU, "m")], tmp_path / "root")
        async with kubelet_and_host(config, {"m": driver}) as (sim, _app):
            await sim.wait_for(_registered(sim))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await sim.call_preferred(GPU, available, must, size)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert words in refused.value.details()
            # What the kubelet does send still gets an answer: must-include among available.
            reply = await sim.call_preferred(GPU, ["gpu0", "gpu1", "gpu2", "gpu3"], ["gpu2"], 2)
            picked = list(reply.container_responses[0].deviceIDs)
            assert "gpu2" in picked and len(picked) == 2

    run(scenario())


def test_the_kubelets_own_admission_path_still_works(short_dir, run, tmp_path):
    driver = MemoryDriver("m", {GPU: make_devices("gpu", 4, (0, 1))})

    async def scenario():
        config = make_config(short_dir, [ResourceConfig(GPU, "m")], tmp_path / "root")
        async with kubelet_and_host(config, {"m": driver}) as (sim, _app):
            await sim.wait_for(_registered(sim))
            for pod in ("a", "b"):
                result = await sim.allocate(GPU, 2, pod=pod)
                assert len(result.device_ids) == 2 and len(result.numa_nodes) == 1

    run(scenario())
