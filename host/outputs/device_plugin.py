"""The device-plugin output: per resource a snapshot, a DevicePluginService, and its
registration with the kubelet (on ``kubelet.sock`` through the Registrar, or through the
plugin watcher for ``registration = "plugin-watcher"``).

A resource is served from its first sync with a device (or at once with
``register_when_empty``); later syncs only update its snapshot, and every ListAndWatch stream
sees the change at once. New options (GetPreferredAllocation turning useful or not) reach the
kubelet only through a new registration, so the endpoint registers again.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Callable, Dict, List, Mapping, Sequence

from host.config.settings import HostSettings
from host.core.driver import Driver, driver_of
from host.core.isolation import DriverCalls
from host.core.model import Device, ResourceConfig
from host.kubelet.registration import Endpoint, Registrar
from host.kubelet.service import DevicePluginService
from host.kubelet.snapshot import Snapshot
from host.metrics import HostMetrics
from host.outputs import Output

if TYPE_CHECKING:  # loaded only for registration = "plugin-watcher"
    from host.kubelet.plugin_watcher import PluginWatcherEndpoint

log = logging.getLogger("host.app")  # the lines operators know


class DevicePluginOutput(Output):
    """``settings``: the host's settings now (a reload replaces them); ``instance``: this
    process's socket-name suffix; ``resolvable``: whether a CDI name is in the spec on disk;
    ``on_registered``: a registration completed; ``on_new``: a new resource waits for its
    first registration."""

    def __init__(self, settings: Callable[[], HostSettings], drivers: Mapping[str, Driver],
                 calls: DriverCalls, metrics: HostMetrics,
                 resolvable: Callable[[str, Sequence[str]], bool],
                 instance: Callable[[], str],
                 on_registered: Callable[[], None], on_new: Callable[[], None]) -> None:
        first = settings()
        self._settings = settings
        self._drivers = drivers
        self._calls = calls
        self._metrics = metrics
        self._resolvable = resolvable
        self._instance = instance
        self._on_registered = on_registered
        self._on_new = on_new
        self.registrar = Registrar(first.plugin_dir, first.register_timeout_s)
        self.registrar.on_registered = self._endpoint_registered
        self.snapshots: Dict[str, Snapshot] = {}
        self.services: Dict[str, DevicePluginService] = {}
        #: Resources registered through the plugin watcher instead of kubelet.sock.
        self.watched: Dict[str, PluginWatcherEndpoint] = {}

    def start(self) -> None:
        self.registrar.start()

    # -- what is served ---------------------------------------------------------------------
    def serves(self, name: str) -> bool:
        return name in self.snapshots

    def wants(self, resource: ResourceConfig, devices: Sequence[Device]) -> bool:
        """Whether the resource is (or now becomes) served: a built-in default with nothing
        on this node is not advertised."""
        return (resource.name in self.snapshots or bool(devices)
                or resource.register_when_empty)

    def names(self) -> List[str]:
        """Every resource served through this output, either way of registering."""
        return [*self.services, *self.watched]

    def count(self) -> int:
        return len(self.registrar.endpoints) + len(self.watched)

    def all_registered(self) -> bool:
        return (self.registrar.all_registered()
                and all(ep.registered for ep in self.watched.values()))

    def registered(self) -> Dict[str, bool]:
        return {name: ep.registered for name, ep in self.registrar.endpoints.items()}

    # -- the interface --------------------------------------------------------------------------
    def sync(self, resource: ResourceConfig, devices: Sequence[Device]) -> None:
        snapshot = self.snapshots.get(resource.name)
        if snapshot is None:
            self._serve(resource, devices)
            return
        if snapshot.update(devices):
            log.info("resource %s: %d devices (%d healthy)", resource.name, len(devices),
                     sum(1 for d in devices if d.healthy))
        current = self.services.get(resource.name)
        if current is not None and current.refresh_options():
            self._register_again(current, "GetPreferredAllocation is "
                                 + ("useful now" if current.options.
                                    get_preferred_allocation_available else "no longer useful"))

    def reconfigure(self, before: ResourceConfig, after: ResourceConfig) -> bool:
        """A reload changed a served resource: keep its stream (the next sync sends the new
        snapshot) when the kubelet-visible options stay; False when it must be served
        afresh (then ``unserve`` it first)."""
        service = self.services.get(after.name)
        if service is None:
            return False
        driver = driver_of(self._drivers, after)
        if (before.driver != after.driver or service.needs_options_change(after, driver)
                or before.registration != after.registration):
            return False
        service.resource = after
        return True

    async def forget(self, resource: ResourceConfig) -> None:
        await self.unserve(resource.name)

    async def unserve(self, name: str) -> None:
        """Stop serving the resource: its socket, registration and snapshot go."""
        await self.registrar.remove(name)
        endpoint = self.watched.pop(name, None)
        if endpoint is not None:
            await endpoint.close()
        self.snapshots.pop(name, None)
        self.services.pop(name, None)

    async def close(self, hand_over: bool) -> None:
        await self.registrar.close()
        for endpoint in list(self.watched.values()):
            await endpoint.close()
        self.watched.clear()

    # -- serving a new resource ---------------------------------------------------------------
    def _serve(self, resource: ResourceConfig, devices: Sequence[Device]) -> None:
        snapshot = Snapshot()
        snapshot.update(devices)
        service = DevicePluginService(
            resource, driver_of(self._drivers, resource), snapshot, self._calls,
            allocate_timeout_s=self._settings().allocate_timeout_s,
            observer=self._metrics.allocate_observer,
        )
        service.cdi_resolvable = self._resolvable
        self.snapshots[resource.name] = snapshot
        self.services[resource.name] = service
        if resource.registration == "plugin-watcher":
            self._watch_register(service)
        else:
            self.registrar.add(service)
        self._on_new()

    def _watch_register(self, service: DevicePluginService) -> None:
        """Registered through the plugin watcher instead of kubelet.sock."""
        from host.kubelet import socket_names
        from host.kubelet.plugin_watcher import (
            PluginWatcherEndpoint,
            device_plugin_info,
            registration_socket_name,
        )
        from host.kubelet.protocol import VERSION

        name = service.resource.name
        settings = self._settings()
        folder = registration_socket_name(name)[: -len("-reg.sock")]
        socket = os.path.join(settings.dra_plugins_dir, folder,
                              socket_names.service_socket_file("device-plugin", self._instance()))
        endpoint = PluginWatcherEndpoint(
            device_plugin_info(name, socket, VERSION), settings.plugins_registry_dir,
            lambda generation: (service.handler(generation),),
            label=f"resource {name}", on_registered=self._watched_registered,
            instance=self._instance())
        self.watched[name] = endpoint
        endpoint.start()

    # -- registrations ------------------------------------------------------------------------
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

    def _endpoint_registered(self, endpoint: Endpoint) -> None:
        if endpoint.service.options_stale():
            self._register_again(endpoint.service, "the options changed during Register")
        self._metrics.registered(endpoint.name)
        self._metrics.kubelet_restarts_seen(self.registrar.link.restarts_seen)
        self._on_registered()

    def _watched_registered(self, endpoint: PluginWatcherEndpoint) -> None:
        self._metrics.registered(endpoint.name)
        self._on_registered()
