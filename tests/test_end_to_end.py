"""Real drivers on captured machine trees, served by the real host, driven by the simulator."""

from __future__ import annotations

from device_plugin_host_testing.harness import running_host
from device_plugin_host_testing.machines import load_machine
from host.config import default_config
from host.config.plugins import load_drivers
from host.sim.kubelet import KubeletSimulator


def test_pod_asking_for_4_gpus_on_the_8_gpu_server_gets_one_numa_node(tmp_path, short_dir, run):
    load_machine("gpu-server-8x", tmp_path / "root")
    registry = load_drivers()
    config = default_config(registry.drivers).with_overrides(
        plugin_dir=short_dir, host_root=str(tmp_path / "root"))

    async def scenario():
        sim = KubeletSimulator(short_dir, topology_policy="best-effort")
        await sim.start()
        try:
            async with running_host(config, registry.drivers) as app:
                assert "nvidia.com/gpu" in app.served()
                await sim.wait_for(lambda s: "nvidia.com/gpu" in s.resources
                                   and s.resources["nvidia.com/gpu"].allocatable == 8,
                                   what="8 GPUs allocatable")
                first = await sim.allocate("nvidia.com/gpu", 4, pod="train-a")
                second = await sim.allocate("nvidia.com/gpu", 4, pod="train-b")
                assert len(first.numa_nodes) == 1 and len(second.numa_nodes) == 1
                assert first.numa_nodes != second.numa_nodes
                assert not set(first.device_ids) & set(second.device_ids)
                nodes = sorted(d.host_path for d in first.response.devices
                               if d.host_path[len("/dev/nvidia"):].isdigit())
                assert len(nodes) == 4
                # A 2-GPU pod after freeing one: the NUMA-compact preference keeps it on one node.
                sim.release("train-a")
                third = await sim.allocate("nvidia.com/gpu", 2, pod="small")
                assert len(third.numa_nodes) == 1
        finally:
            await sim.stop()

    run(scenario())
