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

The per-claim steps (read, map, taints, overlap hold, hooks, CDI, checkpoint) run in the order
the kubelet's DRA manager expects, and each error is reported for its claim.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
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

from host import allocation
from host.dra import claim_cdi, hardware, taints
from host.dra.checkpoint import Checkpoint, PreparedClaim, PreparedDevice
from host.dra.protocol import DRA_HEALTH_SERVICE, DRA_WIRE_SERVICES, dra_health, dra_v1, dra_v1beta1
from host.driver import Driver, implements
from host.fileio import remove_file
from host.isolation import DriverCallError, DriverCalls, driver_allocate, driver_pre_start
from host.model import ContainerAllocation, Device, ResourceConfig

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

    def set_devices(self, devices: Sequence[Device]) -> None:
        self.by_name = {self.naming(device.id): device for device in devices}
        self._node_counts = None

    def footprint(self, device: Device) -> Tuple[str, ...]:
        """host.dra.hardware.footprint among this pool's devices (counted once per change)."""
        if self._node_counts is None:
            self._node_counts = hardware.node_counts(self.by_name.values())
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
        self.metrics: Optional[Any] = None  # host.dra.metrics.DraMetrics
        self._health_version = 0
        self._health_wake: Optional[asyncio.Future] = None
        self.health_streams = 0  # open NodeWatchResources streams
        # Whether unhealthy devices are published with taints (dra_unhealthy = "taint"): then
        # a claim that tolerates a device's taint may use it.
        self.tainted: Callable[[], bool] = lambda: False

    # -- gRPC plumbing --------------------------------------------------------------------
    def handlers(self, tag: object = None) -> List[grpc.GenericRpcHandler]:
        """Both API versions on one server; the kubelet picks one at registration."""
        return [self._handler("v1.DRAPlugin", dra_v1),
                self._handler("v1beta1.DRAPlugin", dra_v1beta1),
                grpc.method_handlers_generic_handler(DRA_HEALTH_SERVICE, {
                    "NodeWatchResources": grpc.unary_stream_rpc_method_handler(
                        self._watch_health,
                        request_deserializer=dra_health.NodeWatchResourcesRequest.FromString,
                        response_serializer=(
                            dra_health.NodeWatchResourcesResponse.SerializeToString)),
                })]

    # -- DRAResourceHealth -----------------------------------------------------------------
    def devices_changed(self) -> None:
        """A pool's devices (or their health) changed: every health stream sends anew."""
        self._health_version += 1
        wake, self._health_wake = self._health_wake, None
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def _watch_health(self, request: Any, context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[Any]:
        """The complete list of the driver's devices now, then on every change and every
        HEALTH_RESEND_S; never ends on its own (the kubelet reconnects every 5 s if it does)."""
        seen = -1
        self.health_streams += 1
        try:
            while True:
                if self._health_version == seen:
                    await self._health_changed(HEALTH_RESEND_S)
                seen = self._health_version
                yield self._health_response()
        finally:
            self.health_streams -= 1

    async def _health_changed(self, timeout: float) -> None:
        if self._health_wake is None:
            self._health_wake = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._health_wake), timeout)
        except asyncio.TimeoutError:
            pass

    def _health_response(self) -> Any:
        now = int(time.time())
        response = dra_health.NodeWatchResourcesResponse()
        for pool_name, pool in self.pools.items():
            for name, device in pool.by_name.items():
                response.devices.add(
                    device=dra_health.DeviceIdentifier(pool_name=pool_name, device_name=name),
                    health=dra_health.HEALTHY if device.healthy else dra_health.UNHEALTHY,
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
        started = time.perf_counter()
        response = api.NodePrepareResourcesResponse()
        claims = list(request.claims)[:MAX_CLAIMS_PER_CALL]
        results = await asyncio.gather(*(self._prepare_one(c.namespace, c.name, c.uid)
                                         for c in claims))
        for claim, (devices, error) in zip(claims, results):
            entry = response.claims[claim.uid]
            if error:
                entry.error = error
                continue
            for device in devices:
                entry.devices.add(request_names=list(device.request_names),
                                  pool_name=device.pool_name, device_name=device.device_name,
                                  cdi_device_ids=list(device.cdi_device_ids))
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
        footprints = {device.id: self.pools[str(result["pool"])].footprint(device)
                      for result, device in picked}
        self._reserve(uid, picked, footprints)
        try:
            return await self._prepare_devices(namespace, name, uid, pods, picked, footprints)
        finally:
            self.checkpoint.reserved.pop(uid, None)

    def _reserve(self, uid: str, picked: Sequence[Tuple[Dict[str, Any], Device]],
                 footprints: Dict[str, Tuple[str, ...]]) -> None:
        """Refuse a device whose hardware overlaps one that another claim holds (prepared and
        not unprepared, or being prepared now), else hold this claim's hardware. No await
        between the check and the hold: concurrent prepares see each other."""
        for result, device in picked:
            mine = footprints[device.id]
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
    ) -> PreparedClaim:
        by_pool: Dict[str, List[Tuple[Dict[str, Any], Device]]] = {}
        for result, device in picked:
            by_pool.setdefault(result["pool"], []).append((result, device))
        prepared: List[PreparedDevice] = []
        files: List[str] = []
        specs: Dict[str, Any] = {}
        try:
            for pool_name, items in by_pool.items():
                pool = self.pools[pool_name]
                by_request: Dict[str, List[Device]] = {}
                for result, device in items:
                    by_request.setdefault(str(result.get("request", "")), []).append(device)
                groups = [claim_cdi.RequestGroup(request, devices,
                                                 await self._hooks(pool, devices))
                          for request, devices in by_request.items()]
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
                    prepared.append(PreparedDevice(
                        request_names=_request_names(str(result.get("request", ""))),
                        pool_name=pool_name, device_name=str(result["device"]),
                        cdi_device_ids=ids[device.id],
                        resource=pool.resource.name, device_id=device.id,
                        hardware=footprints[device.id],
                    ))
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
            raise
        log.info("driver %s: prepared claim %s/%s (%s): %s", self.driver_name, namespace, name,
                 uid, ", ".join(f"{d.pool_name}/{d.device_name}" for d in prepared) or "none")
        return record

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

    async def _hooks(self, pool: DraPool, devices: List[Device]) -> ContainerAllocation:
        merged = allocation.merge(devices)
        driver, resource = pool.driver, pool.resource
        if implements(driver, "allocate"):
            try:
                merged = await driver_allocate(self.calls, driver, resource, devices, merged,
                                               self.allocate_timeout_s)
            except DriverCallError as error:
                raise ClaimError(str(error)) from None
        try:
            needs = bool(driver.needs_pre_start(resource))
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
        started = time.perf_counter()
        response = api.NodeUnprepareResourcesResponse()
        claims = list(request.claims)[:MAX_CLAIMS_PER_CALL]
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


def _request_names(request: str) -> Tuple[str, ...]:
    """A result's request, plus the parent request for a subrequest ("gpu/large"): containers
    reference only top-level requests, and the kubelet gives a container the devices whose
    request_names include the one it references."""
    if not request:
        return ()
    base = request.split("/", 1)[0]
    return tuple(dict.fromkeys([base, request]))
