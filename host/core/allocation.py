"""Allocation without I/O: the default merge of device data, and the NUMA-compact policy.

Both are pure functions over Device records, so Allocate and GetPreferredAllocation answer from
memory in microseconds, and drivers that override either can reuse them.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Dict, FrozenSet, Iterable, List, Sequence, Tuple

from host.core.model import ContainerAllocation, Device, DeviceNode, Mount


def merge(devices: Sequence[Device]) -> ContainerAllocation:
    """One container's response from the data carried on each device, in request order.

    Device nodes and mounts are de-duplicated by container path (shared control nodes such as
    /dev/nvidiactl appear on every GPU); env and annotation values of the same key from several
    devices are joined with "," (PCIDEVICE_*=addr1,addr2), repeated values once; CDI names are
    de-duplicated.
    """
    nodes: Dict[str, DeviceNode] = {}
    mounts: Dict[str, Mount] = {}
    envs: Dict[str, List[str]] = {}
    annotations: Dict[str, List[str]] = {}
    cdi: Dict[str, None] = {}
    for device in devices:
        for node in device.device_nodes:
            nodes.setdefault(node.container_path, node)
        for mount in device.mounts:
            mounts.setdefault(mount.container_path, mount)
        _collect(envs, device.env.items())
        _collect(annotations, device.annotations.items())
        for name in device.cdi_devices:
            cdi.setdefault(name, None)
    return ContainerAllocation(
        envs={key: ",".join(values) for key, values in envs.items()},
        mounts=tuple(mounts.values()),
        device_nodes=tuple(nodes.values()),
        annotations={key: ",".join(values) for key, values in annotations.items()},
        cdi_devices=tuple(cdi),
    )


def _collect(into: Dict[str, List[str]], items: Iterable[Tuple[str, str]]) -> None:
    for key, value in items:
        values = into.setdefault(key, [])
        if value not in values:
            values.append(value)


def natural_key(text: str) -> Tuple[int, str]:
    """A stable pick order: "gpu2" before "gpu10" (shorter first), and fixed-width ids such as
    PCI addresses (hex: 0000:3b:00.0 after 0000:18:00.0) in plain text order."""
    return (len(text), text)


def replica_preferred(
    available: Sequence[Device],
    must_include: Sequence[Device],
    size: int,
    replicas: int,
    policy: str,
) -> List[str]:
    """Pick replica ids (``<device>::<k>``) by policy.

    "pack" fills the devices that are already most used first (then the must-include ones),
    keeping whole devices free for exclusive-minded pods; "spread" takes one replica from
    each of the least-used devices in turn, so co-located containers contend least.
    """
    chosen: Dict[str, Device] = {d.id: d for d in must_include}
    groups: Dict[str, List[Device]] = {}
    for device in sorted(available, key=lambda d: natural_key(d.id)):
        if device.id not in chosen:
            groups.setdefault(device.attributes.get("replica_of", device.id), []).append(device)
    must_groups = {d.attributes.get("replica_of", d.id) for d in must_include}

    def in_use(group: str) -> int:
        return replicas - len(groups[group])

    if policy == "spread":
        order = sorted(groups, key=lambda g: (in_use(g), natural_key(g)))
        while len(chosen) < size and any(groups[g] for g in order):
            for group in order:
                if len(chosen) >= size:
                    break
                if groups[group]:
                    device = groups[group].pop(0)
                    chosen[device.id] = device
    else:
        order = sorted(groups, key=lambda g: (g not in must_groups, -in_use(g), natural_key(g)))
        for group in order:
            for device in groups[group]:
                if len(chosen) >= size:
                    break
                chosen[device.id] = device
    return list(chosen)


_NO_TOPOLOGY: FrozenSet[int] = frozenset()


def numa_compact(
    available: Sequence[Device], must_include: Sequence[Device], size: int
) -> List[str]:
    """Pick ``size`` ids spanning as few NUMA nodes as possible.

    Must-include devices are always in the answer and their nodes are "free" to use. Among
    node sets of equal count, the one leaving the least spare devices wins (best fit), which
    keeps larger NUMA-local pools for later, larger requests. Devices without topology are used
    only when topology-aware ones cannot fill the request. Returns fewer than ``size`` ids only
    when fewer are available.
    """
    chosen: Dict[str, Device] = {d.id: d for d in must_include}
    need = size - len(chosen)
    if need <= 0:
        return list(chosen)[: max(size, len(chosen))]
    pool = sorted(
        (d for d in available if d.id not in chosen), key=lambda d: natural_key(d.id)
    )
    groups: Dict[FrozenSet[int], List[Device]] = {}
    for device in pool:
        groups.setdefault(frozenset(device.numa_nodes), []).append(device)
    located = {nodes: devs for nodes, devs in groups.items() if nodes}
    base: FrozenSet[int] = frozenset(n for d in chosen.values() for n in d.numa_nodes)
    others = sorted(frozenset().union(*located) - base) if located else []

    best: Tuple[FrozenSet[int], int] = (frozenset(), -1)
    for extra_count in range(len(others) + 1):
        for extra in itertools.combinations(others, extra_count):
            nodes = base | frozenset(extra)
            fitting = sum(len(devs) for key, devs in located.items() if key <= nodes)
            if fitting >= need and (best[1] < 0 or fitting < best[1]):
                best = (nodes, fitting)
        if best[1] >= 0:
            break
    if best[1] >= 0:
        span = best[0]
        # Devices on the must-include nodes first, then the added nodes in order.
        ordered = sorted(
            (d for key, devs in located.items() if key <= span for d in devs),
            key=lambda d: (not frozenset(d.numa_nodes) <= base, sorted(d.numa_nodes),
                           natural_key(d.id)),
        )
    else:
        ordered = sorted(
            (d for devs in located.values() for d in devs),
            key=lambda d: (sorted(d.numa_nodes), natural_key(d.id)),
        )
        ordered += groups.get(_NO_TOPOLOGY, [])
    for device in ordered[:need]:
        chosen[device.id] = device
    if len(chosen) < size:
        for device in groups.get(_NO_TOPOLOGY, []):
            if len(chosen) >= size:
                break
            chosen.setdefault(device.id, device)
    return list(chosen)


def replicate(device: Device, count: int) -> List[Device]:
    """The one sharing mechanism: ``count`` ids ``<id>::<k>`` for one device, each carrying
    the device's data and ``replica_of`` (what replica policies group by). ``replicas`` on a
    resource and a driver's own sharing setting (usb ``shared``) both come through here."""
    attributes = {**device.attributes, "replica_of": device.id}
    return [replace(device, id=f"{device.id}::{k}", attributes=attributes) for k in range(count)]
