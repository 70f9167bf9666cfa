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
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Set, Union

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
from host.watch import EventSource, RescanScheduler, UdevSource

if TYPE_CHECKING:  # host.dra is imported only when a resource needs it
    from host.dra.frontend import DraFrontEnd
    from host.dra.registrar import PluginWatcherEndpoint

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
        # Resources with api = "dra", and device plugins registered through the plugin
        # watcher: built at start only when configured, so the device-plugin-only path never
        # imports host.dra (nor the API client).
        self.dra: Optional[DraFrontEnd] = None
        self.kube: Optional[Any] = None
        self.publisher: Optional[Any] = None
        self.watched: Dict[str, PluginWatcherEndpoint] = {}
        self._dra_deferred: Set[str] = set()

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Raises DraStartError (before serving anything) when DRA cannot work here."""
        if any(r.api == "dra" for r in self.config.resources):
            await self._start_dra()
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
        for endpoint in list(self.watched.values()):
            await endpoint.close()
        self.watched.clear()
        await self._stop_dra()
        self.cdi.remove_all()
        self.calls.shutdown()

    # -- serving ---------------------------------------------------------------------------
    def served(self) -> List[str]:
        return list(self.registrar.endpoints)

    def endpoint(self, resource: str) -> Optional[Endpoint]:
        return self.registrar.endpoints.get(resource)

    def _sync(self, resource: ResourceConfig) -> None:
        devices = self.inventory.devices.get(resource.name, [])
        if resource.api == "dra":
            self._sync_dra(resource, devices)
            return
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
            if resource.registration == "plugin-watcher":
                self._watch_register(service)
            else:
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
                      "cdi_dir", "metrics_address", "node_name", "kubeconfig",
                      "plugins_registry_dir", "dra_plugins_dir", "dra_state_dir"):
            if getattr(config.host, field) != getattr(self.config.host, field):
                log.warning("reload: [host] %s changed; it takes effect at the next restart",
                            field)
        self.config = config
        self.inventory.set_resources(config.resources)
        for name in set(old) - set(new):
            log.info("reload: resource %s removed; it stops serving", name)
            self.cdi.remove(name)
            self.metrics.remove_resource(name)
            await self._unserve(name)
            self.snapshots.pop(name, None)
            self.services.pop(name, None)
        rescan: Set[str] = set()
        for name, resource in new.items():
            before = old.get(name)
            if before == resource:
                continue
            rescan.add(resource.driver)
            if before is not None and (before.api != resource.api or before.api == "dra"):
                if before.api != resource.api:
                    log.info("reload: resource %s moves to api = %r", name, resource.api)
                    await self._unserve(name)
                    self.snapshots.pop(name, None)
                    self.services.pop(name, None)
                elif before.dra_driver_name != resource.dra_driver_name:
                    log.info("reload: resource %s changed its DRA driver name", name)
                    await self._unserve(name)  # the old driver's registration goes with it
                continue  # served again (or its DRA pool updated) by _sync after the rescan
            service = self.services.get(name)
            if before is None or service is None:
                log.info("reload: resource %s added", name)
                continue  # served by _sync after the rescan
            driver = self.drivers.get(resource.driver) or UnavailableDriver(
                resource.driver, "not installed")
            if before.driver != resource.driver or service.needs_options_change(
                    resource, driver) or before.registration != resource.registration:
                log.info("reload: resource %s changed its driver or options; re-registering",
                         name)
                await self._unserve(name)
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
        loop = asyncio.get_running_loop()
        wanted = {r.name: r for r in self.config.resources if r.health_interval_s > 0}
        for name in list(self._health_timers):
            if name not in wanted:
                self._health_timers.pop(name).cancel()

        def check(resource: ResourceConfig) -> None:
            if self._stopped:
                return
            self.request_rescan([resource.driver])
            self._health_timers[resource.name] = loop.call_later(
                resource.health_interval_s, check, resource)

        for name, resource in wanted.items():
            timer = self._health_timers.pop(name, None)
            if timer is not None:
                timer.cancel()
            self._health_timers[name] = loop.call_later(resource.health_interval_s, check,
                                                         resource)

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
            source: EventSource = UdevSource(subsystems)
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
    # -- DRA and plugin-watcher registration ----------------------------------------------------
    async def _start_dra(self) -> None:
        from host.dra.frontend import DraFrontEnd
        from host.dra.kube import KubeClient, KubeConfigError
        from host.dra.metrics import DraMetrics
        from host.dra.startup import DraStartError, check_cluster, check_settings

        check_settings(self.config)
        try:
            self.kube = KubeClient.from_settings(self.config.host.kubeconfig)
        except KubeConfigError as error:
            raise DraStartError(f"no API access for DRA: {error}") from None
        try:
            await check_cluster(self.kube, self.config)
        except BaseException:
            await self.kube.close()
            self.kube = None
            raise
        from host.dra.publisher import SlicePublisher

        # Unhealthy devices are left out of the slices: device taints (KEP-5055) are off by
        # default before 1.37, and a taint the server drops would advertise a broken device.
        self.publisher = SlicePublisher(self.kube, self.config.host.node_name,
                                        metrics=self.metrics, taint_unhealthy=False)
        host = self.config.host
        self.dra = DraFrontEnd(
            node_name=host.node_name, claims=self.kube, calls=self.calls,
            registry_dir=host.plugins_registry_dir, plugins_dir=host.dra_plugins_dir,
            state_dir=host.dra_state_dir, cdi_dir=host.cdi_dir,
            allocate_timeout_s=host.allocate_timeout_s, publisher=self.publisher,
            metrics=DraMetrics(self.metrics.registry))
        self.dra.on_registered = self._dra_registered
        if self.publisher is not None:
            await self.publisher.start()

    async def _stop_dra(self) -> None:
        if self.dra is not None:
            await self.dra.close()
        if self.publisher is not None:
            await self.publisher.stop(delete=False)  # the kubelet wipes them if we stay away
        if self.kube is not None:
            await self.kube.close()

    def _sync_dra(self, resource: ResourceConfig, devices: List[Device]) -> None:
        if self.dra is None:
            if resource.name not in self._dra_deferred:
                self._dra_deferred.add(resource.name)
                log.error("resource %s: api = \"dra\" came with a reload; it takes effect "
                          "at the next restart (the API client is set up at start)",
                          resource.name)
            return
        driver = self.drivers.get(resource.driver) or UnavailableDriver(
            resource.driver, "not installed")
        self.dra.sync(resource, driver, devices)
        self.metrics.set_devices(resource.name, devices)
        if not self.dra.all_registered():
            self.ready.clear()

    def _watch_register(self, service: DevicePluginService) -> None:
        """A device plugin registered through the plugin watcher instead of kubelet.sock."""
        from host.dra.registrar import (
            PluginWatcherEndpoint,
            device_plugin_info,
            registration_socket_name,
        )
        from host.protocol import VERSION

        name = service.resource.name
        host = self.config.host
        folder = registration_socket_name(name)[: -len("-reg.sock")]
        socket = os.path.join(host.dra_plugins_dir, folder, "device-plugin.sock")
        endpoint = PluginWatcherEndpoint(
            device_plugin_info(name, socket, VERSION), host.plugins_registry_dir,
            lambda generation: (service.handler(generation),),
            label=f"resource {name}", on_registered=self._watched_registered)
        self.watched[name] = endpoint
        endpoint.start()

    async def _unserve(self, name: str) -> None:
        await self.registrar.remove(name)
        endpoint = self.watched.pop(name, None)
        if endpoint is not None:
            await endpoint.close()
        if self.dra is not None and name in self.dra.pools:
            await self.dra.remove(name)

    def _watched_registered(self, endpoint: Any) -> None:
        self.metrics.registered(endpoint.name)
        self._check_ready()

    def _dra_registered(self, endpoint: Any) -> None:
        self._check_ready()

    def _all_registered(self) -> bool:
        return (self.registrar.all_registered()
                and all(ep.registered for ep in self.watched.values())
                and (self.dra is None or self.dra.all_registered()))

    def _endpoint_registered(self, endpoint: Endpoint) -> None:
        self.metrics.registered(endpoint.name)
        self.metrics.kubelet_restarts_seen(self.registrar.link.restarts_seen)
        self._check_ready()

    def _check_ready(self) -> None:
        if self._all_registered() and not self.ready.is_set():
            self.ready.set()
            log.info("all %d resources registered, %.0f ms after start",
                     len(self.registrar.endpoints), (time.monotonic() - self.started_at) * 1000)
            for callback in self.on_ready:
                callback()

