"""Serving and registering each resource with the kubelet, and keeping it registered.

Each resource has an Endpoint that converges on one goal: *a live socket of ours in the plugin
directory, served, and registered with the kubelet instance that owns kubelet.sock now*. File
system events (our socket deleted by someone else, a new kubelet.sock) and the end of the
kubelet's own ListAndWatch stream only mark endpoints dirty; the endpoint's reconcile loop does
the rest. A new kubelet (a new kubelet.sock identity) gets a fresh server on a fresh socket
name: the old server is stopped (closing its stream) before the new one registers, which avoids
the kubelet's same-name races and the grpcio unlink-on-stop race.

Retries: a failed Register is retried on the same server after a jittered,
doubling backoff, and nothing but a new kubelet identity cuts that backoff short; events
caused by our own socket changes never wake a registration. After a connect failure the next
attempts first check with a plain connect() that the socket accepts at all, so a dead
kubelet's left-over socket costs no Register calls while it is down.

The kubelet's socket identity and channels are in host/kubelet/link.py, the plain-socket
checks in host/kubelet/socket_probe.py.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import stat
import time
from typing import Callable, Dict, List, Optional

import grpc

from host.core.inotify import DirectoryWatch
from host.core.tasks import cancel_and_wait
from host.kubelet.link import RETIRE_AFTER_S, KubeletId, KubeletLink
from host.kubelet.protocol import KUBELET_SOCKET, VERSION, api
from host.kubelet.service import SERVER_OPTIONS, DevicePluginService
from host.kubelet.socket_names import GRPC_MAX_SOCKET_PATH, socket_file_name
from host.kubelet.socket_probe import PluginDirError, bind_problem, dir_problem

log = logging.getLogger(__name__)

__all__ = ["RETIRE_AFTER_S", "Endpoint", "KubeletLink", "Registrar", "socket_file_name"]

MAX_SOCKET_PATH = GRPC_MAX_SOCKET_PATH
BACKOFF_START_S = 0.05
BACKOFF_MAX_S = 5.0
SERVER_STOP_GRACE_S = 0.05  # streams run forever: grace only lets a unary call finish
STREAM_END_GRACE_S = 0.05
#: errno values that say the process (not the directory or the kubelet) is short of something
SHORT_OF = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS))
NO_KUBELET_RECHECK_S = 10.0  # while kubelet.sock is missing, besides the directory watch


def _jitter(salt: int) -> float:
    """A number in [0, 1) that spreads retries: the clock's nanoseconds and ``salt`` through
    a multiplicative hash. No import and no fd: the retry path runs when fds are exhausted,
    where importing ``random`` there fails (EMFILE)."""
    return (((time.monotonic_ns() ^ salt) * 2654435761) & 0xFFFFFFFF) / 4294967296.0


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
        self.registrations = 0  # Register calls made (each failed one counts too)
        self.last_error: Optional[str] = None
        self._dirty = asyncio.Event()
        self._task: Optional[asyncio.Task] = None
        self._retry: Optional[asyncio.TimerHandle] = None
        self._backoff = BACKOFF_START_S
        self._salt = hash(self.name)  # differs per resource and per process
        self._not_before = 0.0  # monotonic: no Register to the same kubelet before this
        self._closing = False
        self._server_kid: Optional[KubeletId] = None  # the kubelet this server registered with
        self._last_kid: Optional[KubeletId] = None
        self._connect_failed_for: Optional[KubeletId] = None
        # The kubelet's own stream is the first ListAndWatch opened on the current
        # server after our Register went out; only its end means "registering again".
        self._claim_open = False
        self._kubelet_stream: Optional[object] = None
        self._on_registered = on_registered
        service.on_stream_start = self._stream_started
        service.on_stream_end = self._stream_ended
        self.quick_until = 0.0  # until then a stream ended by the kubelet re-registers at once

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
        """A directory event. Our own socket appearing (or an old one of ours vanishing) is
        our doing and wakes nothing; our current socket gone, kubelet.sock
        changing or the directory itself coming or going does."""
        ours_gone = self.socket_name in (names or ()) and not self._socket_alive()
        if names is None or KUBELET_SOCKET in names or ours_gone:
            self.poke()

    async def close(self) -> None:
        """Stop serving and remove our socket (the server unlinks it on stop)."""
        self._closing = True
        if self._retry is not None:
            self._retry.cancel()
        await cancel_and_wait(self._task)
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
            except PluginDirError as error:
                why, name = error.args
                self.link.dir_state(why, f" (creating socket {name}); retrying with backoff")
                self._schedule_retry(f"cannot create socket {name}: {why}", quiet=True)
            except Exception as error:  # keep the loop alive whatever happens
                try:
                    if isinstance(error, OSError) and error.errno in SHORT_OF:
                        # The process ran out of fds or memory: one line for all resources
                        # (the link's), and every resource retries until it works.
                        why = error.strerror or str(error)
                        self.link.short_of(why)
                        self._schedule_retry(why, quiet=True)
                    else:
                        log.exception("resource %s: reconcile failed", self.name)
                        self._schedule_retry(f"{type(error).__name__}: {error}")
                except Exception:  # logging itself failed (EMFILE, ENOMEM): retry anyway
                    self._arm_retry(BACKOFF_MAX_S)

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
        missing = dir_problem(self.link.plugin_dir)
        if missing:
            # Waiting for it: the directory watch wakes us when it appears; the backoff
            # retry is the safety net.
            self.link.dir_state(missing, "; waiting for it")
            if self.server is not None:
                await self._stop_server()
            self.registered_with = None
            self._schedule_retry(f"plugin directory {missing}", quiet=True)
            return
        if not self._socket_alive():
            if self.server is not None:
                log.info("resource %s: socket %s was removed; serving anew", self.name,
                         self.socket_name)
            await self._serve_fresh()
        kid = self.link.identity()
        if kid is None:
            self.registered_with = None
            # No kubelet yet: a new kubelet.sock pokes us through the directory watch; the
            # slow recheck covers an event that never comes (a directory replaced under a
            # watch the kernel could not move).
            if self._retry is None or self._retry.cancelled() or \
                    self._retry.when() <= asyncio.get_running_loop().time():
                self._arm_retry(NO_KUBELET_RECHECK_S)
            return
        if kid != self._last_kid:
            # A new kubelet deserves a prompt first try: the only thing that cuts a backoff.
            self._last_kid = kid
            self._backoff = BACKOFF_START_S
            self._not_before = 0.0
            self._connect_failed_for = None
        if self.registered_with == kid:
            return
        wait = self._not_before - time.monotonic()
        if wait > 0:
            self._arm_retry(wait)  # a poke during the backoff: keep the announced time
            return
        if self._server_kid is not None and self._server_kid != kid:
            # A new kubelet: a fresh server for it, so no stale stream of the old one
            # outlives the new registration (the kubelet's same-name race).
            await self._serve_fresh()
        if self._connect_failed_for == kid:
            why = self.link.accepts()
            self.link.kubelet_state(why or "")
            if why is not None:
                self._schedule_retry(f"{self.link.socket_path} does not accept connections"
                                     f" ({why}); waiting for the kubelet", quiet=True)
                return
        await self._register(kid)

    async def _serve_fresh(self) -> None:
        await self._stop_server()
        self.generation += 1
        name = socket_file_name(self.name, self.token, self.generation)
        path = os.path.join(self.link.plugin_dir, name)
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise OSError(f"socket path {path!r} is longer than {MAX_SOCKET_PATH} bytes")
        if os.path.lexists(path):  # never bind over something planted at our path
            os.unlink(path)
        if not self.link.bind_checked():
            why = bind_problem(path)
            if why is not None:
                self.link.bound(False)
                raise PluginDirError(why, name)
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *SERVER_OPTIONS])
        server.add_generic_rpc_handlers((self.service.handler(self.generation),))
        # The socket is born 0600 (only root, the kubelet, dials it). grpc binds inside
        # add_insecure_port, synchronously, so the umask change never spans an await where
        # other coroutines could run (and save/restore it out of order).
        old_umask = os.umask(0o077)
        try:
            bound = server.add_insecure_port(f"unix://{path}")
        except RuntimeError:  # grpcio >= 1.55 raises where older releases returned 0
            bound = 0
        finally:
            os.umask(old_umask)
        if bound == 0:
            # The directory changed since the last bind vouched for it: the probe names why.
            self.link.bound(False)
            why = bind_problem(path)
            raise PluginDirError(why or "could not bind", name)
        self.link.bound(True)
        # Kept before the await: a close() arriving during start() must find and stop it.
        self.server = server
        self.socket_name = name
        self._server_kid = None
        self._kubelet_stream = None
        self._claim_open = False
        await server.start()
        os.chmod(path, 0o600)
        self._socket_inode = os.lstat(path).st_ino
        self.registered_with = None
        self.link.dir_state("")
        if self.link.on_dir_usable is not None:
            self.link.on_dir_usable()
        log.debug("resource %s: serving on %s", self.name, path)

    async def _stop_server(self) -> None:
        server, self.server = self.server, None
        self.registered_with = None
        self._server_kid = None
        self._kubelet_stream = None
        self._claim_open = False
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
        self._server_kid = kid
        # A Register on a server the kubelet already streams from (new options, a retry)
        # makes the kubelet replace that stream, and its end may come before or after the new
        # one opens: from now on the old stream's end is expected, not a reason to register
        # again (it made one extra registration per option change, depending on timing).
        self._kubelet_stream = None
        self._claim_open = True  # the next stream on this server is the kubelet's
        self.registrations += 1
        try:
            await self.link.register(kid, request)
        except grpc.aio.AioRpcError as error:
            # "Maybe registered": the kubelet may hold a stream of ours; a retry on the same
            # server simply replaces it (the kubelet keys by name; the old stream stays ours).
            # A failure is most often a kubelet going away ("context canceled", "connection
            # is closing", refused): check its socket accepts before the next attempt.
            self._connect_failed_for = kid
            self._claim_open = False  # a stream opened from now on is not that Register's
            self._schedule_retry(f"Register failed: {error.code().name}: {error.details()}")
            return
        except asyncio.CancelledError:
            if self._closing:
                raise
            self._schedule_retry("Register was cancelled: the kubelet's channel was replaced")
            return
        self.registered_with = kid
        self.last_error = None
        self.link.kubelet_state("")  # a "kubelet is down" line is followed by one "back" line
        self.link.short_of("")
        if self._retry is not None:  # an earlier failure's retry has nothing left to do
            self._retry.cancel()
            self._retry = None
        self._backoff = BACKOFF_START_S
        self._not_before = 0.0
        self._connect_failed_for = None
        log.info("resource %s: registered with the kubelet as %s (%.1f ms)", self.name,
                 self.socket_name, (time.monotonic() - started) * 1000)
        if self._on_registered is not None:
            self._on_registered(self)

    def _schedule_retry(self, reason: str, quiet: bool = False) -> None:
        """Retry after a jittered, doubling backoff. Runs when resources are short (no fd
        left, no memory for a new socket): it allocates nothing that can run out (no
        import, no file, no socket), and a failure here still arms a retry (``_run``)."""
        self.last_error = reason
        delay = self._backoff * (0.5 + _jitter(self._salt))
        self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
        self._not_before = time.monotonic() + delay
        # quiet: the cause is logged once for all resources by the link; details at DEBUG.
        level = logging.DEBUG if quiet else logging.WARNING
        log.log(level, "resource %s: %s; retrying in %.2f s", self.name, reason, delay)
        self._arm_retry(delay)

    def _arm_retry(self, delay: float) -> None:
        if self._retry is not None:
            self._retry.cancel()
        self._retry = asyncio.get_running_loop().call_later(delay, self.poke)

    def _stream_started(self, generation: object, stream: object) -> None:
        if generation == self.generation and self._claim_open:
            self._claim_open = False
            self._kubelet_stream = stream

    def _stream_ended(self, generation: object, stream: object) -> None:
        if self._closing or generation != self.generation or self.server is None:
            return  # our own server stopping, or an older generation
        if stream is not self._kubelet_stream:
            log.debug("resource %s: a ListAndWatch client other than the kubelet hung up",
                      self.name)
            return
        self._kubelet_stream = None
        log.info("resource %s: the kubelet closed ListAndWatch; registering again", self.name)
        # Usually the kubelet is stopping (its Stop ends the streams before the listener): a
        # moment's grace, then a check that its socket still accepts, before a Register that
        # would only fail (and be logged) once per resource.
        self._connect_failed_for = self.registered_with
        self.registered_with = None
        # While an older host hands over, its stream's end makes kubelets up to 1.36 (clients
        # keyed by resource name) close ours: the kubelet is there, so register again at once.
        grace = 0.0 if time.monotonic() < self.quick_until else STREAM_END_GRACE_S
        self._not_before = time.monotonic() + grace
        self._arm_retry(grace)


class Registrar:
    """Watches the plugin directory and fans its events out to every endpoint."""

    def __init__(self, plugin_dir: str, register_timeout_s: float) -> None:
        self.link = KubeletLink(plugin_dir, register_timeout_s)
        self.token = f"{os.getpid():x}{os.urandom(2).hex()}"
        self.endpoints: Dict[str, Endpoint] = {}
        self._watch = DirectoryWatch(plugin_dir, self._on_dir_change)
        self.on_registered: Optional[Callable[[Endpoint], None]] = None
        self.quick_until = 0.0

    def start(self) -> None:
        self._watch.start()

    def expect_hand_over(self, seconds: float) -> None:
        """An older host is about to stop its servers: for ``seconds``, a ListAndWatch the
        kubelet ends is registered again without the usual grace (the kubelet is up; on
        1.36 the older host's stream end closes ours)."""
        self.quick_until = time.monotonic() + seconds
        for endpoint in self.endpoints.values():
            endpoint.quick_until = self.quick_until

    def add(self, service: DevicePluginService) -> Endpoint:
        endpoint = Endpoint(service, self.link, self.token, self._registered)
        endpoint.quick_until = self.quick_until
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
