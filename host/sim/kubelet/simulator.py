"""The simulator: registration server, dial-back channels, ListAndWatch streams, bookkeeping.

One asyncio loop (grpc.aio) runs the registration server, every dial-back channel and every
ListAndWatch stream; ``stop()`` cancels and awaits all of it, so fifty restarts leak no task,
channel or descriptor.

Restarts are as unkind as the kubelet's (``dm/plugin/v1beta1/server.go`` Start/Stop,
``dm/manager.go`` CleanupPluginDirectory): a Register in flight when the kubelet stops
fails (1.36: "failed to get device plugin options: context canceled"; 1.32: "client connection
is closing"), the stopped kubelet's socket stays behind as a dead file that refuses connections
(the process is gone, nothing unlinked it) unless ``stop(unlink=True)``, nothing listens for
the whole outage, and the next start wipes every socket in the directory, the dead
``kubelet.sock`` included, before the new one appears.

Its state lives in kubelet/state.py. Registration, dial-back, streams and stop share one
loop and one generation counter; their failure orders are the point.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
import time
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import grpc

from host.core.resource_name import resource_name_error
from host.kubelet.protocol import KUBELET_SOCKET, VERSION, api, api_grpc
from host.sim.kubelet import allocation
from host.sim.kubelet.allocation import MAX_NUMA_NODES, PRE_START_TIMEOUT_S, Key
from host.sim.kubelet.podresources import PodResourcesServer
from host.sim.kubelet.state import (
    AllocationError,
    AllocationResult,
    Endpoint,
    NotRegisteredError,
    ResourceState,
    go_error,
    go_quote,
)

log = logging.getLogger(__name__)

SUPPORTED_VERSIONS = (VERSION,)
DIAL_TIMEOUT_S = 10.0  # the kubelet's blocking dial-back
ENDPOINT_STOP_GRACE_S = 300.0  # dm/types.go endpointStopGracePeriod
STOP_GRACE_S = 0.2  # time for in-flight Register handlers to answer with their error at stop
DEADLINE_SLACK_S = 0.05  # a cancel this close to the plugin's deadline is that deadline
_GRPC_PATH_MAX = 105  # grpcio refuses 106- and 107-byte unix socket paths
CONTEXT_CANCELED = (
    "failed to get device plugin options: rpc error: code = Canceled desc = context canceled"
)
CONNECTION_CLOSING = (  # the same stop as seen by kubelets before 1.35
    "failed to get device plugin options: rpc error: code = Canceled desc = grpc: the client"
    " connection is closing"
)
DEADLINE_IN_REGISTER = (1, 35)  # from here on, dial-back and options run in Register's context
CLIENTS_BY_PATH = (1, 37)  # from here on, a client is looked up by resource name and socket


class _Rejected(Exception):
    """The kubelet's Register fails with this message."""
MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # Go gRPC's default receive limit, which the kubelet keeps
POLICIES = ("none", "best-effort", "restricted", "single-numa-node")
_SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes including the terminating NUL

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.default_authority", "localhost"),
]
_SERVER_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


class _Registration(api_grpc.RegistrationServicer):
    def __init__(self, kubelet: KubeletSimulator) -> None:
        self._kubelet = kubelet

    async def Register(
        self, request: api.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> api.Empty:
        return await self._kubelet._register(request, context)


class KubeletSimulator:
    """Serves v1beta1.Registration on ``<plugin_dir>/kubelet.sock`` and drives the plugins.

    ``numa_nodes`` are the machine's nodes for topology hints (default: the nodes the
    resource's devices report, as kubelet 1.36 does); ``dial_timeout`` shortens the kubelet's
    10 s dial-back for tests of plugins that are not serving. ``pod_resources_socket``: also
    serve the PodResources v1 API there (``self.pod_resources``) while started.
    ``kubelet_version``: before (1, 35) the dial-back and GetDevicePluginOptions ignore the
    plugin's Register deadline (a plugin can end up registered although its Register failed
    with DEADLINE_EXCEEDED) and a stop fails Register with "client connection is
    closing"; from 1.35 on both run within the deadline and a stop says "context canceled".
    """

    def __init__(
        self,
        plugin_dir: str,
        *,
        numa_nodes: Optional[Sequence[int]] = None,
        topology_policy: str = "best-effort",
        dial_timeout: float = DIAL_TIMEOUT_S,
        pod_resources_socket: Optional[str] = None,
        kubelet_version: Tuple[int, int] = (1, 36),
        endpoint_stop_grace_s: float = ENDPOINT_STOP_GRACE_S,
    ) -> None:
        if topology_policy not in POLICIES:
            raise ValueError(f"topology_policy must be one of {POLICIES}, not {topology_policy!r}")
        if numa_nodes is not None and len(set(numa_nodes)) > MAX_NUMA_NODES:
            raise ValueError(f"the topology manager supports at most {MAX_NUMA_NODES} NUMA nodes")
        self.plugin_dir = os.path.abspath(plugin_dir)
        self.socket_path = os.path.join(self.plugin_dir, KUBELET_SOCKET)
        self.numa_nodes = None if numa_nodes is None else tuple(sorted(set(numa_nodes)))
        self.topology_policy = topology_policy
        self.dial_timeout = dial_timeout
        self.kubelet_version = tuple(kubelet_version)
        self.endpoint_stop_grace_s = endpoint_stop_grace_s
        self.resources: Dict[str, ResourceState] = {}
        self.register_errors: List[str] = []
        self.register_calls: Dict[str, int] = {}  # every Register, before validation (the metric)
        self.starts = 0
        self.started_at: Optional[float] = None  # time.monotonic() when kubelet.sock last listened
        self.stopping = False
        self._stop_event: Optional[asyncio.Event] = None
        # A slow kubelet: each Register waits this long before its dial-back (tests use it to
        # have Register calls in flight when the kubelet stops).
        self.register_delay_s = 0.0
        self.registers_in_flight = 0
        self.allocation_results: Dict[Key, AllocationResult] = {}
        self._server: Optional[grpc.aio.Server] = None
        self._generation = 0
        self._tasks: Set[asyncio.Task[Optional[str]]] = set()
        self._dialing: Set[grpc.aio.Channel] = set()
        self._cond_obj: Optional[asyncio.Condition] = None
        self._alloc_lock_obj: Optional[asyncio.Lock] = None
        self.pod_resources: Optional[PodResourcesServer] = None
        if pod_resources_socket is not None:
            self.pod_resources = PodResourcesServer(self, pod_resources_socket)

    # -- lifecycle --

    @property
    def serving(self) -> bool:
        return self._server is not None

    async def start(self) -> None:
        """Like a starting kubelet: create the directory, wipe every socket in it, serve."""
        if self._server is not None:
            raise RuntimeError("the kubelet simulator is already started")
        if len(os.fsencode(self.socket_path)) > _SOCKET_PATH_MAX:
            raise ValueError(f"socket path too long for AF_UNIX: {self.socket_path}")
        os.makedirs(self.plugin_dir, mode=0o750, exist_ok=True)
        self._remove_sockets()
        for state in self.resources.values():
            state.forget_devices()
        server = grpc.aio.server(options=_SERVER_OPTIONS)
        api_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        # Listen under a hidden name, then rename it to kubelet.sock: the socket appears already
        # listening (as the kubelet's does), and since grpc unlinks only the name it bound, the
        # stopped server leaves kubelet.sock behind as a dead socket, like a kubelet that exited.
        hidden = os.path.join(self.plugin_dir, f".kubelet-{os.getpid()}-{self._generation}.sock")
        if len(os.fsencode(hidden)) > _GRPC_PATH_MAX:
            hidden = self.socket_path  # no room for the hidden name: bind kubelet.sock itself
        try:
            if server.add_insecure_port("unix:" + hidden) == 0:
                raise OSError(f"kubelet simulator: could not bind {hidden}")
            await server.start()
            if hidden != self.socket_path:
                os.rename(hidden, self.socket_path)
        except BaseException:
            await server.stop(None)
            if hidden != self.socket_path and os.path.lexists(hidden):
                os.unlink(hidden)
            raise
        self._server = server
        self.stopping = False
        self._stop_event = asyncio.Event()
        if self.pod_resources is not None:
            try:
                await self.pod_resources.start()
            except BaseException:
                self._server = None
                await server.stop(None)
                raise
        self._generation += 1
        self.starts += 1
        self.started_at = time.monotonic()
        await self._notify()

    async def stop(self, *, unlink: bool = True) -> None:
        """Stop serving, end every stream and close every plugin channel, and wait for it all.

        Register calls in flight fail with the kubelet's "context canceled" error. ``unlink``:
        remove kubelet.sock (connecting then fails with ENOENT); False leaves it behind dead
        (ECONNREFUSED), as a kubelet that exited does, until the next ``start()`` wipes it.
        """
        self._generation += 1
        self.stopping = True
        if self._stop_event is not None:
            self._stop_event.set()
        server, self._server = self._server, None
        if server is not None:
            # The grace lets the in-flight Register handlers send their error, as the kubelet's
            # cancelled contexts do; nothing new is accepted meanwhile.
            await server.stop(STOP_GRACE_S)
        if unlink and os.path.lexists(self.socket_path):
            try:
                if stat.S_ISSOCK(os.lstat(self.socket_path).st_mode):
                    os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
        if self.pod_resources is not None:
            await self.pod_resources.stop()
        for channel in list(self._dialing):
            await channel.close(None)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for state in self.resources.values():
            if state.connected:
                state.disconnect("kubelet stopped")
            if state.current is not None:
                # A stream task cancelled before its first step never ran its own cleanup.
                await state.current.close()
                state.current = None
        await self._notify()

    async def restart(self, outage_s: float = 0.0, *, unlink: bool = False) -> None:
        """Stop, stay down ``outage_s`` seconds (the dead socket left behind unless ``unlink``),
        start again. The outage is a real wait: it is the thing being simulated."""
        await self.stop(unlink=unlink)
        if outage_s > 0:
            await asyncio.sleep(outage_s)
        await self.start()

    async def __aenter__(self) -> KubeletSimulator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _remove_sockets(self) -> None:
        """Delete every socket directly in the directory, and links to sockets (1.33+)."""
        for entry in os.scandir(self.plugin_dir):
            try:
                if stat.S_ISSOCK(os.stat(entry.path).st_mode):
                    os.unlink(entry.path)
            except FileNotFoundError:
                continue
            except OSError as err:
                log.warning("kubelet simulator: cannot remove socket %s: %s", entry.path, err)

    # -- waiting --

    @property
    def _cond(self) -> asyncio.Condition:
        if self._cond_obj is None:  # created lazily so that it binds to the running loop
            self._cond_obj = asyncio.Condition()
        return self._cond_obj

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    async def wait_for(
        self,
        predicate: Callable[[KubeletSimulator], bool],
        timeout: float = 5.0,
        what: str = "",
    ) -> None:
        """Wait until ``predicate(self)`` holds, re-checked on every register, snapshot and
        stream end. A LookupError from the predicate counts as "not yet", so
        ``lambda k: k.resources["x"].allocatable == 4`` works before "x" registered."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        async with self._cond:
            while not self._holds(predicate):
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise TimeoutError(
                        f"timed out after {timeout:g}s waiting for {what or 'a condition'};"
                        f" state: {self.describe()}"
                    )
                try:
                    await asyncio.wait_for(self._cond.wait(), remaining)
                except asyncio.TimeoutError:
                    pass

    def _holds(self, predicate: Callable[[KubeletSimulator], bool]) -> bool:
        try:
            return bool(predicate(self))
        except LookupError:
            return False

    def describe(self) -> str:
        parts = [f"serving={self.serving}", f"starts={self.starts}"]
        parts += [state.summary() for state in self.resources.values()] or ["no resources"]
        if self.register_errors:
            parts.append(f"last register errors={self.register_errors[-3:]}")
        return "; ".join(parts)

    # -- registration --

    async def _register(
        self, request: api.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> api.Empty:
        name = request.resource_name
        self.register_calls[name] = self.register_calls.get(name, 0) + 1
        if name in self.resources:
            self.resources[name].registrations += 1
        generation = self._generation
        self.registers_in_flight += 1
        await self._notify()
        try:
            if request.version not in SUPPORTED_VERSIONS:
                await self._reject(
                    context,
                    f"requested API version {go_quote(request.version)} is not supported by"
                    f" kubelet. Supported version is {json.dumps(list(SUPPORTED_VERSIONS))}",
                )
            if resource_name_error(name) is not None:
                await self._reject(context, f"the ResourceName {go_quote(name)} is invalid")
            stopped = self._stop_event
            if self.stopping or stopped is None:
                await self._reject(context, "grpc: the server has been stopped",
                                   grpc.StatusCode.UNAVAILABLE)
                return api.Empty()  # not reached: the abort raises
            # filepath.Join: no validation, an absolute endpoint lands under the directory.
            path = os.path.normpath(self.plugin_dir + "/" + request.endpoint)
            if self.kubelet_version < DEADLINE_IN_REGISTER:
                # A background context: the plugin hanging up does not stop the connect.
                job = asyncio.ensure_future(self._connect_and_accept(
                    request, path, None, stopped, generation))
                self._tasks.add(job)
                job.add_done_callback(self._tasks.discard)
                failure = await asyncio.shield(job)
                if failure is not None:
                    await self._reject(context, failure)
                return api.Empty()
            failure = await self._connect_and_accept(request, path, context, stopped, generation)
            if failure is not None:
                await self._reject(context, failure)
            return api.Empty()
        except asyncio.CancelledError:
            # gRPC cancels the handler when the plugin's Register deadline passes or it hangs up.
            if generation == self._generation:
                remaining = context.time_remaining()
                why = "cancelled by the plugin"
                # The plugin's own deadline fires a moment before ours (its cancel is in
                # flight while our copy of the deadline, sent less the transit, still runs):
                # a few ms left is that deadline, not a plugin hanging up early.
                if remaining is not None and remaining <= DEADLINE_SLACK_S:
                    why = "the plugin's Register deadline exceeded"
                self.register_errors.append(f"Register of {go_quote(name)} abandoned: {why}")
            raise
        finally:
            self.registers_in_flight -= 1
            await self._notify()

    async def _reject(
        self,
        context: grpc.aio.ServicerContext,
        message: str,
        code: grpc.StatusCode = grpc.StatusCode.UNKNOWN,
    ) -> None:
        self.register_errors.append(message)
        log.info("kubelet simulator: Register rejected: %s", message)
        await context.abort(code, message)

    async def _connect_and_accept(
        self,
        request: api.RegisterRequest,
        path: str,
        context: Optional[grpc.aio.ServicerContext],
        stopped: asyncio.Event,
        generation: int,
    ) -> Optional[str]:
        """Dial back, take the options, accept; the failure message, or None when accepted.
        ``context`` None: not bounded by the plugin's deadline (kubelets before 1.35)."""
        try:
            endpoint = await self._connect_unless_stopped(path, context, stopped)
        except _Rejected as rejected:
            return str(rejected)
        if generation != self._generation:
            await endpoint.close()
            return self._stop_message()
        await self._accept(request, endpoint)
        await self._notify()
        return None

    def _stop_message(self) -> str:
        return CONTEXT_CANCELED if self.kubelet_version >= DEADLINE_IN_REGISTER else (
            CONNECTION_CLOSING)

    async def _connect_unless_stopped(
        self, path: str, context: Optional[grpc.aio.ServicerContext], stopped: asyncio.Event
    ) -> Endpoint:
        """The dial-back and options call, abandoned when the kubelet stops: its context is
        cancelled, so the plugin's Register fails with "context canceled" (1.36)."""
        connect = asyncio.ensure_future(self._delayed_connect(path, context))
        stop_wait = asyncio.ensure_future(stopped.wait())
        try:
            await asyncio.wait({connect, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_wait.cancel()
            if not connect.done():
                connect.cancel()
            await asyncio.gather(stop_wait, return_exceptions=True)
            await asyncio.gather(connect, return_exceptions=True)
        if connect.cancelled():
            raise _Rejected(self._stop_message())
        return connect.result()

    async def _delayed_connect(
        self, path: str, context: Optional[grpc.aio.ServicerContext]
    ) -> Endpoint:
        if self.register_delay_s > 0:
            await asyncio.sleep(self.register_delay_s)
        return await self._connect(path, context)

    async def _connect(
        self, path: str, context: Optional[grpc.aio.ServicerContext]
    ) -> Endpoint:
        """Dial back and ask for the options; since 1.35 both run within the Register deadline
        (``context`` given), before that with the dial's own 10 s and no deadline."""
        channel = grpc.aio.insecure_channel("unix:" + path, options=_CHANNEL_OPTIONS)
        self._dialing.add(channel)
        connected = False
        try:
            remaining = None if context is None else context.time_remaining()
            timeout = self.dial_timeout if remaining is None else min(self.dial_timeout, remaining)
            try:
                await asyncio.wait_for(channel.channel_ready(), max(timeout, 0.0))
            except asyncio.TimeoutError:
                raise _Rejected("failed to dial device plugin: context deadline exceeded") from None
            stub = api_grpc.DevicePluginStub(channel)
            try:
                options = await stub.GetDevicePluginOptions(
                    api.Empty(), timeout=None if context is None else context.time_remaining()
                )
            except grpc.aio.AioRpcError as err:
                raise _Rejected(f"failed to get device plugin options: {go_error(err)}") from None
            connected = True
            return Endpoint(path, channel, stub, options)
        finally:
            self._dialing.discard(channel)
            if not connected:
                await channel.close(None)

    async def _accept(self, request: api.RegisterRequest, endpoint: Endpoint) -> None:
        name = request.resource_name
        state = self.resources.get(name)
        if state is None:
            state = ResourceState(name=name, registrations=self.register_calls[name])
            self.resources[name] = state
        old = state.attach(request, endpoint)
        task = asyncio.ensure_future(self._list_and_watch(state, endpoint))
        endpoint.task = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if old is not None and old is not endpoint:
            # registerClient only replaces the map entry: the old client's ListAndWatch runs
            # on (its snapshots still feed the name's device sets) until its plugin ends it.
            old.superseded = True

    async def _list_and_watch(self, state: ResourceState, endpoint: Endpoint) -> None:
        """One stream per registration, without deadline or retry, as the kubelet runs it."""
        call: Optional[grpc.aio.UnaryStreamCall] = None
        reason = "ListAndWatch stream ended by the plugin"
        ended_by_plugin = True
        try:
            call = endpoint.call = endpoint.stub.ListAndWatch(api.Empty())
            async for message in call:
                state.apply(message.devices)  # PluginListAndWatchReceiver(resourceName)
                await self._notify()
        except asyncio.CancelledError:
            ended_by_plugin = False
            reason = "ListAndWatch stream cancelled by the kubelet"
            raise
        except grpc.aio.AioRpcError as err:
            reason = f"ListAndWatch failed: {go_error(err)}"
        except Exception as err:  # a broken stream must never take the simulator down
            reason = f"ListAndWatch failed: {err!r}"
        finally:
            if state.current is endpoint and state.connected:
                state.disconnect(reason)
                log.info("kubelet simulator: %s disconnected: %s", state.name, reason)
            elif (ended_by_plugin and endpoint.superseded and state.current is not None
                  and state.connected and self.kubelet_version < CLIENTS_BY_PATH):
                # runClient: getClient(name) finds the *newer* client and disconnects it
                # (its stream cancelled, every device unhealthy); 1.37 (PR #135437) looks
                # the client up by name and socket path and leaves the newer one alone.
                current = state.current
                state.disconnect(f"{reason} (an older registration of the name ended: the "
                                 "kubelet disconnected the current one)")
                log.info("kubelet simulator: %s: the superseded stream ended; the current "
                         "registration was disconnected with it", state.name)
                await current.close()
            await endpoint.close()
            await self._notify()

    # -- node status --

    def get_capacity(self) -> Tuple[Dict[str, int], Dict[str, int], List[str]]:
        """The device manager's ``GetCapacity``, called by every node status sync: capacity
        (healthy + unhealthy) and allocatable (healthy) per resource, and the resources
        removed now: a stopped endpoint (stream ended, no new registration) keeps its
        capacity, with allocatable 0, until ``endpoint_stop_grace_s`` after it stopped; the
        first call after that deletes it and reports it removed (the node status setter
        then writes an explicit 0 for it)."""
        capacity: Dict[str, int] = {}
        allocatable: Dict[str, int] = {}
        removed: List[str] = []
        now = time.monotonic()
        for name, state in list(self.resources.items()):
            if (not state.connected and state.stopped_at is not None
                    and now - state.stopped_at >= self.endpoint_stop_grace_s):
                del self.resources[name]
                removed.append(name)
                continue
            capacity[name] = state.capacity
            allocatable[name] = state.allocatable
        return capacity, allocatable, removed

    # -- allocation --

    @property
    def allocations(self) -> List[Tuple[str, str, str, str, List[str]]]:
        """(namespace, pod, container, resource, ids) of every live allocation, oldest first."""
        return [(*key, list(r.device_ids)) for key, r in self.allocation_results.items()]

    def in_use(self, resource: str) -> Set[str]:
        return {
            dev
            for key, result in self.allocation_results.items()
            if key[3] == resource
            for dev in result.device_ids
        }

    def release(self, pod: str, namespace: str = "default") -> None:
        """Forget a pod's devices; the kubelet does this silently, without any RPC."""
        for key in [k for k in self.allocation_results if k[:2] == (namespace, pod)]:
            del self.allocation_results[key]

    async def allocate(
        self,
        resource: str,
        count: int,
        *,
        pod: str = "pod",
        namespace: str = "default",
        container: str = "main",
    ) -> AllocationResult:
        """Admit one container asking for ``count`` devices, then start it.

        Ids held by any other container (of any pod) are not candidates. Asking again for an
        admitted container is a container restart: no Allocate, the cached response comes back,
        PreStartContainer runs again. A failed PreStartContainer keeps the allocation, as a
        failed container start does.
        """
        if count <= 0:
            raise ValueError("count must be positive: the kubelet allocates only requested devices")
        if self._alloc_lock_obj is None:
            self._alloc_lock_obj = asyncio.Lock()
        async with self._alloc_lock_obj:  # the kubelet admits one pod at a time
            key = (namespace, pod, container, resource)
            result = self.allocation_results.get(key)
            state = self.resources.get(resource)
            if result is None:
                if state is None:
                    raise AllocationError(f"cannot allocate unregistered device {resource}")
                result = await allocation.admit(
                    state, key, count, self.in_use(resource), self.topology_policy, self.numa_nodes
                )
                self.allocation_results[key] = result
            elif len(result.device_ids) != count:
                raise AllocationError(
                    f"pod {pod} container {container} changed request for resource {resource}"
                    f" from {len(result.device_ids)} to {count}"
                )
            if state is not None and state.options.pre_start_required:
                await allocation.pre_start(state, result.device_ids)
            return result

    # -- raw calls (no bookkeeping) for error-path tests; RPC errors raise AioRpcError --

    def _live(self, resource: str) -> Endpoint:
        state = self.resources.get(resource)
        if state is None or state.current is None or not state.connected:
            raise NotRegisteredError(f"{resource} has no live registration")
        return state.current

    async def call_allocate(
        self, resource: str, ids_per_container: Sequence[Sequence[str]]
    ) -> api.AllocateResponse:
        request = api.AllocateRequest(
            container_requests=[
                api.ContainerAllocateRequest(devices_ids=list(ids)) for ids in ids_per_container
            ]
        )
        return await self._live(resource).stub.Allocate(request)

    async def call_preferred(
        self, resource: str, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> api.PreferredAllocationResponse:
        request = allocation.preferred_request(available, must_include, size)
        return await self._live(resource).stub.GetPreferredAllocation(request)

    async def call_pre_start(
        self, resource: str, ids: Sequence[str]
    ) -> api.PreStartContainerResponse:
        return await self._live(resource).stub.PreStartContainer(
            api.PreStartContainerRequest(devices_ids=list(ids)), timeout=PRE_START_TIMEOUT_S
        )

    async def call_options(self, resource: str) -> api.DevicePluginOptions:
        return await self._live(resource).stub.GetDevicePluginOptions(api.Empty())
