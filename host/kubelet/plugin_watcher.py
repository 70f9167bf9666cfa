"""Registration through the kubelet's plugin watcher, kept alive across kubelet restarts.

The plugin watcher (pkg/kubelet/pluginmanager) finds ``*.sock`` files in
``/var/lib/kubelet/plugins_registry`` by fsnotify and by walking the directory when it starts,
dials each (10 s), calls ``GetInfo`` (1 s deadline), validates the answer with the handler of
``PluginInfo.type`` and calls ``NotifyRegistrationStatus`` (5 s). Deleting the registration
socket deregisters the plugin. So each plugin here converges on one goal: *its service socket
served, then its registration socket served*, in that order, because a registration whose
endpoint does not answer yet makes the kubelet's first calls fail with Unavailable and gRPC's
reconnect backoff delays recovery by seconds. A wiped or replaced socket of ours is
noticed by inotify and served again; a new service socket also gets a fresh registration
socket, whose create event makes the kubelet register the new endpoint at once.

The same endpoint serves DRA drivers (type "DRAPlugin", the DRA service on
``<plugins>/<driver>/dra.sock``) and device plugins configured with
``registration = "plugin-watcher"`` (type "DevicePlugin", name = resource name, versions
["v1beta1"], as the device manager's ValidatePlugin expects).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import stat
import time
from typing import Callable, List, Optional, Sequence

import grpc

from host.core.inotify import DirectoryWatch
from host.core.tasks import cancel_and_wait
from host.kubelet import socket_names
from host.kubelet.protocol import pluginregistration_v1_pb2 as reg_api
from host.kubelet.protocol import pluginregistration_v1_pb2_grpc as registration_grpc
from host.kubelet.socket_names import MAX_SOCKET_PATH
from host.kubelet.socket_probe import accepts

log = logging.getLogger(__name__)

BACKOFF_START_S = 0.05
BACKOFF_MAX_S = 5.0
SERVER_STOP_GRACE_S = 0.05

HandlersFor = Callable[[int], Sequence[grpc.GenericRpcHandler]]


def registration_socket_name(plugin_name: str) -> str:
    """``<driver>-reg.sock``, the name the kubelet-plugin helper library uses; a name that
    starts with "." would be ignored by the plugin watcher, so it is never produced."""
    return socket_names.registration_socket_file("", plugin_name)


def remove_dead_instances(registry_dir: str, plugin_name: str, service_dir: str, stem: str,
                          keep: Sequence[str]) -> List[str]:
    """Sockets of earlier instances of this plugin that nothing serves any more (a host killed
    with SIGKILL cannot remove its own): ``<name>[-<id>]-reg.sock`` in ``registry_dir`` and
    the service sockets in ``service_dir`` named ``<stem>[-<id>].sock``. A
    socket that accepts a connection belongs to a live instance and is never touched, nor
    is anything in ``keep``. Returns the paths removed."""
    name = socket_names.registration_socket_file("", plugin_name)[: -len("-reg.sock")]
    found: List[str] = []
    for directory, match in (
        (registry_dir, lambda f: f == f"{name}-reg.sock" or (
            f.startswith(f"{name}-") and f.endswith("-reg.sock")
            and socket_names.instance_id({"POD_UID": f[len(name) + 1:-len("-reg.sock")]}) != "")),
        (service_dir, lambda f: socket_names.is_instance_socket(f, stem)),
    ):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for file_name in names:
            path = os.path.join(directory, file_name)
            if path in keep or not match(file_name):
                continue
            try:
                if not stat.S_ISSOCK(os.lstat(path).st_mode) or accepts(path) is None:
                    continue
                os.unlink(path)
            except OSError:
                continue
            found.append(path)
    if found:
        log.info("removed %d socket%s of earlier %s instances that nothing serves: %s",
                 len(found), "" if len(found) == 1 else "s", plugin_name, ", ".join(found))
    return found


class _ServedSocket:
    """One grpc.aio server on one fixed path, with the inode that proves the file is ours."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.server: Optional[grpc.aio.Server] = None
        self.inode: Optional[int] = None
        self.generation = 0

    def alive(self) -> bool:
        if self.server is None:
            return False
        try:
            st = os.lstat(self.path)
        except OSError:
            return False
        return stat.S_ISSOCK(st.st_mode) and st.st_ino == self.inode

    async def serve(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        # The old server is stopped before the path is bound again: grpc unlinks its socket
        # path on stop, which would otherwise remove the new server's socket.
        await self.stop()
        if len(self.path) > MAX_SOCKET_PATH:
            raise OSError(f"socket path {self.path!r} is longer than {MAX_SOCKET_PATH} bytes")
        os.makedirs(os.path.dirname(self.path), mode=0o750, exist_ok=True)
        if os.path.lexists(self.path):  # a stale socket of an earlier process, or a plant
            os.unlink(self.path)
        self.generation += 1
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers(tuple(handlers))
        old_umask = os.umask(0o077)  # born 0600: only root (the kubelet) dials it
        try:
            bound = server.add_insecure_port(f"unix://{self.path}")
        finally:
            os.umask(old_umask)
        if bound == 0:
            raise OSError(f"could not bind {self.path}")
        self.server = server
        await server.start()
        os.chmod(self.path, 0o600)
        self.inode = os.lstat(self.path).st_ino

    async def stop(self, grace_s: float = SERVER_STOP_GRACE_S) -> None:
        server, self.server = self.server, None
        if server is None:
            return
        try:
            await server.stop(grace_s)
        except asyncio.InvalidStateError:
            # grpc's stop of a server whose start() was cancelled half-way (the host stopped
            # while this endpoint was coming up): nothing is serving.
            log.debug("%s: stopped a server that had not finished starting", self.path)
        try:  # remove it if grpc did not, but never a socket someone else bound meanwhile
            if os.lstat(self.path).st_ino == self.inode:
                os.unlink(self.path)
        except OSError:
            pass


class _Registration(registration_grpc.RegistrationServicer):
    def __init__(self, endpoint: PluginWatcherEndpoint) -> None:
        self._endpoint = endpoint

    async def GetInfo(self, request: reg_api.InfoRequest,
                      context: grpc.aio.ServicerContext) -> reg_api.PluginInfo:
        return self._endpoint.info

    async def NotifyRegistrationStatus(
        self, request: reg_api.RegistrationStatus, context: grpc.aio.ServicerContext
    ) -> reg_api.RegistrationStatusResponse:
        self._endpoint._status(request.plugin_registered, request.error)
        return reg_api.RegistrationStatusResponse()


class PluginWatcherEndpoint:
    """One plugin's service socket and registration socket, and the loop that keeps them."""

    def __init__(
        self,
        info: reg_api.PluginInfo,
        registry_dir: str,
        handlers_for: HandlersFor,
        *,
        label: str = "",
        on_registered: Optional[Callable[[PluginWatcherEndpoint], None]] = None,
        instance: str = "",
    ) -> None:
        """``instance``: this process's instance id (host.dra.socket_names.instance_id); with one,
        the registration socket is ``<name>-<instance>-reg.sock`` so that an old and a new
        instance can be registered at once during an upgrade."""
        self.info = info
        self.name = info.name
        self.label = label or f"{info.type} {info.name}"
        self.registry_dir = registry_dir
        self.service = _ServedSocket(info.endpoint)
        self.registration = _ServedSocket(
            os.path.join(registry_dir,
                         socket_names.registration_socket_file(registry_dir, info.name, instance)))
        self._handlers_for = handlers_for
        self._on_registered = on_registered
        self._instance = instance
        self.registered = False
        self.ever_registered = False  # the kubelet has accepted this endpoint at least once
        self.last_error: Optional[str] = None
        self.registrations = 0
        self._dirty = asyncio.Event()
        self._task: Optional[asyncio.Task] = None
        self._retry: Optional[asyncio.TimerHandle] = None
        self._backoff = BACKOFF_START_S
        self._closing = False
        self._watches: List[DirectoryWatch] = []
        self._served_at = 0.0

    @property
    def socket_path(self) -> str:
        return self.service.path

    @property
    def registration_path(self) -> str:
        return self.registration.path

    def start(self) -> None:
        base = os.path.basename(self.service.path)
        tail = f"-{self._instance}.sock" if self._instance else ".sock"
        if base.endswith(tail):
            remove_dead_instances(self.registry_dir, self.name, os.path.dirname(
                self.service.path), base[: -len(tail)], (self.service.path,
                                                         self.registration.path))
        for directory in dict.fromkeys([self.registry_dir, os.path.dirname(self.service.path)]):
            watch = DirectoryWatch(directory, self._dir_changed)
            watch.start()
            self._watches.append(watch)
        self._task = asyncio.get_running_loop().create_task(self._run(),
                                                             name=f"plugin {self.label}")
        self.poke()

    def poke(self) -> None:
        self._dirty.set()

    def _dir_changed(self, names: Optional[List[str]]) -> None:
        ours = {os.path.basename(self.service.path), os.path.basename(self.registration.path)}
        if names is None or ours.intersection(names):
            self.poke()

    async def close(self, grace_s: float = SERVER_STOP_GRACE_S) -> None:
        """Deregister (the registration socket goes first), then stop the service, letting
        calls in flight finish for up to ``grace_s`` (a drain during an upgrade: the kubelet
        sends new calls to the newer instance once this one is deregistered)."""
        self._closing = True
        if self._retry is not None:
            self._retry.cancel()
        for watch in self._watches:
            watch.close()
        self._watches.clear()
        await cancel_and_wait(self._task)
        await self.registration.stop()
        await self.service.stop(grace_s)
        self.registered = False

    async def _run(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self._reconcile()
                self._backoff = BACKOFF_START_S
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the loop must outlive any one failure
                log.warning("%s: %s", self.label, error)
                self._schedule_retry(f"{type(error).__name__}: {error}")

    async def _reconcile(self) -> None:
        if self._closing:
            return
        fresh_service = False
        if not self.service.alive():
            if self.service.server is not None:
                log.info("%s: service socket %s was removed; serving anew", self.label,
                         self.service.path)
            await self.service.serve(self._handlers_for(self.service.generation + 1))
            fresh_service = True
        if fresh_service or not self.registration.alive():
            if self.registration.server is not None and not fresh_service:
                log.info("%s: registration socket %s was removed; serving anew", self.label,
                         self.registration.path)
            self.registered = False
            await self.registration.serve((_registration_handler(_Registration(self)),))
            self._served_at = time.monotonic()
            log.debug("%s: registration socket %s served", self.label, self.registration.path)

    def _status(self, registered: bool, error: str) -> None:
        self.registrations += 1
        self.registered = registered
        if registered:
            self.ever_registered = True
            self.last_error = None
            log.info("%s: registered with the kubelet's plugin watcher (%.1f ms after serving)",
                     self.label, (time.monotonic() - self._served_at) * 1000)
            if self._on_registered is not None:
                self._on_registered(self)
        else:
            # The kubelet retries with its own backoff; we only report why.
            self.last_error = error or "the kubelet refused the registration"
            log.error("%s: registration failed: %s", self.label, self.last_error)

    def _schedule_retry(self, reason: str) -> None:
        self.last_error = reason
        delay = self._backoff * (0.5 + random.random())
        self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
        if self._retry is not None:
            self._retry.cancel()
        self._retry = asyncio.get_running_loop().call_later(delay, self.poke)


def _registration_handler(servicer: _Registration) -> grpc.GenericRpcHandler:
    methods = {
        "GetInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetInfo,
            request_deserializer=reg_api.InfoRequest.FromString,
            response_serializer=reg_api.PluginInfo.SerializeToString,
        ),
        "NotifyRegistrationStatus": grpc.unary_unary_rpc_method_handler(
            servicer.NotifyRegistrationStatus,
            request_deserializer=reg_api.RegistrationStatus.FromString,
            response_serializer=reg_api.RegistrationStatusResponse.SerializeToString,
        ),
    }
    return grpc.method_handlers_generic_handler("pluginregistration.Registration", methods)


def dra_plugin_info(driver: str, endpoint: str, services: Sequence[str]) -> reg_api.PluginInfo:
    return reg_api.PluginInfo(type="DRAPlugin", name=driver, endpoint=endpoint,
                              supported_versions=list(services))


def device_plugin_info(resource: str, endpoint: str, version: str) -> reg_api.PluginInfo:
    return reg_api.PluginInfo(type="DevicePlugin", name=resource, endpoint=endpoint,
                              supported_versions=[version])
