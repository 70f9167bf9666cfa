"""A hostile local client cannot make the host build what its requests describe: requests
larger than the resource's devices could fill are refused before they are parsed (past
gRPC's own cap with RESOURCE_EXHAUSTED, below it with INVALID_ARGUMENT), and id
lists longer than the resource are refused before anything is built from them."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from device_plugin_host_testing.drivers import MemoryDriver, make_devices
from device_plugin_host_testing.harness import kubelet_and_host, make_config
from host.core.model import Device, ResourceConfig
from host.kubelet.protocol import api
from host.kubelet.protocol import deviceplugin_v1beta1_pb2_grpc as rpc
from host.kubelet.service import MAX_REQUEST_BYTES

GPU = "example.com/gpu"
REPO = Path(__file__).resolve().parents[1]

# Sends COUNT GetPreferredAllocation requests of IDS ids each, INFLIGHT at a time, from its
# own process (its memory is not the host's), and prints the status codes it got.
_CLIENT = r"""
import sys
from concurrent.futures import ThreadPoolExecutor
import grpc
from host.kubelet.protocol import api
from host.kubelet.protocol import deviceplugin_v1beta1_pb2_grpc as rpc
path, count, ids, inflight = sys.argv[1], *map(int, sys.argv[2:5])
channel = grpc.insecure_channel(f"unix://{path}",
                                options=[("grpc.max_send_message_length", -1)])
stub = rpc.DevicePluginStub(channel)
request = api.PreferredAllocationRequest()
container = request.container_requests.add()
container.available_deviceIDs.extend(f"{i:030d}" for i in range(ids))
container.allocation_size = 1
def one(_):
    try:
        stub.GetPreferredAllocation(request, timeout=60)
        return "OK"
    except grpc.RpcError as error:
        return error.code().name
with ThreadPoolExecutor(inflight) as pool:
    print(sorted(set(pool.map(one, range(count)))))
"""


def _rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _socket(app) -> str:
    path = app.device_plugin.registrar.endpoints[GPU].socket_path
    assert path is not None
    return path


def test_a_flood_of_oversized_id_lists_is_refused_and_rss_stays_bounded(short_dir, run):
    driver = MemoryDriver("m", {GPU: make_devices("gpu", 8, (0, 1))})
    config = make_config(short_dir, [ResourceConfig(GPU, "m")])

    async def scenario():
        async with kubelet_and_host(config, {"m": driver}) as (_sim, app):
            before = peak = _rss_mb()
            client = await asyncio.create_subprocess_exec(
                sys.executable, "-c", _CLIENT, _socket(app), "100", "100000", "16",
                stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(REPO)))
            while client.returncode is None:
                try:
                    await asyncio.wait_for(client.wait(), 0.02)
                except asyncio.TimeoutError:
                    pass
                peak = max(peak, _rss_mb())
            assert client.returncode == 0
            codes = (await client.stdout.read()).decode().strip()
            assert codes == "['INVALID_ARGUMENT']"
            # 100 requests of 3.2 MB, 16 at a time: gRPC holds the raw bytes of those in flight,
            # nothing is parsed or listed.
            assert peak - before < 200, f"RSS {before:.0f} MB -> peak {peak:.0f} MB"

    run(scenario(), timeout=120)


def test_requests_past_the_server_cap_and_past_the_resource_are_refused(short_dir, run):
    driver = MemoryDriver("m", {GPU: make_devices("gpu", 8, (0, 1))})
    config = make_config(short_dir, [ResourceConfig(GPU, "m")])

    async def scenario():
        async with kubelet_and_host(config, {"m": driver}) as (_sim, app):
            options = [("grpc.max_send_message_length", -1)]
            async with grpc.aio.insecure_channel(f"unix://{_socket(app)}",
                                                 options=options) as channel:
                stub = rpc.DevicePluginStub(channel)

                async def preferred(ids, must=()):
                    request = api.PreferredAllocationRequest()
                    container = request.container_requests.add()
                    container.available_deviceIDs.extend(ids)
                    container.must_include_deviceIDs.extend(must)
                    container.allocation_size = 1
                    return await stub.GetPreferredAllocation(request, timeout=10)

                # Past gRPC's own cap: refused by the server before the host sees it.
                huge = [f"{i:060d}" for i in range(MAX_REQUEST_BYTES // 60 + 10)]
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await preferred(huge)
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                # Under the cap but more than 8 devices could fill: not parsed.
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await preferred([f"{i:040d}" for i in range(1000)])
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "a request for the 8 devices of example.com/gpu is at most" in \
                    refused.value.details()
                # Small, but more ids than the resource has: refused before any is looked at.
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await preferred([f"g{i}" for i in range(9)])
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "9 ids, more than the 8 devices" in refused.value.details()
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Allocate(api.AllocateRequest(container_requests=[
                        api.ContainerAllocateRequest(devices_ids=[f"g{i}" for i in range(9)])]),
                        timeout=10)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "9 ids, more than the 8 devices" in refused.value.details()
                # What the kubelet sends still works.
                reply = await preferred([f"gpu{i}" for i in range(8)], ["gpu3"])
                assert "gpu3" in reply.container_responses[0].deviceIDs

    run(scenario())


def test_the_kubelets_largest_request_for_a_big_resource_is_answered(short_dir, run):
    """Every device listed as available and must-include: the most the kubelet ever sends."""
    ids = [f"GPU-{i:08x}-1111-2222-3333-444455556666::{i % 1024}" for i in range(5000)]
    devices = [Device(id=device_id, numa_nodes=(n % 2,)) for n, device_id in enumerate(ids)]
    driver = MemoryDriver("m", {GPU: devices})
    config = make_config(short_dir, [ResourceConfig(GPU, "m")])

    async def scenario():
        async with kubelet_and_host(config, {"m": driver}) as (sim, _app):
            reply = await sim.call_preferred(GPU, ids, ids[:4], 4)
            assert sorted(reply.container_responses[0].deviceIDs) == sorted(ids[:4])

    run(scenario(), timeout=120)
