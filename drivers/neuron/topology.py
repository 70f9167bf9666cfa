"""Preferred allocations from the links the Neuron driver reports (pure, no I/O).

Each Neuron device lists the devices it is wired to in ``connected_devices`` (neuron_cdev.c,
from the firmware's topology: a 4x4 torus on trn1.32xlarge, a ring on inf2). Collective
operations across the devices of one pod run over those links, so AWS's scheduler extension
hands out connected sets; the same preference here: a set whose devices are reachable from
each other over links inside the set, with as many links inside as possible. When no
connected set of the size exists among the available devices, None: the host's NUMA-compact
policy answers instead.

For ``unit = "core"``: cores of as few devices as possible, whole devices' worth first.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Set, Tuple

from device_plugin_host import Device


def neighbours_of(devices: Sequence[Device]) -> Dict[str, Set[str]]:
    """Device id -> ids of the given devices it is linked to (links are read both ways)."""
    by_index = {d.attributes.get("neuron_index"): d.id for d in devices}
    out: Dict[str, Set[str]] = {d.id: set() for d in devices}
    for device in devices:
        for part in device.attributes.get("connected_devices", "").split(","):
            other = by_index.get(part.strip())
            if other is not None and other != device.id:
                out[device.id].add(other)
                out[other].add(device.id)
    return out


def connected_preferred(
    available: Sequence[Device], must: Sequence[Device], size: int
) -> Optional[List[str]]:
    ids = [d.id for d in available]
    must_ids = [d.id for d in must]
    if size <= len(must_ids):
        return must_ids[:size] if size == len(must_ids) else None
    if size > len(ids):
        return None
    links = neighbours_of(available)
    order = {device_id: position for position, device_id in enumerate(_by_index(available))}
    seeds: List[Tuple[str, ...]] = [tuple(must_ids)] if must_ids else [(i,) for i in order]
    best: Optional[Tuple[Tuple[int, int], List[str]]] = None
    for seed in seeds:
        grown = _grow(list(seed), size, links, order)
        if grown is None:
            continue
        inside = sum(len(links[a] & set(grown)) for a in grown) // 2
        score = (-inside, min(order[i] for i in grown))
        if best is None or score < best[0]:
            best = (score, grown)
    return None if best is None else best[1]


def _grow(
    chosen: List[str], size: int, links: Mapping[str, Set[str]], order: Mapping[str, int]
) -> Optional[List[str]]:
    """Add the frontier device with the most links into the set until it has ``size``; None
    when the set cannot grow connected (or the seed itself is not connected)."""
    members = set(chosen)
    while len(chosen) < size:
        frontier = {n for member in chosen for n in links[member]} - members
        if not frontier:
            return None
        pick = min(frontier, key=lambda n: (-len(links[n] & members), order[n]))
        chosen.append(pick)
        members.add(pick)
    return chosen if _connected(chosen, links) else None


def _connected(ids: Sequence[str], links: Mapping[str, Set[str]]) -> bool:
    members = set(ids)
    seen = {ids[0]}
    stack = [ids[0]]
    while stack:
        for other in links[stack.pop()] & members:
            if other not in seen:
                seen.add(other)
                stack.append(other)
    return seen == members


def _by_index(devices: Sequence[Device]) -> List[str]:
    def key(device: Device) -> Tuple[int, str]:
        text = device.attributes.get("neuron_index", "")
        return (int(text) if text.isdigit() else 1 << 30, device.id)

    return [d.id for d in sorted(devices, key=key)]


def cores_preferred(
    available: Sequence[Device], must: Sequence[Device], size: int
) -> List[str]:
    """Cores packed onto as few devices as possible: the must-include cores' devices first,
    then the devices with the most free cores (lowest index on a tie)."""
    by_device: Dict[str, List[str]] = {}
    index_of: Dict[str, int] = {}
    for core in available:
        parent = core.attributes.get("neuron_index", core.id)
        by_device.setdefault(parent, []).append(core.id)
        index_of[parent] = int(parent) if parent.isdigit() else 1 << 30
    chosen = [d.id for d in must]
    taken = set(chosen)
    first = {core.attributes.get("neuron_index", core.id) for core in must}
    ranked = sorted(by_device, key=lambda p: (p not in first, -len(by_device[p]), index_of[p]))
    for parent in ranked:
        for core_id in by_device[parent]:
            if len(chosen) >= size:
                return chosen
            if core_id not in taken:
                chosen.append(core_id)
                taken.add(core_id)
    return chosen[:size]
