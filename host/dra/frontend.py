"""The DRA front end: what the host's inventory feeds for resources with ``api = "dra"``.

The app calls ``sync`` with a resource's current devices on every change (scan, hot-plug,
health, drain, reload), exactly where the device plugin side updates its Snapshot; this front
end then updates the pool the DRA service prepares from and tells the slice publisher, so
both kubelet APIs see the same Device records. One DRA driver name may carry several
resources (several pools); each driver name gets one DRA service and one plugin-watcher
registration. Every (re-)registration republishes the slices, because a kubelet start wipes
every ResourceSlice of the node and registers us again afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from host.core.driver import Driver
from host.core.hostfs import HostFS
from host.core.isolation import DriverCalls
from host.core.model import Device, ResourceConfig
from host.dra import naming
from host.dra.checkpoint import Checkpoint, read_boot_id
from host.dra.protocol import DRA_HEALTH_SERVICES, DRA_SERVICES
from host.dra.service import ClaimReader, DraPool, DraService
from host.kubelet import socket_names
from host.kubelet.plugin_watcher import PluginWatcherEndpoint, dra_plugin_info

log = logging.getLogger(__name__)

QUIET_S = 0.2  # a drain deregisters once no call came for this long


class DraFrontEnd:
    def __init__(
        self,
        *,
        node_name: str,
        claims: ClaimReader,
        calls: DriverCalls,
        registry_dir: str,
        plugins_dir: str,
        state_dir: str,
        cdi_dir: str,
        allocate_timeout_s: float,
        publisher: Optional[Any] = None,
        metrics: Optional[Any] = None,
        host: Optional[HostFS] = None,
        instance: str = "",
    ) -> None:
        """``instance``: this process's instance id (host.kubelet.socket_names.instance_id): with
        one, each driver's sockets are named per instance so that an old and a new host can be
        registered with the kubelet at once during an upgrade."""
        self.node_name = node_name
        self.instance = instance
        self.claims = claims
        self.calls = calls
        self.registry_dir = registry_dir
        self.plugins_dir = plugins_dir
        self.cdi_dir = cdi_dir
        self.allocate_timeout_s = allocate_timeout_s
        self.publisher = publisher  # SlicePublisher: set_pool / remove_pool / republish
        self.metrics = metrics  # DraMetrics, or None (tests)
        self.checkpoint = Checkpoint(state_dir, read_boot_id(host or HostFS("/")))
        self.checkpoint.load()
        self.checkpoint.restore_specs()
        self.services: Dict[str, DraService] = {}  # by DRA driver name
        self.endpoints: Dict[str, PluginWatcherEndpoint] = {}
        self.pools: Dict[str, DraPool] = {}  # by resource name
        self._driver_of: Dict[str, str] = {}  # resource name -> DRA driver name
        # DRA driver -> its withdrawn pools whose prepared claims keep it registered
        self._draining: Dict[str, Set[str]] = {}
        # DRA driver -> pool name -> (devices, shares) of pools not published yet because
        # the kubelet has not registered their driver yet (see ``sync``)
        self._unannounced: Dict[str, Dict[str, Tuple[List[Device], int]]] = {}
        self.on_registered: Optional[Callable[[PluginWatcherEndpoint], None]] = None
        # Unhealthy devices published with taints: the publisher's setting where there is
        # one (it follows reloads), else this.
        self.taint_unhealthy = False
        # [host] dra_device_metadata (host.dra.metadata): "off" or the version to write; the
        # app points it at its current config, so a reload applies to the next prepare.
        self.device_metadata: Callable[[], str] = lambda: "off"

    def driver_name(self, resource: ResourceConfig) -> str:
        return naming.driver_name(resource.name, resource.dra_driver_name, resource.driver)

    def socket_path(self, driver_name: str) -> str:
        return os.path.join(self.plugins_dir, driver_name,
                            socket_names.service_socket_file("dra", self.instance))

    def sync(self, resource: ResourceConfig, driver: Driver, devices: Sequence[Device]) -> None:
        """The resource's devices changed (or it is new): cheap, never waits on anything."""
        dra_driver = self.driver_name(resource)
        old_driver = self._driver_of.get(resource.name)
        if old_driver is not None and old_driver != dra_driver:
            self._forget(resource.name)
        pool = self.pools.get(resource.name)
        if pool is None:
            pool = DraPool(resource=resource, driver=driver,
                           pool_name=naming.pool_name(resource.name, self.node_name),
                           naming=naming.dra_device_name)
            self.pools[resource.name] = pool
            self._driver_of[resource.name] = dra_driver
            service = self._service(dra_driver)
            service.pools[pool.pool_name] = pool
        pool.resource, pool.driver = resource, driver
        # replicas = N: each device is shared N ways (host.dra.sharing); ``devices`` are
        # its replicas, as the device plugin side gets them.
        pool.shares = resource.replicas if resource.replicas > 1 else 0
        pool.set_devices(devices)
        self.services[dra_driver].devices_changed()
        if self.publisher is None:
            return
        # The kubelet prepares a claim only for a registered driver ("DRA driver ... is not
        # registered", retried with the pod worker's backoff): a driver's pools are first
        # published once the kubelet has accepted it, so no pod is scheduled onto devices the
        # kubelet cannot prepare yet. Later changes, kubelet restarts included, publish at once.
        if self.endpoints[dra_driver].ever_registered:
            self.publisher.set_pool(dra_driver, pool.pool_name, list(devices), pool.shares)
        else:
            self._unannounced.setdefault(dra_driver, {})[pool.pool_name] = (
                list(devices), pool.shares)

    def _service(self, dra_driver: str) -> DraService:
        service = self.services.get(dra_driver)
        if service is None:
            service = DraService(dra_driver, {}, self.claims, self.checkpoint, self.calls,
                                 self.cdi_dir, allocate_timeout_s=self.allocate_timeout_s)
            service.metrics = self.metrics
            service.tainted = self._tainted
            service.metadata_versions = self._metadata_versions
            service.data_dir = os.path.dirname(self.socket_path(dra_driver))
            self.services[dra_driver] = service
            # The health services are advertised too: newer DRA managers open the health
            # stream only for plugins that list one (pickHealthService, v1 first); the
            # kubelet picks its DRAPlugin service from the same list and ignores names it
            # does not know.
            info = dra_plugin_info(dra_driver, self.socket_path(dra_driver),
                                   (*DRA_SERVICES, *DRA_HEALTH_SERVICES))
            endpoint = PluginWatcherEndpoint(info, self.registry_dir, service.handlers,
                                             label=f"DRA driver {dra_driver}",
                                             on_registered=self._registered,
                                             instance=self.instance)
            self.endpoints[dra_driver] = endpoint
            endpoint.start()
        return service

    def _metadata_versions(self) -> Tuple[str, ...]:
        version = self.device_metadata()
        return () if version == "off" else (version,)

    def _tainted(self) -> bool:
        if self.publisher is not None:
            return bool(getattr(self.publisher, "taint_unhealthy", False))
        return self.taint_unhealthy

    def _forget(self, resource_name: str) -> Optional[str]:
        pool = self.pools.pop(resource_name, None)
        dra_driver = self._driver_of.pop(resource_name, None)
        if pool is None or dra_driver is None:
            return None
        service = self.services.get(dra_driver)
        if service is not None:
            service.pools.pop(pool.pool_name, None)
            service.devices_changed()
        self._unannounced.get(dra_driver, {}).pop(pool.pool_name, None)
        if self.publisher is not None:
            self.publisher.remove_pool(dra_driver, pool.pool_name)
        return dra_driver

    def driver_of(self, resource_name: str) -> Optional[str]:
        """The DRA driver name serving the resource's pool, None when it has none."""
        return self._driver_of.get(resource_name)

    async def remove(self, resource_name: str) -> None:
        """The resource left the config (or DRA): its pool goes. The driver's registration
        goes with its last pool once no claim prepared from its pools remains: the kubelet
        unprepares through it (``close_drained``). Prepared claims stay checkpointed."""
        pool = self.pools.get(resource_name)
        dra_driver = self._forget(resource_name)
        if dra_driver is None or dra_driver in self._driver_of.values():
            return
        if pool is not None and self._claims_of(pool.pool_name):
            self._draining.setdefault(dra_driver, set()).add(pool.pool_name)
            log.info("DRA driver %s: pool %s withdrawn; the driver stays registered until "
                     "its %d prepared claim(s) are unprepared", dra_driver, pool.pool_name,
                     self._claims_of(pool.pool_name))
            return
        await self._close_driver(dra_driver)

    def _claims_of(self, pool_name: str) -> int:
        return sum(1 for claim in self.checkpoint.claims.values()
                   if any(d.pool_name == pool_name for d in claim.devices))

    def draining(self) -> bool:
        """A driver without pools stays registered for its prepared claims."""
        return bool(self._draining)

    async def close_drained(self) -> None:
        """Deregister each driver kept for its prepared claims once they are unprepared (or
        that serves a pool again, which keeps it)."""
        for dra_driver, pools in list(self._draining.items()):
            if dra_driver in self._driver_of.values():
                del self._draining[dra_driver]
            elif not any(self._claims_of(p) for p in pools):
                del self._draining[dra_driver]
                log.info("DRA driver %s: its last prepared claim was unprepared; "
                         "deregistering", dra_driver)
                await self._close_driver(dra_driver)

    async def _close_driver(self, dra_driver: str) -> None:
        self.services.pop(dra_driver, None)
        endpoint = self.endpoints.pop(dra_driver, None)
        if endpoint is not None:
            await endpoint.close()

    def _registered(self, endpoint: PluginWatcherEndpoint) -> None:
        if self.publisher is not None:
            for pool_name, (devices, shares) in self._unannounced.pop(endpoint.name,
                                                                       {}).items():
                self.publisher.set_pool(endpoint.name, pool_name, devices, shares)
            self.publisher.republish()
        if self.on_registered is not None:
            self.on_registered(endpoint)

    def _quiet(self) -> bool:
        now = time.monotonic()
        return all(s.in_flight == 0 and now - s.last_call_end >= QUIET_S
                   for s in self.services.values())

    def all_registered(self) -> bool:
        return all(endpoint.registered for endpoint in self.endpoints.values())

    def prepared_claims(self) -> List[Any]:
        return list(self.checkpoint.claims.values())

    async def close(self, grace_s: Optional[float] = None) -> None:
        """Stop serving; ResourceSlices stay (the kubelet wipes them if we do not return).
        ``grace_s``: a drain (another host serves the drivers now): first wait, up to that
        long, until no call has been in flight for QUIET_S, because the kubelet closes its
        connection to an instance the moment it deregisters, failing the calls in flight on
        its side; it sends new calls to the newest connected instance, so an old one falls
        quiet once the new one registered."""
        if grace_s is not None:
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and not self._quiet():
                await asyncio.sleep(QUIET_S / 4)
        for endpoint in list(self.endpoints.values()):
            await endpoint.close()
        self.endpoints.clear()
        self.services.clear()
        self.checkpoint.close()
