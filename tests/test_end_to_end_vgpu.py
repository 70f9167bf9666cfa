"""NVIDIA SR-IOV vGPU VFs served by the real host to the kubelet simulator from the
vgpu-node example: what virt-launcher gets for a VM (real gRPC over real unix sockets)."""

from __future__ import annotations

from pathlib import Path

from device_plugin_host_testing.harness import running_host
from device_plugin_host_testing.machines import load_machine
from host.config import load_config
from host.config.plugins import load_drivers
from host.sim.kubelet import KubeletSimulator

REPO = Path(__file__).resolve().parents[1]
VGPU = "nvidia.com/NVIDIA_L40S-24Q"


def test_a_vm_gets_the_vfio_nodes_and_kubevirts_variable_of_its_vgpu_vf(
    tmp_path, short_dir, run
):
    load_machine("vgpu-node", tmp_path / "root")
    registry = load_drivers()
    config = load_config(str(REPO / "config" / "examples" / "vgpu-node.toml"),
                         registry.drivers).with_overrides(
        plugin_dir=short_dir, host_root=str(tmp_path / "root"))

    async def scenario():
        sim = KubeletSimulator(short_dir, topology_policy="single-numa-node")
        await sim.start()
        try:
            async with running_host(config, registry.drivers):
                await sim.wait_for(lambda s: VGPU in s.resources
                                   and s.resources[VGPU].allocatable == 4,
                                   what="4 L40S-24Q VFs allocatable")
                result = await sim.allocate(VGPU, 1, pod="virt-launcher-vm1")
                (address,) = result.device_ids
                group = {"0000:41:00.4": 70, "0000:41:00.5": 71,
                         "0000:c1:00.4": 90, "0000:c1:00.5": 91}[address]
                assert sorted((d.host_path, d.container_path) for d in
                              result.response.devices) == [
                    (f"/dev/vfio/{group}", f"/dev/vfio/{group}"),
                    ("/dev/vfio/vfio", "/dev/vfio/vfio")]
                assert result.response.envs["PCI_RESOURCE_NVIDIA_COM_NVIDIA_L40S-24Q"] == address
        finally:
            await sim.stop()

    run(scenario())
