"""The DevicePlugin service of one resource: the six RPCs, answered from its Snapshot.

The rules that need no service state (refusals, CDI names in an answer, when
GetPreferredAllocation is worth advertising) are in host/kubelet/service_rules.py; each RPC's own
checks sit next to its handler.

Handlers are registered through a generic handler so ListAndWatch can yield pre-serialized
snapshots (bytes pass through an identity serializer). Every refusal carries a gRPC status and a
reason; nothing a request contains can raise out of a handler.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Awaitable, Callable, Dict, List, Optional, Sequence, Set, Tuple

import grpc

from host.core import allocation
from host.core.capabilities import Capabilities, needs_pre_start
from host.core.driver import Driver
from host.core.isolation import DriverCallError, DriverCalls, driver_allocate, driver_pre_start
from host.core.model import ContainerAllocation, Device, Health, PreferredRequest, ResourceConfig
from host.kubelet.protocol import api
from host.kubelet.protocol.convert import allocate_response
from host.kubelet.service_rules import RequestError, preferred_allocation_useful, refuse, with_cdi
from host.kubelet.snapshot import Snapshot

log = logging.getLogger(__name__)

# A snapshot sent this recently may still be on its way to the kubelet (or unread by it):
# an Allocate it admitted from the snapshot before is judged by that one too.
TOLD_GRACE_S = 1.0
SERVICE_NAME = "v1beta1.DevicePlugin"

#: The most bytes one request may have, whatever the resource (``grpc.max_receive_message_
#: length`` of every device-plugin server; gRPC answers RESOURCE_EXHAUSTED past it, before
#: the host sees a byte). The kubelet's largest request is a GetPreferredAllocation that lists
#: every device of a resource once (available ids; the must-include ids are a few of them):
#: 1-3 bytes of framing per id, so 4 MiB holds a resource at the host's 100,000-device cap
#: (host/inventory/__init__.py MAX_DEVICES) with ids of up to 38 bytes, or 16,000 devices with
#: 256-byte ids (the longest id the inventory accepts). README "Limits" and docs/limits.md.
MAX_REQUEST_BYTES = 4 * 2**20
#: Past the fixed cap, each request is held to what the resource's own devices can fill:
#: every id at most twice (available and must-include), each in fewer bytes than its entry
#: in the ListAndWatch payload, plus this much for everything else in the message.
REQUEST_SLACK_BYTES = 4096
SERVER_OPTIONS = (("grpc.max_receive_message_length", MAX_REQUEST_BYTES),)


class Oversized:
    """What a request too big for its resource deserializes to: its size, nothing parsed."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size


def _show(device_id: str) -> str:
    return repr(device_id if len(device_id) <= 80 else device_id[:77] + "...")


class DevicePluginService:
    """Long-lived across kubelet restarts: each new gRPC server of the resource reuses it."""

    def __init__(
        self,
        resource: ResourceConfig,
        driver: Driver,
        snapshot: Snapshot,
        calls: DriverCalls,
        *,
        allocate_timeout_s: float,
        on_stream_end: Optional[Callable[[object, object], None]] = None,
        observer: Optional[Callable[[str, str, object, float], None]] = None,
    ) -> None:
        self.resource = resource
        self.driver = driver
        #: What the driver can do beyond discovery, detected once per driver object.
        self.capabilities = Capabilities.of(driver)
        self.snapshot = snapshot
        self.calls = calls
        self.allocate_timeout_s = allocate_timeout_s
        self.on_stream_end = on_stream_end
        # (server tag, stream) for every ListAndWatch that opens / ends.
        self.on_stream_start: Optional[Callable[[object, object], None]] = None
        self.observer = observer  # metrics hooks (optional)
        # Whether CDI names are in the spec on disk (set by the host when it writes specs).
        self.cdi_resolvable: Optional[Callable[[str, Sequence[str]], bool]] = None
        self.options = api.DevicePluginOptions(
            pre_start_required=self._needs_pre_start(),
            get_preferred_allocation_available=self._preferred_useful(),
        )
        self._options_bytes = self.options.SerializeToString()
        # The options the kubelet last read (GetDevicePluginOptions, inside each Register).
        self.served_options: Optional[bytes] = None
        # What ListAndWatch last told each server's clients: tag -> (the payload before,
        # the latest payload, when the latest was sent). Read only when Allocate asks for a
        # device that is Unhealthy now (_told_healthy).
        self._told: Dict[object, Tuple[bytes, bytes, float]] = {}
        self._told_health: Dict[int, Tuple[bytes, Dict[str, str]]] = {}

    def needs_options_change(self, resource: ResourceConfig, driver: Driver) -> bool:
        """Would this resource config advertise different options? Options are read by the
        kubelet only at registration, so a change means registering again."""
        try:
            wanted = needs_pre_start(driver, resource)
        except Exception:
            wanted = False
        return wanted != self.options.pre_start_required

    def _preferred_useful(self) -> bool:
        try:
            return preferred_allocation_useful(self.resource, self.driver,
                                               self.snapshot.devices)
        except Exception as error:  # advertising it is always safe: the host can answer
            log.error("resource %s: cannot tell whether GetPreferredAllocation helps: %s",
                      self.resource.name, error)
            return True

    def refresh_options(self) -> bool:
        """Re-derive ``get_preferred_allocation_available`` from the resource config and the
        current devices; True when it changed (the kubelet reads options only at
        registration, so the caller registers again)."""
        wanted = self._preferred_useful()
        if wanted == self.options.get_preferred_allocation_available:
            return False
        self.options = api.DevicePluginOptions(
            pre_start_required=self.options.pre_start_required,
            get_preferred_allocation_available=wanted,
        )
        self._options_bytes = self.options.SerializeToString()
        return True

    def options_stale(self) -> bool:
        """The kubelet read options that are not the current ones (they changed while a
        Register was in flight)."""
        return self.served_options is not None and self.served_options != self._options_bytes

    def _needs_pre_start(self) -> bool:
        try:
            return needs_pre_start(self.driver, self.resource)
        except Exception as error:  # a broken driver must not stop the resource from serving
            log.error("resource %s: driver %s needs_pre_start failed: %s", self.resource.name,
                      self.driver.name, error)
            return False

    # -- gRPC plumbing -----------------------------------------------------------------
    def handler(self, tag: object) -> grpc.GenericRpcHandler:
        """A generic handler for one server generation; ``tag`` identifies that server (a new
        one replaces the one before: what older servers told is forgotten)."""
        identity: Callable[[bytes], bytes] = lambda data: data  # noqa: E731
        self._told.clear()
        self._told_health.clear()

        async def list_and_watch(request: bytes, context: grpc.aio.ServicerContext):
            async for payload in self._list_and_watch(tag, context):
                yield payload

        async def allocate(request: api.AllocateRequest,
                           context: grpc.aio.ServicerContext) -> api.AllocateResponse:
            return await self._allocate(request, context, tag)

        methods = {
            "GetDevicePluginOptions": grpc.unary_unary_rpc_method_handler(
                self._get_options, request_deserializer=identity, response_serializer=identity
            ),
            "ListAndWatch": grpc.unary_stream_rpc_method_handler(
                list_and_watch, request_deserializer=identity, response_serializer=identity
            ),
            "GetPreferredAllocation": grpc.unary_unary_rpc_method_handler(
                self._bounded(self._get_preferred, "GetPreferredAllocation refused"),
                request_deserializer=self._parser(api.PreferredAllocationRequest.FromString),
                response_serializer=api.PreferredAllocationResponse.SerializeToString,
            ),
            "Allocate": grpc.unary_unary_rpc_method_handler(
                self._bounded(allocate, "Allocate refused"),
                request_deserializer=self._parser(api.AllocateRequest.FromString),
                response_serializer=api.AllocateResponse.SerializeToString,
            ),
            "PreStartContainer": grpc.unary_unary_rpc_method_handler(
                self._bounded(self._pre_start, "PreStartContainer failed"),
                request_deserializer=self._parser(api.PreStartContainerRequest.FromString),
                response_serializer=api.PreStartContainerResponse.SerializeToString,
            ),
        }
        return grpc.method_handlers_generic_handler(SERVICE_NAME, methods)

    def max_request_bytes(self) -> int:
        """The largest request the kubelet could send for the devices served now."""
        return min(MAX_REQUEST_BYTES, 2 * len(self.snapshot.payload) + REQUEST_SLACK_BYTES)

    def _parser(self, parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
        """``parse`` for requests this resource's devices could fill; an ``Oversized`` marker
        (nothing parsed, nothing built) for the rest."""
        def deserialize(data: bytes) -> Any:
            if len(data) > self.max_request_bytes():
                return Oversized(len(data))
            return parse(data)

        return deserialize

    def _bounded(self, handler: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]],
                 what: str) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
        async def bounded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, Oversized):
                limit = self.max_request_bytes()
                await refuse(context, self.resource.name, what, RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the request is {request.size} bytes; a request for the "
                    f"{len(self.snapshot)} devices of {self.resource.name} is at most {limit} "
                    "bytes"))
            return await handler(request, context)

        return bounded

    async def _get_options(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self.served_options = self._options_bytes
        return self._options_bytes

    async def _list_and_watch(self, tag: object, context: grpc.aio.ServicerContext):
        """Full snapshot at once, then one on every change; never returns on its own (the
        kubelet treats a returned stream as a disconnected plugin)."""
        seen = -1
        stream = object()  # this stream's identity: the endpoint tells the kubelet's apart
        if self.on_stream_start is not None:
            self.on_stream_start(tag, stream)
        try:
            while True:
                seen, payload = await self.snapshot.next_payload(seen)
                told = self._told.get(tag)
                if told is None:
                    self._told[tag] = (payload, payload, time.monotonic())
                elif told[1] is not payload:  # another stream may have sent this one
                    self._told[tag] = (told[1], payload, time.monotonic())
                yield payload
        finally:
            # Whether this was the kubelet going away, another client hanging up or our own
            # server stopping, the endpoint decides: only the kubelet's own stream on the
            # current server means re-register.
            if self.on_stream_end is not None:
                self.on_stream_end(tag, stream)

    # -- Allocate --------------------------------------------------------------------------
    async def _allocate(
        self, request: api.AllocateRequest, context: grpc.aio.ServicerContext,
        tag: object = None,
    ) -> api.AllocateResponse:
        """Refuses only what cannot work: an unknown id, a device Unhealthy in what the
        kubelet was last told (its admission saw it so), or one whose device nodes or CDI
        spec are gone. A device the kubelet was last told is Healthy and drained (or marked
        Unhealthy) since is still allocated when it works: the kubelet admitted the pod from
        that snapshot, and the change applies from the next ListAndWatch message on."""
        started = time.perf_counter()
        try:
            if not request.container_requests:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                   "AllocateRequest has no container_requests")
            self._check_containers(len(request.container_requests))
            response = api.AllocateResponse()
            for index, container in enumerate(request.container_requests):
                devices = self._resolve(container.devices_ids, f"container_requests[{index}]",
                                        require_healthy=True, tag=tag)
                merged = allocation.merge(devices)
                if self.capabilities.allocate:
                    merged = await self._driver_allocate(devices, merged)
                if self.resource.cdi:
                    merged = with_cdi(self.resource, devices, merged, self.cdi_resolvable)
                response.container_responses.append(allocate_response(merged))
            self._observe("allocated", request, started)
            return response
        except RequestError as error:
            self._observe("refused", error, started)
            await refuse(context, self.resource.name, "Allocate refused", error)

    async def _driver_allocate(
        self, devices: Sequence[Device], merged: ContainerAllocation
    ) -> ContainerAllocation:
        try:
            return await driver_allocate(self.calls, self.driver, self.resource, devices,
                                         merged, self.allocate_timeout_s)
        except DriverCallError as error:
            raise RequestError.from_driver(error, grpc.StatusCode.INTERNAL) from None

    def _check_containers(self, count: int) -> None:
        """Every container asks for at least one device: more containers than devices is no
        kubelet's request."""
        if count > max(1, len(self.snapshot)):
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"{count} container_requests, more than the "
                               f"{len(self.snapshot)} devices of {self.resource.name}")

    def _resolve(self, ids: Sequence[str], where: str, *, require_healthy: bool,
                 allow_empty: bool = False, tag: object = None) -> List[Device]:
        if not ids and not allow_empty:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: no device ids")
        if len(ids) > len(self.snapshot):  # before building anything from them
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"{where}: {len(ids)} ids, more than the {len(self.snapshot)} "
                               f"devices of {self.resource.name}")
        if len(set(ids)) != len(ids):
            seen: Set[str] = set()
            duplicate = next(i for i in ids if i in seen or _add(seen, i))
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"{where}: device id {_show(duplicate)} is listed twice")
        devices = []
        known = self.snapshot
        for device_id in ids:
            device = known.device(device_id)
            if device is None:
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{where}: unknown device id {_show(device_id)} for resource "
                    f"{self.resource.name} ({len(known)} devices known)",
                )
            if require_healthy and not device.healthy and not self._still_usable(
                    tag, device):
                reason = f": {device.health_reason}" if device.health_reason else ""
                raise RequestError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{where}: device {_show(device_id)} of {self.resource.name} is "
                    f"Unhealthy{reason}",
                )
            devices.append(device)
        return devices

    def _still_usable(self, tag: object, device: Device) -> bool:
        """An Unhealthy device the kubelet was last told is Healthy on this server, whose
        device nodes are all still there (the CDI spec is checked with the answer)."""
        if not self._told_healthy(tag, device.id):
            return False
        if not all(os.path.exists(node.host_path) for node in device.device_nodes):
            return False
        log.info("resource %s: allocating %s, which the kubelet was last told is Healthy "
                 "(now: %s); the change applies from the next ListAndWatch message",
                 self.resource.name, _show(device.id), device.health_reason or "Unhealthy")
        return True

    def _told_healthy(self, tag: object, device_id: str) -> bool:
        told = self._told.get(tag)
        if told is None:
            return False
        before, latest, sent_at = told
        if self._health_in(latest).get(device_id) == Health.HEALTHY.value:
            return True
        return (time.monotonic() - sent_at < TOLD_GRACE_S
                and self._health_in(before).get(device_id) == Health.HEALTHY.value)

    def _health_in(self, payload: bytes) -> Dict[str, str]:
        """Device id -> health in a sent ListAndWatch message (parsed once per message)."""
        cached = self._told_health.get(id(payload))
        if cached is not None and cached[0] is payload:
            return cached[1]
        message = api.ListAndWatchResponse.FromString(payload)
        health = {d.ID: d.health for d in message.devices}
        if len(self._told_health) >= 2:
            self._told_health.clear()
        self._told_health[id(payload)] = (payload, health)
        return health

    # -- GetPreferredAllocation ----------------------------------------------------------
    async def _get_preferred(
        self, request: api.PreferredAllocationRequest, context: grpc.aio.ServicerContext
    ) -> api.PreferredAllocationResponse:
        try:
            if not request.container_requests:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                   "PreferredAllocationRequest has no container_requests")
            self._check_containers(len(request.container_requests))
            response = api.PreferredAllocationResponse()
            for index, container in enumerate(request.container_requests):
                ids = await self._preferred_one(container, f"container_requests[{index}]")
                response.container_responses.add().deviceIDs.extend(ids)
            return response
        except RequestError as error:
            await refuse(context, self.resource.name, "GetPreferredAllocation refused", error)

    async def _preferred_one(
        self, container: api.ContainerPreferredAllocationRequest, where: str
    ) -> List[str]:
        size = container.allocation_size
        known = len(self.snapshot)
        for field, listed in (("available_deviceIDs", container.available_deviceIDs),
                              ("must_include_deviceIDs", container.must_include_deviceIDs)):
            if len(listed) > known:  # before building anything from them
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"{where}.{field}: {len(listed)} ids, more than the "
                                   f"{known} devices of {self.resource.name}")
        must = list(dict.fromkeys(container.must_include_deviceIDs))
        available_ids = list(dict.fromkeys(container.available_deviceIDs))
        if size < 1:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"{where}: allocation_size must be at least 1, got {size}")
        # The kubelet lists the must-include ids among the available ones and asks only for
        # what it has candidates for (devicesToAllocate); anything else is a broken client,
        # and answering it would hand back ids it never offered, or too few.
        offered = set(available_ids)
        outside = [device_id for device_id in must if device_id not in offered]
        if outside:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: must-include id {_show(outside[0])} is not in available_deviceIDs"
                + (f" (and {len(outside) - 1} more)" if len(outside) > 1 else ""),
            )
        if size > len(available_ids):
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: allocation_size {size} is larger than the {len(available_ids)} "
                "available ids",
            )
        if len(must) > size:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: {len(must)} must-include ids exceed allocation_size {size}",
            )
        available = self._resolve(available_ids, f"{where}.available_deviceIDs",
                                  require_healthy=False)
        must_devices = self._resolve(must, f"{where}.must_include_deviceIDs",
                                     require_healthy=False, allow_empty=True)
        request = PreferredRequest(available=available, must_include=must_devices, size=size)
        if self.capabilities.preferred:
            picked = await self._driver_preferred(request, set(available_ids), must)
            if picked is not None:
                return picked
        if self.resource.replicas > 1:
            return allocation.replica_preferred(
                available, must_devices, size, self.resource.replicas,
                self.resource.replica_policy,
            )
        return allocation.numa_compact(available, must_devices, size)

    async def _driver_preferred(
        self, request: PreferredRequest, allowed: set, must: List[str]
    ) -> Optional[List[str]]:
        """The driver's choice when it is sound; otherwise None (NUMA-compact answers), since a
        failed GetPreferredAllocation fails the pod's admission."""
        try:
            picked = await self.calls.call(
                self.driver.name, "preferred", self.allocate_timeout_s,
                self.driver.preferred, self.resource, request,  # type: ignore[attr-defined]
            )
        except DriverCallError as error:
            log.error("resource %s: %s; using NUMA-compact", self.resource.name, error)
            return None
        if picked is None:
            return None
        picked = list(picked)
        if (len(set(picked)) != len(picked) or not set(picked) <= allowed
                or len(picked) > request.size or not set(must) <= set(picked)):
            log.error("resource %s: driver %s preferred an invalid set %r; using NUMA-compact",
                      self.resource.name, self.driver.name, picked[:10])
            return None
        return picked

    # -- PreStartContainer ---------------------------------------------------------------
    async def _pre_start(
        self, request: api.PreStartContainerRequest, context: grpc.aio.ServicerContext
    ) -> api.PreStartContainerResponse:
        try:
            devices = self._resolve(request.devices_ids, "PreStartContainerRequest",
                                    require_healthy=False)
            if self.options.pre_start_required:
                try:
                    await driver_pre_start(self.calls, self.driver, self.resource, devices)
                except DriverCallError as error:
                    raise RequestError.from_driver(
                        error, grpc.StatusCode.FAILED_PRECONDITION) from None
            return api.PreStartContainerResponse()
        except RequestError as error:
            await refuse(context, self.resource.name, "PreStartContainer failed", error)

    def _observe(self, event: str, detail: object, started: float) -> None:
        if self.observer is not None:
            try:
                self.observer(self.resource.name, event, detail,
                              time.perf_counter() - started)
            except Exception:  # metrics must never break an RPC
                log.exception("observer failed")


def _add(seen: Set[str], item: str) -> bool:
    """``seen.add`` inside a generator's condition: False, so the search goes on."""
    seen.add(item)
    return False
