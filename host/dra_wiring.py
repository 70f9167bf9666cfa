"""The host's DRA side: resources with api = "dra", and device plugins registered through the
kubelet's plugin watcher instead of kubelet.sock.

Built at start only when a resource needs it, so the device-plugin-only path never imports
host.dra (nor the API client). The objects it makes (``app.dra``, ``app.kube``,
``app.publisher``, ``app.watched``) belong to the HostApp, which closes them in stop().
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Iterable, List, Optional

from host.config import Config
from host.driver import UnavailableDriver
from host.model import Device, ResourceConfig
from host.service import DevicePluginService

if TYPE_CHECKING:
    from host.app import HostApp

log = logging.getLogger("host.app")


async def start_dra(app: HostApp, config: Optional[Config] = None,
                    ours: Iterable[str] = ()) -> None:
    """Build the DRA side for ``config`` (the app's own at start; a reloaded one that brings
    the first DRA resource). ``ours``: names this host serves through a device plugin now,
    which a move takes off the Node before it publishes them (host/migration.py), so their
    capacity on the Node is no conflict."""
    from host.dra.frontend import DraFrontEnd
    from host.dra.kube import KubeClient, KubeConfigError
    from host.dra.metrics import DraMetrics
    from host.dra.node import NodeWatch
    from host.dra.startup import (
        DraStartError,
        check_cluster,
        check_settings,
        held_by_stopped_plugin,
    )

    config = config or app.config
    check_settings(config, app.instance)
    try:
        kube = KubeClient.from_settings(config.host.kubeconfig)
    except KubeConfigError as error:
        raise DraStartError(f"no API access for DRA: {error}") from None
    ours = set(ours)
    others = dataclasses.replace(config, resources=tuple(r for r in config.resources
                                                         if r.name not in ours))
    try:
        node = await check_cluster(kube, others)
    except BaseException:
        await kube.close()
        raise
    app.kube = kube
    from host.dra.publisher import SlicePublisher

    # Unhealthy devices are left out of the slices unless the operator asks for taints
    # (dra_unhealthy = "taint"): device taints (KEP-5055) are off by default before 1.36, and a
    # server without the gate drops them, so the publisher checks what was stored and falls
    # back to leaving such devices out (one warning).
    app.publisher = SlicePublisher(app.kube, config.host.node_name, metrics=app.metrics,
                                   taint_unhealthy=config.host.dra_unhealthy == "taint")
    host = config.host
    metrics = DraMetrics(app.metrics.registry)
    app.dra = DraFrontEnd(
        node_name=host.node_name, claims=app.kube, calls=app.calls,
        registry_dir=host.plugins_registry_dir, plugins_dir=host.dra_plugins_dir,
        state_dir=host.dra_state_dir, cdi_dir=host.cdi_dir,
        allocate_timeout_s=host.allocate_timeout_s, publisher=app.publisher,
        metrics=metrics, host=app.host, instance=app.instance)
    app.dra.on_registered = app._dra_registered
    app.dra.device_metadata = lambda: app.config.host.dra_device_metadata  # follows reloads
    # The Node may not exist yet (the kubelet registers it after it starts) or be registered
    # again later with a new uid: the publisher writes nothing without one (nor while the
    # API server has not said yet, during an outage at start) and names the current one as
    # owner; the watch's first list answers at once when the server does.
    uid = (node.get("metadata") or {}).get("uid") if node else None
    app.publisher.set_node_uid(uid)
    checked = {uid}  # Node uids whose capacity was checked (check_cluster did the first)

    def node_uid(uid: Optional[str]) -> None:
        """The Node appeared, changed uid or was deleted."""
        assert app.publisher is not None
        app.publisher.set_node_uid(uid)
        if uid is not None and uid not in checked:
            checked.add(uid)
            app.background.spawn(_check_capacity(app), name="dra-node-capacity")

    watch = NodeWatch(app.kube, host.node_name, node_uid, gauge=metrics.node_registered)
    app.node_watch = watch
    watch.start(node)
    for name in held_by_stopped_plugin(node, others):
        app.moves.hold_at_start(name, node)
    app.metrics.notes = lambda: [*watch.waiting(), *app.moves.notes()]
    await app.publisher.start()


async def _check_capacity(app: HostApp) -> None:
    """A Node registered after we started may list device plugin capacity for a name we
    serve through DRA (checked at start when it already existed): say so, once per uid."""
    from host.dra.kube import KubeError
    from host.dra.startup import capacity_conflict

    if app.kube is None:
        return
    try:
        node = await app.kube.get_node(app.config.host.node_name)
    except KubeError:
        return
    conflict = capacity_conflict(node, app.config)
    if conflict:
        log.error("DRA: %s", conflict)


async def stop_dra(app: HostApp, grace_s: Optional[float] = None) -> None:
    if app.node_watch is not None:
        await app.node_watch.close()
    if app.dra is not None:
        await app.dra.close(grace_s)
    if app.publisher is not None:
        await app.publisher.stop(delete=False)  # the kubelet wipes them if we stay away
    if app.kube is not None:
        await app.kube.close()


def sync_dra(app: HostApp, resource: ResourceConfig, devices: List[Device]) -> None:
    if app.dra is None:
        if resource.name not in app._dra_deferred:
            app._dra_deferred.add(resource.name)
            log.error("resource %s: api = \"dra\" came with a reload; it takes effect "
                      "at the next restart (the API client is set up at start)",
                      resource.name)
        return
    driver = app.drivers.get(resource.driver) or UnavailableDriver(
        resource.driver, "not installed")
    app.dra.sync(resource, driver, devices)
    app.metrics.set_devices(resource.name, devices)
    if not app.dra.all_registered():
        app.ready.clear()


def watch_register(app: HostApp, service: DevicePluginService) -> None:
    """A device plugin registered through the plugin watcher instead of kubelet.sock."""
    from host.dra import naming
    from host.dra.registrar import (
        PluginWatcherEndpoint,
        device_plugin_info,
        registration_socket_name,
    )
    from host.protocol import VERSION

    name = service.resource.name
    host = app.config.host
    folder = registration_socket_name(name)[: -len("-reg.sock")]
    socket = os.path.join(host.dra_plugins_dir, folder,
                          naming.service_socket_file("device-plugin", app.instance))
    endpoint = PluginWatcherEndpoint(
        device_plugin_info(name, socket, VERSION), host.plugins_registry_dir,
        lambda generation: (service.handler(generation),),
        label=f"resource {name}", on_registered=app._watched_registered,
        instance=app.instance)
    app.watched[name] = endpoint
    endpoint.start()
