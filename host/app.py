"""The conductor: builds the host's pieces, keeps their start and stop order, and hands every
changed resource from the inventory to the outputs.

Data flows one way: triggers (host/triggers/) ask for rescans; the inventory scans drivers
off the loop and keeps each resource's trusted device list; a resource whose devices
changed goes through the CDI stage (its spec on disk before anything is advertised) to its
API output (device plugin or DRA), and, once that serves it, to every other output
(metrics, node labels, device-info files). A reloaded config is compared with the running
one (host/config/change.py ``plan``) and applied as forget/changed/sync calls.

Start-up order is the one the kubelet needs: scan every driver (concurrently, off the loop),
write the CDI specs, then for each resource create its snapshot and service, serve its
socket, and only then register. Every task and timer belongs to one owner
(``background``); stop() cancels and awaits them all before it removes any file.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Callable, Dict, Iterable, List, Mapping, Optional, Set, Union

from host.config import Config, overlap_error
from host.config.change import plan
from host.core.driver import Driver
from host.core.hostfs import HostFS
from host.core.isolation import DriverCalls
from host.core.model import Device, ResourceConfig
from host.core.overlap import Overlap
from host.core.tasks import Background
from host.inventory import Inventory
from host.kubelet.aio import quiet_poller_wakeups
from host.kubelet.liveness import RegistrationLiveness
from host.kubelet.registration import Endpoint
from host.metrics import HostMetrics
from host.migration import Migrations
from host.outputs import Output
from host.outputs.cdi import CdiStage
from host.outputs.device_plugin import DevicePluginOutput
from host.outputs.devinfo import DeviceInfoReconciler, Held
from host.outputs.dra import DraOutput
from host.outputs.metrics import MetricsOutput
from host.outputs.nfd import FeatureFile
from host.triggers.drains import DrainWatch
from host.triggers.events import DeviceEvents
from host.triggers.timers import Expiry, HealthChecks, SafetyRescan
from host.triggers.uevents import EventSource

if TYPE_CHECKING:  # the PodResources client loads on first use
    from host.kubelet.podresources import PodResourcesClient

log = logging.getLogger(__name__)
#: On a hand-over, how long a DRA call in flight may still finish once deregistered.
DRA_DRAIN_S = 10.0


class HostApp:
    def __init__(
        self,
        config: Config,
        drivers: Dict[str, Driver],
        events: Union[str, EventSource, None] = "udev",
        metrics: Optional[HostMetrics] = None,
    ) -> None:
        """``events``: "udev" for the kernel's uevents, an EventSource (tests inject events),
        or None for no event-driven rescans (the safety rescan still runs). ``metrics``: the
        registry every piece reports to (one for the config's PodResources socket by
        default)."""
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
        self.ready = asyncio.Event()
        self.started_at = time.monotonic()
        self.on_ready: List[Callable[[], None]] = []
        # Every task and timer of the host and its pieces: stop() cancels and awaits them
        # all before it removes any file (host/core/tasks.py).
        self.background = Background("host")
        self._stopped = False
        # Names this process's plugin-watcher sockets, so that an old and a new host overlap
        # during an upgrade (host/kubelet/socket_names.py instance_id; set by `run`, "" keeps the
        # fixed names of a single instance).
        self.instance = ""
        self.metrics = metrics or HostMetrics(
            pod_resources_socket=config.host.pod_resources_socket)
        self._pod_client: Optional[PodResourcesClient] = None  # made on first use

        # -- the outputs --
        self.cdi = CdiStage(
            config.host.cdi_dir, self.background,
            served=lambda: [r for r in self.config.resources
                            if self.device_plugin.serves(r.name)],
            devices_of=self._devices_of,
            resync=self._resync)
        self.device_plugin = DevicePluginOutput(
            lambda: self.config.host, drivers, self.calls, self.metrics,
            self.cdi.writer.resolvable, lambda: self.instance,
            on_registered=self.check_ready, on_new=self.ready.clear)
        self.dra = DraOutput(
            lambda: self.config, drivers, self.calls, self.metrics, self.host,
            self.background, lambda: self.instance,
            hold_at_start=lambda name, node: self.moves.hold_at_start(name, node),
            notes=lambda: self.moves.notes(), on_registered=self.check_ready,
            on_unready=self.ready.clear)
        # Resources moving between the device plugin API and DRA (host/migration.py).
        self.moves = Migrations(
            lambda: self.config, self.background, self.device_plugin, self.dra,
            lambda name: self.inventory.resources.get(name), self.sync, self.check_ready,
            self.held_devices)
        # SR-IOV CNI device-info files: written at Allocate by the driver, removed here.
        self.devinfo = DeviceInfoReconciler(
            lambda: self.config.resources, self._devices_of,
            self.held_devices, background=self.background)
        self.nfd = FeatureFile(config.host.nfd_features_file, background=self.background)
        #: Every output beside the two APIs, in the order each gets a resource.
        self.outputs: List[Output] = [
            MetricsOutput(self.metrics),
            self.nfd,
            self.devinfo,
        ]

        # -- the triggers --
        self.events = DeviceEvents(
            events, self.background, self._subsystems,
            self.inventory.drivers_for_subsystem, self.request_rescan,
            lambda: self.config.host.rescan_interval_s)
        self.safety_rescan = SafetyRescan(
            self.background, lambda: self.config.host.rescan_interval_s, self.request_rescan)
        self.health_checks = HealthChecks(self.background, self.request_rescan)
        self.expiry = Expiry(self.background, self.inventory.next_expiry, self.request_rescan)
        self.drains = DrainWatch(
            lambda: self.config.host.drain_file, lambda: self.inventory.drains,
            self.inventory.set_drains, self._resync_name)

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Raises DraStartError (before serving anything) when DRA cannot work here."""
        quiet_poller_wakeups(asyncio.get_running_loop())
        self.metrics.liveness = RegistrationLiveness(
            self.device_plugin.registered,
            lambda: self.config.host.plugin_dir, lambda: self.config.host.liveness_grace_s,
            dra_registered=self.dra.registered,
        ).problems
        if any(r.api == "dra" for r in self.config.resources):
            await self.dra.start()
        self.device_plugin.start()
        # Armed now for an injected source; the kernel's once registered, with a catch-up
        # rescan: nothing plugged in meanwhile is missed.
        self.events.arm(self.on_ready)
        self.drains.start()
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
        await self.cdi.write(self.config.resources)
        if self._stopped:
            return
        for resource in self.config.resources:
            self.sync(resource)
        self._synced(first=True)
        self.cdi.start_watch(self.config.resources)
        self.cdi.arm_retry()
        self.safety_rescan.arm()
        self.health_checks.arm(self.config.resources)
        self.expiry.arm()
        self.moves.write_state()
        self.check_ready()

    async def stop(self, hand_over: bool = False) -> None:
        """Stop serving and remove our sockets and files; hung driver threads are abandoned.
        CDI specs stay: pods still hold their devices (CdiWriter). Every task and timer has
        ended before the first file is removed: nothing started by the host writes a CDI
        spec (or anything else) after stop() returns.

        ``hand_over``: another host serves the same node now (host/cli/lock.py): only our own
        sockets go; the node labels and device-info files stay (they are that host's now),
        and the DRA drivers drain (deregistered first, calls in flight may finish)."""
        self._stopped = True
        self.drains.close()
        self.cdi.close_watch()
        self.events.close()
        await self.background.aclose()
        await self.device_plugin.close(hand_over)
        await self.dra.close(hand_over, DRA_DRAIN_S if hand_over else None)
        self.cdi.close()  # waits for a write in progress; none starts after it
        for output in reversed(self.outputs):
            await output.close(hand_over)
        if self._pod_client is not None:
            await self._pod_client.close()
        self.calls.shutdown()

    # -- serving ---------------------------------------------------------------------------
    def served(self) -> List[str]:
        return list(self.device_plugin.registrar.endpoints)

    def endpoint(self, resource: str) -> Optional[Endpoint]:
        return self.device_plugin.registrar.endpoints.get(resource)

    def sync(self, resource: ResourceConfig) -> None:
        """Hand the resource's devices now to its API output and, once that serves it, to
        every other output."""
        if self._stopped:
            return  # files are being (or were) removed: never write or serve again
        if self.moves.blocked(resource.name):
            return  # between APIs: served by neither until the old one is gone
        devices = list(self.moves.visible(resource.name, self._devices_of(resource.name)))
        if resource.api == "dra":
            if not self.dra.wants(resource):
                return
            self.dra.sync(resource, devices)
        else:
            if not self.device_plugin.wants(resource, devices):
                return
            devices = self.cdi.stage(resource, devices)  # before the kubelet can ask for one
            self.device_plugin.sync(resource, devices)
        for output in self.outputs:
            output.sync(resource, devices)

    def _devices_of(self, name: str) -> List[Device]:
        """The resource's devices as the inventory holds them now."""
        return self.inventory.devices.get(name, [])

    def _resync(self, resource: ResourceConfig) -> None:
        if resource in self.config.resources:  # not replaced by a reload meanwhile
            self.sync(resource)

    def _resync_name(self, name: str) -> None:
        resource = self.inventory.resources.get(name)
        if resource is not None:
            self.sync(resource)

    def _synced(self, first: bool) -> None:
        for output in self.outputs:
            output.synced(first)

    async def held_devices(self) -> Held:
        """(resource, device id) pairs some container holds, from the kubelet; None when the
        PodResources API does not answer."""
        if not self.config.host.pod_resources_socket:
            return None
        from host.kubelet.podresources import PodResourcesClient, PodResourcesError, assignments

        if self._pod_client is None:
            self._pod_client = PodResourcesClient(self.config.host.pod_resources_socket)
        try:
            pods = await self._pod_client.list()
        except PodResourcesError as error:
            log.debug("device-info reconcile: %s", error)
            return None
        return {(a.resource, d) for a in assignments(pods) for d in a.devices}

    async def rescan(self, drivers: Optional[Iterable[str]] = None) -> Set[str]:
        """Rescan drivers and push every changed resource to the outputs."""
        changed = await self.inventory.scan(drivers)
        self.metrics.sync_drivers(self.inventory.status)
        await self.cdi.write(r for r in map(self.inventory.resources.get, changed)
                             if r is not None)
        for name in changed:
            self._resync_name(name)
        if changed:
            self._synced(first=False)
        await self.cdi.check()
        self.expiry.arm()
        return changed

    def request_rescan(self, drivers: Optional[Iterable[str]] = None) -> None:
        if self._stopped:
            return
        # Owned: cancelled and awaited by stop(), its failure logged, never lost.
        self.background.spawn(self.rescan(drivers), "rescan", on_error=_rescan_failed)

    def _subsystems(self) -> Set[str]:
        return {s for name in self.inventory.by_driver
                for s in getattr(self.drivers.get(name), "subsystems", ())}

    def _driver_unhung(self, driver: str) -> None:
        log.info("driver %r returned from a call that had timed out; rescanning it", driver)
        self.request_rescan([driver])

    # -- live reload ------------------------------------------------------------------------
    async def overlaps_in(self, config: Config) -> List[Overlap]:
        """Scan with a config's resources, without applying them, for devices two of them
        claim: a reload that would double-advertise a device is rejected like a bad file."""
        trial = Inventory(
            self.host, self.drivers, config.resources, self.calls,
            discover_timeout_s=config.host.discover_timeout_s, vanished_grace_s=0,
        )
        trial.warn_overlaps = False
        await trial.scan()
        return trial.overlaps

    def adopt_drivers(self, drivers: Mapping[str, Driver]) -> None:
        """Drivers loaded after start (host/cli/serve.py, host/cli/reload.py): known from now on,
        for a reload to name; the ones already here stay."""
        for name, driver in drivers.items():
            self.drivers.setdefault(name, driver)
            self.inventory.drivers.setdefault(name, driver)

    async def start_dra_live(self, config: Config) -> None:
        """A reloaded config brings the first DRA resource: build the DRA side now. Raises
        DraStartError (nothing changed) when DRA cannot work here."""
        if not self.dra.started and not self._stopped:
            await self.dra.start(config, ours=self.device_plugin.names())

    async def reload(self, config: Config) -> None:
        """Apply a new, already validated config without a blip for what stays.

        Unchanged resources keep their socket, registration and stream. Changed ones keep
        them too when the kubelet-visible options are the same (new selectors or replicas
        just send a new snapshot); otherwise they re-register (also when replicas turn
        GetPreferredAllocation on or off). New ones register; removed ones stop serving; a
        changed ``api`` moves the resource (host/migration.py). Host settings that need a
        restart are reported, not applied."""
        if self._stopped:
            return
        change = plan(self.config, config)
        for field in change.restart_only:
            log.warning("reload: [host] %s changed; it takes effect at the next restart",
                        field)
        self.inventory.discover_timeout_s = config.host.discover_timeout_s
        self.inventory.vanished_grace_s = config.host.vanished_grace_s
        self.dra.set_taint_unhealthy(config.host.dra_unhealthy == "taint")
        self.config = config
        self.inventory.set_resources(config.resources)
        for resource in change.removed:
            log.info("reload: resource %s removed; it stops serving", resource.name)
            self.moves.cancel(resource.name)
            self.cdi.forget(resource.name)
        # Together, not one after the other: each stop waits for its server's grace period
        # (255 removals one by one took 13 s).
        await asyncio.gather(*(self._forget(resource) for resource in change.removed))
        for resource in change.moved:
            self.moves.begin(resource)  # never served by both (host/migration.py)
        for resource in change.added:
            log.info("reload: resource %s added", resource.name)
        for before, after in change.changed:
            await self._reconfigure(before, after)
        await self.rescan(change.drivers)
        await self.cdi.write(config.resources)
        for resource in config.resources:
            self.sync(resource)
            # Each new resource starts an endpoint task (server, socket, Register): let the
            # loop run between them, so a reload to 256 resources never holds it for long.
            await asyncio.sleep(0)
        if self._stopped:
            return  # stop() came meanwhile: start no watch, arm no timer
        self.moves.write_state()
        self.cdi.start_watch(config.resources)
        self._synced(first=False)
        self.health_checks.arm(config.resources)

    async def _forget(self, resource: ResourceConfig) -> None:
        for output in self.outputs:
            await output.forget(resource)
        await self.device_plugin.forget(resource)
        await self.dra.forget(resource)

    async def _reconfigure(self, before: ResourceConfig, after: ResourceConfig) -> None:
        name = after.name
        if after.api == "dra":
            if before.dra_driver_name != after.dra_driver_name:
                log.info("reload: resource %s changed its DRA driver name", name)
                await self.dra.unserve(name)  # the old driver's registration goes with it
            return  # its pool is updated by the sync after the rescan
        if not self.device_plugin.serves(name):
            log.info("reload: resource %s added", name)
            return  # served by the sync after the rescan
        if self.device_plugin.reconfigure(before, after):
            log.info("reload: resource %s changed; same stream, new snapshot", name)
        else:
            log.info("reload: resource %s changed its driver or options; re-registering",
                     name)
            await self.device_plugin.unserve(name)
        if before.cdi and not after.cdi:
            self.cdi.forget(name)
        for output in self.outputs:
            output.changed(before, after)

    # -- readiness -----------------------------------------------------------------------
    def all_registered(self) -> bool:
        return self.device_plugin.all_registered() and self.dra.all_registered()

    def check_ready(self) -> None:
        if self.all_registered() and not self.ready.is_set():
            self.ready.set()
            device_plugins = self.device_plugin.count()
            dra = self.dra.count()
            log.info("all %d resources registered (%d device-plugin, %d DRA), %.0f ms after "
                     "start", device_plugins + dra, device_plugins, dra,
                     (time.monotonic() - self.started_at) * 1000)
            for callback in self.on_ready:
                callback()


def _rescan_failed(error: BaseException) -> None:
    log.error("rescan failed: %s: %s; the next event or safety rescan tries again",
              type(error).__name__, error, exc_info=error)
