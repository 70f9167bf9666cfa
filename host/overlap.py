"""Devices claimed by more than one resource.

Two resources whose selectors match the same GPU would advertise it twice, and the kubelet
would give it to two pods: it cannot know that ``example.com/a`` device ``0000:18:00.0`` and
``example.com/b`` device ``0000:18:00.0`` are one card. So a device belongs to one resource
unless the operator says otherwise with ``shared_with`` on either of them. In a config file an
overlap is an error (check-config, start-up and reload find it with a scan); one that appears
later (a hot-plugged device matching both) gives the device to the first resource in file
order.

A device is "the same" when the same driver reports the same id for it (ids are stable
hardware identities: PCI address, serial), or when two drivers report devices with the same
``pci_address`` attribute (a GPU driver and a vfio one on one function). Within one driver a
shared ``pci_address`` is not enough: MIG slices or partitions of one card carry their card's
address, and two resources of different slice profiles on one GPU are a normal layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Mapping, Optional, Sequence, Set, Tuple

from host.model import Device, ResourceConfig

#: Shown per overlap in messages; the rest is counted.
SHOWN_IDS = 5


@dataclass(frozen=True)
class Overlap:
    """``second`` (later in file order) claims ``device_ids`` that ``first`` also claims."""

    first: str
    second: str
    device_ids: Tuple[str, ...]

    def describe(self) -> str:
        ids = ", ".join(self.device_ids[:SHOWN_IDS])
        more = len(self.device_ids) - SHOWN_IDS
        if more > 0:
            ids += f" and {more} more"
        count = len(self.device_ids)
        return f"{count} device{'s' if count != 1 else ''} ({ids})"


def claim_keys(driver: str, device: Device) -> Tuple[str, ...]:
    """What makes two reported devices one piece of hardware."""
    address = device.attributes.get("pci_address")
    own = f"{driver}\0{device.id}"
    return (own, f"pci\0{address}") if isinstance(address, str) and address else (own,)


def may_share(a: ResourceConfig, b: ResourceConfig) -> bool:
    return b.name in a.shared_with or a.name in b.shared_with


def find_overlaps(
    resources: Sequence[ResourceConfig],
    reported: Mapping[str, Sequence[Device]],
    keys: Mapping[str, FrozenSet[str]],
) -> Tuple[Dict[str, FrozenSet[str]], List[Overlap]]:
    """(device ids each resource must leave out, the overlaps), resources in file order.

    ``keys`` holds each resource's claim keys (``claim_keys`` of every reported device), kept
    by the caller between scans, so the common case (no overlap) is a few set operations in C
    instead of a Python loop over every device.
    """
    claimed: Set[str] = set()
    earlier: List[ResourceConfig] = []
    excluded: Dict[str, FrozenSet[str]] = {}
    overlaps: List[Overlap] = []
    for resource in resources:
        mine = keys.get(resource.name, frozenset())
        if mine and not claimed.isdisjoint(mine):
            dropped = _resolve(resource, reported, keys, earlier, overlaps)
            if dropped:
                excluded[resource.name] = dropped
        claimed |= mine
        earlier.append(resource)
    return excluded, overlaps


def _resolve(
    resource: ResourceConfig,
    reported: Mapping[str, Sequence[Device]],
    keys: Mapping[str, FrozenSet[str]],
    earlier: Sequence[ResourceConfig],
    overlaps: List[Overlap],
) -> FrozenSet[str]:
    """The slow path, only for a resource that does overlap an earlier one."""
    owners: Dict[str, List[ResourceConfig]] = {}
    for other in earlier:
        if may_share(other, resource):
            continue
        for key in keys.get(other.name, frozenset()):
            owners.setdefault(key, []).append(other)
    rank = {other.name: index for index, other in enumerate(earlier)}
    dropped: Dict[str, List[str]] = {}
    for device in reported.get(resource.name, ()):
        owner = _first_owner(resource, device, owners, rank)
        if owner is not None:
            dropped.setdefault(owner.name, []).append(device.id)
    for owner_name, ids in dropped.items():
        overlaps.append(Overlap(owner_name, resource.name, tuple(ids)))
    return frozenset(i for ids in dropped.values() for i in ids)


def _first_owner(
    resource: ResourceConfig, device: Device, owners: Mapping[str, List[ResourceConfig]],
    rank: Mapping[str, int],
) -> Optional[ResourceConfig]:
    """The earliest resource in file order that already claims this device, if any."""
    own, *pci = claim_keys(resource.driver, device)
    candidates = list(owners.get(own, ()))
    for key in pci:  # the PCI function counts only between different drivers
        candidates += [o for o in owners.get(key, ()) if o.driver != resource.driver]
    return min(candidates, key=lambda o: rank[o.name]) if candidates else None
