"""Re-registration after a kubelet restart: from the moment the new kubelet.sock listens (the
end of ``KubeletSimulator.start()``) to every resource registered again with a snapshot.

Setup: the real HostApp in this process and loop with N resources of 4 MemoryDriver devices
each, against the simulator, as the tests run it; ``sim.restart()`` wipes every socket the way
the kubelet does. The host notices through inotify, serves each resource on a fresh socket and
registers it.

Floor: N hand-written minimal plugins (``floors.MinimalPlugin``: one DevicePlugin server with
options and a fixed snapshot, one Register on a shared channel), told directly that the kubelet
is back, so their time is only what a fresh server, a Register with the kubelet's dial-back and
the first ListAndWatch message cost here. Host and floor restarts alternate.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from typing import Callable, Dict, List, Sequence

from benchmarks.core import Context, Figure, median, now, percentile, short_dir
from benchmarks.floors import MinimalPlugin, kubelet_channel
from benchmarks.hostproc import DRIVER, bench_config, build_devices
from host.model import ResourceConfig
from host.protocol.convert import framed_device, snapshot_payload
from host.testing.drivers import MemoryDriver
from host.testing.harness import running_host
from host.testing.kubelet import KubeletSimulator
from host.testing.tree import FakeTree

SIZES = (16, 64)
KEYS = tuple(f"reregister_p99_ms_{n}" for n in SIZES)
DEVICES_PER_RESOURCE = 4


def all_live(names: Sequence[str]) -> Callable[[KubeletSimulator], bool]:
    """Every resource connected on its current registration and its first snapshot in."""
    def check(sim: KubeletSimulator) -> bool:
        return all(sim.resources[n].connected and sim.resources[n].live for n in names)

    return check


async def _restart_and_wait(sim: KubeletSimulator, names: Sequence[str],
                            after_start: Callable[[], object]) -> float:
    await sim.stop()
    await sim.start()
    started = now()
    result = after_start()
    if asyncio.iscoroutine(result):
        await result
    await sim.wait_for(all_live(names), timeout=30, what="every resource registered again")
    return (now() - started) * 1000


async def _measure_size(n: int, restarts: int, root: str) -> Dict[str, List[float]]:
    table = build_devices(n, n * DEVICES_PER_RESOURCE, 2)
    names = list(table)
    payloads = {name: snapshot_payload(framed_device(d) for d in devices)
                for name, devices in table.items()}
    with short_dir() as host_dir, short_dir() as floor_dir:
        host_sim = KubeletSimulator(host_dir)
        floor_sim = KubeletSimulator(floor_dir)
        await host_sim.start()
        await floor_sim.start()
        plugins = [MinimalPlugin(floor_dir, name, i, payloads[name])
                   for i, name in enumerate(names)]
        channels = [kubelet_channel(floor_dir)]

        async def floor_register() -> None:
            old = channels.pop()
            channels.append(kubelet_channel(floor_dir))
            await asyncio.gather(old.close(), *(p.register(channels[0]) for p in plugins))

        config = bench_config(host_dir, [ResourceConfig(name, DRIVER) for name in names], root,
                              root)
        samples: Dict[str, List[float]] = {"host": [], "floor": []}
        try:
            async with running_host(config, {DRIVER: MemoryDriver(DRIVER, table)}):
                await host_sim.wait_for(all_live(names), timeout=30, what="first registration")
                await floor_register()
                await floor_sim.wait_for(all_live(names), timeout=30, what="floor registered")
                for _ in range(restarts):
                    samples["host"].append(
                        await _restart_and_wait(host_sim, names, lambda: None))
                    samples["floor"].append(
                        await _restart_and_wait(floor_sim, names, floor_register))
        finally:
            await asyncio.gather(*(p.stop() for p in plugins))
            await channels[0].close()
            await host_sim.stop()
            await floor_sim.stop()
    return samples


async def _measure(ctx: Context) -> List[Figure]:
    restarts = ctx.pick(50, 10, 2)
    figures = []
    with tempfile.TemporaryDirectory(prefix="dphb-rereg-") as root:
        FakeTree(root).numa_nodes(2)
        for n in SIZES:
            key = f"reregister_p99_ms_{n}"
            if not ctx.wants(key):
                continue
            size = n if not ctx.tiny else min(n, 4)
            ctx.progress(f"{restarts} kubelet restarts with {size} resources")
            samples = await _measure_size(size, restarts, os.fspath(root))
            host, floor = samples["host"], samples["floor"]
            notes = [f"median {median(host):.1f} ms (floor {median(floor):.1f} ms), "
                     f"{restarts} restarts, max {max(host):.1f} ms"]
            if ctx.tiny:
                notes.append(f"tiny run: {size} resources")
            figures.append(Figure(key, percentile(host, 99), "ms", percentile(floor, 99), notes))
    return figures


def run(ctx: Context) -> List[Figure]:
    return asyncio.run(_measure(ctx))
