"""The topology manager's NUMA choice with the device manager as the only hint provider.

Pure functions over NUMA id tuples, so the choice a real kubelet would make can be tested
without sockets. NUMA masks are frozensets of node ids.
"""

from __future__ import annotations

import itertools
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

Mask = FrozenSet[int]
Hint = Tuple[Mask, bool]  # (NUMA affinity, preferred)


def _mask_key(mask: Mask) -> Tuple[int, int]:
    """Narrowest first; equal widths compare as bit masks, so lower node ids win."""
    return (len(mask), sum(1 << n for n in mask if n >= 0))


def topology_hints(
    nodes: Sequence[int],
    all_devices: Sequence[Tuple[int, ...]],
    available: Sequence[Tuple[int, ...]],
    request: int,
) -> List[Hint]:
    """Every NUMA mask holding enough available devices, marked preferred when it is as narrow
    as the narrowest mask that the resource's devices (healthy or not) could ever fill."""
    if len(available) < request:
        return []
    masks = [
        frozenset(combo)
        for size in range(1, len(nodes) + 1)
        for combo in itertools.combinations(sorted(nodes), size)
    ]
    min_size = len(nodes)
    hints: List[Mask] = []
    for mask in masks:
        if sum(1 for numa in all_devices if mask.intersection(numa)) >= request:
            min_size = min(min_size, len(mask))
        if sum(1 for numa in available if mask.intersection(numa)) >= request:
            hints.append(mask)
    return [(mask, len(mask) == min_size) for mask in hints]


def merge_hints(hints: Sequence[Hint], nodes: Sequence[int], policy: str) -> Hint:
    """The best hint the topology manager would pick, and whether it is preferred."""
    default = frozenset(nodes)
    if policy == "single-numa-node":
        hints = [(mask, pref) for mask, pref in hints if pref and len(mask) == 1]
    # With one provider, the narrowest width any hint offers is what a non-preferred pick aims at.
    target = min((len(mask) for mask, _ in hints), default=0)

    def narrower(current: Hint, candidate: Hint) -> Hint:
        return candidate if _mask_key(candidate[0]) < _mask_key(current[0]) else current

    best: Optional[Hint] = None
    for mask, pref in hints:
        candidate = (mask & default, pref)
        if not candidate[0]:
            continue
        if best is None or (pref and not best[1]):
            best = candidate
        elif best[1] and not pref:
            continue
        elif pref:
            best = narrower(best, candidate)
        else:
            current_width, width = len(best[0]), len(candidate[0])
            if current_width > target or current_width == width:
                best = narrower(best, candidate)
            elif current_width < target and (width == target or current_width < width < target):
                best = candidate
    return best if best is not None else (default, False)


def choose_affinity(
    nodes: Sequence[int],
    numa: Dict[str, Tuple[int, ...]],
    available: Sequence[str],
    request: int,
    policy: str,
) -> Hint:
    """Hints over ``nodes`` for ``request`` devices out of ``available``, merged by ``policy``."""
    hints = topology_hints(nodes, list(numa.values()), [numa[d] for d in available], request)
    return merge_hints(hints, nodes, policy)


def split_by_affinity(
    ids: Sequence[str], numa: Dict[str, Tuple[int, ...]], affinity: Mask
) -> Tuple[List[str], List[str], List[str]]:
    """(aligned, unaligned, without topology), keeping the order of ``ids``.

    A device on several nodes is aligned when any of them is in the affinity; -1 is the
    kubelet's "no topology" bucket, never a node.
    """
    aligned: List[str] = []
    unaligned: List[str] = []
    without: List[str] = []
    for dev in ids:
        nodes = numa.get(dev, ())
        if affinity.intersection(nodes):
            aligned.append(dev)
        elif any(n != -1 for n in nodes):
            unaligned.append(dev)
        else:
            without.append(dev)
    return aligned, unaligned, without
