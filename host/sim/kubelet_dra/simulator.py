"""A DRA kubelet: the plugin watcher, the DRA manager's prepare/unprepare, restarts.

Written from upstream's ``pkg/kubelet/cm/dra/manager.go`` and ``claiminfo.go``: before calling
a plugin the kubelet reads each ResourceClaim and refuses a pod the claim is not reserved for
(only the pod UID is compared, and it is checked first), then needs every ``results[].driver``
to be registered; it records the pod reference before the call (so unprepare follows even a
failed prepare), calls ``NodePrepareResources`` per driver with a 45 s deadline on the service
version chosen at registration, and rejects responses keyed by an unknown claim UID, claims
left out ("skipped N ResourceClaims") and per-claim errors. A restart drops every plugin and
connection, deletes the node's ResourceSlices (the DRA plugin manager's start-up wipe) and,
as in the scenario of a node whose kubelet dirs are cleaned, the plugin sockets; the claim
infos survive as the kubelet's checkpoint does, but as "not prepared". A prepared device
keeps the plugin's ``share_id`` (v1), as claiminfo.go does for shared devices; the health
stream is opened on the service ``pickHealthService`` would choose (``health_services``).

The plugin watcher, the manager's checks and its restarts share one state, as in the kubelet.
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import stat
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import grpc

from host.dra.protocol import (
    DRA_HEALTH_SERVICE,
    DRA_HEALTH_SERVICE_V1,
    DRA_WIRE_SERVICES,
    dra_health,
    dra_health_v1,
    dra_v1,
    dra_v1beta1,
)
from host.kubelet.protocol import api as dp_api
from host.sim.kubelet_dra.watcher import PluginWatcher, RegisteredPlugin

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 45.0  # cm/dra/plugin: defaultClientCallTimeout
WIPING_DELAY_S = 30.0  # kubelet: the DRA plugin manager's wipingDelay
HEALTH_RETRY_S = 5.0  # dra_plugin_manager.go: wait.UntilWithContext(..., 5*time.Second)
HEALTH_DEFAULT_TIMEOUT_S = 30.0  # cm/dra/healthinfo.go DefaultHealthTimeout
_MODULES = {"v1.DRAPlugin": dra_v1, "v1beta1.DRAPlugin": dra_v1beta1}
_HEALTH_MODULES = {DRA_HEALTH_SERVICE: dra_health, DRA_HEALTH_SERVICE_V1: dra_health_v1}
HEALTH_MESSAGE_MAX = 1024  # healthinfo.go: longer ones become the first 1021 + "..."

ClaimGetter = Callable[[str, str], Awaitable[Dict[str, Any]]]
SliceWiper = Callable[[str], Union[Awaitable[None], None]]


class PrepareError(Exception):
    """What the kubelet would put in the pod's events; the pod does not start."""


@dataclass
class PreparedDevice:
    request_names: List[str]
    pool_name: str
    device_name: str
    cdi_device_ids: List[str]
    share_id: str = ""  # v1's optional share_id: a share of a device several claims use


@dataclass
class ClaimInfo:
    uid: str
    namespace: str
    name: str
    drivers: Set[str] = field(default_factory=set)
    pods: Set[str] = field(default_factory=set)
    prepared: bool = False
    devices: Dict[str, List[PreparedDevice]] = field(default_factory=dict)  # by driver

    def cdi_devices(self, request: str = "") -> List[str]:
        """claiminfo.go cdiDevicesAsList: what a container referencing ``request`` gets."""
        out: List[str] = []
        for devices in self.devices.values():
            for device in devices:
                if not request or not device.request_names or request in device.request_names:
                    out.extend(device.cdi_device_ids)
        return out


@dataclass
class DeviceHealth:
    """What the kubelet's healthInfoCache holds for one device (stamped on receipt)."""

    health: str  # "Healthy", "Unhealthy", "Unknown"
    message: str
    received: float  # loop time
    timeout_s: float


@dataclass
class _DevicePluginConnection:
    channel: grpc.aio.Channel
    task: asyncio.Task
    snapshots: List[List[Tuple[str, str]]] = field(default_factory=list)


class DraKubeletSimulator:
    """``get_claim(namespace, name)``: the kubelet's read of a claim (a KubeClient's
    ``get_resource_claim``); ``wipe_slices(node)``: what a kubelet start does to the API
    server (``ApiServerStandIn.delete_slices_of_node``)."""

    def __init__(
        self,
        registry_dir: str,
        *,
        get_claim: ClaimGetter,
        node_name: str = "node-1",
        wipe_slices: Optional[SliceWiper] = None,
        plugins_dir: Optional[str] = None,
        get_info_timeout_s: float = 1.0,
        call_timeout_s: float = CALL_TIMEOUT_S,
        kube: Optional[Any] = None,
        wiping_delay_s: float = WIPING_DELAY_S,
        startup_wipe_delay_s: Optional[float] = None,
    ) -> None:
        self.registry_dir = registry_dir
        self.plugins_dir = plugins_dir
        self.node_name = node_name
        self._get_claim = get_claim
        self._wipe_slices = wipe_slices
        self.get_info_timeout_s = get_info_timeout_s
        self.call_timeout_s = call_timeout_s
        # With a KubeClient: the DRA plugin manager's delayed wipe of a driver's slices once
        # its last plugin is gone (cancelled when one registers again).
        self._kube = kube
        self.wiping_delay_s = wiping_delay_s
        # None: the start-up wipe is done before the plugin watcher starts. A number: as the
        # real DRAPluginManager does it, in the background after that long (its Node GET and
        # backoff from 1 s), racing the plugins' registration.
        self.startup_wipe_delay_s = startup_wipe_delay_s
        self._startup_wipe: Optional[asyncio.Task] = None
        self._wipes: Dict[str, asyncio.Task] = {}
        self.wiped_drivers: List[str] = []
        self.claims: Dict[str, ClaimInfo] = {}
        self.restarts = 0
        self.watcher: Optional[PluginWatcher] = None
        self._channels: Dict[str, grpc.aio.Channel] = {}  # endpoint -> channel
        self._closing: Set[asyncio.Task] = set()
        self.device_plugins: Dict[str, _DevicePluginConnection] = {}
        # DRAResourceHealth (ResourceHealthStatus on, the 1.36 default): per driver, per
        # "pool/device"; the stream errors the kubelet would log every 5 s.
        self.watch_health = True
        # Newer DRA plugin managers (pickHealthService) open the health stream only for a
        # plugin that lists a health service among its supported_versions, and take
        # "v1.DRAResourceHealth" where it lists both; 1.36.2 opens v1alpha1 for every plugin.
        self.health_requires_advertised = False
        self.health_services: Dict[str, str] = {}  # driver -> the health service it streams
        self.device_health: Dict[str, Dict[str, DeviceHealth]] = {}
        self.health_errors: List[str] = []
        self.health_messages = 0
        self._health_tasks: Dict[str, asyncio.Task] = {}  # by endpoint: one per instance

    # -- lifecycle -----------------------------------------------------------------------
    async def _wipe_node(self, delay_s: float = 0.0) -> None:
        if delay_s:
            await asyncio.sleep(delay_s)
        assert self._wipe_slices is not None
        result = self._wipe_slices(self.node_name)
        if asyncio.iscoroutine(result):
            await result

    async def start(self) -> None:
        if self._wipe_slices is not None:
            if self.startup_wipe_delay_s is None:
                await self._wipe_node()
            else:
                self._startup_wipe = asyncio.get_running_loop().create_task(
                    self._wipe_node(self.startup_wipe_delay_s), name="kubelet start-up wipe")
        self.watcher = PluginWatcher(self.registry_dir,
                                     get_info_timeout_s=self.get_info_timeout_s,
                                     on_register=self._registered,
                                     on_deregister=self._deregistered)
        await self.watcher.start()

    async def stop(self) -> None:
        if self.watcher is not None:
            await self.watcher.stop()
            self.watcher = None
        health, self._health_tasks = list(self._health_tasks.values()), {}
        health += list(self._wipes.values())
        self._wipes.clear()
        if self._startup_wipe is not None:
            health.append(self._startup_wipe)
            self._startup_wipe = None
        for task in health:
            task.cancel()
        await asyncio.gather(*health, return_exceptions=True)
        for connection in self.device_plugins.values():
            connection.task.cancel()
        await asyncio.gather(*(c.task for c in self.device_plugins.values()),
                             return_exceptions=True)
        for connection in self.device_plugins.values():
            await connection.channel.close()
        self.device_plugins.clear()
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
        await asyncio.gather(*self._closing, return_exceptions=True)
        self._closing.clear()

    async def restart(self, wipe_sockets: bool = True) -> None:
        """A new kubelet: everything in memory gone, slices wiped, sockets (optionally)
        deleted, claim infos restored from the checkpoint as not prepared."""
        await self.stop()
        self.restarts += 1
        if wipe_sockets:
            patterns = [os.path.join(self.registry_dir, "*")]
            if self.plugins_dir is not None:
                patterns.append(os.path.join(self.plugins_dir, "*", "*"))
            for pattern in patterns:
                for path in glob.glob(pattern):
                    try:
                        if stat.S_ISSOCK(os.lstat(path).st_mode):
                            os.unlink(path)
                    except OSError:
                        pass
        for claim in self.claims.values():
            claim.prepared = False
        await self.start()

    # -- registrations -----------------------------------------------------------------------
    def plugin(self, driver: str) -> Optional[RegisteredPlugin]:
        """dra_plugin_manager.go ``get``: of the driver's registered endpoints (1.33+ keeps
        every one, in registration order), the newest whose gRPC connection is up, else the
        newest. A connection is up once gRPC connected it (the kubelet asks for that at
        registration) and down as soon as the plugin's server closed it: a new instance is
        used only after it registered *and* connected, and a call routed to an instance
        whose server has just stopped fails (Unavailable), as on a real node."""
        if self.watcher is None:
            return None
        found = sorted((p for p in self.watcher.plugins.values()
                        if p.type == "DRAPlugin" and p.name == driver),
                       key=lambda p: p.registered_at)
        for plugin in reversed(found):
            if self._connected(plugin):
                return plugin
        return found[-1] if found else None

    def plugins_of(self, driver: str) -> List[RegisteredPlugin]:
        """Every registered endpoint of ``driver``, oldest first."""
        if self.watcher is None:
            return []
        return sorted((p for p in self.watcher.plugins.values()
                       if p.type == "DRAPlugin" and p.name == driver),
                      key=lambda p: p.registered_at)

    def _connected(self, plugin: RegisteredPlugin) -> bool:
        channel = self._channels.get(plugin.endpoint)
        if channel is None:
            return False
        # try_to_connect: grpc.NewClient + Connect(), and the reconnect after a ConnEnd.
        return channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY

    def registered(self, driver: str) -> bool:
        return self.plugin(driver) is not None

    async def wait_registered(self, *names: str, plugin_type: str = "DRAPlugin",
                              timeout: float = 10.0) -> None:
        assert self.watcher is not None, "start() first"
        await self.watcher.wait_for(
            lambda w: all(w.by_name(plugin_type, n) is not None for n in names),
            timeout=timeout, what=f"{plugin_type} {', '.join(names)} registered")

    def _registered(self, plugin: RegisteredPlugin) -> None:
        if plugin.type == "DRAPlugin":
            wipe = self._wipes.pop(plugin.name, None)
            if wipe is not None:
                wipe.cancel()  # the driver came back in time
            if plugin.endpoint not in self._channels:
                # grpc.NewClient + Connect(): created once, connects at once ("to detect
                # early whether a plugin is really available").
                self._channels[plugin.endpoint] = grpc.aio.insecure_channel(
                    f"unix://{plugin.endpoint}", options=[("grpc.enable_http_proxy", 0),
                                                          ("grpc.use_local_subchannel_pool", 1)])
                self._channels[plugin.endpoint].get_state(try_to_connect=True)
            service: Optional[str] = DRA_HEALTH_SERVICE
            if self.health_requires_advertised:
                service = next((s for s in (DRA_HEALTH_SERVICE_V1, DRA_HEALTH_SERVICE)
                                if s in plugin.supported), None)
            if self.watch_health and service is not None:
                old = self._health_tasks.pop(plugin.endpoint, None)
                if old is not None:
                    old.cancel()
                self.health_services[plugin.name] = service
                self._health_tasks[plugin.endpoint] = asyncio.get_running_loop().create_task(
                    self._health_stream(plugin, service))
        elif plugin.type == "DevicePlugin":
            self._connect_device_plugin(plugin)

    def _deregistered(self, plugin: RegisteredPlugin) -> None:
        if plugin.type == "DRAPlugin":
            task = self._health_tasks.pop(plugin.endpoint, None)
            if task is not None:
                task.cancel()
            if (self._kube is not None and not self.registered(plugin.name)
                    and plugin.name not in self._wipes):
                self._wipes[plugin.name] = asyncio.get_running_loop().create_task(
                    self._wipe_later(plugin.name))
            channel = self._channels.pop(plugin.endpoint, None)
            if channel is not None:
                self._closing.add(asyncio.ensure_future(channel.close()))
        elif plugin.type == "DevicePlugin":
            connection = self.device_plugins.pop(plugin.name, None)
            if connection is not None:
                connection.task.cancel()
                self._closing.add(asyncio.ensure_future(connection.channel.close()))

    def _connect_device_plugin(self, plugin: RegisteredPlugin) -> None:
        old = self.device_plugins.pop(plugin.name, None)
        if old is not None:
            old.task.cancel()
            self._closing.add(asyncio.ensure_future(old.channel.close()))
        channel = grpc.aio.insecure_channel(f"unix://{plugin.endpoint}",
                                            options=[("grpc.enable_http_proxy", 0)])
        connection = _DevicePluginConnection(channel, asyncio.get_running_loop().create_task(
            self._list_and_watch(plugin.name, channel)))
        self.device_plugins[plugin.name] = connection

    async def _list_and_watch(self, name: str, channel: grpc.aio.Channel) -> None:
        """The device manager's plugin client: options first, then the stream."""
        base = "/v1beta1.DevicePlugin/"
        options = channel.unary_unary(
            base + "GetDevicePluginOptions",
            request_serializer=dp_api.Empty.SerializeToString,
            response_deserializer=dp_api.DevicePluginOptions.FromString)
        stream = channel.unary_stream(
            base + "ListAndWatch",
            request_serializer=dp_api.Empty.SerializeToString,
            response_deserializer=dp_api.ListAndWatchResponse.FromString)
        try:
            await options(dp_api.Empty(), timeout=10.0)
            async for response in stream(dp_api.Empty()):
                connection = self.device_plugins.get(name)
                if connection is not None:
                    connection.snapshots.append([(d.ID, d.health) for d in response.devices])
                if self.watcher is not None:
                    self.watcher._changed.set()
        except grpc.aio.AioRpcError as error:
            log.info("device plugin %s: stream ended: %s", name, error.code().name)

    async def _wipe_later(self, driver: str) -> None:
        """dra_plugin_manager.go sync/wipeResourceSlices: DeleteCollection of the driver's
        slices on this node once it was unusable for wipingDelay."""
        await asyncio.sleep(self.wiping_delay_s)
        assert self._kube is not None
        for piece in await self._kube.list_resource_slices(driver, self.node_name):
            meta = piece["metadata"]
            try:
                await self._kube.delete_resource_slice(meta["name"], None)
            except Exception as error:  # deleted meanwhile: fine, as DeleteCollection
                if getattr(error, "status", None) != 404:
                    raise
        self.wiped_drivers.append(driver)
        self._wipes.pop(driver, None)
        if self.watcher is not None:
            self.watcher._changed.set()

    # -- DRAResourceHealth ----------------------------------------------------------------------
    async def _health_stream(self, plugin: RegisteredPlugin, service: str) -> None:
        """dra_plugin_manager.go: open NodeWatchResources, feed every message to the health
        cache, and when the stream fails or ends, try again 5 s later, for as long as the
        plugin is registered."""
        api = _HEALTH_MODULES[service]
        while True:
            call = self._channel(plugin).unary_stream(
                f"/{service}/NodeWatchResources",
                request_serializer=api.NodeWatchResourcesRequest.SerializeToString,
                response_deserializer=api.NodeWatchResourcesResponse.FromString)
            try:
                async for response in call(api.NodeWatchResourcesRequest()):
                    self._update_health(plugin.name, response)
                self.health_errors.append(f"{plugin.name}: WatchResources stream ended")
            except grpc.aio.AioRpcError as error:
                self.health_errors.append(f"{plugin.name}: {error.code().name}: "
                                          f"{error.details()}")
            if self.watcher is not None:
                self.watcher._changed.set()
            await asyncio.sleep(HEALTH_RETRY_S)

    def _update_health(self, driver: str, response: Any) -> None:
        """healthinfo.go updateHealthInfo: reported devices stamped now; unreported ones turn
        Unknown once their timeout passed."""
        now = asyncio.get_running_loop().time()
        cache = self.device_health.setdefault(driver, {})
        names = {0: "Unknown", 1: "Healthy", 2: "Unhealthy"}
        reported = set()
        for device in response.devices:
            key = f"{device.device.pool_name}/{device.device.device_name}"
            reported.add(key)
            timeout = device.health_check_timeout_seconds
            message = device.message
            if len(message) > HEALTH_MESSAGE_MAX:
                message = message[:HEALTH_MESSAGE_MAX - 3] + "..."
            cache[key] = DeviceHealth(names.get(device.health, "Unknown"), message,
                                      now, float(timeout) if timeout > 0
                                      else HEALTH_DEFAULT_TIMEOUT_S)
        for key, known in cache.items():
            if key not in reported and now - known.received > known.timeout_s:
                cache[key] = DeviceHealth("Unknown", "", now, known.timeout_s)
        self.health_messages += 1
        if self.watcher is not None:
            self.watcher._changed.set()

    def health(self, driver: str, pool: str, device: str) -> Tuple[str, str]:
        """healthinfo.go getHealthInfo: (health, message) as pod status would show it."""
        known = self.device_health.get(driver, {}).get(f"{pool}/{device}")
        if known is None:
            return "Unknown", ""
        if asyncio.get_running_loop().time() - known.received > known.timeout_s:
            return "Unknown", ""
        return known.health, known.message

    # -- the DRA manager ---------------------------------------------------------------------
    async def prepare(self, pod_uid: str, claims: Sequence[Tuple[str, str]]) -> List[ClaimInfo]:
        """PrepareResources for one pod's claims ((namespace, name) each)."""
        read: List[Tuple[Dict[str, Any], ClaimInfo]] = []
        for namespace, name in claims:
            obj = await self._get_claim(namespace, name)
            meta = obj.get("metadata") or {}
            status = obj.get("status") or {}
            reserved = [r.get("uid") for r in status.get("reservedFor") or ()]
            if pod_uid not in reserved:
                raise PrepareError(f"pod {pod_uid} is not allowed to use ResourceClaim "
                                   f"{namespace}/{name}")
            results = ((status.get("allocation") or {}).get("devices") or {}).get("results")
            if status.get("allocation") is None:
                raise PrepareError(f"ResourceClaim {namespace}/{name} is not allocated")
            uid = str(meta.get("uid", ""))
            info = self.claims.get(uid) or ClaimInfo(uid, namespace, name)
            info.drivers = {str(r.get("driver")) for r in results or ()}
            info.pods.add(pod_uid)  # checkpointed before any plugin call
            self.claims[uid] = info
            read.append((obj, info))
        by_driver: Dict[str, List[ClaimInfo]] = {}
        for _, info in read:
            if info.prepared:
                continue
            for driver in sorted(info.drivers):
                by_driver.setdefault(driver, []).append(info)
        for driver, infos in by_driver.items():
            plugin = self.plugin(driver)
            if plugin is None:
                raise PrepareError(f"prepare dynamic resources: DRA driver {driver} is not "
                                   f"registered")
            await self._prepare_with(plugin, infos)
        for _, info in read:
            if all(d in info.devices for d in info.drivers):
                info.prepared = True
        return [info for _, info in read]

    async def node_prepare(self, driver: str, claims: Sequence[Tuple[str, str, str]],
                           service: Optional[str] = None) -> Any:
        """The bare RPC (no pre-checks) on the driver's chosen service or ``service``;
        claims are (namespace, name, uid). Raises grpc.aio.AioRpcError."""
        return await self._raw(driver, "NodePrepareResources", claims, service)

    async def node_unprepare(self, driver: str, claims: Sequence[Tuple[str, str, str]],
                             service: Optional[str] = None) -> Any:
        return await self._raw(driver, "NodeUnprepareResources", claims, service)

    async def _raw(self, driver: str, method: str, claims: Sequence[Tuple[str, str, str]],
                   service: Optional[str]) -> Any:
        plugin = self.plugin(driver)
        if plugin is None:
            raise PrepareError(f"DRA driver {driver} is not registered")
        chosen = service or plugin.chosen_service
        api = _MODULES[chosen]
        request_type = getattr(api, f"{method}Request")
        response_type = getattr(api, f"{method}Response")
        call = self._channel(plugin).unary_unary(
            f"/{DRA_WIRE_SERVICES[chosen]}/{method}",
            request_serializer=request_type.SerializeToString,
            response_deserializer=response_type.FromString)
        request = request_type(claims=[api.Claim(namespace=ns, name=name, uid=uid)
                                       for ns, name, uid in claims])
        return await call(request, timeout=self.call_timeout_s)

    async def _prepare_with(self, plugin: RegisteredPlugin, infos: List[ClaimInfo]) -> None:
        try:
            response = await self.node_prepare(
                plugin.name, [(i.namespace, i.name, i.uid) for i in infos])
        except grpc.aio.AioRpcError as error:
            raise PrepareError(f"NodePrepareResources failed: rpc error: code = "
                               f"{_go_code(error.code())} desc = {error.details()}") from None
        wanted = {i.uid: i for i in infos}
        for uid, result in response.claims.items():
            info = wanted.get(uid)
            if info is None:
                raise PrepareError(f"NodePrepareResources returned result for unknown claim "
                                   f"UID {uid}")
            if result.error:
                raise PrepareError(f"NodePrepareResources failed for ResourceClaim "
                                   f"{info.name}: {result.error}")
            info.devices[plugin.name] = [
                PreparedDevice(list(d.request_names), d.pool_name, d.device_name,
                               list(d.cdi_device_ids), _share_id(d)) for d in result.devices]
        missing = len(set(wanted) - set(response.claims))
        if missing:
            raise PrepareError(f"NodePrepareResources skipped {missing} ResourceClaims")

    async def unprepare(self, pod_uid: str) -> None:
        """UnprepareResources for a pod that is gone: every claim only it used."""
        by_driver: Dict[str, List[ClaimInfo]] = {}
        done: List[ClaimInfo] = []
        for info in self.claims.values():
            if pod_uid not in info.pods:
                continue
            info.pods.discard(pod_uid)
            if info.pods:
                continue  # still used by another pod
            done.append(info)
            for driver in sorted(info.drivers):
                by_driver.setdefault(driver, []).append(info)
        for driver, infos in by_driver.items():
            plugin = self.plugin(driver)
            if plugin is None:
                raise PrepareError(f"unprepare dynamic resources: DRA driver {driver} is not "
                                   f"registered")
            try:
                response = await self.node_unprepare(
                    driver, [(i.namespace, i.name, i.uid) for i in infos])
            except grpc.aio.AioRpcError as error:
                raise PrepareError(f"NodeUnprepareResources failed: rpc error: code = "
                                   f"{_go_code(error.code())} desc = {error.details()}") from None
            for info in infos:
                result = response.claims.get(info.uid)
                if result is None:
                    raise PrepareError("NodeUnprepareResources skipped 1 ResourceClaims")
                if result.error:
                    raise PrepareError(f"NodeUnprepareResources failed for ResourceClaim "
                                       f"{info.name}: {result.error}")
        for info in done:
            self.claims.pop(info.uid, None)

    def _channel(self, plugin: RegisteredPlugin) -> grpc.aio.Channel:
        channel = self._channels.get(plugin.endpoint)
        if channel is None:
            channel = grpc.aio.insecure_channel(f"unix://{plugin.endpoint}",
                                                options=[("grpc.enable_http_proxy", 0)])
            self._channels[plugin.endpoint] = channel
        return channel


def _share_id(device: Any) -> str:
    """claiminfo.go: the device's ShareID where the plugin set one (v1 only)."""
    if "share_id" in device.DESCRIPTOR.fields_by_name and device.HasField("share_id"):
        return str(device.share_id)
    return ""


def _go_code(code: grpc.StatusCode) -> str:
    return "".join(part.capitalize() for part in code.name.split("_"))
