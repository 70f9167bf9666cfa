"""Serving and registering each resource with the kubelet, and keeping it registered.

Each resource has an Endpoint that converges on one goal: *a live socket of ours in the plugin
directory, served, and registered with the kubelet instance that owns kubelet.sock now*. File
system events (our socket deleted, a new kubelet.sock) and a ListAndWatch stream ended by the
kubelet only mark endpoints dirty; the endpoint's reconcile loop does the rest. Every
registration gets a fresh server on a fresh socket name: the old server is stopped (closing its
stream) before the new one registers, which avoids the kubelet's same-name races (facts §3.4)
and the grpcio unlink-on-stop race (facts §8).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import random
import re
import stat
import time
from typing import Callable, Dict, List, Optional, Set, Tuple

import grpc

from host.inotify import DirectoryWatch
from host.protocol import KUBELET_SOCKET, VERSION, api, api_grpc
from host.service import DevicePluginService

log = logging.getLogger(__name__)

KubeletId = Tuple[int, int]  # (inode, ctime_ns) of kubelet.sock: a new kubelet, a new id
MAX_SOCKET_PATH = 107
BACKOFF_START_S = 0.05
BACKOFF_MAX_S = 5.0
SERVER_STOP_GRACE_S = 0.05  # streams run forever: grace only lets a unary call finish


def socket_file_name(resource: str, token: str, generation: int) -> str:
    """A bare, unique, short socket file name: readable prefix, hash for uniqueness."""
    digest = hashlib.sha1(resource.encode()).hexdigest()[:8]
    readable = re.sub(r"[^A-Za-z0-9]+", "-", resource).strip("-")[:32]
    return f"dph-{readable}-{digest}-{token}-{generation}.sock"


class KubeletLink:
    """What the host knows about the kubelet: its socket's identity and one shared channel."""

    def __init__(self, plugin_dir: str, register_timeout_s: float) -> None:
        self.plugin_dir = plugin_dir
        self.socket_path = os.path.join(plugin_dir, KUBELET_SOCKET)
        self.register_timeout_s = register_timeout_s
        self._channel: Optional[grpc.aio.Channel] = None
        self._channel_for: Optional[KubeletId] = None
        self.restarts_seen = 0
        self._last_id: Optional[KubeletId] = None
        self._retired: List[grpc.aio.Channel] = []
        self._closing_tasks: Set[asyncio.Future] = set()

    def identity(self) -> Optional[KubeletId]:
        try:
            st = os.stat(self.socket_path)
        except OSError:
            return None
        if not stat.S_ISSOCK(st.st_mode):
            return None
        kid = (st.st_ino, st.st_ctime_ns)
        if self._last_id is not None and kid != self._last_id:
            self.restarts_seen += 1
        self._last_id = kid
        return kid

    async def register(self, kid: KubeletId, request: api.RegisterRequest) -> None:
        if self._channel_for != kid or self._channel is None:
            old = self._channel
            self._channel = grpc.aio.insecure_channel(
                f"unix://{self.socket_path}", options=[("grpc.enable_http_proxy", 0)]
            )
            self._channel_for = kid
            if old is not None:
                # Calls still on the old channel belong to a kubelet that is gone; give them
                # a moment to fail on their own instead of cancelling them under their caller.
                self._retired.append(old)
                asyncio.get_running_loop().call_later(1.0, self._close_retired, old)
        channel = self._channel
        stub = api_grpc.RegistrationStub(channel)
        await stub.Register(request, timeout=self.register_timeout_s)

    def _close_retired(self, channel: grpc.aio.Channel) -> None:
        if channel in self._retired:
            self._retired.remove(channel)
            self._closing_tasks.add(asyncio.ensure_future(channel.close()))
            self._closing_tasks = {t for t in self._closing_tasks if not t.done()}

    async def close(self) -> None:
        channel, self._channel, self._channel_for = self._channel, None, None
        retired, self._retired = self._retired, []
        for old in [*retired, channel]:
            if old is not None:
                await old.close()


class Endpoint:
    """One resource's server generations and its registration state."""

    def __init__(
        self,
        service: DevicePluginService,
        link: KubeletLink,
        token: str,
        on_registered: Optional[Callable[[Endpoint], None]] = None,
    ) -> None:
        self.service = service
        self.link = link
        self.token = token
        self.name = service.resource.name
        self.generation = 0
        self.server: Optional[grpc.aio.Server] = None
        self.socket_name: Optional[str] = None
        self._socket_inode: Optional[int] = None
        self.registered_with: Optional[KubeletId] = None
        self.registrations = 0
        self.last_error: Optional[str] = None
        self._dirty = asyncio.Event()
        self._task: Optional[asyncio.Task] = None
        self._retry: Optional[asyncio.TimerHandle] = None
        self._backoff = BACKOFF_START_S
        self._closing = False
        self._server_used = False
        self._last_kid: Optional[KubeletId] = None
        self._on_registered = on_registered
        service.on_stream_end = self._stream_ended

    @property
    def socket_path(self) -> Optional[str]:
        return os.path.join(self.link.plugin_dir, self.socket_name) if self.socket_name else None

    @property
    def registered(self) -> bool:
        return self.registered_with is not None and self.server is not None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run(), name=f"endpoint {self.name}")
        self.poke()

    def poke(self) -> None:
        """Something changed: re-check the socket and the registration."""
        self._dirty.set()

    def socket_event(self, names: Optional[List[str]]) -> None:
        if names is None or KUBELET_SOCKET in names or (self.socket_name in names):
            self.poke()

    async def close(self) -> None:
        """Stop serving and remove our socket (the server unlinks it on stop)."""
        self._closing = True
        if self._retry is not None:
            self._retry.cancel()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self._stop_server()

    # -- the reconcile loop ----------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self._reconcile()
            except asyncio.CancelledError:
                if self._closing:
                    raise
                # grpc.aio raises CancelledError for a call whose channel was closed under it
                # (the kubelet's channel replaced after a restart): not our cancellation, so
                # the loop must live on, or this resource would never register again.
                self._schedule_retry("a kubelet call was cancelled under us")
            except Exception as error:  # keep the loop alive whatever happens
                log.exception("resource %s: reconcile failed", self.name)
                self._schedule_retry(f"{type(error).__name__}: {error}")

    def _socket_alive(self) -> bool:
        path = self.socket_path
        if self.server is None or path is None:
            return False
        try:
            st = os.lstat(path)
        except OSError:
            return False
        return stat.S_ISSOCK(st.st_mode) and st.st_ino == self._socket_inode

    async def _reconcile(self) -> None:
        if self._closing:
            return
        if not os.path.isdir(self.link.plugin_dir):
            if self.server is not None:
                log.warning("resource %s: plugin directory %s is gone; waiting for it",
                            self.name, self.link.plugin_dir)
                await self._stop_server()
            self.registered_with = None
            return
        if not self._socket_alive():
            if self.server is not None:
                log.info("resource %s: socket %s was removed; serving anew", self.name,
                         self.socket_name)
            await self._serve_fresh()
        kid = self.link.identity()
        if kid is None:
            self.registered_with = None
            return  # no kubelet yet: a new kubelet.sock will poke us
        if kid != self._last_kid:
            self._last_kid = kid
            self._backoff = BACKOFF_START_S  # a new kubelet deserves a prompt first try
        if self.registered_with == kid:
            return
        if self._server_used:
            # A new kubelet, the old one dropped our stream, or a Register that may have half
            # worked: a fresh server for the new registration, so no stale stream outlives it.
            await self._serve_fresh()
        await self._register(kid)

    async def _serve_fresh(self) -> None:
        await self._stop_server()
        self.generation += 1
        name = socket_file_name(self.name, self.token, self.generation)
        path = os.path.join(self.link.plugin_dir, name)
        if len(path) > MAX_SOCKET_PATH:
            raise OSError(f"socket path {path!r} is longer than {MAX_SOCKET_PATH} bytes")
        if os.path.lexists(path):  # never bind over something planted at our path
            os.unlink(path)
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers((self.service.handler(self.generation),))
        # The socket is born 0600 (only root, the kubelet, dials it). grpc binds inside
        # add_insecure_port, synchronously, so the umask change never spans an await where
        # other coroutines could run (and save/restore it out of order).
        old_umask = os.umask(0o077)
        try:
            bound = server.add_insecure_port(f"unix://{path}")
        finally:
            os.umask(old_umask)
        if bound == 0:
            raise OSError(f"could not bind {path}")
        # Kept before the await: a close() arriving during start() must find and stop it.
        self.server = server
        self.socket_name = name
        await server.start()
        os.chmod(path, 0o600)
        self._server_used = False
        self._socket_inode = os.lstat(path).st_ino
        self.registered_with = None
        log.debug("resource %s: serving on %s", self.name, path)

    async def _stop_server(self) -> None:
        server, self.server = self.server, None
        self.registered_with = None
        if server is not None:
            await server.stop(SERVER_STOP_GRACE_S)

    async def _register(self, kid: KubeletId) -> None:
        request = api.RegisterRequest(
            version=VERSION,
            endpoint=self.socket_name or "",
            resource_name=self.name,
            options=self.service.options,
        )
        started = time.monotonic()
        self._server_used = True
        try:
            await self.link.register(kid, request)
        except grpc.aio.AioRpcError as error:
            # "Maybe registered": the retry runs on a fresh server, so it is harmless.
            self.registrations += 1
            self._schedule_retry(f"Register failed: {error.code().name}: {error.details()}")
            return
        except asyncio.CancelledError:
            if self._closing:
                raise
            self._schedule_retry("Register was cancelled: the kubelet's channel was replaced")
            return
        self.registrations += 1
        self.registered_with = kid
        self.last_error = None
        self._backoff = BACKOFF_START_S
        log.info("resource %s: registered with the kubelet as %s (%.1f ms)", self.name,
                 self.socket_name, (time.monotonic() - started) * 1000)
        if self._on_registered is not None:
            self._on_registered(self)

    def _schedule_retry(self, reason: str) -> None:
        self.last_error = reason
        delay = self._backoff * (0.5 + random.random())
        self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
        log.warning("resource %s: %s; retrying in %.2f s", self.name, reason, delay)
        if self._retry is not None:
            self._retry.cancel()
        self._retry = asyncio.get_running_loop().call_later(delay, self.poke)

    def _stream_ended(self, generation: object) -> None:
        if self._closing or generation != self.generation or self.server is None:
            return  # our own server stopping, or an older generation
        log.info("resource %s: the kubelet closed ListAndWatch; registering again", self.name)
        self.registered_with = None
        self.poke()


class Registrar:
    """Watches the plugin directory and fans its events out to every endpoint."""

    def __init__(self, plugin_dir: str, register_timeout_s: float) -> None:
        self.link = KubeletLink(plugin_dir, register_timeout_s)
        self.token = f"{os.getpid():x}{random.getrandbits(16):04x}"
        self.endpoints: Dict[str, Endpoint] = {}
        self._watch = DirectoryWatch(plugin_dir, self._on_dir_change)
        self.on_registered: Optional[Callable[[Endpoint], None]] = None

    def start(self) -> None:
        self._watch.start()

    def add(self, service: DevicePluginService) -> Endpoint:
        endpoint = Endpoint(service, self.link, self.token, self._registered)
        self.endpoints[endpoint.name] = endpoint
        endpoint.start()
        return endpoint

    async def remove(self, name: str) -> None:
        endpoint = self.endpoints.pop(name, None)
        if endpoint is not None:
            await endpoint.close()

    def all_registered(self) -> bool:
        return all(endpoint.registered for endpoint in self.endpoints.values())

    def _registered(self, endpoint: Endpoint) -> None:
        if self.on_registered is not None:
            self.on_registered(endpoint)

    def _on_dir_change(self, names: Optional[List[str]]) -> None:
        for endpoint in self.endpoints.values():
            endpoint.socket_event(names)

    async def close(self) -> None:
        self._watch.close()
        await asyncio.gather(*(ep.close() for ep in self.endpoints.values()))
        self.endpoints.clear()
        await self.link.close()
