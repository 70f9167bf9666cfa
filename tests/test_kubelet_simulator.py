"""The kubelet simulator against a tiny hand-written grpc.aio device plugin.

The plugin here is deliberately dumb and fully scripted, so every assertion is about what the
simulator did on the wire: what it dialed, which RPCs it sent with which arguments, and how it
read the replies.
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import grpc
import pytest

from host.kubelet.protocol import api, api_grpc
from host.sim.kubelet import (
    AllocationError,
    KubeletSimulator,
    NotRegisteredError,
    merge_hints,
    split_by_affinity,
    topology_hints,
)

GPU = "example.com/gpu"


def device(dev_id: str, numa: Sequence[int] = (), health: str = "Healthy") -> api.Device:
    dev = api.Device(ID=dev_id, health=health)
    if numa:
        dev.topology.nodes.extend(api.NUMANode(ID=n) for n in numa)
    return dev


def two_node_gpus() -> List[api.Device]:
    return [device("g0", [0]), device("g1", [0]), device("g2", [1]), device("g3", [1])]


class FakePlugin(api_grpc.DevicePluginServicer):
    """A scripted plugin: records every call, answers what the test says."""

    def __init__(
        self,
        plugin_dir: str,
        resource: str = GPU,
        *,
        endpoint: str = "fake.sock",
        devices: Optional[List[api.Device]] = None,
        pre_start: bool = False,
        preferred: bool = False,
    ) -> None:
        self.plugin_dir = plugin_dir
        self.resource = resource
        self.endpoint = endpoint
        self.socket = os.path.normpath(plugin_dir + "/" + endpoint)
        self.devices = list(devices if devices is not None else two_node_gpus())
        self.options = api.DevicePluginOptions(
            pre_start_required=pre_start, get_preferred_allocation_available=preferred
        )
        self.calls: List[Tuple[str, Any]] = []
        self.preferred_answer: Optional[List[str]] = None  # None: the first N available
        self.fail: Dict[str, grpc.StatusCode] = {}  # RPC name -> status to fail it with
        self.empty_allocate = False
        self.options_delay = 0.0
        self.stream_cancelled = asyncio.Event()
        self.seen_when_registered: List[str] = []  # calls received before Register returned
        self._updates: List[asyncio.Queue] = []
        self._server: Optional[grpc.aio.Server] = None

    def names(self) -> List[str]:
        return [name for name, _ in self.calls]

    async def _maybe_fail(self, name: str, context: grpc.aio.ServicerContext) -> None:
        if name in self.fail:
            await context.abort(self.fail[name], f"{name} refused by the test")

    async def GetDevicePluginOptions(self, request, context):
        self.calls.append(("GetDevicePluginOptions", request))
        await self._maybe_fail("GetDevicePluginOptions", context)
        if self.options_delay:
            await asyncio.sleep(self.options_delay)
        return self.options

    async def ListAndWatch(self, request, context):
        self.calls.append(("ListAndWatch", request))
        queue: asyncio.Queue = asyncio.Queue()
        self._updates.append(queue)
        try:
            snapshot: Optional[List[api.Device]] = self.devices
            while snapshot is not None:
                yield api.ListAndWatchResponse(devices=snapshot)
                snapshot = await queue.get()
        except asyncio.CancelledError:
            self.stream_cancelled.set()
            raise
        finally:
            self._updates.remove(queue)

    async def GetPreferredAllocation(self, request, context):
        self.calls.append(("GetPreferredAllocation", request))
        await self._maybe_fail("GetPreferredAllocation", context)
        reply = api.PreferredAllocationResponse()
        for req in request.container_requests:
            if self.preferred_answer is not None:
                ids = self.preferred_answer
            else:
                ids = list(req.must_include_deviceIDs)
                ids += [d for d in req.available_deviceIDs if d not in ids]
                ids = ids[: req.allocation_size]
            reply.container_responses.add(deviceIDs=ids)
        return reply

    async def Allocate(self, request, context):
        self.calls.append(("Allocate", request))
        await self._maybe_fail("Allocate", context)
        reply = api.AllocateResponse()
        if self.empty_allocate:
            return reply
        for req in request.container_requests:
            reply.container_responses.add(envs={"IDS": ",".join(req.devices_ids)})
        return reply

    async def PreStartContainer(self, request, context):
        self.calls.append(("PreStartContainer", request))
        await self._maybe_fail("PreStartContainer", context)
        return api.PreStartContainerResponse()

    # -- driving it --

    async def serve(self) -> None:
        self._server = grpc.aio.server()
        api_grpc.add_DevicePluginServicer_to_server(self, self._server)
        self._server.add_insecure_port("unix:" + self.socket)
        await self._server.start()

    async def register(
        self,
        *,
        version: str = "v1beta1",
        name: Optional[str] = None,
        endpoint: Optional[str] = None,
        timeout: float = 5.0,
    ) -> None:
        served = self.options
        request = api.RegisterRequest(
            version=version,
            endpoint=self.endpoint if endpoint is None else endpoint,
            resource_name=self.resource if name is None else name,
            # Deliberately the opposite of what GetDevicePluginOptions answers.
            options=api.DevicePluginOptions(
                pre_start_required=not served.pre_start_required,
                get_preferred_allocation_available=not served.get_preferred_allocation_available,
            ),
        )
        target = "unix:" + os.path.join(self.plugin_dir, "kubelet.sock")
        async with grpc.aio.insecure_channel(target) as channel:
            await api_grpc.RegistrationStub(channel).Register(request, timeout=timeout)
        self.seen_when_registered = self.names()

    async def start(self) -> None:
        await self.serve()
        await self.register()

    def push(self, devices: Optional[List[api.Device]]) -> None:
        """A new full snapshot on every open stream; None ends the streams (handler returns)."""
        if devices is not None:
            self.devices = list(devices)
        for queue in self._updates:
            queue.put_nowait(devices)

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(None)
            self._server = None


def registered(resource: str = GPU):
    def check(k: KubeletSimulator) -> bool:
        state = k.resources[resource]
        return state.connected and state.snapshots > 0

    return check


_SIM_ARGS = ("numa_nodes", "topology_policy", "dial_timeout", "kubelet_version")


async def started(plugin_dir: str, **kwargs: Any) -> Tuple[KubeletSimulator, FakePlugin]:
    kubelet = KubeletSimulator(plugin_dir, **{k: v for k, v in kwargs.items() if k in _SIM_ARGS})
    await kubelet.start()
    plugin = FakePlugin(plugin_dir, **{k: v for k, v in kwargs.items() if k not in _SIM_ARGS})
    await plugin.start()
    await kubelet.wait_for(registered(), what="the fake plugin registered")
    return kubelet, plugin


# --- registration ------------------------------------------------------------------------------


def test_register_dials_back_and_keeps_the_options_reply(short_dir, run):
    async def scenario():
        kubelet, plugin = await started(short_dir, preferred=True)
        try:
            # Dial-back and the options call happened inside Register, before it returned.
            assert plugin.seen_when_registered[0] == "GetDevicePluginOptions"
            state = kubelet.resources[GPU]
            # Options come from GetDevicePluginOptions, not from the (inverted) request.
            assert state.options.get_preferred_allocation_available
            assert not state.options.pre_start_required
            assert state.endpoint == "fake.sock"
            assert state.socket_path == os.path.join(short_dir, "fake.sock")
            assert (state.registrations, kubelet.register_calls[GPU]) == (1, 1)
            assert state.capacity == 4 and state.allocatable == 4
            assert state.healthy == {"g0", "g1", "g2", "g3"} and state.stopped_at is None
            assert await kubelet.call_options(GPU) == plugin.options
            assert kubelet.register_errors == []
        finally:
            await kubelet.stop()
            await plugin.stop()

    run(scenario())


@pytest.mark.parametrize(
    "name",
    [
        "gpu",
        "kubernetes.io/gpu",
        "mykubernetes.io/gpu",
        "requests.example.com/gpu",
        "Example.com/gpu",
        "example.com/a/b",
        "example.com/gpu-",
        "/gpu",
        "example.com/",
    ],
)
def test_register_rejects_invalid_names(short_dir, run, name):
    async def scenario():
        async with KubeletSimulator(short_dir) as kubelet:
            plugin = FakePlugin(short_dir)
            await plugin.serve()
            try:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await plugin.register(name=name)
                assert err.value.code() == grpc.StatusCode.UNKNOWN
                assert err.value.details() == f'the ResourceName "{name}" is invalid'
                assert kubelet.register_errors == [err.value.details()]
                assert kubelet.register_calls == {name: 1}  # counted before validation
                assert kubelet.resources == {} and plugin.calls == []  # never dialed
            finally:
                await plugin.stop()

    run(scenario())


def test_register_failures_keep_nothing(short_dir, run):
    async def scenario():
        async with KubeletSimulator(short_dir, dial_timeout=0.3) as kubelet:
            plugin = FakePlugin(short_dir)
            await plugin.serve()
            try:
                with pytest.raises(grpc.aio.AioRpcError) as version:
                    await plugin.register(version="v1alpha")
                assert version.value.code() == grpc.StatusCode.UNKNOWN
                assert version.value.details() == (
                    'requested API version "v1alpha" is not supported by kubelet.'
                    ' Supported version is ["v1beta1"]'
                )
                with pytest.raises(grpc.aio.AioRpcError) as dial:
                    await plugin.register(endpoint="missing.sock")
                assert dial.value.details() == (
                    "failed to dial device plugin: context deadline exceeded"
                )
                plugin.fail["GetDevicePluginOptions"] = grpc.StatusCode.INTERNAL
                with pytest.raises(grpc.aio.AioRpcError) as options:
                    await plugin.register()
                assert options.value.details() == (
                    "failed to get device plugin options: rpc error: code = Internal"
                    " desc = GetDevicePluginOptions refused by the test"
                )
                assert GPU not in kubelet.resources
                assert kubelet.register_calls[GPU] == 3
                assert len(kubelet.register_errors) == 3
                assert "ListAndWatch" not in plugin.names()

                # Registered, then a failed re-registration leaves the live one alone.
                del plugin.fail["GetDevicePluginOptions"]
                await plugin.register()
                await kubelet.wait_for(registered())
                with pytest.raises(grpc.aio.AioRpcError):
                    await plugin.register(endpoint="missing.sock")
                state = kubelet.resources[GPU]
                assert state.connected and state.endpoint == "fake.sock"
                assert state.registrations == 5 and state.allocatable == 4
            finally:
                await plugin.stop()

    run(scenario())


def test_register_deadline_bounds_the_options_call(short_dir, run):
    """Since 1.35 the dial-back and options call run within the plugin's Register deadline."""

    async def scenario():
        async with KubeletSimulator(short_dir) as kubelet:
            plugin = FakePlugin(short_dir)
            plugin.options_delay = 1.0
            await plugin.serve()
            try:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await plugin.register(timeout=0.2)
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                await kubelet.wait_for(lambda k: len(k.register_errors) == 1, timeout=2)
                assert "deadline" in kubelet.register_errors[0].lower()
                assert GPU not in kubelet.resources
            finally:
                await plugin.stop()

    run(scenario())


def test_before_1_35_the_kubelet_registers_a_plugin_whose_register_timed_out(short_dir, run):
    """With a background context (1.32) the options call outlives the plugin's
    deadline: the plugin sees DEADLINE_EXCEEDED and is registered all the same."""

    async def scenario():
        async with KubeletSimulator(short_dir, kubelet_version=(1, 32)) as kubelet:
            plugin = FakePlugin(short_dir)
            plugin.options_delay = 0.5
            await plugin.serve()
            try:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await plugin.register(timeout=0.2)
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                await kubelet.wait_for(registered(), timeout=3, what="registered anyway")
            finally:
                await plugin.stop()

    run(scenario())


def test_before_1_35_a_stop_fails_register_with_connection_closing(short_dir, run):
    async def scenario():
        kubelet, plugin = await started(short_dir, kubelet_version=(1, 32))
        try:
            kubelet.register_delay_s = 30.0
            call = asyncio.ensure_future(plugin.register(timeout=20))
            await kubelet.wait_for(lambda k: k.registers_in_flight == 1, what="in flight")
            await kubelet.stop()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            assert "the client connection is closing" in caught.value.details()
        finally:
            await kubelet.stop()
            await plugin.stop()

    run(scenario())


def test_a_non_bare_endpoint_is_joined_under_the_directory(short_dir, run):
    async def scenario():
        async with KubeletSimulator(short_dir) as kubelet:
            # What filepath.Join does: "/abs.sock" lands inside the directory.
            plugin = FakePlugin(short_dir, endpoint="/abs.sock")
            assert plugin.socket == os.path.join(short_dir, "abs.sock")
            await plugin.start()
            try:
                await kubelet.wait_for(registered())
                assert kubelet.resources[GPU].socket_path == plugin.socket
                assert kubelet.resources[GPU].endpoint == "/abs.sock"
            finally:
                await plugin.stop()

    run(scenario())


# --- ListAndWatch ------------------------------------------------------------------------------


def test_every_message_is_a_full_snapshot(short_dir, run):
    async def scenario():
        kubelet, plugin = await started(short_dir)
        try:
            state = kubelet.resources[GPU]
            # Exactly "Healthy" counts; anything else, even "healthy", is unhealthy.
            plugin.push([device("g0"), device("g1", health="healthy"), device("g2", health="")])
            await kubelet.wait_for(lambda k: k.resources[GPU].snapshots == 2)
            assert state.healthy == {"g0"} and state.unhealthy == {"g1", "g2"}
            assert (state.capacity, state.allocatable) == (3, 1)
            assert sorted(state.devices) == ["g0", "g1", "g2"]  # g3 missing = gone
            # The same id sent Healthy and Unhealthy counts in both sets, like GetCapacity.
            plugin.push([device("g0"), device("g0", health="Unhealthy")])
            await kubelet.wait_for(lambda k: k.resources[GPU].snapshots == 3)
            assert (state.capacity, state.allocatable) == (2, 1)
            plugin.push([])
            await kubelet.wait_for(lambda k: k.resources[GPU].snapshots == 4)
            assert state.capacity == 0 and state.devices == {} and state.connected
        finally:
            await kubelet.stop()
            await plugin.stop()

    run(scenario())


def test_stream_end_disconnects_and_is_never_redialed(short_dir, run):
    async def scenario():
        kubelet, plugin = await started(short_dir)
        try:
            plugin.push(None)  # the handler returns: the stream ends with OK
            await kubelet.wait_for(lambda k: not k.resources[GPU].connected, what="disconnect")
            state = kubelet.resources[GPU]
            assert state.stopped_at is not None and state.last_error
            assert (state.capacity, state.allocatable) == (4, 0)  # all unhealthy
            assert state.unhealthy == {"g0", "g1", "g2", "g3"}
            with pytest.raises(NotRegisteredError):
                await kubelet.call_options(GPU)
            with pytest.raises(AllocationError, match="no healthy devices present"):
                await kubelet.allocate(GPU, 1)
            # Re-registering opens exactly one new stream: the simulator never re-dialed.
            await plugin.register()
            await kubelet.wait_for(lambda k: k.resources[GPU].allocatable == 4)
            assert plugin.names().count("ListAndWatch") == 2
            assert state.stopped_at is None and state.registrations == 2
        finally:
            await kubelet.stop()
            await plugin.stop()

    run(scenario())


def test_plugin_death_ends_the_stream(short_dir, run):
    async def scenario():
        kubelet, plugin = await started(short_dir)
        try:
            await plugin.stop()
            await kubelet.wait_for(lambda k: not k.resources[GPU].connected)
            assert "Unavailable" in kubelet.resources[GPU].last_error
        finally:
            await kubelet.stop()

    run(scenario())


def test_snapshots_over_4_mib_break_the_stream(short_dir, run):
    async def scenario():
        kubelet, plugin = await started(short_dir)
        try:
            plugin.push([device(f"device-{i:08d}-{'x' * 40}") for i in range(80_000)])
            await kubelet.wait_for(lambda k: not k.resources[GPU].connected, timeout=10)
            assert "ResourceExhausted" in kubelet.resources[GPU].last_error
        finally:
            await kubelet.stop()
            await plugin.stop()

    run(scenario())


@pytest.mark.parametrize("version", [(1, 36), (1, 37)])
def test_reregistration_replaces_the_endpoint_and_the_old_stream_end_is_as_upstream(
        short_dir, run, version):
    """A new Register of the name replaces the endpoint; the old client's stream runs on and
    the device sets stay healthy meanwhile (PluginConnected keeps them). When the old plugin
    then ends its stream, a 1.36 kubelet finds the client by name (the new one) and
    disconnects it; 1.37 (clients by name and socket path) leaves the new one alone."""
    async def scenario():
        kubelet, old = await started(short_dir, endpoint="old.sock", kubelet_version=version)
        new = FakePlugin(short_dir, endpoint="new.sock", devices=[device("n0")])
        try:
            await new.start()
            await kubelet.wait_for(
                lambda k: (
                    k.resources[GPU].endpoint == "new.sock" and k.resources[GPU].snapshots == 2
                )
            )
            state = kubelet.resources[GPU]
            assert state.healthy == {"n0"}
            assert not old.stream_cancelled.is_set()  # the kubelet did not end it
            await old.stop()
            if version < (1, 37):
                await kubelet.wait_for(lambda k: not k.resources[GPU].connected)
                assert state.allocatable == 0 and "older registration" in state.last_error
                await asyncio.wait_for(new.stream_cancelled.wait(), 2)
                return
            new.push([device("n0"), device("n1")])
            await kubelet.wait_for(lambda k: k.resources[GPU].snapshots == 3)
            assert state.connected and state.healthy == {"n0", "n1"}
            assert (await kubelet.call_allocate(GPU, [["n1"]])).container_responses
            assert "Allocate" in new.names() and "Allocate" not in old.names()
        finally:
            await kubelet.stop()
            await old.stop()
            await new.stop()

    run(scenario())


# --- restart -----------------------------------------------------------------------------------


def test_start_removes_only_sockets_directly_in_the_directory(short_dir, run):
    plugin_dir = os.path.join(short_dir, "dp")

    def bind(path: str) -> None:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(path)
        sock.close()

    async def scenario():
        os.makedirs(os.path.join(plugin_dir, "sub"))
        bind(os.path.join(plugin_dir, "stale.sock"))
        bind(os.path.join(plugin_dir, "sub", "nested.sock"))
        bind(os.path.join(short_dir, "outside.sock"))
        os.symlink(os.path.join(short_dir, "outside.sock"), os.path.join(plugin_dir, "link.sock"))
        with open(os.path.join(plugin_dir, "kubelet_internal_checkpoint"), "w") as f:
            f.write("{}")
        async with KubeletSimulator(plugin_dir) as kubelet:
            left = sorted(os.listdir(plugin_dir))
            assert left == ["kubelet.sock", "kubelet_internal_checkpoint", "sub"]
            assert os.path.exists(os.path.join(plugin_dir, "sub", "nested.sock"))
            assert os.path.exists(os.path.join(short_dir, "outside.sock"))
            assert stat.S_ISSOCK(os.stat(kubelet.socket_path).st_mode)
        assert not os.path.exists(os.path.join(plugin_dir, "kubelet.sock"))

    run(scenario())


def test_start_creates_the_directory_0750(short_dir, run):
    plugin_dir = os.path.join(short_dir, "a", "device-plugins")

    async def scenario():
        old = os.umask(0o022)
        try:
            async with KubeletSimulator(plugin_dir):
                assert stat.S_IMODE(os.stat(plugin_dir).st_mode) == 0o750
        finally:
            os.umask(old)

    run(scenario())


def test_restart_wipes_the_plugin_socket_and_waits_for_reregistration(short_dir, run):
    async def scenario():
        kubelet, plugin = await started(short_dir)
        try:
            await kubelet.allocate(GPU, 1, pod="keep")
            await kubelet.restart()
            state = kubelet.resources[GPU]
            assert not os.path.exists(plugin.socket)  # the kubelet deleted it
            assert not state.connected and state.capacity == 0  # known name, no devices
            assert kubelet.allocations[0][:4] == ("default", "keep", "main", GPU)  # checkpointed
            assert kubelet.starts == 2
            await plugin.stop()
            await plugin.start()  # re-serve on a fresh socket, then Register
            await kubelet.wait_for(lambda k: k.resources[GPU].allocatable == 4)
            assert state.registrations == 2
            # The checkpointed allocation still holds its device.
            result = await kubelet.allocate(GPU, 3, pod="other")
            assert not set(result.device_ids) & set(kubelet.allocations[0][4])
        finally:
            await kubelet.stop()
            await plugin.stop()

    run(scenario())


def test_a_register_in_flight_when_the_kubelet_stops_fails_with_context_canceled(short_dir, run):
    async def scenario():
        kubelet, plugin = await started(short_dir)
        try:
            kubelet.register_delay_s = 30.0
            call = asyncio.ensure_future(plugin.register(timeout=20))
            await kubelet.wait_for(lambda k: k.registers_in_flight == 1, what="in flight")
            await kubelet.stop(unlink=False)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            assert caught.value.code() == grpc.StatusCode.UNKNOWN
            assert "context canceled" in caught.value.details()
            assert kubelet.registers_in_flight == 0
        finally:
            await kubelet.stop()
            await plugin.stop()

    run(scenario())


def _connect_error(path: str) -> Optional[int]:
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.connect(path)
    except OSError as error:
        return error.errno
    finally:
        sock.close()
    return None


def test_a_stopped_kubelet_leaves_a_dead_socket_for_the_outage_then_a_new_one(short_dir, run):
    import errno

    async def scenario():
        kubelet, plugin = await started(short_dir)
        try:
            first = os.stat(kubelet.socket_path)
            restart = asyncio.ensure_future(kubelet.restart(outage_s=0.3))
            await kubelet.wait_for(lambda k: not k.serving, what="stopped")
            # Down: the file is still there (same inode), nothing accepts.
            assert os.stat(kubelet.socket_path).st_ino == first.st_ino
            assert _connect_error(kubelet.socket_path) == errno.ECONNREFUSED
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await plugin.register(timeout=1)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            await restart
            # Back: a new kubelet.sock that listens, our socket wiped. (The kernel may hand
            # the freed inode number out again: the change time tells the files apart.)
            again = os.stat(kubelet.socket_path)
            assert (again.st_ino, again.st_ctime_ns) != (first.st_ino, first.st_ctime_ns)
            assert _connect_error(kubelet.socket_path) is None
            assert not os.path.exists(plugin.socket)
            assert kubelet.started_at is not None and kubelet.starts == 2
            await kubelet.stop(unlink=True)
            assert _connect_error(kubelet.socket_path) == errno.ENOENT
        finally:
            await kubelet.stop()
            await plugin.stop()

    run(scenario())


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_sixty_restarts_leak_no_task_channel_fd_or_thread(short_dir, run):
    async def scenario():
        kubelet, plugin = await started(short_dir)
        baseline: Optional[Tuple[int, int, int]] = None
        try:
            for restart in range(60):
                await kubelet.restart()
                await plugin.stop()
                await plugin.start()
                await kubelet.wait_for(
                    lambda k, n=2 * restart + 2: (
                        k.resources[GPU].registrations == n and k.resources[GPU].allocatable == 4
                    ),
                    what=f"re-registration {restart}",
                )
                await kubelet.allocate(GPU, 1, pod=f"p{restart}")
                kubelet.release(f"p{restart}")
                # The stream-end path too: the plugin ends its stream, then registers again.
                plugin.push(None)
                await kubelet.wait_for(lambda k: not k.resources[GPU].connected)
                await plugin.register()
                await kubelet.wait_for(lambda k: k.resources[GPU].allocatable == 4)
                if restart == 9:
                    baseline = (_fds(), threading.active_count(), _os_threads())
            assert baseline is not None
            assert _fds() <= baseline[0] + 2, (baseline, _fds())
            assert threading.active_count() <= baseline[1]
            assert _os_threads() <= baseline[2] + 2, (baseline, _os_threads())
            assert len(kubelet._tasks) == 1  # only the current stream
        finally:
            await kubelet.stop()
            await plugin.stop()
        assert kubelet._tasks == set()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert not [t for t in others if "list_and_watch" in repr(t)]

    run(scenario(), timeout=90)


# --- allocation --------------------------------------------------------------------------------


def test_allocate_sends_one_container_request_and_records_it(short_dir, run):
    async def scenario():
        kubelet, plugin = await started(short_dir, pre_start=True)
        try:
            result = await kubelet.allocate(GPU, 2, pod="p1", namespace="ns", container="c")
            allocates = [req for name, req in plugin.calls if name == "Allocate"]
            assert len(allocates) == 1 and len(allocates[0].container_requests) == 1
            assert list(allocates[0].container_requests[0].devices_ids) == result.device_ids
            assert result.response.envs["IDS"] == ",".join(result.device_ids)
            assert result.numa_nodes == {0} and result.affinity == frozenset({0})
            assert result.preferred is None  # option off: never asked
            assert "GetPreferredAllocation" not in plugin.names()
            pre_starts = [req for name, req in plugin.calls if name == "PreStartContainer"]
            assert [list(r.devices_ids) for r in pre_starts] == [result.device_ids]
            assert kubelet.allocations == [("ns", "p1", "c", GPU, result.device_ids)]

            # Ids in use by another container are not candidates.
            second = await kubelet.allocate(GPU, 2, pod="p2")
            assert not set(second.device_ids) & set(result.device_ids)
            with pytest.raises(AllocationError, match="Requested: 1, Available: 0"):
                await kubelet.allocate(GPU, 1, pod="p3")

            # Asking again for an admitted container is a restart: PreStart only.
            again = await kubelet.allocate(GPU, 2, pod="p1", namespace="ns", container="c")
            assert again is result
            assert plugin.names().count("Allocate") == 2
            assert plugin.names().count("PreStartContainer") == 3
            with pytest.raises(AllocationError, match="changed request"):
                await kubelet.allocate(GPU, 1, pod="p1", namespace="ns", container="c")

            kubelet.release("p1", namespace="ns")  # no RPC, the ids are free again
            assert kubelet.in_use(GPU) == set(second.device_ids)
            third = await kubelet.allocate(GPU, 2, pod="p3")
            assert set(third.device_ids) == set(result.device_ids)
        finally:
            await kubelet.stop()
            await plugin.stop()

    run(scenario())


def test_allocate_failures_carry_the_plugin_status(short_dir, run):
    async def scenario():
        kubelet, plugin = await started(short_dir, pre_start=True, preferred=True)
        try:
            plugin.fail["Allocate"] = grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(AllocationError) as err:
                await kubelet.allocate(GPU, 1, pod="a")
            assert (err.value.stage, err.value.code) == (
                "allocate",
                grpc.StatusCode.INVALID_ARGUMENT,
            )
            assert err.value.details == "Allocate refused by the test"
            assert "which is unexpected" in str(err.value)
            assert kubelet.allocations == []
            del plugin.fail["Allocate"]

            plugin.empty_allocate = True
            with pytest.raises(AllocationError, match="no containers return"):
                await kubelet.allocate(GPU, 1, pod="a")
            plugin.empty_allocate = False

            plugin.fail["GetPreferredAllocation"] = grpc.StatusCode.UNIMPLEMENTED
            with pytest.raises(AllocationError) as err:
                await kubelet.allocate(GPU, 1, pod="a")
            assert err.value.stage == "preferred"
            assert plugin.names().count("Allocate") == 2  # admission failed before Allocate
            del plugin.fail["GetPreferredAllocation"]

            # A failed PreStartContainer fails the start, not the allocation.
            plugin.fail["PreStartContainer"] = grpc.StatusCode.UNAVAILABLE
            with pytest.raises(AllocationError) as err:
                await kubelet.allocate(GPU, 1, pod="a")
            assert (err.value.stage, err.value.code) == ("pre_start", grpc.StatusCode.UNAVAILABLE)
            assert len(kubelet.allocations) == 1

            with pytest.raises(AllocationError, match="unregistered"):
                await kubelet.allocate("example.com/none", 1)
            with pytest.raises(ValueError):
                await kubelet.allocate(GPU, 0)
        finally:
            await kubelet.stop()
            await plugin.stop()

    run(scenario())


def test_preferred_allocation_inside_the_numa_affinity(short_dir, run):
    async def scenario():
        kubelet, plugin = await started(short_dir, preferred=True)
        try:
            # One device: affinity {0}; two aligned candidates, so the plugin chooses.
            plugin.preferred_answer = ["g1"]
            first = await kubelet.allocate(GPU, 1, pod="a")
            name, request = plugin.calls[-2]
            assert name == "GetPreferredAllocation" and len(request.container_requests) == 1
            req = request.container_requests[0]
            assert list(req.available_deviceIDs) == ["g0", "g1"]
            assert list(req.must_include_deviceIDs) == [] and req.allocation_size == 1
            assert first.device_ids == ["g1"] and first.preferred == ["g1"]

            # Node 0 has one free device left, node 1 two: a pair goes to node 1, and
            # exactly two aligned ids leave nothing to choose (no preferred call).
            calls = len(plugin.calls)
            second = await kubelet.allocate(GPU, 2, pod="b")
            assert second.affinity == frozenset({1}) and sorted(second.device_ids) == ["g2", "g3"]
            assert [n for n, _ in plugin.calls[calls:]] == ["Allocate"]
        finally:
            await kubelet.stop()
            await plugin.stop()

    run(scenario())


def test_preferred_answer_outside_the_candidates_is_ignored_and_the_shortfall_filled(
    short_dir, run
):
    async def scenario():
        devices = [device(f"d{i}") for i in range(4)]  # no topology at all
        kubelet, plugin = await started(short_dir, preferred=True, devices=devices)
        try:
            await kubelet.allocate(GPU, 1, pod="a")  # takes d0 (the plugin's default answer)
            plugin.preferred_answer = ["d0", "bogus", "d3"]
            result = await kubelet.allocate(GPU, 2, pod="b")
            req = plugin.calls[-2][1].container_requests[0]
            assert list(req.available_deviceIDs) == ["d1", "d2", "d3"]
            assert result.device_ids == ["d3", "d1"]  # d3 kept, d0/bogus dropped, d1 filled
            assert result.numa_nodes == set() and result.affinity is None
        finally:
            await kubelet.stop()
            await plugin.stop()

    run(scenario())


def test_short_aligned_set_is_taken_whole_and_the_plugin_picks_the_rest(short_dir, run):
    async def scenario():
        devices = [device("g0", [0]), device("g1", [1]), device("x"), device("y")]
        kubelet, plugin = await started(short_dir, preferred=True, devices=devices)
        try:
            plugin.preferred_answer = ["y", "g0"]
            result = await kubelet.allocate(GPU, 3)
            # No NUMA mask holds three: best-effort admits with every node, takes both aligned
            # ids as must-include and offers all candidates for the third.
            assert result.affinity == frozenset({0, 1})
            req = plugin.calls[-2][1].container_requests[0]
            assert list(req.available_deviceIDs) == ["g0", "g1", "x", "y"]
            assert list(req.must_include_deviceIDs) == ["g0", "g1"]
            assert req.allocation_size == 3
            assert result.device_ids == ["g0", "g1", "y"] and result.preferred == ["y", "g0"]
        finally:
            await kubelet.stop()
            await plugin.stop()

    run(scenario())


def test_single_numa_node_policy_rejects_what_does_not_fit_one_node(short_dir, run):
    async def scenario():
        kubelet, plugin = await started(short_dir, topology_policy="single-numa-node")
        try:
            with pytest.raises(AllocationError) as err:
                await kubelet.allocate(GPU, 3)
            assert err.value.stage == "topology" and "TopologyAffinityError" in str(err.value)
            assert "Allocate" not in plugin.names()
            result = await kubelet.allocate(GPU, 2)
            assert result.affinity == frozenset({0})
            # Node 0 is full, node 1 has two: a second pair still fits one node.
            assert (await kubelet.allocate(GPU, 2, pod="q")).affinity == frozenset({1})
        finally:
            await kubelet.stop()
            await plugin.stop()

    run(scenario())


def test_machine_numa_nodes_and_policy_none(short_dir, run):
    async def scenario():
        devices = [device("a", [1]), device("b", [1]), device("c"), device("d", [-1])]
        kubelet, plugin = await started(short_dir, devices=devices, numa_nodes=[0, 1])
        try:
            # Two machine nodes, devices only on node 1: one id is aligned to {1}.
            result = await kubelet.allocate(GPU, 1)
            assert result.affinity == frozenset({1}) and result.device_ids == ["a"]
            # Three ids: node 1 has two, the rest come from the topology-less ones.
            result = await kubelet.allocate(GPU, 3, pod="p2")
            assert result.device_ids == ["b", "c", "d"] and result.numa_nodes == {1}
            assert result.device_numa == {"b": (1,), "c": (), "d": (-1,)}
        finally:
            await kubelet.stop()
            await plugin.stop()
        kubelet, plugin = await started(short_dir, devices=devices, topology_policy="none")
        try:
            assert (await kubelet.allocate(GPU, 1)).affinity is None
        finally:
            await kubelet.stop()
            await plugin.stop()

    run(scenario())


# --- raw calls and waiting ---------------------------------------------------------------------


def test_raw_calls_do_no_bookkeeping(short_dir, run):
    async def scenario():
        kubelet, plugin = await started(short_dir, preferred=True, pre_start=True)
        try:
            reply = await kubelet.call_allocate(GPU, [["g0"], ["g1", "g2"]])
            assert [r.envs["IDS"] for r in reply.container_responses] == ["g0", "g1,g2"]
            reply = await kubelet.call_preferred(GPU, ["g0", "g1", "g2"], ["g2"], 2)
            assert list(reply.container_responses[0].deviceIDs) == ["g2", "g0"]
            await kubelet.call_pre_start(GPU, ["g3"])
            assert kubelet.allocations == [] and kubelet.in_use(GPU) == set()
            plugin.fail["Allocate"] = grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await kubelet.call_allocate(GPU, [["g0"]])
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(NotRegisteredError):
                await kubelet.call_allocate("example.com/none", [["x"]])
        finally:
            await kubelet.stop()
            await plugin.stop()

    run(scenario())


def test_wait_for_times_out_with_a_summary(short_dir, run):
    async def scenario():
        kubelet, plugin = await started(short_dir)
        try:
            loop = asyncio.get_running_loop()
            begun = loop.time()
            with pytest.raises(TimeoutError) as err:
                await kubelet.wait_for(
                    lambda k: k.resources["example.com/x"].capacity == 9, timeout=0.1, what="nine x"
                )
            assert 0.1 <= loop.time() - begun < 1.0
            text = str(err.value)
            assert "nine x" in text and f"{GPU}: connected" in text and "healthy=4" in text
        finally:
            await kubelet.stop()
            await plugin.stop()

    run(scenario())


def test_wait_for_wakes_on_the_event_not_on_a_poll(short_dir, run):
    async def scenario():
        kubelet, plugin = await started(short_dir)
        try:
            loop = asyncio.get_running_loop()
            calls = 0

            def predicate(k: KubeletSimulator) -> bool:
                nonlocal calls
                calls += 1
                return k.resources[GPU].allocatable == 1

            loop.call_later(0.3, plugin.push, [device("only")])
            await kubelet.wait_for(predicate, timeout=3)
            assert calls <= 4  # checked at the start and on each change, not in a loop
        finally:
            await kubelet.stop()
            await plugin.stop()

    run(scenario())


# --- topology functions ------------------------------------------------------------------------


def test_hints_prefer_the_narrowest_mask_all_devices_could_fill():
    all_devices = [(0,), (0,), (1,), (1,)]
    hints = dict(topology_hints([0, 1], all_devices, [(0,), (1,), (1,)], 2))
    assert hints == {frozenset({1}): True, frozenset({0, 1}): False}
    assert merge_hints(list(hints.items()), [0, 1], "best-effort") == (frozenset({1}), True)
    # Fragmented: only the pair of nodes fits, and it is not preferred.
    hints2 = topology_hints([0, 1], all_devices, [(0,), (1,)], 2)
    assert hints2 == [(frozenset({0, 1}), False)]
    assert merge_hints(hints2, [0, 1], "best-effort") == (frozenset({0, 1}), False)
    assert merge_hints(hints2, [0, 1], "single-numa-node") == (frozenset({0, 1}), False)
    # Not enough devices at all: no hint, the default affinity, not preferred.
    assert topology_hints([0, 1], all_devices, [(0,)], 2) == []
    assert merge_hints([], [0, 1], "best-effort") == (frozenset({0, 1}), False)
    # Equal widths: the lower node wins.
    both = [(frozenset({1}), True), (frozenset({0}), True)]
    assert merge_hints(both, [0, 1], "best-effort") == (frozenset({0}), True)


def test_split_by_affinity_buckets():
    numa = {"a": (0,), "b": (1,), "c": (), "d": (-1,), "e": (1, 0), "f": (-1, 3)}
    aligned, unaligned, without = split_by_affinity(list(numa), numa, frozenset({0}))
    assert (aligned, unaligned, without) == (["a", "e"], ["b", "f"], ["c", "d"])
