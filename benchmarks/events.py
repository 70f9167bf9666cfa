"""Device event to kubelet: how fast a hot-plug reaches the kubelet, and what watching costs.

``event_to_kubelet_p99_ms_N`` (N = 1, 16, 64 resources, one driver serving them all): the
real HostApp in this process with the event seam (``InjectedSource``); each sample changes one
resource's devices in the driver (untimed), then times ``inject("pci")`` until the kubelet
simulator holds that resource's new snapshot. The path measured is the host's whole one:
coalescing window (4 ms), the driver scan in its worker thread (all N resources), checks,
diff, only the changed resource's stream woken, gRPC to the simulator. Floor: a bare
grpc.aio server-stream push of a same-size snapshot to a client that only receives it.

``idle_cpu_pct_watching``: a host process with 64 resources whose driver declares the pci,
usb, net, infiniband and drm subsystems, the kernel uevent monitor armed (netlink) and the
plugin-dir and drain-file inotify watches, idle over 30 s (quick: 5 s); floor: 64 bare
grpc.aio servers measured side by side.
"""

from __future__ import annotations

import asyncio
import gc
import os
import tempfile
from typing import Dict, List

from benchmarks.core import TINY_IDLE_S, Context, Figure, median, now, percentile, short_dir
from benchmarks.floors import PushFloor
from benchmarks.hostproc import DRIVER, bench_config, resource_name
from benchmarks.resources import idle_side_by_side
from device_plugin_host_testing.drivers import MemoryDriver, make_devices
from device_plugin_host_testing.harness import running_host
from host.core.model import Health, ResourceConfig
from host.kubelet.protocol.convert import framed_device, snapshot_payload
from host.sim.kubelet import KubeletSimulator
from host.sim.tree import FakeTree
from host.triggers.uevents import InjectedSource

COUNTS = (1, 16, 64)
KEYS = (*(f"event_to_kubelet_p99_ms_{n}" for n in COUNTS), "idle_cpu_pct_watching")
DEVICES_PER_RESOURCE = 8


async def _measure_count(count: int, samples: int, root: str) -> Dict[str, List[float]]:
    names = [resource_name(i) for i in range(count)]
    table = {name: make_devices(f"r{i}d", DEVICES_PER_RESOURCE, (0, 1))
             for i, name in enumerate(names)}
    driver = MemoryDriver(DRIVER, table)
    driver.subsystems = ("pci",)
    source = InjectedSource()
    out: Dict[str, List[float]] = {"host": [], "floor": []}
    with short_dir() as plugin_dir:
        sim = KubeletSimulator(plugin_dir)
        await sim.start()
        config = bench_config(plugin_dir, [ResourceConfig(n, DRIVER) for n in names], root, root)
        try:
            async with PushFloor(plugin_dir) as floor, running_host(
                    config, {DRIVER: driver}, events=source):
                gc.freeze()  # as `cli run` does once the host has started
                await sim.wait_for(lambda k: all(k.resources[n].live for n in names),
                                   timeout=60, what=f"{count} resources registered")
                for i in range(samples):
                    name = names[i % count]
                    devices = list(table[name])
                    flip = i % DEVICES_PER_RESOURCE
                    devices[flip] = devices[flip].with_health(
                        Health.HEALTHY if not devices[flip].healthy else Health.UNHEALTHY)
                    table[name] = devices
                    driver.devices[name] = devices
                    state = sim.resources[name]
                    before = state.snapshots
                    started = now()
                    source.inject("pci")
                    await sim.wait_for(lambda k, n=name, b=before: k.resources[n].snapshots > b,
                                       timeout=30, what="the changed snapshot")
                    out["host"].append((now() - started) * 1000)

                    payload = snapshot_payload(framed_device(d) for d in devices)
                    out["floor"].append(await floor.time_push_ms(payload))
        finally:
            await sim.stop()
    return out


async def _idle_watching(ctx: Context) -> Figure:
    idle_s = ctx.pick(30, 5, 1) if not ctx.tiny else TINY_IDLE_S
    resources = 64 if not ctx.tiny else 4
    names = [resource_name(i) for i in range(resources)]
    with short_dir() as host_dir, short_dir() as bare_dir:
        sim = KubeletSimulator(host_dir)
        await sim.start()
        try:
            host_args = ["-m", "benchmarks.hostproc", "--resources", str(resources),
                         "--devices", str(resources * 4), "--plugin-dir", host_dir,
                         "--events", "udev"]
            bare_args = ["-m", "benchmarks.floors", "servers", "--count", str(resources),
                         "--dir", bare_dir]
            _rss, cpu, pct, wall, _method = await idle_side_by_side(
                ctx, sim, host_args, bare_args, names, None, idle_s)
        finally:
            await sim.stop()
    return Figure("idle_cpu_pct_watching", pct["host"], "%", pct["bare"],
                  [f"{resources} resources, udev netlink monitor + inotify armed, "
                   f"{wall:.1f} s idle; host {cpu['host'] * 1000:.1f} ms, floor "
                   f"{cpu['bare'] * 1000:.1f} ms of CPU"])


async def _measure(ctx: Context) -> List[Figure]:
    figures = []
    samples = ctx.pick(200, 40, 5)
    with tempfile.TemporaryDirectory(prefix="dphb-ev-") as root:
        FakeTree(root).numa_nodes(2)
        for count in COUNTS:
            key = f"event_to_kubelet_p99_ms_{count}"
            if not ctx.wants(key):
                continue
            n = count if not ctx.tiny else min(count, 4)
            ctx.progress(f"{samples} injected events over {n} resources")
            result = await _measure_count(n, samples, os.fspath(root))
            host, floor = result["host"], result["floor"]
            notes = [f"median {median(host):.2f} ms (floor {median(floor):.2f} ms), "
                     f"{samples} events, {DEVICES_PER_RESOURCE} devices per resource, "
                     "4 ms coalescing window included"]
            figures.append(Figure(key, percentile(host, 99), "ms", percentile(floor, 99), notes))
    if ctx.wants("idle_cpu_pct_watching"):
        figures.append(await _idle_watching(ctx))
    return figures


def run(ctx: Context) -> List[Figure]:
    if not any(ctx.wants(key) for key in KEYS):
        return []
    return asyncio.run(_measure(ctx))
