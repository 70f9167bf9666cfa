"""The host: one event loop that discovers, serves, registers and keeps everything current.

Start-up order is the one the kubelet needs: scan every driver (concurrently, off the loop),
then for each resource create its snapshot and service, serve its socket, and only then
register. Later rescans only update snapshots; ListAndWatch streams see the change at once.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from typing import Callable, Dict, Iterable, List, Optional, Set, Union

from host.cdi import CdiWriter
from host.config import Config
from host.drain import read_drains
from host.driver import Driver, UnavailableDriver
from host.hostfs import HostFS
from host.inotify import DirectoryWatch
from host.inventory import Inventory
from host.isolation import DriverCalls
from host.metrics import HostMetrics
from host.model import Device, ResourceConfig
from host.registration import Endpoint, Registrar
from host.service import DevicePluginService
from host.snapshot import Snapshot
from host.watch import EventSource, RescanScheduler, device_events

log = logging.getLogger(__name__)


class HostApp:
    def __init__(
        self,
        config: Config,
        drivers: Dict[str, Driver],
        events: Union[str, EventSource, None] = "udev",
    ) -> None:
        """``events``: "udev" for the kernel's uevents, an EventSource (tests inject events),
        or None for no event-driven rescans (the safety rescan still runs)."""
        self.config = config
        self.drivers = drivers
        self.host = HostFS(config.host.host_root)
        self.calls = DriverCalls()
        self.calls.on_unhung = self._driver_unhung
        self.inventory = Inventory(
            self.host, drivers, config.resources, self.calls,
            discover_timeout_s=config.host.discover_timeout_s,
            vanished_grace_s=config.host.vanished_grace_s,
        )
        self.registrar = Registrar(config.host.plugin_dir, config.host.register_timeout_s)
        self.registrar.on_registered = self._endpoint_registered
        self.cdi = CdiWriter(config.host.cdi_dir)
        self.snapshots: Dict[str, Snapshot] = {}
        self.services: Dict[str, DevicePluginService] = {}
        self.ready = asyncio.Event()
        self.started_at = time.monotonic()
        self.on_ready: List[Callable[[], None]] = []
        self._safety: Optional[asyncio.TimerHandle] = None
        self._rescan_task: Optional[asyncio.Task] = None
        self._expiry: Optional[asyncio.TimerHandle] = None
        self._stopped = False
        self._events_spec = events
        self._drain_watch: Optional[DirectoryWatch] = None
        self._health_timers: Dict[str, asyncio.TimerHandle] = {}
        self.events: Optional[EventSource] = None
        self.scheduler = RescanScheduler(self._drivers_for_subsystem, self.request_rescan)
        self.metrics = HostMetrics(pod_resources_socket=config.host.pod_resources_socket)

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self.registrar.start()
        self._start_events()  # before the first scan: nothing plugged in meanwhile is missed
        self._watch_drains()
        await self.inventory.scan()
        self.metrics.sync_drivers(self.inventory.status)
        for resource in self.config.resources:
            self._sync(resource)
        self._arm_safety_rescan()
        self._arm_health_checks()
        self._arm_expiry()
        self._check_ready()
        # Everything built so far lives as long as the process: keep it out of the cyclic
        # collector, whose full passes over ~80,000 objects (10,000 devices) took ~18 ms and
        # set ListAndWatch's p99.
        gc.freeze()

    async def stop(self) -> None:
        """Stop serving and remove every socket of ours; hung driver threads are abandoned."""
        self._stopped = True
        self.scheduler.close()
        if self._drain_watch is not None:
            self._drain_watch.close()
        for timer in self._health_timers.values():
            timer.cancel()
        if self.events is not None:
            self.events.close()
        if self._safety is not None:
            self._safety.cancel()
        if self._expiry is not None:
            self._expiry.cancel()
        if self._rescan_task is not None:
            self._rescan_task.cancel()
        await self.registrar.close()
        self.cdi.remove_all()
        self.calls.shutdown()

    # -- serving ---------------------------------------------------------------------------
    def served(self) -> List[str]:
        return list(self.registrar.endpoints)

    def endpoint(self, resource: str) -> Optional[Endpoint]:
        return self.registrar.endpoints.get(resource)

    def _sync(self, resource: ResourceConfig) -> None:
        devices = self.inventory.devices.get(resource.name, [])
        snapshot = self.snapshots.get(resource.name)
        if snapshot is None:
            if not devices and not resource.register_when_empty:
                return  # a built-in default with nothing on this node: not advertised
            snapshot = Snapshot()
            snapshot.update(devices)
            self._write_cdi(resource, devices)
            driver = self.drivers.get(resource.driver) or UnavailableDriver(
                resource.driver, "not installed"
            )
            service = DevicePluginService(
                resource, driver,
                snapshot, self.calls, allocate_timeout_s=self.config.host.allocate_timeout_s,
                observer=self.metrics.allocate_observer,
            )
            self.snapshots[resource.name] = snapshot
            self.services[resource.name] = service
            self.registrar.add(service)
            self.metrics.set_devices(resource.name, devices)
            self.ready.clear()
            return
        self._write_cdi(resource, devices)  # before the kubelet can ask for a new device
        if snapshot.update(devices):
            log.info("resource %s: %d devices (%d healthy)", resource.name, len(devices),
                     sum(1 for d in devices if d.healthy))
        self.metrics.set_devices(resource.name, devices)

    def _write_cdi(self, resource: ResourceConfig, devices: List[Device]) -> None:
        if resource.cdi:
            self.cdi.update(resource.name, devices)

    async def rescan(self, drivers: Optional[Iterable[str]] = None) -> Set[str]:
        """Rescan drivers and push every changed resource to its streams."""
        changed = await self.inventory.scan(drivers)
        self.metrics.sync_drivers(self.inventory.status)
        for name in changed:
            resource = self.inventory.resources.get(name)
            if resource is not None:
                self._sync(resource)
        self._arm_expiry()
        return changed

    def request_rescan(self, drivers: Optional[Iterable[str]] = None) -> None:
        if self._stopped:
            return
        asyncio.get_running_loop().create_task(self.rescan(drivers))

    # -- live reload ------------------------------------------------------------------------
    async def reload(self, config: Config) -> None:
        """Apply a new, already validated config without a blip for unchanged resources.

        Unchanged resources keep their socket, registration and stream. Changed ones keep
        them too when the kubelet-visible options are the same (new selectors or replicas
        just send a new snapshot); otherwise they re-register. New ones register; removed
        ones stop serving. Host settings that need a restart are reported, not applied.
        """
        old = {r.name: r for r in self.config.resources}
        new = {r.name: r for r in config.resources}
        for field in ("plugin_dir", "host_root", "pod_resources_socket", "drain_file",
                      "cdi_dir", "metrics_address"):
            if getattr(config.host, field) != getattr(self.config.host, field):
                log.warning("reload: [host] %s changed; it takes effect at the next restart",
                            field)
        self.config = config
        self.inventory.set_resources(config.resources)
        for name in set(old) - set(new):
            log.info("reload: resource %s removed; it stops serving", name)
            self.cdi.remove(name)
            self.metrics.remove_resource(name)
            await self.registrar.remove(name)
            self.snapshots.pop(name, None)
            self.services.pop(name, None)
        rescan: Set[str] = set()
        for name, resource in new.items():
            before = old.get(name)
            if before == resource:
                continue
            rescan.add(resource.driver)
            service = self.services.get(name)
            if before is None or service is None:
                log.info("reload: resource %s added", name)
                continue  # served by _sync after the rescan
            driver = self.drivers.get(resource.driver) or UnavailableDriver(
                resource.driver, "not installed")
            if before.driver != resource.driver or service.needs_options_change(
                    resource, driver):
                log.info("reload: resource %s changed its driver or options; re-registering",
                         name)
                await self.registrar.remove(name)
                self.snapshots.pop(name, None)
                self.services.pop(name, None)
            else:
                log.info("reload: resource %s changed; same stream, new snapshot", name)
                service.resource = resource
            if before.cdi and not resource.cdi:
                self.cdi.remove(name)
        await self.rescan(rescan)
        for resource in config.resources:
            self._sync(resource)
        self._arm_health_checks()

    # -- periodic health and operator drains ---------------------------------------------------
    def _arm_health_checks(self) -> None:
        # One timer per driver, at its resources' shortest interval: a rescan covers every
        # resource of the driver, so a timer per resource rescanned it N times (issue 10.5).
        loop = asyncio.get_running_loop()
        wanted: Dict[str, float] = {}
        for r in self.config.resources:
            if r.health_interval_s > 0:
                wanted[r.driver] = min(wanted.get(r.driver, r.health_interval_s),
                                       r.health_interval_s)
        for name in list(self._health_timers):
            if name not in wanted:
                self._health_timers.pop(name).cancel()

        def check(driver: str, interval: float) -> None:
            if self._stopped:
                return
            self.request_rescan([driver])
            self._health_timers[driver] = loop.call_later(interval, check, driver, interval)

        for driver, interval in wanted.items():
            timer = self._health_timers.pop(driver, None)
            if timer is not None:
                timer.cancel()
            self._health_timers[driver] = loop.call_later(interval, check, driver, interval)

    def _watch_drains(self) -> None:
        path = self.config.host.drain_file
        self._apply_drains()
        directory = os.path.dirname(path)
        try:  # watching the directory itself, not a busy ancestor such as /var/lib or /tmp
            os.makedirs(directory, mode=0o700, exist_ok=True)
        except OSError as error:
            log.debug("cannot create %s (%s); watching for it", directory, error)
        name = os.path.basename(path)

        def changed(names: Optional[List[str]]) -> None:
            if names is None or name in names:
                self._apply_drains()

        try:
            self._drain_watch = DirectoryWatch(directory, changed)
            self._drain_watch.start()
        except OSError as error:
            log.warning("cannot watch the drain file %s: %s", path, error)
            self._drain_watch = None

    def _apply_drains(self) -> None:
        drains = read_drains(self.config.host.drain_file)
        for (resource, device), reason in drains.items():
            if (resource, device) not in self.inventory.drains:
                log.warning("resource %s: device %s drained by an operator: %s", resource,
                            device, reason)
        for name in self.inventory.set_drains(drains):
            resource = self.inventory.resources.get(name)
            if resource is not None:
                self._sync(resource)

    def _start_events(self) -> None:
        spec = self._events_spec
        if spec is None:
            return
        if spec == "udev":
            subsystems = {s for name in self.inventory.by_driver
                          for s in getattr(self.drivers.get(name), "subsystems", ())}
            if not subsystems:
                return
            source: EventSource = device_events(subsystems)  # + rtnetlink for "net"
        elif isinstance(spec, str):
            raise ValueError(f"unknown event source {spec!r}")
        else:
            source = spec
        try:
            source.start(self.scheduler.event)
        except Exception as error:
            log.debug("event source failed to start", exc_info=True)
            log.warning("device events unavailable (%s); relying on the safety rescan every "
                        "%g s", error, self.config.host.rescan_interval_s)
            return
        self.events = source

    def _drivers_for_subsystem(self, subsystem: str) -> Set[str]:
        return self.inventory.drivers_for_subsystem(subsystem)

    def _driver_unhung(self, driver: str) -> None:
        log.info("driver %r returned from a call that had timed out; rescanning it", driver)
        self.request_rescan([driver])

    def _arm_safety_rescan(self) -> None:
        interval = self.config.host.rescan_interval_s
        if interval <= 0 or self._stopped:
            return
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self.request_rescan()
            self._arm_safety_rescan()

        self._safety = loop.call_later(interval, fire)

    def _arm_expiry(self) -> None:
        delay = self.inventory.next_expiry()
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        if delay is not None and not self._stopped:
            self._expiry = asyncio.get_running_loop().call_later(
                delay + 0.01, self.request_rescan, []
            )

    # -- readiness -----------------------------------------------------------------------
    def _endpoint_registered(self, endpoint: Endpoint) -> None:
        self.metrics.registered(endpoint.name)
        self.metrics.kubelet_restarts_seen(self.registrar.link.restarts_seen)
        self._check_ready()

    def _check_ready(self) -> None:
        if self.registrar.all_registered() and not self.ready.is_set():
            self.ready.set()
            log.info("all %d resources registered, %.0f ms after start",
                     len(self.registrar.endpoints), (time.monotonic() - self.started_at) * 1000)
            for callback in self.on_ready:
                callback()
