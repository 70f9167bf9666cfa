"""Start-up: ``python -m host run`` spawned to every resource registered and its first snapshot
seen by the kubelet simulator in this process.

The host reads a fake GPU tree (four NVIDIA GPUs on two NUMA nodes, the ``gpu`` driver) and a
config with N resources ``example.com/gpu-0..N-1``, all from that one driver, so the figure is
the host's fixed cost plus N servers and N registrations, not the sysfs scan.

Floor: ``python -m benchmarks.floors servers --count 1``, a process that imports grpc and the
generated device plugin modules and serves one grpc.aio server on a unix socket, timed from
spawn to its "ready" line: what any Python device plugin pays before it can serve. Floor and
host starts alternate, and both read their bytecode from one cache, as an installed host does
(``benchmarks.core.bytecode_cache``, set up by the suite); the first start of each is a
warm-up, not counted.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
from typing import Dict, List, Sequence

from benchmarks.core import (
    REPO,
    Context,
    Figure,
    child_env,
    child_process,
    median,
    now,
    short_dir,
)
from host.sim import fake_gpu
from host.sim.kubelet import KubeletSimulator
from host.sim.tree import FakeTree

SIZES = (1, 16, 64)
KEYS = tuple(f"startup_ms_{n}" for n in SIZES)
GPUS = 4


def build_gpu_tree(root: str, gpus: int = GPUS) -> None:
    """A two-socket GPU server: ``gpus`` NVIDIA GPUs split over NUMA nodes 0 and 1."""
    tree = FakeTree(root)
    tree.numa_nodes(2)
    fake_gpu.add_nvidia_control_nodes(tree)
    for minor in range(gpus):
        bus = 0x18 + 0x10 * minor
        fake_gpu.add_nvidia_gpu(tree, f"0000:{bus:02x}:00.0", minor=minor,
                                numa_node=0 if minor < gpus // 2 else 1)


def write_config(path: str, count: int, drain_dir: str) -> List[str]:
    """Default [host] settings (info logging, metrics served) but for the metrics port, any
    free one so that a concurrent test run cannot clash, and the drain file's directory,
    which exists as a DaemonSet's hostPath makes it."""
    names = [f"example.com/gpu-{i}" for i in range(count)]
    with open(path, "w", encoding="utf-8") as out:
        out.write(f'[host]\nmetrics_address = "127.0.0.1:0"\n'
                  f'drain_file = "{os.path.join(drain_dir, "drained")}"\n')
        for index, name in enumerate(names):
            # Every resource serves the same GPUs, which must be said (host/core/overlap.py): each
            # names the ones before it.
            shared = ", ".join(f'"{other}"' for other in names[:index])
            out.write(f'\n[[resource]]\nname = "{name}"\ndriver = "gpu"\n'
                      + (f"shared_with = [{shared}]\n" if shared else "")
                      + '[resource.selectors]\nvendor = "0x10de"\n')
    return names


async def _host_start(config: str, names: Sequence[str], root: str) -> float:
    """Milliseconds from spawn to every resource registered with a snapshot."""
    with short_dir() as plugin_dir, tempfile.TemporaryFile() as errors:
        sim = KubeletSimulator(plugin_dir)
        await sim.start()
        process = None
        try:
            started = now()
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "host", "run", "--config", config, "--plugin-dir",
                plugin_dir, "--host-root", root, cwd=str(REPO), env=child_env(),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=errors)
            try:
                await sim.wait_for(
                    lambda k: all(k.resources[n].connected and k.resources[n].snapshots
                                  for n in names), timeout=60, what="every resource registered")
            except TimeoutError:
                errors.seek(0)
                raise RuntimeError(
                    f"host never registered: {errors.read().decode(errors='replace')[-2000:]}"
                ) from None
            return (now() - started) * 1000
        finally:
            if process is not None and process.returncode is None:
                process.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(process.wait(), 15)
                except asyncio.TimeoutError:
                    process.kill()
                    await process.wait()
            await sim.stop()


async def _plugins_start(names: Sequence[str]) -> float:
    """Milliseconds from spawn to ``names`` registered with a snapshot, by a process of
    hand-written minimal plugins (benchmarks.floors plugins): what any Python plugin pays for
    N servers and N registrations. Not the key's floor (that is one bare server); a note, so the
    host's own share of a many-resource start can be read."""
    with short_dir() as plugin_dir:
        sim = KubeletSimulator(plugin_dir)
        await sim.start()
        try:
            started = now()
            async with child_process(["-m", "benchmarks.floors", "plugins", "--dir", plugin_dir,
                                      "--devices", str(GPUS), *names]):
                await sim.wait_for(
                    lambda k: all(k.resources[n].connected and k.resources[n].snapshots
                                  for n in names), timeout=60, what="every plugin registered")
                return (now() - started) * 1000
        finally:
            await sim.stop()


async def _bare_start() -> float:
    """Milliseconds from spawn to one bare grpc.aio server serving."""
    with short_dir() as directory:
        started = now()
        async with child_process(["-m", "benchmarks.floors", "servers", "--count", "1",
                                  "--dir", directory]):
            return (now() - started) * 1000


async def _measure(ctx: Context) -> List[Figure]:
    runs = ctx.pick(9, 3, 1)
    sizes = [n for n in SIZES if ctx.wants(f"startup_ms_{n}")]
    figures = []
    with tempfile.TemporaryDirectory(prefix="dphb-startup-") as work:
        root = os.path.join(work, "root")
        build_gpu_tree(root)
        drain_dir = os.path.join(work, "drain")
        os.makedirs(drain_dir)
        samples: Dict[int, List[float]] = {n: [] for n in sizes}
        minimal: Dict[int, List[float]] = {n: [] for n in sizes}
        floors: List[float] = []
        configs = {}
        for n in sizes:
            configs[n] = os.path.join(work, f"config-{n}.toml")
            names = write_config(configs[n], ctx.pick(n, n, min(n, 4)), drain_dir)
            configs[n] = (configs[n], names)
        if not ctx.tiny:  # warm-ups (the page cache, the bytecode cache); a tiny run is shapes
            await _bare_start()
            if sizes:
                await _host_start(*configs[sizes[0]], root)
        for _ in range(runs):  # interleaved, so drift hits every size and the floor alike
            floors.append(await _bare_start())
            for n in sizes:
                path, names = configs[n]
                ctx.progress(f"startup of {len(names)} resources")
                samples[n].append(await _host_start(path, names, root))
                minimal[n].append(await _plugins_start(names))
    floor = median(floors)
    for n in sizes:
        notes = [f"median of {runs}, {GPUS} fake NVIDIA GPUs, max {max(samples[n]):.0f} ms; "
                 f"floor: one bare grpc.aio server, max {max(floors):.0f} ms"]
        plugins = median(minimal[n])
        notes.append(f"{len(configs[n][1])} minimal plugins in one process (grpc, a server and "
                     f"a Register each): {plugins:.0f} ms; host / that = "
                     f"{median(samples[n]) / plugins:.2f}x")
        if ctx.tiny:
            notes.append(f"tiny run: {min(n, 4)} resources")
        figures.append(Figure(f"startup_ms_{n}", median(samples[n]), "ms", floor, notes))
    return figures


def run(ctx: Context) -> List[Figure]:
    return asyncio.run(_measure(ctx))
