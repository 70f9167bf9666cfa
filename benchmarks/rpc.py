"""Allocate and GetPreferredAllocation round trips, kubelet to host, against a bare unary call.

Setup: the host runs in its own process (``benchmarks.hostproc``: the real HostApp, one resource
of 8 MemoryDriver devices) and the kubelet simulator in this one, because the kubelet is another
process and the two sides then run on their own cores as they do on a node. Calls go through
the simulator's own client (``call_allocate`` / ``call_preferred``: it builds the request, the
generated stub serializes it and parses the answer).

Floor: a bare grpc.aio unary handler, also in its own process, called from this process on a
channel with the simulator's options, with the same request message built the same way. For
Allocate it answers with the bytes of the host's own AllocateResponse to that request (fetched
once before timing), parsed by the same generated class: a response of the same size. For
GetPreferredAllocation it echoes the request. Host and floor calls alternate in batches so
that drift (frequency scaling, other load) hits both equally.
"""

from __future__ import annotations

import asyncio
import os
from typing import Awaitable, Callable, Dict, List

import grpc

from benchmarks.core import Context, Figure, child_process, median, now, percentile, short_dir
from benchmarks.floors import CLIENT_OPTIONS, ECHO_METHOD, REPLY_METHOD, SET_REPLY_METHOD
from benchmarks.hostproc import device_prefix, resource_name
from host.kubelet.protocol import api
from host.sim.kubelet import KubeletSimulator
from host.sim.kubelet.allocation import preferred_request

KEYS = ("allocate_median_us", "allocate_p99_us", "preferred_median_us")
DEVICES = 8
ALLOCATE_IDS = 2  # one container asking for two devices
BATCH = 100

Call = Callable[[], Awaitable[object]]


async def _time_calls(calls: Dict[str, Call], count: int, warmup: int) -> Dict[str, List[float]]:
    """Microseconds per call of each kind, the kinds interleaved batch by batch."""
    for call in calls.values():
        for _ in range(warmup):
            await call()
    samples: Dict[str, List[float]] = {name: [] for name in calls}
    done = 0
    while done < count:
        batch = min(BATCH, count - done)
        for name, call in calls.items():
            out = samples[name]
            for _ in range(batch):
                start = now()
                await call()
                out.append((now() - start) * 1e6)
        done += batch
    return samples


async def _measure(ctx: Context) -> List[Figure]:
    count = ctx.pick(3000, 800, 20)
    warmup = ctx.pick(300, 100, 5)
    name = resource_name(0)
    ids = [f"{device_prefix(0)}{i}" for i in range(DEVICES)]
    with short_dir() as plugin_dir:
        sim = KubeletSimulator(plugin_dir)
        await sim.start()
        try:
            host_args = ["-m", "benchmarks.hostproc", "--resources", "1", "--devices",
                         str(DEVICES), "--plugin-dir", plugin_dir]
            echo_path = os.path.join(plugin_dir, "echo.sock")
            async with child_process(host_args), child_process(
                    ["-m", "benchmarks.floors", "echo", "--socket", echo_path]):
                await sim.wait_for(
                    lambda k: k.resources[name].connected and len(k.resources[name].devices)
                    == DEVICES, timeout=30, what="the host process registered")
                channel = grpc.aio.insecure_channel(f"unix:{echo_path}", options=CLIENT_OPTIONS)
                try:
                    await asyncio.wait_for(channel.channel_ready(), 10)
                    wanted = [ids[:ALLOCATE_IDS]]
                    answer = await sim.call_allocate(name, wanted)
                    await channel.unary_unary(SET_REPLY_METHOD)(answer.SerializeToString())
                    echo_allocate = channel.unary_unary(
                        REPLY_METHOD, request_serializer=api.AllocateRequest.SerializeToString,
                        response_deserializer=api.AllocateResponse.FromString)
                    echo_preferred = channel.unary_unary(
                        ECHO_METHOD,
                        request_serializer=api.PreferredAllocationRequest.SerializeToString,
                        response_deserializer=api.PreferredAllocationRequest.FromString)

                    def floor_allocate() -> Awaitable[object]:
                        # Built exactly as KubeletSimulator.call_allocate builds it.
                        return echo_allocate(api.AllocateRequest(container_requests=[
                            api.ContainerAllocateRequest(devices_ids=list(c)) for c in wanted]))

                    samples = await _time_calls({
                        "allocate": lambda: sim.call_allocate(name, wanted),
                        "allocate_floor": floor_allocate,
                        "preferred": lambda: sim.call_preferred(name, ids, [], 2),
                        "preferred_floor": lambda: echo_preferred(
                            preferred_request(ids, [], 2)),
                    }, count, warmup)
                finally:
                    await channel.close()
        finally:
            await sim.stop()
    note = (f"host in its own process; kubelet simulator client; floor answers the host's "
            f"{len(answer.SerializeToString())}-byte AllocateResponse")
    return [
        Figure("allocate_median_us", median(samples["allocate"]), "us",
               median(samples["allocate_floor"]), [note, f"n={count}"]),
        Figure("allocate_p99_us", percentile(samples["allocate"], 99), "us",
               percentile(samples["allocate_floor"], 99), [f"n={count}"]),
        Figure("preferred_median_us", median(samples["preferred"]), "us",
               median(samples["preferred_floor"]), [f"8 available, size 2, n={count}"]),
    ]


def run(ctx: Context) -> List[Figure]:
    return asyncio.run(_measure(ctx))
