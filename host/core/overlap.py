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

from operator import attrgetter, methodcaller
from typing import Dict, FrozenSet, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple

from host.core.model import Device, ResourceConfig

#: Shown per overlap in messages; the rest is counted.
SHOWN_IDS = 5

_id = attrgetter("id")
_attributes = attrgetter("attributes")
_pci_address = methodcaller("get", "pci_address")


class Overlap(NamedTuple):
    """``second`` (later in file order) claims ``device_ids`` that ``first`` also claims.
    Built only when two resources overlap."""

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


def resource_claim_keys(driver: str, devices: Sequence[Device]) -> FrozenSet[str]:
    return frozenset(key for device in devices for key in claim_keys(driver, device))


def may_share(a: ResourceConfig, b: ResourceConfig) -> bool:
    return b.name in a.shared_with or a.name in b.shared_with


def _pci_keys(driver: str, devices: Sequence[Device]) -> Set[str]:
    """The PCI claim keys of these devices, without their ``pci`` prefix: their PCI
    functions, and the ids themselves for a driver named ``pci`` (whose own keys have the
    same prefix). Most devices have no address, which ``filter`` drops in C."""
    found = {a for a in filter(None, map(_pci_address, map(_attributes, devices)))
             if isinstance(a, str)}
    if driver == "pci":
        found.update(map(_id, devices))
    return found


def find_overlaps(
    resources: Sequence[ResourceConfig],
    reported: Mapping[str, Sequence[Device]],
    keys: Optional[Mapping[str, FrozenSet[str]]] = None,
    reporters: Optional[Mapping[str, str]] = None,
) -> Tuple[Dict[str, FrozenSet[str]], List[Overlap]]:
    """(device ids each resource must leave out, the overlaps), resources in file order.

    ``reporters``: the driver that reported each resource's devices, where that is not (yet)
    its configured one. ``keys``: each resource's claim keys (``resource_claim_keys``), by
    default made when needed: only a resource that may overlap an earlier one needs them.

    The common case, no overlap, is found without a claim key per device: two resources'
    keys meet only on the same id from the same driver or on the same PCI key, so one set
    of ids per driver and one of PCI keys, filled in C and dropped after the call, flag
    exactly the resources that comparing each one's claim keys with the earlier ones' did.
    A host with 10,000 devices keeps no 10,000 keys and their sets for this between scans.
    """
    reporter = reporters or {}
    ids: Dict[str, Set[str]] = {}  # driver -> ids the earlier resources claim
    pci: Set[str] = set()  # the earlier resources' pci keys
    earlier: List[ResourceConfig] = []
    excluded: Dict[str, FrozenSet[str]] = {}
    overlaps: List[Overlap] = []
    made: Dict[str, FrozenSet[str]] = {}
    for resource in resources:
        devices = reported.get(resource.name, ())
        driver = reporter.get(resource.name, resource.driver)
        claimed = ids.setdefault(driver, set())
        mine = _pci_keys(driver, devices)
        if not (claimed.isdisjoint(map(_id, devices)) and pci.isdisjoint(mine)):
            if keys is None:
                for other in earlier:
                    if other.name not in made:
                        made[other.name] = resource_claim_keys(
                            reporter.get(other.name, other.driver),
                            reported.get(other.name, ()))
            dropped = _resolve(resource, reported, made if keys is None else keys, earlier,
                               overlaps)
            if dropped:
                excluded[resource.name] = dropped
        claimed.update(map(_id, devices))
        pci |= mine
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
