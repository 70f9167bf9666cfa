"""Memory and idle CPU of a host process: 1 and 16 resources as a node runs it, 64 resources
and 10,000 devices in all.

``rss_mb_1r``, ``rss_mb_16r``: ``python -m host run`` (the CLI, the entry-point drivers, the
udev monitor and the metrics endpoint, default settings) on the start-up family's fake GPU
tree with 1 or 16 resources of the ``gpu`` driver, registered with the kubelet simulator in
this process; RSS once every resource has its snapshot and a short settle. Floor: ``python -m
benchmarks.floors servers --count N``, a process that imports grpc and the generated device
plugin modules and starts N grpc.aio servers, read at the same moment. Median of three
alternating pairs, after one warm-up pair (the first processes of a run read ~5 MB higher,
host and floor alike).

``rss_mb_64r_10k``, ``idle_cpu_pct_64r``:

Setup: ``benchmarks.hostproc`` (the real HostApp, MemoryDriver devices spread over 64
resources, on a host root with 2 NUMA nodes built by this process; of the test kit only the
MemoryDriver is loaded there) registered with the kubelet simulator in this process, every
ListAndWatch stream open, the operator drain file's directory present. The CLI, the
entry-point drivers and the udev monitor are not loaded: a ``device-plugin-host run``
process is bigger (its imports alone by about 2.6 MB when it loaded every installed driver
once serving; about 1.3 MB since the host's own drivers that no resource names wait for a
reload that needs them; ``rss_mb_1r`` and ``rss_mb_16r`` measure that path).
Once every resource has its snapshot and a short settle, RSS is read (psutil; MB = 10^6
bytes), then CPU time over an idle window (30 s; quick: 5 s) as a percentage of one core.
CPU time is the sum of the per-thread ``schedstat`` run times (nanoseconds) where Linux has
them, else psutil's user + system (10 ms ticks).

Floor: ``python -m benchmarks.floors servers --count 64``, a process that imports grpc and
starts 64 grpc.aio servers on unix sockets, measured the same way over the same window (both
processes idle side by side).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from typing import Dict, List, Optional, Tuple

import psutil

from benchmarks.core import (
    TINY_IDLE_S,
    Context,
    Figure,
    child_process,
    median,
    now,
    short_dir,
)
from benchmarks.hostproc import numa_root, resource_name
from benchmarks.startup import build_gpu_tree, write_config
from host.sim.kubelet import KubeletSimulator

KEYS = ("rss_mb_1r", "rss_mb_16r", "rss_mb_64r_10k", "idle_cpu_pct_64r")
SMALL = (1, 16)
RESOURCES = 64
DEVICES = 10_000


def _schedstat(pid: int) -> Optional[Dict[int, int]]:
    """Run time in ns of each thread, or None when the kernel does not expose it."""
    out = {}
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as handle:
                out[int(tid)] = int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return out


class CpuMeter:
    """CPU seconds a process spent between ``start`` and ``stop``."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self._threads: Optional[Dict[int, int]] = None
        self._times: Tuple[float, float] = (0.0, 0.0)
        self.method = "schedstat"

    def start(self) -> None:
        self._threads = _schedstat(self.process.pid)
        times = self.process.cpu_times()
        self._times = (times.user, times.system)

    def stop(self) -> float:
        after = _schedstat(self.process.pid)
        times = self.process.cpu_times()
        before = self._threads
        if before is not None and after is not None and set(before) <= set(after):
            return sum(after[tid] - before.get(tid, 0) for tid in after) / 1e9
        self.method = "psutil"  # a thread ended in the window: its schedstat is gone
        return (times.user - self._times[0]) + (times.system - self._times[1])


async def idle_side_by_side(
    ctx: Context, sim: KubeletSimulator, host_args: List[str], bare_args: List[str],
    names: List[str], devices: Optional[int], idle_s: float,
) -> Tuple[Dict[str, float], Dict[str, float], Dict[str, float], float, str]:
    """Start the host and the bare floor process, wait until the simulator has every resource
    (and ``devices`` devices in all, when given), settle, then read RSS (MB) and the CPU
    seconds each used over ``idle_s``. Returns (rss, cpu seconds, cpu %, wall, method)."""
    async with child_process(host_args, timeout=120) as host, \
            child_process(bare_args, timeout=120) as bare:
        await sim.wait_for(
            lambda k: all(k.resources[n].live for n in names)
            and (devices is None
                 or sum(len(k.resources[n].devices) for n in names) == devices),
            timeout=120, what=f"{len(names)} resources registered")
        await asyncio.sleep(ctx.pick(2, 1, 0))  # let start-up garbage settle
        rss = {name: psutil.Process(p.pid).memory_info().rss / 1e6
               for name, p in (("host", host), ("bare", bare))}
        meters = {"host": CpuMeter(host.pid), "bare": CpuMeter(bare.pid)}
        for meter in meters.values():
            meter.start()
        started = now()
        ctx.progress(f"idle for {idle_s} s")
        await asyncio.sleep(idle_s)
        cpu = {name: meter.stop() for name, meter in meters.items()}
        wall = now() - started
    pct = {name: 100 * seconds / wall for name, seconds in cpu.items()}
    return rss, cpu, pct, wall, meters["host"].method


async def _small_rss(ctx: Context, count: int, work: str, root: str) -> Tuple[float, float]:
    """(host, floor) RSS in MB of ``python -m host run`` with ``count`` gpu resources and of
    ``count`` bare servers, read side by side once every resource is registered."""
    config = os.path.join(work, f"config-{count}.toml")
    drain_dir = os.path.join(work, "drain")
    os.makedirs(drain_dir, exist_ok=True)
    names = write_config(config, count, drain_dir)
    with short_dir() as host_dir, short_dir() as bare_dir:
        sim = KubeletSimulator(host_dir)
        await sim.start()
        try:
            host_args = ["-m", "host", "run", "--config", config, "--plugin-dir", host_dir,
                         "--host-root", root]
            bare_args = ["-m", "benchmarks.floors", "servers", "--count", str(count),
                         "--dir", bare_dir]
            async with child_process(host_args, wait_for_line=None, timeout=120) as host, \
                    child_process(bare_args, timeout=120) as bare:
                await sim.wait_for(
                    lambda k: all(k.resources[n].live for n in names), timeout=120,
                    what=f"{count} resources registered")
                await asyncio.sleep(ctx.pick(2, 1, 0))  # let start-up garbage settle
                return (psutil.Process(host.pid).memory_info().rss / 1e6,
                        psutil.Process(bare.pid).memory_info().rss / 1e6)
        finally:
            await sim.stop()


async def _measure_small(ctx: Context) -> List[Figure]:
    counts = [n for n in SMALL if ctx.wants(f"rss_mb_{n}r")]
    runs = ctx.pick(3, 1, 1)
    samples: Dict[int, List[Tuple[float, float]]] = {n: [] for n in counts}
    with tempfile.TemporaryDirectory(prefix="dphb-rss-") as work:
        root = os.path.join(work, "root")
        build_gpu_tree(root)
        if counts and not ctx.tiny:  # the first pair reads ~5 MB higher on both sides
            await _small_rss(ctx, ctx.pick(1, 1, 1), work, root)
        for _ in range(runs):
            for n in counts:
                ctx.progress(f"idle RSS of {n} resources")
                samples[n].append(await _small_rss(ctx, ctx.pick(n, n, min(n, 2)), work, root))
    figures = []
    for n in counts:
        host = median([h for h, _ in samples[n]])
        bare = median([b for _, b in samples[n]])
        note = (f"python -m host run, {n} gpu resources, median of {runs}; floor: {n} bare "
                f"grpc.aio servers")
        figures.append(Figure(f"rss_mb_{n}r", host, "MB", bare, [note]))
    return figures


async def _measure(ctx: Context) -> List[Figure]:
    idle_s = ctx.pick(30, 5, 1) if not ctx.tiny else TINY_IDLE_S
    resources = RESOURCES if not ctx.tiny else 4
    devices = DEVICES if not ctx.tiny else 100
    names = [resource_name(i) for i in range(resources)]

    with short_dir() as host_dir, short_dir() as bare_dir, \
            tempfile.TemporaryDirectory(prefix="dphb-root-") as root:
        sim = KubeletSimulator(host_dir)
        await sim.start()
        try:
            host_args = ["-m", "benchmarks.hostproc", "--resources", str(resources),
                         "--devices", str(devices), "--plugin-dir", host_dir,
                         "--host-root", numa_root(root, 2)]
            bare_args = ["-m", "benchmarks.floors", "servers", "--count", str(resources),
                         "--dir", bare_dir]
            rss, cpu, pct, wall, method = await idle_side_by_side(
                ctx, sim, host_args, bare_args, names, devices, idle_s)
        finally:
            await sim.stop()
    size = f"{resources} resources, {devices} devices"
    return [
        Figure("rss_mb_64r_10k", rss["host"], "MB", rss["bare"],
               [f"{size}; floor: 64 bare grpc.aio servers"]),
        # A floor of 0.000 is possible: the ratio is then null and the figure stands alone.
        Figure("idle_cpu_pct_64r", pct["host"], "%", pct["bare"],
               [f"{wall:.1f} s idle, {method}; host {cpu['host'] * 1000:.1f} ms,"
                f" floor {cpu['bare'] * 1000:.1f} ms of CPU"]),
    ]


def run(ctx: Context) -> List[Figure]:
    figures = []
    if any(ctx.wants(f"rss_mb_{n}r") for n in SMALL):
        figures.extend(asyncio.run(_measure_small(ctx)))
    if any(ctx.wants(key) for key in ("rss_mb_64r_10k", "idle_cpu_pct_64r")):
        figures.extend(asyncio.run(_measure(ctx)))
    return [f for f in figures if ctx.wants(f.key)]
