"""ListAndWatch latency: one device's health flipped to the kubelet holding the new snapshot.

Setup: the real HostApp in this process and loop (as the tests run it) with one resource of N
MemoryDriver devices, registered with the kubelet simulator. Each sample builds the new device
list first (untimed), then times ``app.snapshots[name].update(new_list)`` (the call a rescan
makes: diff against cached encodings, wake the stream) until the simulator has applied the
next snapshot; the flipped device's health is checked after each sample.

Floor: a bare grpc.aio server-stream in the same loop pushing a payload of the same bytes to a
client that only receives it (parsed by the same generated message class the simulator's stub
uses, but without the simulator's bookkeeping). Host and floor samples alternate.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from typing import Dict, List, Optional

import grpc

from benchmarks.core import Context, Figure, median, now, percentile, short_dir
from benchmarks.floors import CLIENT_OPTIONS, PUSH_METHOD, PushServer, start_server
from benchmarks.hostproc import DRIVER, bench_config
from host.model import Device, Health, ResourceConfig
from host.protocol import HEALTHY, api
from host.protocol.convert import framed_device, snapshot_payload
from host.testing.drivers import MemoryDriver, make_devices
from host.testing.harness import running_host
from host.testing.kubelet import KubeletSimulator
from host.testing.tree import FakeTree

SIZES = (10, 1000, 10_000)
KEYS = tuple(f"listwatch_p99_ms_{n}" for n in SIZES)
RESOURCE = "example.com/watched"


def _flip(device: Device) -> Device:
    if device.healthy:
        return device.with_health(Health.UNHEALTHY, "benchmark flip")
    return device.with_health(Health.HEALTHY)


class _Receiver:
    """The floor's client: reads the stream, wakes whoever waits for the next message."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self.call = call
        self.received = 0
        self._waiter: Optional[asyncio.Future] = None
        self.task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for _message in self.call:
            self.received += 1
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(None)

    async def next_after(self, seen: int) -> None:
        while self.received <= seen:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter

    async def close(self) -> None:
        self.call.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def _measure_size(n: int, updates: int, root: str) -> Dict[str, List[float]]:
    devices = make_devices("dev", n, (0, 1))
    samples: Dict[str, List[float]] = {"host": [], "floor": [], "update": []}
    with short_dir() as plugin_dir:
        sim = KubeletSimulator(plugin_dir)
        await sim.start()
        push = PushServer()
        floor_server = await start_server(os.path.join(plugin_dir, "push.sock"), push.handler())
        channel = grpc.aio.insecure_channel(f"unix:{os.path.join(plugin_dir, 'push.sock')}",
                                            options=CLIENT_OPTIONS)
        receiver = _Receiver(channel.unary_stream(
            PUSH_METHOD, request_serializer=lambda data: data,
            response_deserializer=api.ListAndWatchResponse.FromString)(b""))
        config = bench_config(plugin_dir, [ResourceConfig(RESOURCE, DRIVER)], root, root)
        try:
            async with running_host(config, {DRIVER: MemoryDriver(DRIVER, {RESOURCE: devices})}
                                    ) as app:
                await sim.wait_for(lambda k: k.resources[RESOURCE].live
                                   and len(k.resources[RESOURCE].devices) == n, timeout=30,
                                   what=f"{n} devices registered")
                snapshot = app.snapshots[RESOURCE]
                state = sim.resources[RESOURCE]
                current = list(devices)
                for i in range(updates):
                    index = (i * 7919) % n
                    new = list(current)
                    new[index] = _flip(current[index])
                    before = state.snapshots
                    started = now()
                    if not snapshot.update(new):
                        raise RuntimeError("Snapshot.update saw no change")
                    samples["update"].append((now() - started) * 1000)
                    await sim.wait_for(lambda k, b=before: k.resources[RESOURCE].snapshots > b,
                                       timeout=30, what="the flipped snapshot")
                    samples["host"].append((now() - started) * 1000)
                    seen = state.devices[new[index].id].health == HEALTHY
                    if seen != new[index].healthy:
                        raise RuntimeError(f"simulator shows {new[index].id} unchanged")
                    current = new

                    payload = snapshot_payload(framed_device(d) for d in new)
                    seen_count = receiver.received
                    started = now()
                    push.queue.put_nowait(payload)
                    await asyncio.wait_for(receiver.next_after(seen_count), 30)
                    samples["floor"].append((now() - started) * 1000)
        finally:
            await receiver.close()
            await channel.close()
            await floor_server.stop(None)
            await sim.stop()
    return samples


async def _measure(ctx: Context) -> List[Figure]:
    updates = ctx.pick(100, 20, 3)
    figures = []
    with tempfile.TemporaryDirectory(prefix="dphb-lw-") as root:
        FakeTree(root).numa_nodes(2)
        for n in SIZES:
            key = f"listwatch_p99_ms_{n}"
            if not ctx.wants(key):
                continue
            size = n if not ctx.tiny else min(n, 100)
            ctx.progress(f"{updates} health flips over {size} devices")
            samples = await _measure_size(size, updates, os.fspath(root))
            host, floor = samples["host"], samples["floor"]
            notes = [f"median {median(host):.2f} ms (floor {median(floor):.2f} ms), "
                     f"{updates} flips; Snapshot.update alone: median "
                     f"{median(samples['update']):.2f} ms, p99 "
                     f"{percentile(samples['update'], 99):.2f} ms"]
            if ctx.tiny:
                notes.append(f"tiny run: {size} devices")
            figures.append(Figure(key, percentile(host, 99), "ms", percentile(floor, 99), notes))
    return figures


def run(ctx: Context) -> List[Figure]:
    return asyncio.run(_measure(ctx))
