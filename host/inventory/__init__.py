"""Per-driver snapshots turned into per-resource device lists the kubelet can trust.

Drivers hand over whole snapshots. Here they are checked (garbage from a third-party driver
never reaches the kubelet), devices that vanished are kept as Unhealthy for a grace period (a
pod holding one sees it fail instead of silently disappearing; a replug within the grace keeps
the same id), and a driver that raises or hangs degrades only its own resources: their last
known devices turn Unhealthy with the driver's error as the reason.

What is pure lives beside it: checking a report (host/inventory/sanitize.py), the scan as it runs in
the driver's thread with its AER reads (host/inventory/probe.py), and what the host adds
(host/inventory/host_view.py: drains, AER health, replicas). This module keeps the state across
scans (vanished grace, claims and overlaps, the device cap, drains).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from host.core.drains import DrainKey
from host.core.driver import Driver
from host.core.health import AerCounts, AerTracker
from host.core.hostfs import HostFS
from host.core.isolation import DriverCallError, DriverCalls
from host.core.model import Device, Health, ResourceConfig
from host.core.overlap import Overlap, find_overlaps
from host.inventory.host_view import host_view
from host.inventory.probe import discover_and_probe
from host.inventory.sanitize import sanitize

log = logging.getLogger(__name__)

#: Advertised devices on one host, replicas included (README). Far past any real node; what
#: keeps a runaway driver or ``replicas`` on a big card pool from taking the host's memory.
MAX_DEVICES = 100_000


@dataclass
class DriverStatus:
    """What operators (discover, metrics, logs) are told about a driver."""

    name: str
    last_ok: Optional[float] = None  # time.time() of the last successful scan
    last_error: Optional[str] = None
    scans: int = 0
    errors: int = 0
    scanning: bool = False
    rescan_pending: bool = False


class Inventory:
    def __init__(
        self,
        host: HostFS,
        drivers: Mapping[str, Driver],
        resources: Sequence[ResourceConfig],
        calls: DriverCalls,
        *,
        discover_timeout_s: float,
        vanished_grace_s: float,
    ) -> None:
        self.host = host
        self.drivers = dict(drivers)
        self.calls = calls
        self.discover_timeout_s = discover_timeout_s
        self.vanished_grace_s = vanished_grace_s
        self.resources: Dict[str, ResourceConfig] = {}
        self.by_driver: Dict[str, List[ResourceConfig]] = {}
        self.devices: Dict[str, List[Device]] = {}
        self.status: Dict[str, DriverStatus] = {}
        self._vanished: Dict[str, Dict[str, float]] = {}  # resource -> id -> monotonic time
        self._machine_numa = host.machine_numa_nodes()
        # What the driver reported last, checked but before host-level health and replicas,
        # so a drain mark or a config change re-publishes without rescanning.
        self._reported: Dict[str, List[Device]] = {}
        self._aer = AerTracker()
        self._aer_problems: Dict[str, Dict[str, str]] = {}  # resource -> pci address -> why
        self.drains: Dict[DrainKey, str] = {}
        # Devices claimed by two resources (host/core/overlap.py): the driver that reported each
        # resource's devices, the ids it must leave out, the overlaps found by the last scan,
        # and the ones warned of.
        self._reported_by: Dict[str, str] = {}
        self._excluded: Dict[str, FrozenSet[str]] = {}
        self.overlaps: List[Overlap] = []
        self._warned: Set[Tuple[str, str, str]] = set()
        # Off where an overlap is reported as a config error instead (check-config, start-up).
        self.warn_overlaps = True
        self._capped: Dict[str, int] = {}  # resource -> devices left out by MAX_DEVICES
        self.set_resources(resources)

    def set_resources(self, resources: Sequence[ResourceConfig]) -> None:
        old = self.resources
        self.resources = {r.name: r for r in resources}
        self.by_driver = {}
        for resource in resources:
            self.by_driver.setdefault(resource.driver, []).append(resource)
            self.devices.setdefault(resource.name, [])
        for name in list(self.devices):
            if name not in self.resources:
                del self.devices[name]
                self._vanished.pop(name, None)
                self._reported.pop(name, None)
                self._reported_by.pop(name, None)
                self._aer.retain(name, ())
                self._aer_problems.pop(name, None)
        # A resource whose config changed (selectors, replicas) is rescanned by the caller;
        # its replicas are re-derived right away from what the driver last reported.
        for name, resource in self.resources.items():
            if name in old and old[name] != resource:
                # Ids that a config change retires (new selectors, replicas) are not devices
                # gone from the host: no Unhealthy grace period for them.
                self.devices[name] = []
                self._vanished.pop(name, None)
                if name in self._reported:
                    self._publish(name, self._host_view(resource, self._reported[name]))
        for driver in self.by_driver:
            self.status.setdefault(driver, DriverStatus(driver))
        self._refresh_overlaps()  # file order or shared_with may have changed

    def drivers_for_subsystem(self, subsystem: str) -> Set[str]:
        return {
            name for name in self.by_driver
            if subsystem in getattr(self.drivers.get(name), "subsystems", ())
        }

    # -- scanning -----------------------------------------------------------------------
    async def scan(self, drivers: Optional[Iterable[str]] = None) -> Set[str]:
        """Rescan the given drivers (all by default) concurrently; the changed resources."""
        names = list(drivers) if drivers is not None else list(self.by_driver)
        results = await asyncio.gather(
            *(self._scan_driver(n) for n in names if n in self.by_driver)
        )
        changed: Set[str] = set()
        for result in results:
            changed |= result
        changed |= self.expire_vanished()
        return changed

    async def _scan_driver(self, name: str) -> Set[str]:
        status = self.status[name]
        resources = self.by_driver[name]
        if status.scanning or self.calls.hung(name):
            status.rescan_pending = True  # run again once the current scan returns
            return set()
        driver = self.drivers.get(name)
        status.scanning = True
        changed: Set[str] = set()
        try:
            while True:
                status.rescan_pending = False
                changed |= await self._scan_once(name, driver, resources, status)
                if not status.rescan_pending:
                    break
        finally:
            status.scanning = False
        return changed

    async def _scan_once(
        self, name: str, driver: Optional[Driver], resources: List[ResourceConfig],
        status: DriverStatus,
    ) -> Set[str]:
        status.scans += 1
        try:
            if driver is None:
                raise DriverCallError(name, "discover", "driver is not loaded")
            result, aer = await self.calls.call(
                name, "discover", self.discover_timeout_s, self._discover_and_probe, driver,
                list(resources),
            )
        except DriverCallError as error:
            status.errors += 1
            status.last_error = str(error)
            log.error("%s; its resources (%s) report Unhealthy", error,
                      ", ".join(r.name for r in resources))
            return self._degrade(resources, str(error))
        status.last_ok = time.time()
        if status.last_error:
            log.info("driver %r recovered", name)
        status.last_error = None
        changed = set()
        for resource in resources:
            devices = self._sanitize(name, resource.name, result.get(resource.name, ()))
            self._reported[resource.name] = devices
            self._reported_by[resource.name] = name
        # Before publishing: a device two resources claim is never advertised by both.
        changed |= self._refresh_overlaps()
        for resource in resources:
            devices = self._reported[resource.name]
            if resource.health_interval_s > 0:
                read = aer.get(resource.name, {})
                self._aer_problems[resource.name] = {
                    address: self._aer.problem(resource.name, address, counts,
                                               resource.health_interval_s)
                    for address, counts in read.items()
                }
                self._aer.retain(resource.name, read)
            else:
                self._aer.retain(resource.name, ())
                self._aer_problems.pop(resource.name, None)
            if self._publish(resource.name, self._host_view(resource, devices)):
                changed.add(resource.name)
        for extra in set(result) - {r.name for r in resources}:
            log.warning("driver %r returned devices for %r, which it was not asked for", name,
                        extra)
        return changed

    def _discover_and_probe(
        self, driver: Driver, resources: List[ResourceConfig]
    ) -> Tuple[Mapping[str, Sequence[Device]], Dict[str, Dict[str, Optional[AerCounts]]]]:
        return discover_and_probe(self.host, driver, resources)

    def _refresh_overlaps(self) -> Set[str]:
        """Recompute which devices each resource leaves to an earlier one; republish the
        resources whose share changed and warn once per newly overlapping device."""
        excluded, overlaps = find_overlaps(list(self.resources.values()), self._reported,
                                           reporters=self._reported_by)
        self.overlaps = overlaps
        for overlap in overlaps:
            new = [i for i in overlap.device_ids
                   if (overlap.first, overlap.second, i) not in self._warned]
            if new and self.warn_overlaps:
                self._warned.update((overlap.first, overlap.second, i) for i in new)
                log.warning("resource %s: %s also claimed by resource %s, which comes first in "
                            "the config: only %s advertises them (set shared_with to share)",
                            overlap.second, Overlap(overlap.first, overlap.second,
                                                    tuple(new)).describe(),
                            overlap.first, overlap.first)
        moved = {name for name in set(excluded) | set(self._excluded)
                 if excluded.get(name) != self._excluded.get(name)}
        self._excluded = excluded
        changed = set()
        for name in moved:
            resource = self.resources.get(name)
            if resource is not None and name in self._reported and self._publish(
                    name, self._host_view(resource, self._reported[name])):
                changed.add(name)
        return changed

    def _host_view(self, resource: ResourceConfig, devices: List[Device]) -> List[Device]:
        return self._cap(resource.name, host_view(
            resource, devices, excluded=self._excluded.get(resource.name),
            aer=self._aer_problems.get(resource.name, {}), drains=self.drains))

    def _cap(self, resource: str, devices: List[Device]) -> List[Device]:
        """Keep the host within MAX_DEVICES: a resource gets what the others leave, and
        what does not fit is not advertised, with one error line per change in the count."""
        others = sum(len(d) for name, d in self.devices.items() if name != resource)
        room = max(0, MAX_DEVICES - others)
        left_out = max(0, len(devices) - room)
        if left_out != self._capped.get(resource, 0):
            if left_out:
                log.error("resource %s: %d devices would pass the host's limit of %d "
                          "advertised devices (replicas included); %d are not advertised",
                          resource, len(devices), MAX_DEVICES, left_out)
            else:
                log.info("resource %s: all its devices fit within the limit again", resource)
            self._capped[resource] = left_out
        return devices[:room] if left_out else devices

    def set_drains(self, drains: Mapping[DrainKey, str]) -> Set[str]:
        """Apply the operator's marks; the resources whose advertised health changed."""
        touched = {r for r, _ in drains} | {r for r, _ in self.drains}
        self.drains = dict(drains)
        changed = set()
        for name in touched:
            resource = self.resources.get(name)
            if resource is not None and name in self._reported and self._publish(
                name, self._host_view(resource, self._reported[name])
            ):
                changed.add(name)
        return changed

    def _degrade(self, resources: List[ResourceConfig], reason: str) -> Set[str]:
        changed = set()
        for resource in resources:
            current = self.devices.get(resource.name, [])
            degraded = [d if not d.healthy and d.health_reason == reason
                        else d.with_health(Health.UNHEALTHY, reason) for d in current]
            if degraded != current:
                self.devices[resource.name] = degraded
                changed.add(resource.name)
        return changed

    def _sanitize(self, driver: str, resource: str, devices: object) -> List[Device]:
        return sanitize(driver, resource, devices, self._machine_numa)

    def _publish(self, resource: str, devices: List[Device]) -> bool:
        """Merge in vanished devices (Unhealthy, until their grace ends); True on change."""
        now = time.monotonic()
        vanished = self._vanished.setdefault(resource, {})
        present = {d.id for d in devices}
        for device_id in list(vanished):
            if device_id in present:
                del vanished[device_id]
                log.info("resource %s: device %s is back", resource, device_id)
        result = list(devices)
        left = self._excluded.get(resource, frozenset())
        if self.vanished_grace_s > 0:
            for old in self.devices.get(resource, []):
                if old.id in present or old.attributes.get("replica_of", old.id) in left:
                    continue  # still here, or now advertised by the resource it belongs to
                since = vanished.setdefault(old.id, now)
                if since == now:
                    log.warning("resource %s: device %s is gone from the host", resource, old.id)
                if now - since < self.vanished_grace_s:
                    result.append(old if old.health_reason == "gone from the host"
                                  else old.with_health(Health.UNHEALTHY, "gone from the host"))
                else:
                    del vanished[old.id]
        if result == self.devices.get(resource):
            return False
        self.devices[resource] = result
        return True

    def expire_vanished(self) -> Set[str]:
        """Drop vanished devices whose grace ended; the resources that changed."""
        now = time.monotonic()
        changed = set()
        for resource, vanished in self._vanished.items():
            expired = {i for i, since in vanished.items() if now - since >= self.vanished_grace_s}
            if expired:
                for device_id in expired:
                    del vanished[device_id]
                self.devices[resource] = [d for d in self.devices.get(resource, [])
                                          if d.id not in expired]
                changed.add(resource)
        return changed

    def next_expiry(self) -> Optional[float]:
        """Seconds until the next vanished device must be dropped, if any."""
        times = [since for v in self._vanished.values() for since in v.values()]
        if not times:
            return None
        return max(0.0, min(times) + self.vanished_grace_s - time.monotonic())
