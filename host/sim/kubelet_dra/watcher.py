"""The kubelet's plugin watcher and registration handlers, as unkind as pkg/kubelet/pluginmanager.

Written from upstream's code: ``pluginwatcher/plugin_watcher.go`` (creates the directory,
walks it at start, fsnotify create/remove afterwards, names starting with "." and non-sockets
ignored), ``operationexecutor/operation_generator.go`` (dial 10 s blocking, GetInfo with a 1 s
deadline, handler chosen by ``PluginInfo.type``, empty endpoint means the registration socket,
ValidatePlugin, then RegisterPlugin, then NotifyRegistrationStatus with 5 s; every failure is
notified with plugin_registered=false and retried), ``nestedpendingoperations`` (retry backoff
0.5 s doubling up to 2 min 2 s), ``reconciler`` (a re-created socket is deregistered and
registered again), and the handlers: ``cm/dra/plugin/dra_plugin_manager.go`` (supported
versions: the *plugin's* first entry the kubelet supports; "endpoint already registered") and
the device manager's ``plugin/v1beta1/handler.go`` (versions must include v1beta1, the name
must be an extended resource name).
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import grpc

from host.core.inotify import DirectoryWatch
from host.core.resource_name import resource_name_error
from host.kubelet.protocol import pluginregistration_v1_pb2 as reg_api
from host.kubelet.protocol import pluginregistration_v1_pb2_grpc as registration_grpc

log = logging.getLogger(__name__)

DIAL_TIMEOUT_S = 10.0
GET_INFO_TIMEOUT_S = 1.0
NOTIFY_TIMEOUT_S = 5.0
RETRY_START_S = 0.5
RETRY_MAX_S = 122.0
#: cm/dra/plugin: servicesSupportedByKubelet (1.34+).
KUBELET_DRA_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
DEVICE_PLUGIN_VERSIONS = ("v1beta1",)


class ValidationError(Exception):
    pass


@dataclass
class RegisteredPlugin:
    type: str
    name: str
    endpoint: str
    socket_path: str  # the registration socket it came from
    chosen_service: str  # DRA: "v1.DRAPlugin" or "v1beta1.DRAPlugin"; device plugins: version
    inode: int = 0  # of the registration socket: a new inode is a new socket (fsnotify Create)
    supported: Tuple[str, ...] = ()  # PluginInfo.supported_versions as the plugin sent them
    registered_at: float = field(default_factory=time.monotonic)


@dataclass
class _Pending:
    attempts: int = 0
    task: Optional[asyncio.Task] = None
    last_error: str = ""


class PluginWatcher:
    """Watches one registry directory and keeps ``plugins`` as the kubelet would."""

    def __init__(
        self,
        registry_dir: str,
        *,
        get_info_timeout_s: float = GET_INFO_TIMEOUT_S,
        on_register: Optional[Callable[[RegisteredPlugin], None]] = None,
        on_deregister: Optional[Callable[[RegisteredPlugin], None]] = None,
    ) -> None:
        self.registry_dir = registry_dir
        self.get_info_timeout_s = get_info_timeout_s
        self.plugins: Dict[str, RegisteredPlugin] = {}  # socket path -> plugin
        self.errors: List[str] = []
        self.attempts = 0
        self._pending: Dict[str, _Pending] = {}
        self._watch: Optional[DirectoryWatch] = None
        self._on_register = on_register
        self._on_deregister = on_deregister
        self._changed = asyncio.Event()
        self._stopped = False

    async def start(self) -> None:
        self._stopped = False
        os.makedirs(self.registry_dir, mode=0o755, exist_ok=True)
        self._watch = DirectoryWatch(self.registry_dir, self._dir_changed)
        self._watch.start()
        self._walk()

    async def stop(self) -> None:
        self._stopped = True
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        tasks = [p.task for p in self._pending.values() if p.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._pending.clear()
        self.plugins.clear()

    def by_name(self, plugin_type: str, name: str) -> Optional[RegisteredPlugin]:
        """The most recent registration of a name (the DRA manager prefers the newest)."""
        found = [p for p in self.plugins.values() if p.type == plugin_type and p.name == name]
        return max(found, key=lambda p: p.registered_at) if found else None

    async def wait_for(self, predicate: Callable[[PluginWatcher], bool], timeout: float = 10.0,
                       what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not predicate(self):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"plugin watcher: timed out waiting for {what}; "
                                   f"errors: {self.errors[-3:]}")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                pass

    # -- events -----------------------------------------------------------------------------
    def _walk(self) -> None:
        try:
            names = os.listdir(self.registry_dir)
        except OSError:
            return
        for name in names:
            self._consider(os.path.join(self.registry_dir, name))

    def _dir_changed(self, names: Optional[List[str]]) -> None:
        if self._stopped:
            return
        if names is None:
            self._walk()
            for path in list(self.plugins):
                if not _is_socket(path):
                    self._deregister(path)
            return
        for name in names:
            path = os.path.join(self.registry_dir, name)
            if _is_socket(path):
                self._consider(path)
            elif path in self.plugins or path in self._pending:
                self._deregister(path)

    def _consider(self, path: str) -> None:
        name = os.path.basename(path)
        if name.startswith(".") or not _is_socket(path):
            return
        if path in self._pending and self._pending[path].task is not None:
            task = self._pending[path].task
            if task is not None and not task.done():
                return  # an attempt is under way; it reads the socket afresh
        known = self.plugins.get(path)
        if known is not None:
            if known.inode == _inode(path):
                return  # an attribute change, not a new socket
            self._deregister(path)  # the reconciler: a new timestamp means unregister first
        pending = self._pending.setdefault(path, _Pending())
        pending.task = asyncio.get_running_loop().create_task(self._register_loop(path, pending))

    def _deregister(self, path: str) -> None:
        pending = self._pending.pop(path, None)
        if pending is not None and pending.task is not None:
            pending.task.cancel()
        plugin = self.plugins.pop(path, None)
        if plugin is not None:
            log.info("plugin watcher: %s %s deregistered", plugin.type, plugin.name)
            if self._on_deregister is not None:
                self._on_deregister(plugin)
            self._changed.set()

    async def _register_loop(self, path: str, pending: _Pending) -> None:
        delay = RETRY_START_S
        while not self._stopped and _is_socket(path):
            pending.attempts += 1
            self.attempts += 1
            try:
                plugin = await self._register_once(path)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                message = f"RegisterPlugin error at socket {path}: {error}"
                pending.last_error = message
                self.errors.append(message)
                self._changed.set()
                await asyncio.sleep(delay)  # upstream's exponential backoff between attempts
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            self.plugins[path] = plugin
            self._pending.pop(path, None)
            if self._on_register is not None:
                self._on_register(plugin)
            self._changed.set()
            return

    async def _register_once(self, path: str) -> RegisteredPlugin:
        inode = _inode(path)
        channel = grpc.aio.insecure_channel(f"unix://{path}",
                                            options=[("grpc.enable_http_proxy", 0)])
        try:
            try:
                await asyncio.wait_for(channel.channel_ready(), DIAL_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise ValidationError(f"dial failed at socket {path}") from None
            stub = registration_grpc.RegistrationStub(channel)
            try:
                info = await stub.GetInfo(reg_api.InfoRequest(),
                                          timeout=self.get_info_timeout_s)
            except grpc.aio.AioRpcError as error:
                raise ValidationError(f"failed to get plugin info using RPC GetInfo: "
                                      f"{error.code().name}: {error.details()}") from None
            endpoint = info.endpoint or path
            try:
                chosen = self._validate(info, endpoint)
                plugin = RegisteredPlugin(info.type, info.name, endpoint, path, chosen,
                                          inode=inode,
                                          supported=tuple(info.supported_versions))
                self._check_register(plugin)
            except ValidationError as error:
                await self._notify(stub, False, f"plugin validation failed with err: {error}")
                raise
            await self._notify(stub, True, "")
            return plugin
        finally:
            await channel.close()

    def _validate(self, info: reg_api.PluginInfo, endpoint: str) -> str:
        versions: Sequence[str] = list(info.supported_versions)
        if info.type == "DRAPlugin":
            if not versions:
                raise ValidationError("empty list of supported gRPC services (aka supported "
                                      "versions)")
            for service in versions:  # the plugin's order decides
                if service in KUBELET_DRA_SERVICES:
                    return service
            raise ValidationError(f"none of services supported by the plugin ({versions}) are "
                                  f"supported by the kubelet ({list(KUBELET_DRA_SERVICES)})")
        if info.type == "DevicePlugin":
            chosen = next((v for v in versions if v in DEVICE_PLUGIN_VERSIONS), None)
            if chosen is None:
                raise ValidationError(f"manager version, v1beta1, is not among plugin "
                                      f"supported versions {versions}")
            problem = resource_name_error(info.name)
            if problem is not None:
                raise ValidationError(f"invalid name of device plugin socket: {problem}")
            return chosen
        raise ValidationError(f"no handler registered for plugin type: {info.type}")

    def _check_register(self, plugin: RegisteredPlugin) -> None:
        for other in self.plugins.values():
            if (other.type == plugin.type and other.name == plugin.name
                    and other.endpoint == plugin.endpoint):
                raise ValidationError(f"endpoint {plugin.endpoint} already registered for "
                                      f"{plugin.type} plugin {plugin.name}")

    async def _notify(self, stub: registration_grpc.RegistrationStub, ok: bool,
                      error: str) -> None:
        try:
            await stub.NotifyRegistrationStatus(
                reg_api.RegistrationStatus(plugin_registered=ok, error=error),
                timeout=NOTIFY_TIMEOUT_S)
        except grpc.aio.AioRpcError as failure:
            raise ValidationError(f"failed to send registration status: "
                                  f"{failure.code().name}: {failure.details()}") from None


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


def _inode(path: str) -> int:
    try:
        return os.lstat(path).st_ino
    except OSError:
        return 0
