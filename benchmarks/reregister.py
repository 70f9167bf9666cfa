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

Outage keys (``reregister_p99_ms_64_outage_<s>``): the restart the real kubelet
does. A Register of the host is in flight when the kubelet stops (one resource's socket is
wiped under it while the simulator holds Register calls), the dead kubelet.sock stays behind
for the outage, then the new kubelet wipes every socket and listens. Measured from the new
kubelet.sock listening to every resource live again; the floor plugins are told when the
kubelet is back, so an outage cannot change their time and theirs is 0.1 s.
``reregister_attempts_64``: Register calls the host made per restart per resource (failed
ones included) over all outage restarts (floor: the minimal plugins' 1); target at most 2,
ideally 1.
"""

from __future__ import annotations

import asyncio
import gc
import os
import tempfile
from typing import Callable, Dict, List, Sequence, Tuple

from benchmarks.core import Context, Figure, median, now, percentile, short_dir
from benchmarks.floors import MinimalPlugin, kubelet_channel
from benchmarks.hostproc import DRIVER, bench_config, build_devices
from device_plugin_host_testing.drivers import MemoryDriver
from device_plugin_host_testing.harness import running_host
from host.core.model import ResourceConfig
from host.kubelet.protocol.convert import framed_device, snapshot_payload
from host.sim.kubelet import KubeletSimulator
from host.sim.tree import FakeTree

SIZES = (16, 64)
OUTAGES = (0.5, 2, 10)
OUTAGE_SIZE = 64
ATTEMPTS_KEY = f"reregister_attempts_{OUTAGE_SIZE}"
OUTAGE_KEYS = tuple(f"reregister_p99_ms_{OUTAGE_SIZE}_outage_{s:g}" for s in OUTAGES)
KEYS = (*(f"reregister_p99_ms_{n}" for n in SIZES), *OUTAGE_KEYS, ATTEMPTS_KEY)
DEVICES_PER_RESOURCE = 4
FLOOR_OUTAGE_S = 0.1


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
                gc.freeze()  # as `cli run` does once the host has started
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


def _since_start(sim: KubeletSimulator, names: Sequence[str]) -> float:
    assert sim.started_at is not None
    return (max(sim.resources[n].live_at for n in names) - sim.started_at) * 1000


async def _measure_outages(n: int, outages: Sequence[float], restarts: int,
                           root: str
                           ) -> Tuple[Dict[float, Dict[str, List[float]]], List[float],
                                      List[float]]:
    """Per outage: host and floor milliseconds; and Register calls per restart per resource."""
    table = build_devices(n, n * DEVICES_PER_RESOURCE, 2)
    names = list(table)
    payloads = {name: snapshot_payload(framed_device(d) for d in devices)
                for name, devices in table.items()}
    out: Dict[float, Dict[str, List[float]]] = {}
    attempts: List[float] = []  # Register calls the host made (failed ones included)
    kubelet_seen: List[float] = []  # ... and those that reached the kubelet
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

        config = bench_config(host_dir, [ResourceConfig(name, DRIVER) for name in table], root,
                              root)
        try:
            async with running_host(config, {DRIVER: MemoryDriver(DRIVER, table)}) as app:
                gc.freeze()  # as `cli run` does once the host has started
                await host_sim.wait_for(all_live(names), timeout=30, what="first registration")
                await floor_register()
                await floor_sim.wait_for(all_live(names), timeout=30, what="floor registered")
                for outage in outages:
                    samples = out.setdefault(outage, {"host": [], "floor": []})
                    for restart in range(restarts):
                        before = sum(ep.registrations
                                     for ep in app.device_plugin.registrar.endpoints.values())
                        received = sum(host_sim.register_calls.get(x, 0) for x in names)
                        # A Register in flight when the kubelet stops.
                        host_sim.register_delay_s = 30.0
                        victim = app.device_plugin.registrar.endpoints[names[restart % n]]
                        if victim.socket_path is not None:
                            os.unlink(victim.socket_path)
                        await host_sim.wait_for(lambda k: k.registers_in_flight > 0,
                                                timeout=10, what="a Register in flight")
                        host_sim.register_delay_s = 0.0
                        await host_sim.restart(outage, unlink=False)
                        await host_sim.wait_for(all_live(names), timeout=60,
                                                what="every resource back after the outage")
                        samples["host"].append(_since_start(host_sim, names))
                        after = sum(ep.registrations
                                    for ep in app.device_plugin.registrar.endpoints.values())
                        attempts.append((after - before) / n)
                        received = sum(host_sim.register_calls.get(x, 0)
                                       for x in names) - received
                        kubelet_seen.append(received / n)
                        await floor_sim.restart(FLOOR_OUTAGE_S, unlink=False)
                        await floor_register()
                        await floor_sim.wait_for(all_live(names), timeout=30,
                                                 what="floor back")
                        samples["floor"].append(_since_start(floor_sim, names))
        finally:
            await asyncio.gather(*(p.stop() for p in plugins))
            await channels[0].close()
            await host_sim.stop()
            await floor_sim.stop()
    return out, attempts, kubelet_seen


async def _measure(ctx: Context) -> List[Figure]:
    restarts = ctx.pick(50, 10, 2)
    figures = []
    with tempfile.TemporaryDirectory(prefix="dphb-rereg-") as root:
        FakeTree(root).numa_nodes(2)
        wanted_outages = [s for s, key in zip(OUTAGES, OUTAGE_KEYS) if ctx.wants(key)]
        if wanted_outages or ctx.wants(ATTEMPTS_KEY):
            outages = wanted_outages or [OUTAGES[0]]
            size = OUTAGE_SIZE if not ctx.tiny else 4
            # Tiny runs check shapes only: the outages shrink to keep the smoke test short.
            scaled = [s if not ctx.tiny else s / 100 for s in outages]
            count = ctx.pick(5, 2, 1)
            ctx.progress(f"{count} kubelet restarts per outage {outages} s with {size}"
                         " resources and a Register in flight")
            per_outage, attempts, seen = await _measure_outages(size, scaled, count,
                                                                os.fspath(root))
            for outage, run_outage in zip(outages, scaled):
                key = f"reregister_p99_ms_{OUTAGE_SIZE}_outage_{outage:g}"
                if outage not in wanted_outages:
                    continue
                host, floor = per_outage[run_outage]["host"], per_outage[run_outage]["floor"]
                notes = [f"median {median(host):.1f} ms (floor {median(floor):.1f} ms), "
                         f"{count} restarts, max {max(host):.1f} ms"]
                if ctx.tiny:
                    notes.append(f"tiny run: {size} resources, outage {run_outage:g} s")
                figures.append(Figure(key, percentile(host, 99), "ms",
                                      percentile(floor, 99), notes))
            if ctx.wants(ATTEMPTS_KEY):
                figures.append(Figure(
                    ATTEMPTS_KEY, sum(attempts) / len(attempts), "calls", 1.0,
                    [f"Register calls the host made per restart per resource (failed ones"
                     f" included), max {max(attempts):.2f} over {len(attempts)} restarts;"
                     f" received by the kubelet {sum(seen) / len(seen):.2f}"]))
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
