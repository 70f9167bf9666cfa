"""The DRA service of one driver: NodePrepareResources / NodeUnprepareResources, v1 and v1beta1.

The kubelet sends only {namespace, name, uid} per claim, so each claim is read from
the API server, its allocation results for our driver are mapped back to Device records of our
pools, the driver's allocate / pre_start hooks run isolated under timeouts (as for the device
plugin side), a CDI spec is written per claim and resource, the claim is checkpointed, and the
devices are returned keyed by claim UID. Every failure is one claim's ``error`` string; the
call as a whole never fails for one bad claim. Prepare is idempotent (the kubelet retries and
calls again after its restart): a checkpointed claim gets the same answer without any work.
Unprepare of a claim we do not know succeeds, since the kubelet unprepares claims whose
prepare failed.

Prepare is the last line of defense: a device whose hardware overlaps one that another claim
holds (host.dra.hardware) is refused, and an unhealthy device is prepared only where
unhealthy devices are published with taints and the claim tolerates its taint
(host.dra.taints).

The claim's pods (its ``status.reservedFor``) and their containers' other claims are read too,
so that env naming devices lists every device of this driver a container receives over all its
claims (host.dra.containers, host.dra.claim_cdi); where that cannot be known for all containers
alike, a request's env names its own devices (one warning per claim, counted). A claim already
prepared for an earlier pod is not prepared again for a later one.

A device shared by several claims (``replicas``, host.dra.sharing) is prepared per share: the
result's ``shareID`` is returned as ``share_id``, each share gets a CDI entry of its own, and
no more shares of a device are handed out than it has. With device metadata on
(host.dra.metadata), each request's devices are also described in a file mounted by CDI.

The per-claim steps (read, map, taints, overlap hold, hooks, CDI, checkpoint) run in the order
the kubelet's DRA manager expects, and each error is reported for its claim.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field, replace
from typing import (
    Any,
    AsyncIterator,
    Callable,
    Dict,
    List,
    Mapping,
    Optional,
    Protocol,
    Sequence,
    Tuple,
)

import grpc

from host.core import allocation
from host.core.capabilities import Capabilities, needs_pre_start
from host.core.driver import Driver
from host.core.fileio import remove_file
from host.core.isolation import DriverCallError, DriverCalls, driver_allocate, driver_pre_start
from host.core.model import ContainerAllocation, Device, ResourceConfig
from host.dra import claim_cdi, containers, hardware, metadata, sharing, taints
from host.dra.checkpoint import Checkpoint, PreparedClaim, PreparedDevice
from host.dra.protocol import (
    DRA_HEALTH_SERVICE,
    DRA_HEALTH_SERVICE_V1,
    DRA_WIRE_SERVICES,
    dra_health,
    dra_health_v1,
    dra_v1,
    dra_v1beta1,
)

log = logging.getLogger(__name__)

CLAIM_GET_TIMEOUT_S = 10.0  # well inside the kubelet's 45 s NodePrepareResources deadline
# The kubelet stamps each reported device on receipt and shows it Unknown once older than the
# device's timeout (cm/dra/healthinfo.go, default 30 s): so the full list is sent on every
# change and again every HEALTH_RESEND_S, well inside the timeout we state.
HEALTH_TIMEOUT_S = 60
HEALTH_RESEND_S = 20.0
HEALTH_MESSAGE_MAX = 1024
MAX_CLAIMS_PER_CALL = 10_000


class ClaimReader(Protocol):
    async def get_resource_claim(self, namespace: str, name: str) -> Dict[str, Any]: ...

    async def get_pod(self, namespace: str, name: str) -> Dict[str, Any]: ...


class ClaimError(Exception):
    """Why one claim cannot be prepared: the text goes into that claim's ``error``."""


@dataclass
class DraPool:
    """One resource served through DRA on this node: its pool and its devices by DRA name."""

    resource: ResourceConfig
    driver: Driver
    pool_name: str
    naming: Callable[[str], str]  # Device.id -> the DNS-label device name in the slice
    by_name: Dict[str, Device] = field(default_factory=dict)
    _node_counts: Optional[Mapping[str, int]] = None
    # > 1: each device is shared that many ways (replicas = N; host.dra.sharing): by_name
    # holds both the shared devices and their replicas (what a server without consumable
    # capacity is given instead), so claims allocated from either are prepared.
    shares: int = 0

    def set_devices(self, devices: Sequence[Device]) -> None:
        self.by_name = {self.naming(device.id): device for device in devices}
        if self.shares > 1:
            for base in sharing.bases(devices):
                self.by_name.setdefault(self.naming(base.id), base)
        self._node_counts = None

    def footprint(self, device: Device) -> Tuple[str, ...]:
        """host.dra.hardware.footprint among this pool's devices (counted once per change)."""
        if self._node_counts is None:
            self._node_counts = hardware.node_counts(
                d for d in self.by_name.values() if not sharing.is_replica(d))
        return hardware.footprint(device, self._node_counts)


class DraService:
    """Long-lived: each new DRA server (after a wiped socket) reuses it and its state."""

    def __init__(
        self,
        driver_name: str,
        pools: Dict[str, DraPool],
        claims: ClaimReader,
        checkpoint: Checkpoint,
        calls: DriverCalls,
        cdi_dir: str,
        *,
        allocate_timeout_s: float,
        claim_get_timeout_s: float = CLAIM_GET_TIMEOUT_S,
    ) -> None:
        self.driver_name = driver_name
        self.pools = pools  # pool name -> pool; the app keeps it current
        self.claims = claims
        self.checkpoint = checkpoint
        self.calls = calls
        self.cdi_dir = cdi_dir
        self.allocate_timeout_s = allocate_timeout_s
        self.claim_get_timeout_s = claim_get_timeout_s
        self._locks: Dict[str, Tuple[asyncio.Lock, int]] = {}  # claim uid -> (lock, users)
        self.env_fallbacks = 0  # claims whose list-valued env stayed per request
        self.in_flight = 0  # prepare/unprepare calls being answered now
        self.last_call_end = 0.0  # time.monotonic() the last one was answered
        self.metrics: Optional[Any] = None  # host.dra.metrics.DraMetrics
        self._health_version = 0
        self._health_wake: Optional[asyncio.Future] = None
        self.health_streams = 0  # open NodeWatchResources streams
        # Whether unhealthy devices are published with taints (dra_unhealthy = "taint"): then
        # a claim that tolerates a device's taint may use it.
        self.tainted: Callable[[], bool] = lambda: False
        # Device metadata (host.dra.metadata): the versions to write, () when off; and the
        # plugin data directory the files go to (beside the DRA socket).
        self.metadata_versions: Callable[[], Sequence[str]] = lambda: ()
        self.data_dir = ""

    # -- gRPC plumbing --------------------------------------------------------------------
    def handlers(self, tag: object = None) -> List[grpc.GenericRpcHandler]:
        """Both API versions on one server; the kubelet picks one at registration. The
        health stream likewise in v1 and v1alpha1 (same messages, two proto packages)."""
        return [self._handler("v1.DRAPlugin", dra_v1),
                self._handler("v1beta1.DRAPlugin", dra_v1beta1),
                self._health_handler(DRA_HEALTH_SERVICE, dra_health),
                self._health_handler(DRA_HEALTH_SERVICE_V1, dra_health_v1)]

    def _health_handler(self, service: str, api: Any) -> grpc.GenericRpcHandler:
        async def watch(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for response in self._watch_health(api):
                yield response

        return grpc.method_handlers_generic_handler(service, {
            "NodeWatchResources": grpc.unary_stream_rpc_method_handler(
                watch, request_deserializer=api.NodeWatchResourcesRequest.FromString,
                response_serializer=api.NodeWatchResourcesResponse.SerializeToString)})

    # -- DRAResourceHealth -----------------------------------------------------------------
    def devices_changed(self) -> None:
        """A pool's devices (or their health) changed: every health stream sends anew."""
        self._health_version += 1
        wake, self._health_wake = self._health_wake, None
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def _watch_health(self, api: Any) -> AsyncIterator[Any]:
        """The complete list of the driver's devices now, then on every change and every
        HEALTH_RESEND_S; never ends on its own (the kubelet reconnects every 5 s if it does)."""
        seen = -1
        self.health_streams += 1
        try:
            while True:
                if self._health_version == seen:
                    await self._health_changed(HEALTH_RESEND_S)
                seen = self._health_version
                yield self._health_response(api)
        finally:
            self.health_streams -= 1

    async def _health_changed(self, timeout: float) -> None:
        if self._health_wake is None:
            self._health_wake = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._health_wake), timeout)
        except asyncio.TimeoutError:
            pass

    def _health_response(self, api: Any) -> Any:
        """Every device of the driver, each with its health reason as ``message`` (what the
        kubelet shows in the pod's allocatedResourcesStatus) and the timeout we promise."""
        now = int(time.time())
        response = api.NodeWatchResourcesResponse()
        for pool_name, pool in self.pools.items():
            for name, device in pool.by_name.items():
                response.devices.add(
                    device=api.DeviceIdentifier(pool_name=pool_name, device_name=name),
                    health=api.HEALTHY if device.healthy else api.UNHEALTHY,
                    last_updated_time=now, health_check_timeout_seconds=HEALTH_TIMEOUT_S,
                    message=device.health_reason[:HEALTH_MESSAGE_MAX])
        return response

    def _handler(self, short: str, api: Any) -> grpc.GenericRpcHandler:
        async def prepare(request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await self._prepare_call(api, request)

        async def unprepare(request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await self._unprepare_call(api, request)

        methods = {
            "NodePrepareResources": grpc.unary_unary_rpc_method_handler(
                prepare,
                request_deserializer=api.NodePrepareResourcesRequest.FromString,
                response_serializer=api.NodePrepareResourcesResponse.SerializeToString,
            ),
            "NodeUnprepareResources": grpc.unary_unary_rpc_method_handler(
                unprepare,
                request_deserializer=api.NodeUnprepareResourcesRequest.FromString,
                response_serializer=api.NodeUnprepareResourcesResponse.SerializeToString,
            ),
        }
        return grpc.method_handlers_generic_handler(DRA_WIRE_SERVICES[short], methods)

    # -- NodePrepareResources ---------------------------------------------------------------
    async def _prepare_call(self, api: Any, request: Any) -> Any:
        self.in_flight += 1
        try:
            return await self._prepare_call_counted(api, request)
        finally:
            self.in_flight -= 1
            self.last_call_end = time.monotonic()

    async def _prepare_call_counted(self, api: Any, request: Any) -> Any:
        started = time.perf_counter()
        response = api.NodePrepareResourcesResponse()
        claims = list(request.claims)[:MAX_CLAIMS_PER_CALL]
        async with self.checkpoint.shared():  # another host may serve the driver too
            results = await asyncio.gather(*(self._prepare_one(c.namespace, c.name, c.uid)
                                             for c in claims))
        for claim, (devices, error) in zip(claims, results):
            entry = response.claims[claim.uid]
            if error:
                entry.error = error
                continue
            for device in devices:
                added = entry.devices.add(
                    request_names=list(device.request_names), pool_name=device.pool_name,
                    device_name=device.device_name, cdi_device_ids=list(device.cdi_device_ids))
                if device.share_id and "share_id" in added.DESCRIPTOR.fields_by_name:
                    added.share_id = device.share_id  # v1 only; v1beta1 has no field for it
        self._observe("prepare", started)
        return response

    async def _prepare_one(
        self, namespace: str, name: str, uid: str
    ) -> Tuple[Sequence[PreparedDevice], str]:
        if not uid:
            return (), "claim has no uid"
        try:
            async with self._claim_lock(uid):
                done = self.checkpoint.get(uid)
                if done is not None:
                    missing = [f for f in done.cdi_files if not os.path.exists(f)]
                    if not missing:
                        self._count("again")
                        return done.devices, ""  # idempotent: the kubelet retried/restarted
                    # A reboot emptied /var/run/cdi (a tmpfs) and the kubelet prepares its
                    # restored claims again: answering from the checkpoint alone would hand
                    # out CDI ids no spec defines, so the claim is prepared anew.
                    log.warning("driver %s: claim %s/%s (%s) was prepared but its CDI spec "
                                "%s is gone; preparing it again", self.driver_name, namespace,
                                name, uid, missing[0])
                prepared = await self._prepare_new(namespace, name, uid)
                self._count("prepared")
                return prepared.devices, ""
        except ClaimError as error:
            self._count("failed")
            log.warning("driver %s: cannot prepare claim %s/%s (%s): %s", self.driver_name,
                        namespace, name, uid, error)
            return (), f"{namespace}/{name}: {error}"
        except Exception as error:  # a bug must cost one claim, never the call
            self._count("failed")
            log.exception("driver %s: preparing claim %s/%s failed", self.driver_name,
                          namespace, name)
            return (), f"{namespace}/{name}: internal error: {type(error).__name__}: {error}"

    @contextlib.asynccontextmanager
    async def _claim_lock(self, uid: str) -> AsyncIterator[None]:
        """One prepare or unprepare of a claim at a time: the kubelet retries a slow prepare
        (45 s deadline) while the first one still runs; the retry then finds it checkpointed.
        The lock lives while anyone holds or waits for it."""
        lock, users = self._locks.get(uid) or (asyncio.Lock(), 0)
        self._locks[uid] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[uid]
            if users <= 1:
                del self._locks[uid]
            else:
                self._locks[uid] = (lock, users - 1)

    async def _read_claim(self, namespace: str, name: str) -> Dict[str, Any]:
        try:
            return await asyncio.wait_for(
                self.claims.get_resource_claim(namespace, name), self.claim_get_timeout_s)
        except asyncio.TimeoutError:
            raise ClaimError(f"reading the ResourceClaim from the API server took longer "
                             f"than {self.claim_get_timeout_s:g} s") from None
        except Exception as error:
            status = getattr(error, "status", None)
            reason = getattr(error, "reason", None) or str(error) or type(error).__name__
            if status == 404:
                raise ClaimError("ResourceClaim not found in the API server") from None
            where = f"HTTP {status}: " if status else ""
            raise ClaimError(f"cannot read the ResourceClaim: {where}{reason}") from None

    async def _prepare_new(self, namespace: str, name: str, uid: str) -> PreparedClaim:
        claim = await self._read_claim(namespace, name)
        meta = claim.get("metadata") or {}
        if meta.get("uid") != uid:
            raise ClaimError(f"the ResourceClaim in the API server has UID {meta.get('uid')!r},"
                             f" not {uid!r} (deleted and created again?)")
        status = claim.get("status") or {}
        pods = [r for r in status.get("reservedFor") or ()
                if isinstance(r, dict) and r.get("resource") == "pods" and not r.get("apiGroup")]
        if not pods:
            raise ClaimError("the ResourceClaim is not reserved for any pod")
        allocation_ = status.get("allocation")
        if not isinstance(allocation_, dict):
            raise ClaimError("the ResourceClaim is not allocated")
        results = [r for r in ((allocation_.get("devices") or {}).get("results") or ())
                   if isinstance(r, dict) and r.get("driver") == self.driver_name]
        picked = [self._resolve(r, claim, f"{namespace}/{name}") for r in results]
        footprints = {_key(result, device): self._footprint(result, device)
                      for result, device in picked}
        self._reserve(uid, picked, footprints)
        try:
            unions = await self._container_unions(namespace, name, pods, picked)
            return await self._prepare_devices(namespace, name, uid, pods, picked, footprints,
                                               unions, claim)
        finally:
            self.checkpoint.reserved.pop(uid, None)
            self.checkpoint.reserved_shares.pop(uid, None)

    def _footprint(self, result: Dict[str, Any], device: Device) -> Tuple[str, ...]:
        """The device's hardware keys; those of a share where it was allocated as one."""
        keys = self.pools[str(result["pool"])].footprint(device)
        return hardware.shared(keys) if _share_id(result) else keys

    def _check_shares(self, uid: str, picked: Sequence[Tuple[Dict[str, Any], Device]],
                      footprints: Dict[str, Tuple[str, ...]]) -> None:
        """Refuse shares beyond what a shared device has (``replicas``), counting those of
        prepared claims and of claims being prepared now; else hold this claim's shares."""
        wanted: Dict[Tuple[str, ...], int] = {}
        limits: Dict[Tuple[str, ...], Tuple[int, str]] = {}
        for result, device in picked:
            keys = _share_keys(footprints[_key(result, device)])
            if not keys:
                continue
            count = sharing.consumed_shares(result) if _share_id(result) else 1
            wanted[keys] = wanted.get(keys, 0) + count
            pool = self.pools[str(result["pool"])]
            limits[keys] = (pool.shares, str(result.get("device")))
        if not wanted:
            return
        held: Dict[Tuple[str, ...], int] = {}
        for other in self.checkpoint.claims.values():
            if other.uid == uid:
                continue
            for device_ in other.devices:
                keys = _share_keys(device_.hardware)
                if keys in wanted:
                    held[keys] = held.get(keys, 0) + max(device_.shares, 1)
        for other_uid, taken in self.checkpoint.reserved_shares.items():
            for keys, count in taken if other_uid != uid else ():
                if keys in wanted:
                    held[keys] = held.get(keys, 0) + count
        for keys, count in wanted.items():
            limit, name = limits[keys]
            if limit > 1 and held.get(keys, 0) + count > limit:
                raise ClaimError(f"allocated device {name!r} is shared {limit} ways and "
                                 f"{held.get(keys, 0)} shares are held by other claims on this "
                                 f"node: {count} more do not fit")
        self.checkpoint.reserved_shares[uid] = list(wanted.items())

    def _reserve(self, uid: str, picked: Sequence[Tuple[Dict[str, Any], Device]],
                 footprints: Dict[str, Tuple[str, ...]]) -> None:
        """Refuse a device whose hardware overlaps one that another claim holds (prepared and
        not unprepared, or being prepared now), else hold this claim's hardware. No await
        between the check and the hold: concurrent prepares see each other."""
        for result, device in picked:
            mine = footprints[_key(result, device)]
            for other in self.checkpoint.claims.values():
                if other.uid == uid:
                    continue
                for held in other.devices:
                    why = hardware.conflict(mine, held.hardware or self._footprint_now(held))
                    if why:
                        raise ClaimError(
                            f"allocated device {result.get('device')!r} ({device.id}) overlaps "
                            f"{held.device_name!r} ({held.device_id}) of claim {other.namespace}/"
                            f"{other.name} ({other.uid}), prepared on this node and not "
                            f"unprepared: {why}")
            for other_uid, held_keys in self.checkpoint.reserved.items():
                why = hardware.conflict(mine, held_keys) if other_uid != uid else None
                if why:
                    raise ClaimError(
                        f"allocated device {result.get('device')!r} ({device.id}) overlaps a "
                        f"device of claim {other_uid}, being prepared on this node: {why}")
        self._check_shares(uid, picked, footprints)
        self.checkpoint.reserved[uid] = tuple(k for keys in footprints.values() for k in keys)

    def _footprint_now(self, held: PreparedDevice) -> Tuple[str, ...]:
        """For a device checkpointed without its footprint: from its record in the pool now."""
        for pool in self.pools.values():
            if pool.resource.name == held.resource:
                device = pool.by_name.get(held.device_name)
                if device is not None and device.id == held.device_id:
                    return pool.footprint(device)
        return ()

    async def _prepare_devices(
        self, namespace: str, name: str, uid: str, pods: List[Dict[str, Any]],
        picked: List[Tuple[Dict[str, Any], Device]], footprints: Dict[str, Tuple[str, ...]],
        unions: Dict[containers.Entry, List[Device]],
        claim: Dict[str, Any],
    ) -> PreparedClaim:
        by_pool: Dict[str, List[Tuple[Dict[str, Any], Device]]] = {}
        for result, device in picked:
            by_pool.setdefault(result["pool"], []).append((result, device))
        prepared: List[PreparedDevice] = []
        in_order: List[Tuple[Dict[str, Any], Device]] = []  # parallel to prepared
        files: List[str] = []
        specs: Dict[str, Any] = {}
        try:
            for pool_name, items in by_pool.items():
                pool = self.pools[pool_name]
                by_request: Dict[str, List[Tuple[Dict[str, Any], Device]]] = {}
                for result, device in items:
                    by_request.setdefault(str(result.get("request", "")), []).append(
                        (result, device))
                groups = []
                for request, pairs in by_request.items():
                    devices = [d for _, d in pairs]
                    merged = await self._hooks(pool, devices)
                    union = unions.get((pool_name, request))
                    if union is not None and [d.id for d in union] != [d.id for d in devices]:
                        # What every container referencing this request receives from the
                        # pool over all its claims: its list-valued env, in every such entry.
                        whole = await self._merge(pool, union)
                        merged = replace(merged, envs=dict(merged.envs, **whole.envs))
                    groups.append(claim_cdi.RequestGroup(
                        request, [self._share_view(pool, r, d) for r, d in pairs], merged,
                        [_share_id(r) for r, _ in pairs]))
                spec, ids = claim_cdi.build_claim_spec(uid, pool.resource.name, groups)
                path = claim_cdi.spec_path(self.cdi_dir, uid, pool.resource.name)
                try:  # fsynced: off the loop, which serves every other resource meanwhile
                    await asyncio.get_running_loop().run_in_executor(
                        None, claim_cdi.write_claim_spec, path, spec)
                except OSError as error:
                    raise ClaimError(f"cannot write the CDI spec {path}: {error}") from None
                files.append(path)
                specs[path] = spec
                for result, device in items:
                    share_id = _share_id(result)
                    in_order.append((result, device))
                    prepared.append(PreparedDevice(
                        request_names=_request_names(str(result.get("request", ""))),
                        pool_name=pool_name, device_name=str(result["device"]),
                        cdi_device_ids=ids[claim_cdi.device_key(device, share_id)],
                        resource=pool.resource.name, device_id=device.id,
                        hardware=footprints[_key(result, device)], share_id=share_id,
                        shares=(sharing.consumed_shares(result) if share_id else
                                1 if sharing.is_replica(device) else 0),
                    ))
            versions = self.metadata_versions() if self.data_dir else ()
            if versions and prepared:
                prepared = await self._write_metadata(claim, in_order, prepared, versions,
                                                      files, specs)
            record = PreparedClaim(uid=uid, namespace=namespace, name=name,
                                   devices=tuple(prepared), cdi_files=tuple(files),
                                   pod_uids=tuple(str(p.get("uid", "")) for p in pods),
                                   cdi_specs=specs)
            try:
                await self.checkpoint.aput(record)
            except OSError as error:
                raise ClaimError(f"cannot save the checkpoint {self.checkpoint.path}: "
                                 f"{error}") from None
        except BaseException:
            for path in files:  # nothing half prepared stays behind
                remove_file(path)
            if self.metadata_versions() and self.data_dir:
                with contextlib.suppress(OSError):
                    metadata.remove_claim(self.data_dir, namespace, name)
            raise
        log.info("driver %s: prepared claim %s/%s (%s): %s", self.driver_name, namespace, name,
                 uid, ", ".join(f"{d.pool_name}/{d.device_name}" for d in prepared) or "none")
        return record

    async def _write_metadata(
        self, claim: Dict[str, Any], picked: List[Tuple[Dict[str, Any], Device]],
        prepared: List[PreparedDevice], versions: Sequence[str], files: List[str],
        specs: Dict[str, Any],
    ) -> List[PreparedDevice]:
        """host.dra.metadata: one file and CDI spec per base request of the claim; the CDI
        id goes to the first device of each request. ``prepared`` is parallel to ``picked``."""
        by_request: Dict[str, List[int]] = {}
        ordered = picked
        for index, (result, _) in enumerate(ordered):
            by_request.setdefault(metadata.base_request(str(result.get("request", ""))),
                                  []).append(index)
        out = list(prepared)
        for request, indexes in by_request.items():
            items = [metadata.MetadataDevice(str(ordered[i][0]["pool"]),
                                             str(ordered[i][0]["device"]), ordered[i][1])
                     for i in indexes]
            ref = str(ordered[indexes[0]][0].get("request", "")) or request
            try:  # fsynced: off the loop
                written, spec, cdi_id = await asyncio.get_running_loop().run_in_executor(
                    None, metadata.write_request, self.data_dir, self.cdi_dir,
                    self.driver_name, claim, request or "all", ref, items, versions)
            except OSError as error:
                raise ClaimError(f"cannot write the device metadata of request "
                                 f"{request!r}: {error}") from None
            files.extend(written)
            specs.update(spec)
            first = out[indexes[0]]
            out[indexes[0]] = replace(first, cdi_device_ids=(*first.cdi_device_ids, cdi_id))
        return out

    def _share_view(self, pool: DraPool, result: Dict[str, Any], device: Device) -> Device:
        """The device as its CDI entry shows it: a share (or a replica) also carries which
        share and how much of the device (host.dra.sharing.share_env)."""
        share_id = _share_id(result)
        if share_id:
            env = sharing.share_env(device, sharing.consumed_shares(result), pool.shares,
                                    share_id)
        elif sharing.is_replica(device) and pool.shares > 1:
            env = sharing.share_env(device, 1, pool.shares)
        else:
            return device
        return replace(device, env={**device.env, **env})

    def _resolve(self, result: Dict[str, Any], claim: Dict[str, Any], label: str
                 ) -> Tuple[Dict[str, Any], Device]:
        pool_name = result.get("pool")
        device_name = result.get("device")
        pool = self.pools.get(str(pool_name))
        if pool is None:
            raise ClaimError(f"allocated pool {pool_name!r} is not served by driver "
                             f"{self.driver_name} on this node (pools: "
                             f"{', '.join(sorted(self.pools)) or 'none'})")
        device = pool.by_name.get(str(device_name))
        if device is None:
            raise ClaimError(f"allocated device {device_name!r} is not in pool {pool_name} "
                             f"any more (removed since the allocation?)")
        if _share_id(result) and (pool.shares <= 1 or sharing.is_replica(device)):
            raise ClaimError(f"allocated device {device_name!r} ({device.id}) was allocated as "
                             f"a share ({_share_id(result)}), but it is not shared on this "
                             f"node (replicas of {pool.resource.name})")
        if not device.healthy:
            reason = f": {device.health_reason}" if device.health_reason else ""
            if not self.tainted():
                raise ClaimError(f"allocated device {device_name!r} ({device.id}) is "
                                 f"Unhealthy{reason}")
            taint = taints.device_taint(device)
            shown = f"{taint['key']}={taint['value']}:{taint['effect']}"
            broken = taints.unusable(device.health_reason)
            if broken:
                raise ClaimError(f"allocated device {device_name!r} ({device.id}) cannot "
                                 f"work: {broken} (taint {shown})")
            if not any(taints.tolerates(t, taint)
                       for t in taints.tolerations_of(result, claim)):
                raise ClaimError(f"allocated device {device_name!r} ({device.id}) is "
                                 f"Unhealthy{reason}, and the claim does not tolerate its "
                                 f"taint {shown}")
            log.warning("driver %s: claim %s uses device %s (%s) that is Unhealthy%s: it "
                        "tolerates the taint %s", self.driver_name, label, device_name,
                        device.id, reason, shown)
        return result, device

    async def _container_unions(
        self, namespace: str, name: str, pods: List[Dict[str, Any]],
        picked: List[Tuple[Dict[str, Any], Device]],
    ) -> Dict[containers.Entry, List[Device]]:
        """Per (pool, request) of this claim, the devices of that pool that every container
        referencing it receives over all its claims (host.dra.containers), read from the
        claim's pods and their other claims. Entries whose containers disagree are left out,
        and so is every entry when a pod or claim cannot be read: those keep the request's own
        devices in their env (one warning per claim, counted)."""
        if not picked:
            return {}
        entries = list(dict.fromkeys((str(r["pool"]), str(r.get("request", "")))
                                     for r, _ in picked))
        results_of: Dict[str, List[Tuple[str, str, str]]] = {
            name: [(str(r["pool"]), str(r["device"]), str(r.get("request", "")))
                   for r, _ in picked]}
        refs: List[List[containers.Ref]] = []
        try:
            read = await asyncio.gather(*(
                self._read("Pod", self._get_pod, namespace, str(ref.get("name")))
                for ref in pods))
            for ref, pod in zip(pods, read):
                if (pod.get("metadata") or {}).get("uid") != ref.get("uid"):
                    raise ClaimError(f"Pod {namespace}/{ref.get('name')} has another UID than "
                                     "the claim is reserved for")
                by_container = containers.container_refs(pod)
                if by_container is None:
                    raise ClaimError(f"Pod {namespace}/{ref.get('name')} references a claim "
                                     "whose ResourceClaim is not named yet")
                refs.extend(r for r in by_container.values()
                            if any(claim == name for claim, _ in r))
            others = sorted({c for r in refs for c, _ in r} - {name})
            claims = await asyncio.gather(*(
                self._read("ResourceClaim", self.claims.get_resource_claim, namespace, other)
                for other in others))
            for other, claim in zip(others, claims):
                results_of[other] = [
                    (str(r.get("pool")), str(r.get("device")), str(r.get("request", "")))
                    for r in ((((claim.get("status") or {}).get("allocation") or {})
                               .get("devices") or {}).get("results") or ())
                    if isinstance(r, dict) and r.get("driver") == self.driver_name]
        except ClaimError as error:
            self._env_fallback(namespace, name, "unreadable", str(error))
            return {}
        agreed, disagree = containers.unions(name, entries, refs, results_of)
        out: Dict[containers.Entry, List[Device]] = {}
        for (pool_name, request), names in agreed.items():
            pool = self.pools.get(pool_name)
            devices = [pool.by_name.get(n) for n in names] if pool is not None else [None]
            if all(d is not None for d in devices):
                out[(pool_name, request)] = [d for d in devices if d is not None]
            else:
                disagree.append((pool_name, request))
        if disagree:
            self._env_fallback(
                namespace, name, "containers_disagree",
                "the containers referencing request(s) " + ", ".join(
                    sorted({r or "(all)" for _, r in disagree})) + " receive different devices "
                "of this driver over their claims")
        return out

    async def _get_pod(self, namespace: str, name: str) -> Dict[str, Any]:
        get = getattr(self.claims, "get_pod", None)
        if get is None:
            raise ClaimError("no Pod reader")
        result: Dict[str, Any] = await get(namespace, name)
        return result

    async def _read(self, kind: str, get: Callable[[str, str], Any], namespace: str,
                    name: str) -> Dict[str, Any]:
        try:
            result: Dict[str, Any] = await asyncio.wait_for(get(namespace, name),
                                                            self.claim_get_timeout_s)
            return result
        except ClaimError:
            raise
        except asyncio.TimeoutError:
            raise ClaimError(f"reading {kind} {namespace}/{name} took longer than "
                             f"{self.claim_get_timeout_s:g} s") from None
        except Exception as error:
            status = getattr(error, "status", None)
            reason = getattr(error, "reason", None) or str(error) or type(error).__name__
            where = f"HTTP {status}: " if status else ""
            raise ClaimError(f"cannot read {kind} {namespace}/{name}: {where}{reason}") from None

    def _env_fallback(self, namespace: str, name: str, reason: str, detail: str) -> None:
        self.env_fallbacks += 1
        log.warning("driver %s: claim %s/%s: each request's env lists only that request's "
                    "devices (a container with more devices of this driver may see fewer "
                    "in it): %s", self.driver_name, namespace, name, detail)
        if self.metrics is not None:
            try:
                self.metrics.env_fallback(self.driver_name, reason)
            except Exception:
                log.exception("DRA metrics failed")

    async def _merge(self, pool: DraPool, devices: List[Device]) -> ContainerAllocation:
        """The driver's merge (its allocate hook, if any) of ``devices``."""
        merged = allocation.merge(devices)
        driver, resource = pool.driver, pool.resource
        if Capabilities.of(driver).allocate:
            try:
                merged = await driver_allocate(self.calls, driver, resource, devices, merged,
                                               self.allocate_timeout_s)
            except DriverCallError as error:
                raise ClaimError(str(error)) from None
        return merged

    async def _hooks(self, pool: DraPool, devices: List[Device]) -> ContainerAllocation:
        merged = await self._merge(pool, devices)
        driver, resource = pool.driver, pool.resource
        try:
            needs = needs_pre_start(driver, resource)
        except Exception:
            needs = False
        if needs:
            try:
                await driver_pre_start(self.calls, driver, resource, devices)
            except DriverCallError as error:
                raise ClaimError(str(error)) from None
        return merged

    # -- NodeUnprepareResources ------------------------------------------------------------
    async def _unprepare_call(self, api: Any, request: Any) -> Any:
        self.in_flight += 1
        try:
            return await self._unprepare_call_counted(api, request)
        finally:
            self.in_flight -= 1
            self.last_call_end = time.monotonic()

    async def _unprepare_call_counted(self, api: Any, request: Any) -> Any:
        started = time.perf_counter()
        response = api.NodeUnprepareResourcesResponse()
        claims = list(request.claims)[:MAX_CLAIMS_PER_CALL]
        async with self.checkpoint.shared():
            errors = await asyncio.gather(*(self._unprepare_one(c.uid) for c in claims))
        for claim, error in zip(claims, errors):
            entry = response.claims[claim.uid]
            if error:
                entry.error = error
        self._observe("unprepare", started)
        return response

    async def _unprepare_one(self, uid: str) -> str:
        async with self._claim_lock(uid):
            claim = self.checkpoint.get(uid)
            if claim is None:
                return ""  # never prepared here (or already unprepared): nothing to undo
            for path in claim.cdi_files:
                try:
                    remove_file(path)
                except OSError as error:
                    self._count("unprepare_failed")
                    return f"cannot remove the CDI spec {path}: {error}"
            try:  # written only where metadata was on, but it may have been turned off since
                if self.data_dir:
                    metadata.remove_claim(self.data_dir, claim.namespace, claim.name)
            except OSError as error:
                self._count("unprepare_failed")
                return f"cannot remove the device metadata of the claim: {error}"
            try:
                await self.checkpoint.aremove(uid)
            except OSError as error:
                self._count("unprepare_failed")
                return f"cannot save the checkpoint {self.checkpoint.path}: {error}"
            self._count("unprepared")
            log.info("driver %s: unprepared claim %s/%s (%s)", self.driver_name,
                     claim.namespace, claim.name, uid)
            return ""

    def _observe(self, what: str, started: float) -> None:
        if self.metrics is not None:
            try:
                self.metrics.call(self.driver_name, what, time.perf_counter() - started,
                                  len(self.checkpoint.claims))
            except Exception:  # metrics must never break an RPC
                log.exception("DRA metrics failed")

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            try:
                self.metrics.claim(self.driver_name, outcome)
            except Exception:
                log.exception("DRA metrics failed")


def _share_id(result: Mapping[str, Any]) -> str:
    return str(result.get("shareID") or "")


def _key(result: Mapping[str, Any], device: Device) -> str:
    """One allocated device of a claim: two shares of one device are two."""
    return claim_cdi.device_key(device, _share_id(result))


def _share_keys(keys: Sequence[str]) -> Tuple[str, ...]:
    """The shared device a footprint is a share of (its share: keys), () for a whole one."""
    return tuple(k for k in keys if k.startswith("share:"))


def _request_names(request: str) -> Tuple[str, ...]:
    """A result's request, plus the parent request for a subrequest ("gpu/large"): containers
    reference only top-level requests, and the kubelet gives a container the devices whose
    request_names include the one it references."""
    if not request:
        return ()
    base = request.split("/", 1)[0]
    return tuple(dict.fromkeys([base, request]))
