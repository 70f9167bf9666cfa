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

import logging
import os
from typing import Any, Callable, Dict, List, Optional, Sequence

from host.dra import naming
from host.dra.checkpoint import Checkpoint, read_boot_id
from host.dra.protocol import DRA_HEALTH_SERVICE, DRA_SERVICES
from host.dra.registrar import PluginWatcherEndpoint, dra_plugin_info
from host.dra.service import ClaimReader, DraPool, DraService
from host.driver import Driver
from host.hostfs import HostFS
from host.isolation import DriverCalls
from host.model import Device, ResourceConfig

log = logging.getLogger(__name__)

DRA_SOCKET = "dra.sock"


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
    ) -> None:
        self.node_name = node_name
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
        self.on_registered: Optional[Callable[[PluginWatcherEndpoint], None]] = None
        # Unhealthy devices published with taints: the publisher's setting where there is
        # one (it follows reloads), else this.
        self.taint_unhealthy = False

    def driver_name(self, resource: ResourceConfig) -> str:
        return naming.driver_name(resource.name, resource.dra_driver_name, resource.driver)

    def socket_path(self, driver_name: str) -> str:
        return os.path.join(self.plugins_dir, driver_name, DRA_SOCKET)

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
        pool.set_devices(devices)
        self.services[dra_driver].devices_changed()
        if self.publisher is not None:
            self.publisher.set_pool(dra_driver, pool.pool_name, list(devices))

    def _service(self, dra_driver: str) -> DraService:
        service = self.services.get(dra_driver)
        if service is None:
            service = DraService(dra_driver, {}, self.claims, self.checkpoint, self.calls,
                                 self.cdi_dir, allocate_timeout_s=self.allocate_timeout_s)
            service.metrics = self.metrics
            service.tainted = self._tainted
            self.services[dra_driver] = service
            # The health service is advertised too: newer DRA managers open the health
            # stream only for plugins that list it (pickHealthService); the kubelet picks
            # its DRAPlugin service from the same list and ignores names it does not know.
            info = dra_plugin_info(dra_driver, self.socket_path(dra_driver),
                                   (*DRA_SERVICES, DRA_HEALTH_SERVICE))
            endpoint = PluginWatcherEndpoint(info, self.registry_dir, service.handlers,
                                             label=f"DRA driver {dra_driver}",
                                             on_registered=self._registered)
            self.endpoints[dra_driver] = endpoint
            endpoint.start()
        return service

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
        if self.publisher is not None:
            self.publisher.remove_pool(dra_driver, pool.pool_name)
        return dra_driver

    async def remove(self, resource_name: str) -> None:
        """The resource left the config: its pool goes; the driver's registration goes with
        its last pool. Prepared claims stay checkpointed so they can still be unprepared."""
        dra_driver = self._forget(resource_name)
        if dra_driver is None or dra_driver in self._driver_of.values():
            return
        self.services.pop(dra_driver, None)
        endpoint = self.endpoints.pop(dra_driver, None)
        if endpoint is not None:
            await endpoint.close()

    def _registered(self, endpoint: PluginWatcherEndpoint) -> None:
        if self.publisher is not None:
            self.publisher.republish()
        if self.on_registered is not None:
            self.on_registered(endpoint)

    def all_registered(self) -> bool:
        return all(endpoint.registered for endpoint in self.endpoints.values())

    def prepared_claims(self) -> List[Any]:
        return list(self.checkpoint.claims.values())

    async def close(self) -> None:
        """Stop serving; ResourceSlices stay (the kubelet wipes them if we do not return)."""
        for endpoint in list(self.endpoints.values()):
            await endpoint.close()
        self.endpoints.clear()
        self.services.clear()
        self.checkpoint.close()
