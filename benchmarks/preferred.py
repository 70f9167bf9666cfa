"""The NUMA-compact policy alone: ``host.core.allocation.numa_compact`` over 1024 devices on 8 NUMA
nodes (128 a node), for request sizes 8, 64 and 200, each without and with must-include ids
(two ids on different nodes, which forces a wider node set).

Figure: the slowest shape's median over many calls; every shape's median is in the notes.
Floor: for that same shape, sorting the 1024 available ids into pick order
(``sorted(ids, key=natural_key)[:size]``), the least any policy that answers in a stable order
does; numa_compact sorts once the same way, so the ratio is the policy's own work.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from benchmarks.core import Context, Figure, median, now
from device_plugin_host_testing.drivers import make_devices
from host.core.allocation import natural_key, numa_compact

KEYS = ("preferred_ms_1024_8numa",)
DEVICES = 1024
NUMA_NODES = 8
SIZES = (8, 64, 200)


def run(ctx: Context) -> List[Figure]:
    if not ctx.wants(KEYS[0]):
        return []
    calls = ctx.pick(200, 60, 3)
    devices = make_devices("gpu", DEVICES, tuple(range(NUMA_NODES)))
    ids = [d.id for d in devices]
    per_node = DEVICES // NUMA_NODES
    must_pair = [devices[3 * per_node + 5], devices[5 * per_node + 7]]  # nodes 3 and 5
    results: Dict[str, Tuple[float, float]] = {}
    for size in SIZES:
        for must in ([], must_pair):
            shape = f"size {size}{' +must' if must else ''}"
            picked = numa_compact(devices, must, size)  # a sanity check, and warm-up
            if len(picked) != size or not {d.id for d in must} <= set(picked):
                raise RuntimeError(f"numa_compact answered {len(picked)} ids for {shape}")
            policy: List[float] = []
            floor: List[float] = []
            for _ in range(calls):
                started = now()
                numa_compact(devices, must, size)
                policy.append((now() - started) * 1000)
                started = now()
                sorted(ids, key=natural_key)[:size]
                floor.append((now() - started) * 1000)
            results[shape] = (median(policy), median(floor))
    worst = max(results, key=lambda shape: results[shape][0])
    value, floor_value = results[worst]
    details = ", ".join(f"{shape} {ms:.2f}" for shape, (ms, _) in results.items())
    return [Figure(KEYS[0], value, "ms", floor_value, [
        f"slowest shape: {worst}; medians (ms) of {calls}: {details}",
        "floor: sorting the 1024 ids by natural_key",
    ])]
