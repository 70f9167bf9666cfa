"""AMD compute partitions (MI300X SPX/CPX, NPS1/NPS4) on fake trees in amdgpu's and KFD's
shapes (host/sim/fake_gpu.py AmdMachine), and served end to end through the simulator."""

from __future__ import annotations

import asyncio
from typing import Dict, List

import pytest

from device_plugin_host_testing.harness import kubelet_and_host, make_config
from drivers.gpu.driver import GpuDriver
from drivers.gpu.kfd import pci_address, read_topology
from host.config.plugins import load_drivers
from host.core.driver import SelectorError
from host.core.hostfs import HostFS
from host.core.model import Device, ResourceConfig
from host.sim.fake_gpu import AmdMachine
from host.sim.tree import FakeTree
from host.triggers.uevents import InjectedSource

AMD_GPU = ResourceConfig("amd.com/gpu", "gpu", {"vendor": "0x1002"})
CPX_NPS4 = ResourceConfig("amd.com/cpx_nps4", "gpu",
                          {"vendor": "0x1002", "partition_mode": "cpx_nps4"})
SPX_NPS1 = ResourceConfig("amd.com/spx_nps1", "gpu",
                          {"vendor": "0x1002", "partition_mode": "spx_nps1"})


def _machine(tmp_path, modes, partition_bits: str = "low") -> AmdMachine:
    tree = FakeTree(tmp_path / "root")
    tree.numa_nodes(2)
    machine = AmdMachine(tree, cpu_nodes=2, partition_bits=partition_bits)
    for number, (compute, memory) in enumerate(modes):
        machine.add_gpu(f"0000:{0x0c + number * 0x10:02x}:00.0", numa_node=number // 4,
                        compute=compute, memory=memory)
    machine.write_kfd()
    return machine


def _discover(machine: AmdMachine, *resources: ResourceConfig) -> Dict[str, List[Device]]:
    found = GpuDriver().discover(HostFS(machine.tree.root), resources or (AMD_GPU,))
    return {name: list(devices) for name, devices in found.items()}


def _paths(device: Device) -> List[str]:
    return [n.host_path for n in device.device_nodes]


def test_kfd_location_id_decodes_address_and_partition_index():
    assert pci_address(0, 0x0C00) == ("0000:0c:00.0", 0)
    assert pci_address(1, (5 << 28) | 0x9A08) == ("0001:9a:01.0", 5)


def test_cpx_gpu_is_served_as_its_eight_partitions_with_kfd_and_their_own_nodes(tmp_path):
    machine = _machine(tmp_path, [("CPX", "NPS4"), ("SPX", "NPS1")])
    devices = _discover(machine)["amd.com/gpu"]
    partitions = [d for d in devices if d.id.startswith("0000:0c:00.0")]
    assert [d.id for d in partitions] == [f"0000:0c:00.0-p{i}" for i in range(8)]
    assert all(d.healthy for d in devices), [d.health_reason for d in devices]
    for index, device in enumerate(partitions):
        # ROCm uses a partition through /dev/kfd and its render node (no card node).
        assert _paths(device) == ["/dev/kfd", f"/dev/dri/renderD{128 + index}"]
        assert device.numa_nodes == (0,)
        assert device.attributes["partition_mode"] == "cpx_nps4"
        assert device.attributes["partition_index"] == str(index)
        assert device.attributes["pci_address"] == "0000:0c:00.0"
        assert device.attributes["product"] == "AMD Instinct MI300X"
        assert int(device.attributes["memory_bytes"]) == 206_141_652_992 // 8
    # Partition 0 uses the PCI function's own DRM device; the others the amdgpu_xcp ones.
    host = HostFS(machine.tree.root)
    assert host.resolve("/sys/class/drm/renderD129/device") == "/sys/devices/platform/amdgpu_xcp.0"
    spx = [d for d in devices if d.id == "0000:1c:00.0"]
    assert len(spx) == 1 and spx[0].attributes["partition_mode"] == "spx_nps1"
    assert spx[0].attributes["memory_bytes"] == "206141652992"


@pytest.mark.parametrize("partition_bits", ["low", "high"])
def test_both_kernel_encodings_of_the_partition_in_location_id_give_the_partitions(
    tmp_path, partition_bits
):
    # ROCm/amdgpu and mainline OR the node id into location_id's low bits (partition 3 of
    # 0c:00.0 reads as 0c:00.3); a short-lived mainline form put it in bits 31:28. Both are
    # the same eight partitions of one GPU, never a GPU whose partitions are missing.
    machine = _machine(tmp_path, [("CPX", "NPS4"), ("CPX", "NPS4")], partition_bits)
    devices = _discover(machine)["amd.com/gpu"]
    assert [d.id for d in devices] == [
        f"0000:{bus}:00.0-p{i}" for bus in ("0c", "1c") for i in range(8)]
    assert all(d.healthy for d in devices), [d.health_reason for d in devices]
    assert [_paths(d)[1] for d in devices] == [f"/dev/dri/renderD{128 + i}" for i in range(16)]


def test_eight_spx_gpus_are_eight_devices_not_sixty_four_render_nodes(tmp_path):
    machine = _machine(tmp_path, [("SPX", "NPS1")] * 8)
    host = HostFS(machine.tree.root)
    renders = [n for n in host.listdir("/sys/class/drm") if n.startswith("renderD")]
    assert len(renders) == 64  # the idle xcp devices are there, as on a real MI300X in SPX
    devices = _discover(machine)["amd.com/gpu"]
    assert len(devices) == 8 and all(d.healthy for d in devices)
    assert [d.numa_nodes for d in devices] == [(0,)] * 4 + [(1,)] * 4
    assert all(_paths(d)[0] == "/dev/kfd" for d in devices)
    assert len(read_topology(host)) == 8


def test_rocm_naming_single_and_mixed(tmp_path):
    machine = _machine(tmp_path, [("CPX", "NPS4"), ("SPX", "NPS1")])
    found = _discover(machine, AMD_GPU, CPX_NPS4, SPX_NPS1,
                      ResourceConfig("amd.com/cpx", "gpu", {"partition_mode": "cpx"}))
    assert len(found["amd.com/gpu"]) == 9  # single: everything under one name
    assert [d.id for d in found["amd.com/cpx_nps4"]] == [f"0000:0c:00.0-p{i}" for i in range(8)]
    assert [d.id for d in found["amd.com/spx_nps1"]] == ["0000:1c:00.0"]
    assert len(found["amd.com/cpx"]) == 8


@pytest.mark.parametrize("value", ["cpx_nps3", "CPX-NPS4", "mig", ""])
def test_partition_mode_selector_rejects_what_rocm_cannot_name(value):
    with pytest.raises(SelectorError) as caught:
        GpuDriver().check_selectors({"partition_mode": value})
    assert caught.value.key == "partition_mode"


def test_partitioned_mode_without_kfd_nodes_is_one_unhealthy_gpu(tmp_path):
    machine = _machine(tmp_path, [("CPX", "NPS4")])
    machine.tree.remove("/sys/devices/virtual/kfd/kfd/topology/nodes")
    devices = _discover(machine)["amd.com/gpu"]
    assert [d.id for d in devices] == ["0000:0c:00.0"]
    assert not devices[0].healthy
    assert "compute partition CPX but no KFD topology node" in devices[0].health_reason


def test_a_partition_whose_render_node_is_missing_is_unhealthy_alone(tmp_path):
    machine = _machine(tmp_path, [("CPX", "NPS4")])
    machine.tree.remove("/dev/dri/renderD131")
    devices = {d.id: d for d in _discover(machine)["amd.com/gpu"]}
    assert not devices["0000:0c:00.0-p3"].healthy
    assert "/dev/dri/renderD131 missing" in devices["0000:0c:00.0-p3"].health_reason
    assert sum(d.healthy for d in devices.values()) == 7


def test_cpu_nodes_and_garbage_in_kfd_are_not_agents(tmp_path):
    machine = _machine(tmp_path, [("SPX", "NPS1")])
    base = "/sys/devices/virtual/kfd/kfd/topology/nodes"
    machine.tree.attr(f"{base}/9/properties", "simd_count 304\nlocation_id nonsense\n")
    machine.tree.attr(f"{base}/10/properties", "")
    nodes = read_topology(HostFS(machine.tree.root))
    assert [(n.node, n.address, n.partition) for n in nodes] == [(2, "0000:0c:00.0", 0)]


# -- through the host and the kubelet simulator --------------------------------------------------
def test_cpx_partition_allocation_carries_its_render_node_and_kfd(tmp_path, short_dir, run):
    machine = _machine(tmp_path, [("CPX", "NPS4"), ("CPX", "NPS4")])
    config = make_config(short_dir, [CPX_NPS4], host_root=machine.tree.root)

    async def scenario():
        async with kubelet_and_host(config, load_drivers().drivers) as (sim, _app):
            await sim.wait_for(lambda s: s.resources["amd.com/cpx_nps4"].allocatable == 16)
            got = await sim.allocate("amd.com/cpx_nps4", 2, pod="infer")
            paths = sorted(d.host_path for d in got.response.devices)
            renders = [p for p in paths if "renderD" in p]
            assert "/dev/kfd" in paths and len(renders) == 2
            for device_id in got.device_ids:
                index = int(device_id.rsplit("-p", 1)[1])
                base = 128 if device_id.startswith("0000:0c") else 136
                assert f"/dev/dri/renderD{base + index}" in renders

    run(scenario())


def test_repartition_updates_the_advertisement_without_a_restart(tmp_path, short_dir, run):
    machine = _machine(tmp_path, [("SPX", "NPS1"), ("SPX", "NPS1")])
    # ROCm's mixed strategy: one resource per mode, so no partition is advertised twice.
    config = make_config(short_dir, [SPX_NPS1, CPX_NPS4], host_root=machine.tree.root,
                         rescan_interval_s=0, vanished_grace_s=0)
    source = InjectedSource()

    async def scenario():
        async with kubelet_and_host(config, load_drivers().drivers, events=source) as (sim, _):
            await sim.wait_for(lambda s: s.resources["amd.com/spx_nps1"].allocatable == 2)
            assert sim.resources["amd.com/cpx_nps4"].capacity == 0
            machine.set_partition("0000:0c:00.0", "CPX", "NPS4")
            started = asyncio.get_running_loop().time()
            source.inject("pci")
            await sim.wait_for(lambda s: s.resources["amd.com/spx_nps1"].allocatable == 1
                               and s.resources["amd.com/cpx_nps4"].allocatable == 8,
                               timeout=3, what="the CPX partitions advertised")
            assert asyncio.get_running_loop().time() - started < 2.0
            assert "0000:0c:00.0" not in {
                i for i, d in sim.resources["amd.com/spx_nps1"].devices.items()
                if d.health == "Healthy"
            }
            machine.set_partition("0000:0c:00.0", "SPX", "NPS1")
            source.inject("drm")
            await sim.wait_for(lambda s: s.resources["amd.com/spx_nps1"].allocatable == 2
                               and s.resources["amd.com/cpx_nps4"].allocatable == 0,
                               timeout=3, what="back to SPX")

    run(scenario())


def test_capture_keeps_what_partition_discovery_reads(tmp_path):
    """A `device-plugin-host capture` of an MI300X node in CPX reproduces its partitions."""
    from host.cli.capture import capture_tree

    machine = _machine(tmp_path / "real", [("CPX", "NPS4"), ("SPX", "NPS1")])
    lines = list(capture_tree(machine.tree.root, ("/dev/kfd", "/dev/dri/*")))
    copy = FakeTree(tmp_path / "copy")
    copy.load("\n".join(lines))
    found = GpuDriver().discover(HostFS(copy.root), [AMD_GPU])["amd.com/gpu"]
    original = _discover(machine)["amd.com/gpu"]
    assert [(d.id, d.health, _paths(d), d.attributes.get("xgmi_peers")) for d in found] == [
        (d.id, d.health, _paths(d), d.attributes.get("xgmi_peers")) for d in original]
    assert len(found) == 9
