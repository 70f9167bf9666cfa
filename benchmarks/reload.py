"""How long a live reload of the largest allowed config holds the event loop.

The real host (usb driver on an empty fake tree, so every resource registers with an empty
snapshot) and the real reloader read a config file; the reload goes from 1 resource to the
documented cap (256) and back, each applied through ``ConfigReloader.reload`` (parse and
validation in a worker thread, then the app's reload), with the kubelet simulator in the same
loop registering every new resource. A ticker task asks for a 1 ms sleep over and over and
records how late it wakes: the largest lateness is the longest stretch the loop could not run
anything else (a kubelet's call, a ListAndWatch push).

Figure: the largest lateness over the reload rounds, until the simulator has seen every
change. Floor: the same ticker's largest lateness with the same host and simulator idle, for
as long as a reload took.
"""

from __future__ import annotations

import asyncio
import gc
import tempfile
from pathlib import Path
from typing import Any, Callable, List, Tuple

from benchmarks.core import Context, Figure, now, short_dir

KEYS = ("reload_max_stall_ms_256",)
TICK_S = 0.001


def _config(count: int) -> str:
    return "".join(f'[[resource]]\nname = "example.com/r{i}"\ndriver = "usb"\n\n'
                   for i in range(count))


class Ticker:
    """Largest lateness of a 1 ms sleep while it runs."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while True:
            started = now()
            await asyncio.sleep(TICK_S)
            self.worst = max(self.worst, now() - started - TICK_S)

    def start(self) -> None:
        self.worst = 0.0
        self._task = asyncio.get_running_loop().create_task(self._tick())

    async def stop(self) -> float:
        assert self._task is not None
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        return self.worst * 1000


def _serving(count: int) -> Callable[[Any], bool]:
    return lambda sim: sum(r.connected for r in sim.resources.values()) == count


async def _measure(count: int, rounds: int) -> Tuple[List[float], List[float], List[float]]:
    from host.app import HostApp
    from host.cli.reload import ConfigReloader
    from host.config import load_config
    from host.config.plugins import load_drivers
    from host.sim.kubelet import KubeletSimulator
    from host.sim.tree import FakeTree

    stalls: List[float] = []
    floors: List[float] = []
    durations: List[float] = []
    with tempfile.TemporaryDirectory(prefix="dph-reload-") as tmp, short_dir() as plugin_dir:
        root = Path(tmp) / "root"
        FakeTree(root).numa_nodes(1)
        path = Path(tmp) / "config.toml"
        path.write_text(_config(1))
        registry = load_drivers()
        overrides = {"plugin_dir": plugin_dir, "host_root": str(root)}
        config = load_config(str(path), registry.with_unavailable()).with_overrides(**overrides)
        sim = KubeletSimulator(plugin_dir)
        await sim.start()
        app = HostApp(config, registry.with_unavailable(), events=None)
        reloader = ConfigReloader(app, str(path), registry, overrides)
        ticker = Ticker()
        try:
            await app.start()
            gc.freeze()  # as `cli run` does once the host has started
            await sim.wait_for(lambda s: s.resources["example.com/r0"].connected, timeout=30)
            for _ in range(rounds):
                for size in (count, 1):
                    path.write_text(_config(size))
                    ticker.start()
                    started = now()
                    await reloader.reload(force=True)
                    await sim.wait_for(_serving(size), timeout=60,
                                       what=f"{size} resources served")
                    durations.append(now() - started)
                    stalls.append(await ticker.stop())
                    ticker.start()
                    await asyncio.sleep(durations[-1])  # idle, as long as the reload took
                    floors.append(await ticker.stop())
        finally:
            await reloader.aclose()
            await app.stop()
            await sim.stop()
    return stalls, floors, durations


def run(ctx: Context) -> List[Figure]:
    if not ctx.wants(KEYS[0]):
        return []
    count = 8 if ctx.tiny else 256
    rounds = ctx.pick(3, 2, 1)
    stalls, floors, durations = asyncio.run(_measure(count, rounds))
    return [Figure(KEYS[0], max(stalls), "ms", max(floors), [
        f"reload 1 -> {count} -> 1 resources, {rounds} rounds; stalls (ms) "
        + ", ".join(f"{s:.1f}" for s in stalls)
        + "; each reload until the simulator saw it: "
        + ", ".join(f"{d * 1000:.0f}" for d in durations) + " ms",
        "floor: the same ticker with host and simulator idle for as long",
    ])]
