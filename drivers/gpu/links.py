"""GetPreferredAllocation for GPUs that know their links: XGMI (KFD io_links) and NVLink (NVML).

Which GPUs a multi-GPU job gets matters more than NUMA: collective operations run at the speed
of the slowest link, and two MI300X without a direct XGMI link talk over PCIe. So the choice
is made over *GPUs* (a partition or MIG device counts as its parent GPU; partitions of one GPU
are the closest of all), ranked by:

1. the chosen GPUs form a clique of direct links (every pair one hop apart),
2. as few GPUs as possible (partitions of one GPU before partitions of several),
3. as few NUMA nodes as possible,
4. the least spare capacity left in the chosen GPUs (best fit keeps whole GPUs free),

and then filled from the GPUs holding must-include devices first, the fullest-used first.
Pure: reads only attributes the scan put on each Device (``pci_address``, ``xgmi_peers``,
``nvlink_peers``). Returns None where links say nothing NUMA-compact would not (no link facts
and one device per GPU), or the GPUs are more than 12, too many to rank exhaustively.
"""

from __future__ import annotations

import itertools
from typing import Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

from device_plugin_host import Device, natural_key

LINK_ATTRIBUTES = ("xgmi_peers", "nvlink_peers")
MAX_GPUS_RANKED = 12  # 4096 subsets at most (~10 ms); a node has 8


def group_of(device: Device) -> str:
    return device.attributes.get("pci_address", device.id)


def peers_of(device: Device) -> Set[str]:
    out: Set[str] = set()
    for key in LINK_ATTRIBUTES:
        value = device.attributes.get(key)
        if value:
            out.update(part for part in value.split(",") if part)
    return out


def link_preferred(
    available: Sequence[Device], must_include: Sequence[Device], size: int
) -> Optional[List[str]]:
    must_ids = [d.id for d in must_include]
    need = size - len(must_ids)
    if need <= 0:
        return must_ids[:max(size, len(must_ids))]
    groups: Dict[str, List[Device]] = {}
    numa: Dict[str, FrozenSet[int]] = {}
    peers: Dict[str, Set[str]] = {}
    for device in [*must_include, *available]:
        group = group_of(device)
        peers.setdefault(group, set()).update(peers_of(device))
        numa[group] = numa.get(group, frozenset()) | frozenset(device.numa_nodes)
        if device.id not in must_ids:
            members = groups.setdefault(group, [])
            if all(d.id != device.id for d in members):
                members.append(device)
    must_groups = {group_of(d) for d in must_include}
    every = sorted(set(groups) | must_groups)
    linked = any(peers.values())
    if not linked and all(len(v) <= 1 for v in groups.values()):
        return None  # nothing beyond NUMA to go by
    if len(every) > MAX_GPUS_RANKED:
        return None

    def adjacent(a: str, b: str) -> bool:
        return a == b or b in peers.get(a, ()) or a in peers.get(b, ())

    others = [g for g in every if g not in must_groups]
    best: Optional[Tuple[Tuple, FrozenSet[str]]] = None
    for count in range(len(others) + 1):
        if best is not None and not best[0][0]:
            break  # a clique of fewer GPUs beats anything larger
        for extra in itertools.combinations(others, count):
            chosen = frozenset(must_groups) | frozenset(extra)
            free = sum(len(groups.get(g, ())) for g in chosen)
            if free < need or not chosen:
                continue
            clique = all(adjacent(a, b) for a, b in itertools.combinations(sorted(chosen), 2))
            span = frozenset().union(*(numa[g] for g in chosen))
            score = (not clique, len(chosen), len(span) if span else 99, free - need,
                     sorted(natural_key(g) for g in chosen))
            if best is None or score < best[0]:
                best = (score, chosen)
    if best is None:
        return None  # fewer devices than asked for: the host's policy says what it can
    chosen = best[1]
    used = {g: sum(1 for d in must_include if group_of(d) == g) for g in chosen}
    order = sorted(chosen, key=lambda g: (g not in must_groups, -used[g], len(groups.get(g, ())),
                                          natural_key(g)))
    picked = list(must_ids)
    for group in order:
        for device in sorted(groups.get(group, ()), key=lambda d: natural_key(d.id)):
            if len(picked) >= size:
                break
            picked.append(device.id)
    return picked
