"""The host: one event loop that discovers, serves, registers and keeps everything current.

Start-up order is the one the kubelet needs: scan every driver (concurrently, off the loop),
then for each resource create its snapshot and service, serve its socket, and only then
register. Later rescans only update snapshots; ListAndWatch streams see the change at once.

Around it: the timers and watches that start rescans (host/scheduling.py), applying a reloaded
config (host/reconfigure.py), the DRA side (host/dra_wiring.py), and the one owner of every
task and timer (host/tasks.py). What stays is the lifecycle (start and stop order), one
resource's sync (snapshot, CDI spec, service, registration) and readiness.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    Iterable,
    List,
    Mapping,
    Optional,
    Set,
    Tuple,
    TypeVar,
    Union,
)

from host import devinfo, dra_wiring, reconfigure, scheduling
from host.cdi import CdiWriter
from host.config import Config, overlap_error
from host.driver import Driver, UnavailableDriver
from host.hostfs import HostFS
from host.inotify import DirectoryWatch
from host.inventory import Inventory
from host.isolation import DriverCalls
from host.liveness import RegistrationLiveness
from host.metrics import HostMetrics
from host.migration import Migrations
from host.model import Device, Health, ResourceConfig
from host.nfd import FeatureFile
from host.overlap import Overlap
from host.registration import Endpoint, Registrar
from host.service import DevicePluginService
from host.snapshot import Snapshot
from host.tasks import Background
from host.watch import EventSource, RescanScheduler

if TYPE_CHECKING:  # host.dra is imported only when a resource needs it
    from host.dra.frontend import DraFrontEnd
    from host.dra.registrar import PluginWatcherEndpoint
    from host.podresources import PodResourcesClient

log = logging.getLogger(__name__)
T = TypeVar("T")
#: On a hand-over, how long a DRA call in flight may still finish once deregistered.
DRA_DRAIN_S = 10.0


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
        # Every task and timer of the host (rescans, reloads, safety rescan, expiry, health
        # checks, the event scheduler, CDI retries, the NFD write, device-info passes):
        # stop() cancels and awaits them all before it removes any file (host/tasks.py).
        self.background = Background("host")
        self._stopped = False
        self._events_spec = events
        self._drain_watch: Optional[DirectoryWatch] = None
        self._health_checked: Set[str] = set()  # drivers with a health-check timer
        self._cdi_watch: Optional[DirectoryWatch] = None
        self._cdi_backoff = 1.0
        self._cdi_thread: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._cdi_check: Optional[asyncio.Task] = None  # scheduling.schedule_cdi_check's
        self._cdi_check_again = False
        self.events: Optional[EventSource] = None
        self.scheduler = RescanScheduler(self._drivers_for_subsystem, self.request_rescan,
                                         background=self.background)
        self.metrics = HostMetrics(pod_resources_socket=config.host.pod_resources_socket)
        # SR-IOV CNI device-info files: written at Allocate by the driver, removed here.
        self.devinfo = devinfo.DeviceInfoReconciler(
            lambda: self.config.resources, lambda name: self.inventory.devices.get(name, []),
            self._held_devices, background=self.background)
        self._pod_client: Optional[PodResourcesClient] = None
        self.nfd = FeatureFile(config.host.nfd_features_file, background=self.background)
        # Resources with api = "dra", and device plugins registered through the plugin
        # watcher: built at start only when configured, so the device-plugin-only path never
        # imports host.dra (nor the API client).
        self.dra: Optional[DraFrontEnd] = None
        self.kube: Optional[Any] = None
        self.publisher: Optional[Any] = None
        self.node_watch: Optional[Any] = None  # host.dra.node.NodeWatch
        self.watched: Dict[str, PluginWatcherEndpoint] = {}
        self._dra_deferred: Set[str] = set()
        # Names this process's plugin-watcher sockets, so that an old and a new host overlap
        # during an upgrade (host/socket_names.py instance_id; set by `run`, "" keeps the
        # fixed names of a single instance).
        self.instance = ""
        # Resources moving between the device plugin API and DRA (host/migration.py).
        self.moves = Migrations(self)

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Raises DraStartError (before serving anything) when DRA cannot work here."""
        self.metrics.liveness = RegistrationLiveness(
            lambda: {name: ep.registered for name, ep in self.registrar.endpoints.items()},
            lambda: self.config.host.plugin_dir, lambda: self.config.host.liveness_grace_s,
            dra_registered=lambda: {} if self.dra is None else {
                name: ep.registered for name, ep in self.dra.endpoints.items()},
        ).problems
        if any(r.api == "dra" for r in self.config.resources):
            await self._start_dra()
        self.registrar.start()
        # Armed now for an injected source; the kernel's once registered, with a catch-up
        # rescan (scheduling.arm_events): nothing plugged in meanwhile is missed.
        scheduling.arm_events(self)
        scheduling.watch_drains(self)
        self.inventory.warn_overlaps = self.config.is_default
        await self.inventory.scan()
        self.inventory.warn_overlaps = True
        if self._stopped:
            return  # stop() came during the first scan: serve nothing, write nothing
        if self.inventory.overlaps and not self.config.is_default:
            # The operator's file makes two resources advertise one device: refuse to start
            # (exit 2) rather than let two pods be given it. Built-in defaults that overlap
            # are the drivers' doing; the first resource keeps the device (inventory).
            raise overlap_error(self.config, self.inventory.overlaps[0])
        self.metrics.sync_drivers(self.inventory.status)
        await self._write_specs(self.config.resources)
        if self._stopped:
            return
        for resource in self.config.resources:
            self._sync(resource)
        self.nfd.flush()
        self.devinfo.start()
        scheduling.watch_cdi(self)
        scheduling.arm_cdi_retry(self)
        scheduling.arm_safety_rescan(self)
        scheduling.arm_health_checks(self)
        scheduling.arm_expiry(self)
        self.moves.write_state()
        self._check_ready()

    async def stop(self, hand_over: bool = False) -> None:
        """Stop serving and remove our sockets and files; hung driver threads are abandoned.
        CDI specs stay: pods still hold their devices (CdiWriter). Every task and timer has
        ended before the first file is removed: nothing started by the host writes a CDI
        spec (or anything else) after stop() returns.

        ``hand_over``: another host serves the same node now (host/lock.py): only our own
        sockets go; the node labels and device-info files stay (they are that host's now),
        and the DRA drivers drain (deregistered first, calls in flight may finish)."""
        self._stopped = True
        if self._drain_watch is not None:
            self._drain_watch.close()
        if self._cdi_watch is not None:
            self._cdi_watch.close()
        if self.events is not None:
            self.events.close()
        self.scheduler.close()
        await self.background.aclose()
        await self.registrar.close()
        for endpoint in list(self.watched.values()):
            await endpoint.close()
        self.watched.clear()
        await self._stop_dra(DRA_DRAIN_S if hand_over else None)
        self.cdi.close()  # waits for a write in progress; none starts after it
        if self._cdi_thread is not None:
            self._cdi_thread.shutdown(wait=False)
        await self.devinfo.stop(remove=not hand_over)
        if self._pod_client is not None:
            await self._pod_client.close()
        self.nfd.remove(keep_file=hand_over)
        self.calls.shutdown()

    # -- serving ---------------------------------------------------------------------------
    def served(self) -> List[str]:
        return list(self.registrar.endpoints)

    def endpoint(self, resource: str) -> Optional[Endpoint]:
        return self.registrar.endpoints.get(resource)

    def _sync(self, resource: ResourceConfig) -> None:
        if self._stopped:
            return  # files are being (or were) removed: never write or serve again
        if self.moves.blocked(resource.name):
            return  # between APIs: served by neither until the old one is gone
        devices = list(self.moves.visible(
            resource.name, self.inventory.devices.get(resource.name, [])))
        if resource.api == "dra":
            self._sync_dra(resource, devices)
            return
        snapshot = self.snapshots.get(resource.name)
        if snapshot is None:
            if not devices and not resource.register_when_empty:
                return  # a built-in default with nothing on this node: not advertised
            snapshot = Snapshot()
            devices = self._write_cdi(resource, devices)
            snapshot.update(devices)
            driver = self.drivers.get(resource.driver) or UnavailableDriver(
                resource.driver, "not installed"
            )
            service = DevicePluginService(
                resource, driver,
                snapshot, self.calls, allocate_timeout_s=self.config.host.allocate_timeout_s,
                observer=self.metrics.allocate_observer,
            )
            service.cdi_resolvable = self.cdi.resolvable
            self.snapshots[resource.name] = snapshot
            self.services[resource.name] = service
            if resource.registration == "plugin-watcher":
                self._watch_register(service)
            else:
                self.registrar.add(service)
            self.metrics.set_devices(resource.name, devices)
            self.nfd.update(resource.name, devices)
            self.ready.clear()
            return
        devices = self._write_cdi(resource, devices)  # before the kubelet can ask for one
        if snapshot.update(devices):
            log.info("resource %s: %d devices (%d healthy)", resource.name, len(devices),
                     sum(1 for d in devices if d.healthy))
        current = self.services.get(resource.name)
        if current is not None and current.refresh_options():
            self._register_again(current, "GetPreferredAllocation is "
                                 + ("useful now" if current.options.
                                    get_preferred_allocation_available else "no longer useful"))
        self.metrics.set_devices(resource.name, devices)
        self.nfd.update(resource.name, devices)

    async def _held_devices(self) -> devinfo.Held:
        """(resource, device id) pairs some container holds, from the kubelet; None when the
        PodResources API does not answer."""
        if not self.config.host.pod_resources_socket:
            return None
        from host.podresources import PodResourcesClient, PodResourcesError, assignments

        if self._pod_client is None:
            self._pod_client = PodResourcesClient(self.config.host.pod_resources_socket)
        try:
            pods = await self._pod_client.list()
        except PodResourcesError as error:
            log.debug("device-info reconcile: %s", error)
            return None
        return {(a.resource, d) for a in assignments(pods) for d in a.devices}

    async def _write_specs(self, resources: Iterable[ResourceConfig]) -> None:
        """Write these resources' CDI specs in a worker thread: JSON and fsync of thousands of
        devices must not stall the loop (and every ListAndWatch stream with it). ``_sync``
        then finds each spec current for the very device list it pushes (no JSON, one
        stat). One thread: writes land in the order they were asked for."""
        items = [(r.name, self.inventory.devices.get(r.name, [])) for r in resources if r.cdi]
        if items:
            await self._in_cdi_thread(lambda: self._write_now(items))

    async def _in_cdi_thread(self, fn: Callable[[], T]) -> Optional[T]:
        """Run ``fn`` in the CDI writer's one thread; None (not run) once stopped."""
        if self._stopped:
            return None
        if self._cdi_thread is None:
            self._cdi_thread = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="cdi-writer")
        return await asyncio.get_running_loop().run_in_executor(self._cdi_thread, fn)

    def _write_now(self, items: List[Tuple[str, List[Device]]]) -> None:
        for name, devices in items:
            self.cdi.update(name, devices)

    def _write_cdi(self, resource: ResourceConfig, devices: List[Device]) -> List[Device]:
        """Write the resource's CDI spec; the devices as they may be advertised.

        A device whose CDI name is not in the spec on disk cannot be used by a runtime: it is
        Unhealthy with the reason, unless ``cdi_fallback`` lets Allocate hand out its device
        nodes instead (the service then leaves the CDI names out)."""
        if not resource.cdi:
            return devices
        self.cdi.update(resource.name, devices)
        if resource.cdi_fallback:
            return devices
        broken = self.cdi.unresolvable(resource.name, devices)
        if not broken:
            return devices
        return [d.with_health(Health.UNHEALTHY, broken[d.id])
                if d.id in broken and d.healthy else d for d in devices]

    async def rescan(self, drivers: Optional[Iterable[str]] = None) -> Set[str]:
        """Rescan drivers and push every changed resource to its streams."""
        changed = await self.inventory.scan(drivers)
        self.metrics.sync_drivers(self.inventory.status)
        await self._write_specs(r for r in map(self.inventory.resources.get, changed)
                                if r is not None)
        for name in changed:
            resource = self.inventory.resources.get(name)
            if resource is not None:
                self._sync(resource)
        if changed:
            self.nfd.schedule()
        await scheduling.check_cdi(self)
        scheduling.arm_expiry(self)
        return changed

    def request_rescan(self, drivers: Optional[Iterable[str]] = None) -> None:
        if self._stopped:
            return
        # Owned: cancelled and awaited by stop(), its failure logged, never lost.
        self.background.spawn(self.rescan(drivers), "rescan", on_error=_rescan_failed)

    # -- live reload ------------------------------------------------------------------------
    async def overlaps_in(self, config: Config) -> List[Overlap]:
        """Scan with a config's resources, without applying them, for devices two of them
        claim (host/reconfigure.py)."""
        return await reconfigure.overlaps_in(self, config)

    def adopt_drivers(self, drivers: Mapping[str, Driver]) -> None:
        """Drivers loaded after start (host/serve.py, host/reload.py): known from now on, for
        a reload to name; the ones already here stay."""
        for name, driver in drivers.items():
            self.drivers.setdefault(name, driver)
            self.inventory.drivers.setdefault(name, driver)

    async def reload(self, config: Config) -> None:
        """Apply a new, already validated config without a blip for unchanged resources
        (host/reconfigure.py)."""
        await reconfigure.apply_config(self, config)

    # -- periodic health and operator drains ---------------------------------------------------
    def _drivers_for_subsystem(self, subsystem: str) -> Set[str]:
        return self.inventory.drivers_for_subsystem(subsystem)

    def _driver_unhung(self, driver: str) -> None:
        log.info("driver %r returned from a call that had timed out; rescanning it", driver)
        self.request_rescan([driver])

    def _register_again(self, service: DevicePluginService, why: str) -> None:
        """New options reach the kubelet only through a new registration (it reads them in
        GetDevicePluginOptions inside Register): the endpoint serves a fresh server and
        registers again, as after a dropped stream."""
        endpoint = self.registrar.endpoints.get(service.resource.name)
        if endpoint is None:
            return
        log.info("resource %s: %s; registering again with the new options",
                 service.resource.name, why)
        service.served_options = None
        endpoint.registered_with = None
        endpoint.poke()

    # -- readiness -----------------------------------------------------------------------
    # -- DRA and plugin-watcher registration ----------------------------------------------------
    async def _start_dra(self) -> None:
        """Raises DraStartError (before serving anything) when DRA cannot work here."""
        await dra_wiring.start_dra(self)

    async def start_dra_live(self, config: Config) -> None:
        """A reloaded config brings the first DRA resource: build the DRA side now. Raises
        DraStartError (nothing changed) when DRA cannot work here."""
        if self.dra is None and not self._stopped:
            await dra_wiring.start_dra(self, config,
                                       ours=[*self.services, *self.watched])

    async def _stop_dra(self, grace_s: Optional[float] = None) -> None:
        await dra_wiring.stop_dra(self, grace_s)

    def _sync_dra(self, resource: ResourceConfig, devices: List[Device]) -> None:
        dra_wiring.sync_dra(self, resource, devices)

    def _watch_register(self, service: DevicePluginService) -> None:
        """A device plugin registered through the plugin watcher instead of kubelet.sock."""
        dra_wiring.watch_register(self, service)

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
        if endpoint.service.options_stale():
            self._register_again(endpoint.service, "the options changed during Register")
        self.metrics.registered(endpoint.name)
        self.metrics.kubelet_restarts_seen(self.registrar.link.restarts_seen)
        self._check_ready()

    def _check_ready(self) -> None:
        if self._all_registered() and not self.ready.is_set():
            self.ready.set()
            device_plugins = len(self.registrar.endpoints) + len(self.watched)
            dra = 0 if self.dra is None else len(self.dra.pools)
            log.info("all %d resources registered (%d device-plugin, %d DRA), %.0f ms after "
                     "start", device_plugins + dra, device_plugins, dra,
                     (time.monotonic() - self.started_at) * 1000)
            for callback in self.on_ready:
                callback()


def _rescan_failed(error: BaseException) -> None:
    log.error("rescan failed: %s: %s; the next event or safety rescan tries again",
              type(error).__name__, error, exc_info=error)
