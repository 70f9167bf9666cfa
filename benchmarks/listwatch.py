"""ListAndWatch latency: one device's health flipped to the kubelet holding the new snapshot.

Setup: the real HostApp in this process and loop (as the tests run it) with one resource of N
MemoryDriver devices, registered with the kubelet simulator. Each sample builds the new device
list first (untimed), then times ``app.device_plugin.snapshots[name].update(new_list)``
(the call a rescan makes: diff against cached encodings, wake the stream) until the
simulator has applied the next snapshot; the flipped device's health is checked after each sample.

Floor: a bare grpc.aio server-stream in the same loop pushing a payload of the same bytes to a
client that only receives it (parsed by the same generated message class the simulator's stub
uses, but without the simulator's bookkeeping). Host and floor samples alternate.
"""

from __future__ import annotations

import asyncio
import gc
import os
import tempfile
from typing import Dict, List

from benchmarks.core import Context, Figure, median, now, percentile, short_dir
from benchmarks.floors import PushFloor
from benchmarks.hostproc import DRIVER, bench_config
from device_plugin_host_testing.drivers import MemoryDriver, make_devices
from device_plugin_host_testing.harness import running_host
from host.core.model import Device, Health, ResourceConfig
from host.kubelet.protocol import HEALTHY
from host.kubelet.protocol.convert import framed_device, snapshot_payload
from host.sim.kubelet import KubeletSimulator
from host.sim.tree import FakeTree

SIZES = (10, 1000, 10_000)
KEYS = tuple(f"listwatch_p99_ms_{n}" for n in SIZES)
RESOURCE = "example.com/watched"


def _flip(device: Device) -> Device:
    if device.healthy:
        return device.with_health(Health.UNHEALTHY, "benchmark flip")
    return device.with_health(Health.HEALTHY)


async def _measure_size(n: int, updates: int, root: str) -> Dict[str, List[float]]:
    devices = make_devices("dev", n, (0, 1))
    samples: Dict[str, List[float]] = {"host": [], "floor": [], "update": []}
    with short_dir() as plugin_dir:
        sim = KubeletSimulator(plugin_dir)
        await sim.start()
        config = bench_config(plugin_dir, [ResourceConfig(RESOURCE, DRIVER)], root, root)
        try:
            async with PushFloor(plugin_dir) as floor, running_host(
                    config, {DRIVER: MemoryDriver(DRIVER, {RESOURCE: devices})}) as app:
                gc.freeze()  # as `cli run` does once the host has started
                await sim.wait_for(lambda k: k.resources[RESOURCE].live
                                   and len(k.resources[RESOURCE].devices) == n, timeout=30,
                                   what=f"{n} devices registered")
                snapshot = app.device_plugin.snapshots[RESOURCE]
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
                    samples["floor"].append(await floor.time_push_ms(payload))
        finally:
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
