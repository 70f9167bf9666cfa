"""The DRA output: resources with api = "dra", published as ResourceSlices and prepared by
our kubelet plugin (host/dra/).

``start`` builds the DRA side (API client, slice publisher, kubelet plugin, Node watch) only
when a resource needs it, so the device-plugin-only path never imports host.dra (nor the
API client); a reload that brings the first DRA resource starts it then. Until it has
started, a DRA resource is not served (one error line says why).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    Iterable,
    List,
    Mapping,
    Optional,
    Sequence,
    Set,
)

from host.config import Config
from host.core.driver import Driver, driver_of
from host.core.isolation import DriverCalls
from host.core.model import Device, ResourceConfig
from host.core.tasks import Background
from host.metrics import HostMetrics
from host.outputs import Output

if TYPE_CHECKING:
    from host.core.hostfs import HostFS
    from host.dra.frontend import DraFrontEnd
    from host.dra.kube import KubeClient
    from host.dra.node import NodeWatch
    from host.dra.publisher import SlicePublisher

log = logging.getLogger("host.app")


class DraOutput(Output):
    """``config``: the host's config now (a reload replaces it); ``instance``: this process's
    socket-name suffix; ``hold_at_start``: a resource the Node still lists from a device plugin
    that stopped, to publish once the kubelet drops it; ``notes``: the /healthz notes of
    others (moves in progress) shown beside the Node watch's; ``on_registered``: a kubelet
    registration completed; ``on_unready``: a resource waits for its registration."""

    def __init__(self, config: Callable[[], Config], drivers: Mapping[str, Driver],
                 calls: DriverCalls, metrics: HostMetrics, host: HostFS,
                 background: Background, instance: Callable[[], str],
                 hold_at_start: Callable[[str, Optional[Dict[str, Any]]], None],
                 notes: Callable[[], List[str]],
                 on_registered: Callable[[], None], on_unready: Callable[[], None]) -> None:
        self._config = config
        self._drivers = drivers
        self._calls = calls
        self._metrics = metrics
        self._host = host
        self._background = background
        self._instance = instance
        self._hold_at_start = hold_at_start
        self._notes = notes
        self._on_registered = on_registered
        self._on_unready = on_unready
        self.frontend: Optional[DraFrontEnd] = None
        self.kube: Optional[KubeClient] = None
        self.publisher: Optional[SlicePublisher] = None
        self.node_watch: Optional[NodeWatch] = None
        self._deferred: Set[str] = set()

    @property
    def started(self) -> bool:
        return self.frontend is not None

    # -- start ------------------------------------------------------------------------------
    async def start(self, config: Optional[Config] = None, ours: Iterable[str] = ()) -> None:
        """Build the DRA side for ``config`` (the host's own at start; a reloaded one that
        brings the first DRA resource). ``ours``: names this host serves through a device
        plugin now, which a move takes off the Node before it publishes them
        (host/migration.py), so their capacity on the Node is no conflict. Raises
        DraStartError (nothing changed) when DRA cannot work here."""
        from host.dra.frontend import DraFrontEnd
        from host.dra.kube import KubeClient, KubeConfigError
        from host.dra.metrics import DraMetrics
        from host.dra.node import NodeWatch
        from host.dra.publisher import SlicePublisher
        from host.dra.startup import (
            DraStartError,
            check_cluster,
            check_settings,
            held_by_stopped_plugin,
        )

        config = config or self._config()
        check_settings(config, self._instance())
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
        self.kube = kube
        # Unhealthy devices are left out of the slices unless the operator asks for taints
        # (dra_unhealthy = "taint"): device taints (KEP-5055) are off by default before 1.36,
        # and a server without the gate drops them, so the publisher checks what was stored
        # and falls back to leaving such devices out (one warning).
        publisher = SlicePublisher(kube, config.host.node_name, metrics=self._metrics,
                                   taint_unhealthy=config.host.dra_unhealthy == "taint")
        self.publisher = publisher
        host = config.host
        metrics = DraMetrics(self._metrics.registry)
        frontend = DraFrontEnd(
            node_name=host.node_name, claims=kube, calls=self._calls,
            registry_dir=host.plugins_registry_dir, plugins_dir=host.dra_plugins_dir,
            state_dir=host.dra_state_dir, cdi_dir=host.cdi_dir,
            allocate_timeout_s=host.allocate_timeout_s, publisher=publisher,
            metrics=metrics, host=self._host, instance=self._instance())
        frontend.on_registered = lambda endpoint: self._on_registered()
        # follows reloads
        frontend.device_metadata = lambda: self._config().host.dra_device_metadata
        self.frontend = frontend
        # The Node may not exist yet (the kubelet registers it after it starts) or be
        # registered again later with a new uid: the publisher writes nothing without one
        # (nor while the API server has not said yet, during an outage at start) and names
        # the current one as owner; the watch's first list answers at once when the server
        # does.
        uid = (node.get("metadata") or {}).get("uid") if node else None
        publisher.set_node_uid(uid)
        checked = {uid}  # Node uids whose capacity was checked (check_cluster did the first)

        def node_uid(uid: Optional[str]) -> None:
            """The Node appeared, changed uid or was deleted."""
            publisher.set_node_uid(uid)
            if uid is not None and uid not in checked:
                checked.add(uid)
                self._background.spawn(self._check_capacity(), name="dra-node-capacity")

        watch = NodeWatch(kube, host.node_name, node_uid, gauge=metrics.node_registered)
        self.node_watch = watch
        watch.start(node)
        for name in held_by_stopped_plugin(node, others):
            self._hold_at_start(name, node)
        self._metrics.notes = lambda: [*watch.waiting(), *self._notes()]
        await publisher.start()

    async def _check_capacity(self) -> None:
        """A Node registered after we started may list device plugin capacity for a name we
        serve through DRA (checked at start when it already existed): say so, once per
        uid."""
        from host.dra.kube import KubeError
        from host.dra.startup import capacity_conflict

        if self.kube is None:
            return
        config = self._config()
        try:
            node = await self.kube.get_node(config.host.node_name)
        except KubeError:
            return
        conflict = capacity_conflict(node, config)
        if conflict:
            log.error("DRA: %s", conflict)

    def set_taint_unhealthy(self, taint: bool) -> None:
        """Applied live: every pool is rewritten the new way."""
        if self.publisher is not None:
            self.publisher.set_taint_unhealthy(taint)

    # -- the interface --------------------------------------------------------------------------
    def wants(self, resource: ResourceConfig) -> bool:
        """Whether the resource can be served: not before the DRA side has started."""
        if self.frontend is not None:
            return True
        if resource.name not in self._deferred:
            self._deferred.add(resource.name)
            log.error("resource %s: api = \"dra\" came with a reload; it takes effect "
                      "at the next restart (the API client is set up at start)",
                      resource.name)
        return False

    def sync(self, resource: ResourceConfig, devices: Sequence[Device]) -> None:
        if self.frontend is None:
            return
        self.frontend.sync(resource, driver_of(self._drivers, resource), list(devices))
        if not self.frontend.all_registered():
            self._on_unready()

    async def forget(self, resource: ResourceConfig) -> None:
        await self.unserve(resource.name)

    async def unserve(self, name: str) -> None:
        """The resource's pool is withdrawn (and its driver's registration, once its last
        pool goes)."""
        if self.frontend is not None and name in self.frontend.pools:
            await self.frontend.remove(name)

    def serves(self, name: str) -> bool:
        return self.frontend is not None and name in self.frontend.pools

    def count(self) -> int:
        return 0 if self.frontend is None else len(self.frontend.pools)

    def all_registered(self) -> bool:
        return self.frontend is None or self.frontend.all_registered()

    def registered(self) -> Dict[str, bool]:
        return {} if self.frontend is None else {
            name: ep.registered for name, ep in self.frontend.endpoints.items()}

    async def close(self, hand_over: bool, grace_s: Optional[float] = None) -> None:
        """``grace_s``: on a hand-over, how long a call in flight may still finish once
        deregistered."""
        if self.node_watch is not None:
            await self.node_watch.close()
        if self.frontend is not None:
            await self.frontend.close(grace_s)
        if self.publisher is not None:
            await self.publisher.stop(delete=False)  # the kubelet wipes them if we stay away
        if self.kube is not None:
            await self.kube.close()
