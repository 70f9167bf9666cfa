"""``pods`` and the PodResources v1 API: the simulator's socket, our client, the table and JSON.

The real host serves MemoryDriver devices to the kubelet simulator, pods are admitted through
it, and the answers come back over the simulator's pod-resources socket, as on a node.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from typing import List, Tuple

import grpc
import pytest

from device_plugin_host_testing.drivers import MemoryDriver, make_devices
from device_plugin_host_testing.harness import make_config, running_host
from host.core.model import Device, DeviceNode, Health, ResourceConfig
from host.kubelet.podresources import (
    Assignment,
    PodResourcesClient,
    PodResourcesError,
    assignments,
    format_table,
    pods_main,
    running_in_container,
)
from host.kubelet.protocol import api, podresources
from host.sim.kubelet import AllocationResult, KubeletSimulator
from host.sim.kubelet.podresources import RATE_LIMITED, TokenBucket
from host.sim.tree import FakeTree

GPU = "example.com/gpu"
NIC = "example.com/nic"


def _socket(plugin_dir: str) -> str:
    return os.path.join(plugin_dir, "pod-resources", "kubelet.sock")


def _devices() -> dict:
    gpus = make_devices("gpu", 4, (0, 1))
    # A device on two NUMA nodes: the kubelet reports it once per node.
    gpus.append(Device(id="gpu-wide", numa_nodes=(0, 1),
                       device_nodes=(DeviceNode("/dev/gpu-wide"),)))
    return {GPU: gpus, NIC: make_devices("nic", 2, ())}


class Node:
    """The host serving GPU and NIC devices to a simulator that also serves PodResources."""

    def __init__(self, plugin_dir: str, host_root: str) -> None:
        FakeTree(host_root).numa_nodes(2)
        self.driver = MemoryDriver("m", _devices())
        self.config = make_config(plugin_dir, [ResourceConfig(GPU, "m"), ResourceConfig(NIC, "m")],
                                  host_root=host_root)
        self.sim = KubeletSimulator(plugin_dir, pod_resources_socket=_socket(plugin_dir))
        self.socket = _socket(plugin_dir)

    async def admit_two_pods(self) -> None:
        """train (default): 2 GPUs of node 1 + 1 NIC; infer (team-a): the two-node GPU."""
        await self.sim.wait_for(
            lambda k: k.resources[GPU].allocatable == 5 and k.resources[NIC].allocatable == 2,
            what="both resources registered")
        await self.sim.allocate(GPU, 2, pod="train", container="trainer")
        await self.sim.allocate(NIC, 1, pod="train", container="trainer")
        await self.sim.allocate(GPU, 1, pod="infer", namespace="team-a", container="server")


def _scenario(short_dir: str, tmp_path, body):
    async def scenario():
        node = Node(short_dir, str(tmp_path / "root"))
        await node.sim.start()
        try:
            async with running_host(node.config, {"m": node.driver}) as app:
                await body(node, app)
        finally:
            await node.sim.stop()

    return scenario()


async def _pods_main(*args) -> int:
    """pods_main runs its own event loop, so it runs in a thread beside the simulator's."""
    return await asyncio.get_running_loop().run_in_executor(None, pods_main, *args)


def _held(node: Node) -> dict:
    return {(ns, pod, c, r): ids for ns, pod, c, r, ids in node.sim.allocations}


# -- pods_main against the simulator ---------------------------------------------------------
def test_pods_table_json_and_filter(short_dir, tmp_path, run, capsys):
    async def body(node: Node, app) -> None:
        await node.admit_two_pods()
        held = _held(node)
        train_gpus = held[("default", "train", "trainer", GPU)]
        infer_gpu = held[("team-a", "infer", "server", GPU)]
        train_nic = held[("default", "train", "trainer", NIC)]
        capsys.readouterr()

        assert await _pods_main(node.socket, None, True) == 0
        rows = json.loads(capsys.readouterr().out)
        numa = {f"gpu{i}": [i // 2] for i in range(4)}
        numa.update({"gpu-wide": [0, 1], "nic0": [], "nic1": []})
        expected = [
            {"pod": "train", "namespace": "default", "container": "trainer", "resource": GPU,
             "devices": train_gpus,
             "numa_nodes": sorted({n for d in train_gpus for n in numa[d]}),
             "device_numa": {d: numa[d] for d in train_gpus}},
            {"pod": "train", "namespace": "default", "container": "trainer", "resource": NIC,
             "devices": train_nic, "numa_nodes": [], "device_numa": {train_nic[0]: []}},
            {"pod": "infer", "namespace": "team-a", "container": "server", "resource": GPU,
             "devices": infer_gpu,
             "numa_nodes": sorted({n for d in infer_gpu for n in numa[d]}),
             "device_numa": {d: numa[d] for d in infer_gpu}},
        ]
        assert rows == expected

        assert await _pods_main(node.socket, None, False) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].split() == ["POD", "NAMESPACE", "CONTAINER", "RESOURCE", "DEVICES",
                                    "NUMA"]
        table = [line.split() for line in lines[1:]]
        assert table == [
            ["train", "default", "trainer", GPU, ",".join(train_gpus),
             ",".join(str(n) for n in expected[0]["numa_nodes"])],
            ["train", "default", "trainer", NIC, train_nic[0], "-"],
            ["infer", "team-a", "server", GPU, ",".join(infer_gpu),
             ",".join(str(n) for n in expected[2]["numa_nodes"])],
        ]
        # Columns line up: every row's DEVICES starts under the header's.
        column = lines[0].index("DEVICES")
        assert all(line[column - 2:column] == "  " and line[column] != " "
                   for line in lines[1:])

        assert await _pods_main(node.socket, NIC, True) == 0
        assert json.loads(capsys.readouterr().out) == [expected[1]]
        assert await _pods_main(node.socket, "example.com/g*", False) == 0
        assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]] == [
            "train", "infer"]

        # A released pod is gone from the kubelet's answer, and an empty answer says so.
        node.sim.release("train")
        assert await _pods_main(node.socket, NIC, False) == 0
        out = capsys.readouterr()
        assert out.out.splitlines()[1:] == []
        assert "no running pod holds devices of example.com/nic" in out.err

    run(_scenario(short_dir, tmp_path, body))


def test_two_node_device_is_listed_once_per_numa_node_and_merged(short_dir, tmp_path, run):
    async def body(node: Node, app) -> None:
        await node.sim.wait_for(lambda k: k.resources[GPU].allocatable == 5)
        await node.sim.allocate(GPU, 5, pod="all")  # every GPU, the two-node one included
        async with PodResourcesClient(node.socket) as client:
            (pod,) = await client.list()
        entries = [(list(d.device_ids), [n.ID for n in d.topology.nodes])
                   for d in pod.containers[0].devices]
        assert all(len(ids) == 1 for ids, _ in entries)  # one id per entry
        assert [e for e in entries if e[0] == ["gpu-wide"]] == [(["gpu-wide"], [0]),
                                                                (["gpu-wide"], [1])]
        assert sorted(e for e in entries if e[0] != ["gpu-wide"]) == [
            (["gpu0"], [0]), (["gpu1"], [0]), (["gpu2"], [1]), (["gpu3"], [1])]
        (row,) = assignments([pod])
        assert sorted(row.devices) == ["gpu-wide", "gpu0", "gpu1", "gpu2", "gpu3"]
        assert row.device_numa["gpu-wide"] == (0, 1) and row.numa_nodes == (0, 1)

    run(_scenario(short_dir, tmp_path, body))


# -- the simulator's other RPCs ---------------------------------------------------------------
def test_allocatable_lists_healthy_devices_only(short_dir, tmp_path, run):
    async def body(node: Node, app) -> None:
        # Both resources: they register independently, and the GPU list is checked below.
        await node.sim.wait_for(
            lambda k: k.resources[GPU].allocatable == 5 and k.resources[NIC].allocatable == 2)
        devices = _devices()
        devices[NIC][0] = devices[NIC][0].with_health(Health.UNHEALTHY, "link down")
        node.driver.devices = devices
        await app.rescan()
        await node.sim.wait_for(lambda k: k.resources[NIC].allocatable == 1)
        async with PodResourcesClient(node.socket) as client:
            entries = await client.allocatable()
        nic = [(list(e.device_ids), e.HasField("topology")) for e in entries
               if e.resource_name == NIC]
        assert nic == [(["nic1"], False)]
        gpu = sorted((e.device_ids[0], tuple(n.ID for n in e.topology.nodes))
                     for e in entries if e.resource_name == GPU)
        assert gpu == [("gpu-wide", (0,)), ("gpu-wide", (1,)), ("gpu0", (0,)), ("gpu1", (0,)),
                       ("gpu2", (1,)), ("gpu3", (1,))]

    run(_scenario(short_dir, tmp_path, body))


def test_get_finds_a_pod_and_words_errors_like_the_kubelet(short_dir, tmp_path, run):
    async def body(node: Node, app) -> None:
        await node.admit_two_pods()
        async with PodResourcesClient(node.socket) as client:
            pod = await client.get("infer", "team-a")
            assert (pod.name, pod.namespace) == ("infer", "team-a")
            assert [c.name for c in pod.containers] == ["server"]
            with pytest.raises(PodResourcesError) as missing:
                await client.get("infer", "default")
            assert missing.value.code == grpc.StatusCode.UNKNOWN
            assert "pod infer in namespace default not found" in str(missing.value)
            assert node.sim.pod_resources is not None
            node.sim.pod_resources.servicer.get_enabled = False
            with pytest.raises(PodResourcesError) as disabled:
                await client.get("infer", "team-a")
            assert "PodResources API Get method disabled" in str(disabled.value)

    run(_scenario(short_dir, tmp_path, body))


def test_rate_limit_answers_resource_exhausted(short_dir, tmp_path, run, capsys):
    async def body(node: Node, app) -> None:
        assert node.sim.pod_resources is not None
        # No refill: exactly the burst gets through, whatever the machine's speed.
        node.sim.pod_resources.servicer.limiter = TokenBucket(qps=0.0, burst=2)
        async with PodResourcesClient(node.socket) as client:
            await client.list()
            await client.allocatable()
            with pytest.raises(PodResourcesError) as refused:
                await client.list()
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert RATE_LIMITED in str(refused.value) and "100" in str(refused.value)
        capsys.readouterr()
        assert await _pods_main(node.socket, None, False) == 1
        err = capsys.readouterr().err
        assert err.startswith("device-plugin-host pods: ") and RATE_LIMITED in err

    run(_scenario(short_dir, tmp_path, body))


def test_token_bucket_starts_full_and_refills_at_qps():
    now = [100.0]
    bucket = TokenBucket(qps=100.0, burst=10, clock=lambda: now[0])
    assert [bucket.allow() for _ in range(11)] == [True] * 10 + [False]
    now[0] += 0.025  # 2.5 tokens
    assert [bucket.allow() for _ in range(3)] == [True, True, False]
    now[0] += 60.0  # never more than the burst
    assert sum(bucket.allow() for _ in range(20)) == 10


def test_answers_over_4_mib_are_received(short_dir, run):
    """The kubelet's server sends without limit; grpc's 4 MiB client default would fail."""

    async def scenario():
        sim = KubeletSimulator(short_dir, pod_resources_socket=_socket(short_dir))
        ids = [f"{i:06d}-" + "x" * 90 for i in range(50_000)]  # about 5 MiB on the wire
        sim.allocation_results[("default", "huge", "main", GPU)] = AllocationResult(
            resource=GPU, device_ids=ids, response=api.ContainerAllocateResponse(),
            numa_nodes=set(), preferred=None, pod="huge")
        await sim.start()
        try:
            async with PodResourcesClient(sim.pod_resources.socket_path) as client:
                pods = await client.list()
            assert sum(len(d.device_ids) for d in pods[0].containers[0].devices) == 50_000
            small = PodResourcesClient(sim.pod_resources.socket_path,
                                       max_receive_bytes=4 * 1024 * 1024)
            try:
                with pytest.raises(PodResourcesError) as too_big:
                    await small.list()
                assert too_big.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            finally:
                await small.close()
        finally:
            await sim.stop()

    run(scenario())


# -- client errors ----------------------------------------------------------------------------
def test_missing_socket_is_a_clear_error_with_exit_code_1(tmp_path, capsys):
    directory = tmp_path / "pod-resources"
    directory.mkdir()
    missing = str(directory / "kubelet.sock")
    assert pods_main(missing, None, False) == 1
    err = capsys.readouterr().err
    assert f"no pod-resources socket at {missing}" in err
    assert "kubelet is not serving it" in err

    unmounted = str(tmp_path / "nowhere" / "kubelet.sock")
    assert pods_main(unmounted, None, True, in_container=True) == 1
    captured = capsys.readouterr()
    assert captured.out == ""  # no half-written JSON for scripts to misread
    assert "mount the kubelet's pod-resources directory" in captured.err


def test_on_the_node_itself_a_missing_directory_is_not_a_mount_to_add(tmp_path, capsys):
    missing = str(tmp_path / "nowhere" / "kubelet.sock")
    assert pods_main(missing, None, False, in_container=False) == 1
    err = capsys.readouterr().err
    assert f"no pod-resources socket at {missing}" in err
    assert "mount" not in err and "container" not in err
    assert "does not exist on this node" in err and "--socket" in err


@pytest.mark.parametrize(("markers", "environ", "expected"), [
    ((), {}, False),
    ((), {"PATH": "/usr/bin", "KUBERNETES_SERVICE_HOST": ""}, False),
    ((".dockerenv",), {}, True),
    (("run/.containerenv",), {}, True),
    ((), {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}, True),  # every pod gets it
    ((), {"container": "podman"}, True),
])
def test_running_in_a_container_is_told_by_what_runtimes_leave(tmp_path, markers, environ,
                                                                expected):
    root = tmp_path / "root"
    (root / "run").mkdir(parents=True)
    for marker in markers:
        (root / marker).write_text("")
    assert running_in_container(str(root), environ) is expected


def test_a_file_that_is_not_a_socket_is_refused(tmp_path, capsys):
    path = tmp_path / "kubelet.sock"
    path.write_text("")
    assert pods_main(str(path), None, False) == 1
    assert f"{path} is not a socket" in capsys.readouterr().err


def test_a_socket_nobody_serves_is_unavailable(short_dir, capsys):
    path = os.path.join(short_dir, "kubelet.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)  # the file of a kubelet that died: bound once, nobody listening
    stale.close()
    assert pods_main(path, None, False, 2.0) == 1
    err = capsys.readouterr().err
    assert f"cannot reach the kubelet on {path}" in err


# -- pure helpers -----------------------------------------------------------------------------
def _pod(name: str, namespace: str, containers: List[Tuple[str, List[Tuple[str, str, list]]]]):
    return podresources.PodResources(
        name=name, namespace=namespace,
        containers=[
            podresources.ContainerResources(name=cname, devices=[
                podresources.ContainerDevices(
                    resource_name=res, device_ids=[dev],
                    topology=podresources.TopologyInfo(
                        nodes=[podresources.NUMANode(ID=n) for n in nodes]) if nodes else None)
                for res, dev, nodes in devices])
            for cname, devices in containers
        ])


def test_assignments_group_sort_and_skip_device_less_containers():
    pods = [
        _pod("b", "ns", [("c2", [("r/x", "d2", [1]), ("r/x", "d1", [0]), ("r/y", "y0", [])]),
                         ("sidecar", [])]),
        _pod("a", "ns", [("c1", [("r/x", "d3", [])])]),
    ]
    rows = assignments(pods)
    assert rows == [
        Assignment("ns", "a", "c1", "r/x", ("d3",), {"d3": ()}),
        Assignment("ns", "b", "c2", "r/x", ("d2", "d1"), {"d2": (1,), "d1": (0,)}),
        Assignment("ns", "b", "c2", "r/y", ("y0",), {"y0": ()}),
    ]
    assert rows[1].numa_nodes == (0, 1)
    assert format_table([]) == ["POD  NAMESPACE  CONTAINER  RESOURCE  DEVICES  NUMA"]
