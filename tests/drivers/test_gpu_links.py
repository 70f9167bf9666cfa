"""GetPreferredAllocation that knows XGMI (KFD io_links) and NVLink (NVML): fake trees in KFD's
shapes, the pure policy, and the policy answering the kubelet simulator."""

from __future__ import annotations

from typing import Dict, List

from device_plugin_host_testing.harness import kubelet_and_host, make_config
from drivers.gpu.driver import GpuDriver
from drivers.gpu.links import link_preferred
from host.config.plugins import load_drivers
from host.core.allocation import numa_compact
from host.core.hostfs import HostFS
from host.core.model import Device, PreferredRequest, ResourceConfig
from host.sim.fake_gpu import AmdMachine
from host.sim.tree import FakeTree

AMD_GPU = ResourceConfig("amd.com/gpu", "gpu", {"vendor": "0x1002"})
HIVE_A, HIVE_B = 0xA1, 0xB2


def _split_hives(tmp_path, compute: str = "SPX") -> AmdMachine:
    """A and B on NUMA 0 in different XGMI hives; C on NUMA 1 in A's hive; D in B's."""
    tree = FakeTree(tmp_path / "root")
    tree.numa_nodes(2)
    machine = AmdMachine(tree, cpu_nodes=2)
    for address, node, hive in (("0000:0c:00.0", 0, HIVE_A), ("0000:22:00.0", 0, HIVE_B),
                                ("0000:8c:00.0", 1, HIVE_A), ("0000:a2:00.0", 1, HIVE_B)):
        machine.add_gpu(address, numa_node=node, hive=hive, compute=compute,
                        memory="NPS4" if compute == "CPX" else "NPS1")
    machine.write_kfd()
    return machine


def _devices(machine: AmdMachine) -> Dict[str, Device]:
    found = GpuDriver().discover(HostFS(machine.tree.root), [AMD_GPU])["amd.com/gpu"]
    return {d.id: d for d in found}


def _prefer(devices: Dict[str, Device], available: List[str], size: int,
            must: List[str] = ()) -> List[str]:
    request = PreferredRequest([devices[i] for i in available], [devices[i] for i in must], size)
    picked = GpuDriver().preferred(AMD_GPU, request)
    assert picked is not None
    return list(picked)


def test_xgmi_peers_come_from_kfd_io_links(tmp_path):
    devices = _devices(_split_hives(tmp_path))
    assert devices["0000:0c:00.0"].attributes["xgmi_peers"] == "0000:8c:00.0"
    assert devices["0000:22:00.0"].attributes["xgmi_peers"] == "0000:a2:00.0"


def test_an_xgmi_linked_pair_beats_a_numa_local_unlinked_one(tmp_path):
    devices = _devices(_split_hives(tmp_path))
    available = ["0000:0c:00.0", "0000:22:00.0", "0000:8c:00.0"]
    # NUMA-compact alone takes the two NUMA 0 GPUs, which have no XGMI link between them.
    assert numa_compact([devices[i] for i in available], [], 2) == available[:2]
    assert sorted(_prefer(devices, available, 2)) == ["0000:0c:00.0", "0000:8c:00.0"]
    # With a must-include GPU the partner is its XGMI peer.
    assert _prefer(devices, list(devices), 2, must=["0000:22:00.0"]) == [
        "0000:22:00.0", "0000:a2:00.0"]


def test_without_any_clique_it_falls_back_to_numa_compact_order(tmp_path):
    devices = _devices(_split_hives(tmp_path))
    available = ["0000:0c:00.0", "0000:22:00.0", "0000:a2:00.0"]
    assert sorted(_prefer(devices, available, 3)) == sorted(available)
    picked = _prefer(devices, ["0000:0c:00.0", "0000:22:00.0", "0000:a2:00.0"], 2)
    assert sorted(picked) == ["0000:22:00.0", "0000:a2:00.0"]  # the linked pair


def test_partitions_of_one_gpu_first_then_its_xgmi_peer(tmp_path):
    devices = _devices(_split_hives(tmp_path, "CPX"))
    everything = list(devices)
    four = _prefer(devices, everything, 4)
    assert len({d.rsplit("-p", 1)[0] for d in four}) == 1
    # 3 partitions left on 0c, all 8 free elsewhere: a 4-partition job takes one whole GPU.
    taken = {f"0000:0c:00.0-p{i}" for i in range(5)}
    four = _prefer(devices, [d for d in everything if d not in taken], 4)
    assert len({d.rsplit("-p", 1)[0] for d in four}) == 1
    # Ten partitions with one on 0c that must come: 0c's free ones, then its XGMI peer 8c.
    ten = _prefer(devices, everything, 10, must=["0000:0c:00.0-p7"])
    parents = {d.rsplit("-p", 1)[0] for d in ten}
    assert parents == {"0000:0c:00.0", "0000:8c:00.0"}
    assert ten[0] == "0000:0c:00.0-p7" and len(ten) == 10


def test_no_link_facts_and_whole_gpus_leave_it_to_the_host():
    plain = [Device(id=f"0000:{b:02x}:00.0", numa_nodes=(b // 0x80,),
                    attributes={"pci_address": f"0000:{b:02x}:00.0"}) for b in (0x18, 0x9a)]
    assert link_preferred(plain, [], 1) is None
    replicated = ResourceConfig("amd.com/gpu", "gpu", {}, replicas=4)
    assert GpuDriver().preferred(replicated, PreferredRequest(plain, [], 1)) is None


def test_nvlink_peers_work_the_same_way():
    def gpu(bus: int, node: int, peers: str) -> Device:
        address = f"0000:{bus:02x}:00.0"
        return Device(id=address, numa_nodes=(node,),
                      attributes={"pci_address": address, "nvlink_peers": peers})

    a, b, c = gpu(0x18, 0, "0000:9a:00.0"), gpu(0x2a, 0, ""), gpu(0x9a, 1, "0000:18:00.0")
    assert sorted(link_preferred([a, b, c], [], 2)) == ["0000:18:00.0", "0000:9a:00.0"]


def test_the_simulated_kubelet_gets_the_xgmi_pair(tmp_path, short_dir, run):
    machine = _split_hives(tmp_path)
    machine.tree.remove("/sys/bus/pci/devices/0000:a2:00.0")  # leave 0c, 22 (NUMA 0), 8c
    config = make_config(short_dir, [AMD_GPU], host_root=machine.tree.root)

    async def scenario():
        # The kubelet's default topology policy "none": every free GPU is a candidate.
        async with kubelet_and_host(config, load_drivers().drivers,
                                    topology_policy="none") as (sim, _app):
            await sim.wait_for(lambda s: s.resources["amd.com/gpu"].allocatable == 3)
            got = await sim.allocate("amd.com/gpu", 2, pod="allreduce")
            assert sorted(got.device_ids) == ["0000:0c:00.0", "0000:8c:00.0"]

    run(scenario())
