"""What the host knows about the kubelet: its socket's identity and one channel per identity.

A new kubelet.sock (a restarted kubelet) is a new identity: it gets a fresh gRPC channel, and
the old one is retired a moment later (a Register in flight on it may still finish). Why a
fresh channel with a local subchannel pool: see CHANNEL_OPTIONS.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from typing import Callable, List, Optional, Set, Tuple

import grpc

from host.core.health import TransitionLog
from host.kubelet.protocol import KUBELET_SOCKET, api, api_grpc
from host.kubelet.socket_probe import accepts

log = logging.getLogger("host.kubelet.registration")  # the lines operators know

KubeletId = Tuple[int, int]  # (inode, ctime_ns) of kubelet.sock: a new kubelet, a new id
RETIRE_AFTER_S = 1.0
# How long a successful bind vouches for the plugin directory (KubeletLink.bind_checked): long
# enough to cover every resource of one start or kubelet restart, short enough that a
# directory going read-only or full later is probed again (and told in one line).
BIND_CHECK_VALID_S = 1.0

# After a Register failed to connect (the kubelet stopping, its dead socket left
# behind), that subchannel sits in reconnect backoff and keeps retrying on its own; by default a
# new channel to the same target shares it through gRPC's *global* subchannel pool, so the new
# kubelet's first Register fails fast ("connect failed") until that backoff runs out
# (benchmarks/reconnect_probe.py compares the alternatives). Hence a fresh channel per kubelet
# identity with a local subchannel pool. It removes the
# cause (no connection state shared with a dead kubelet's channel, whatever the other args),
# costs no reconnect traffic while the kubelet is down, and needs no grpc-internal arg hack.
CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0), ("grpc.use_local_subchannel_pool", 1)]


class KubeletLink:
    """What the host knows about the kubelet: its socket's identity and one channel per
    kubelet identity (see CHANNEL_OPTIONS for why)."""

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
        self._retire_timers: List[asyncio.TimerHandle] = []  # owned: cancelled by close()
        # Shared by every endpoint: a plugin_dir problem is one line, not one per resource.
        self.dir_log = TransitionLog(log)
        # Called whenever one of our sockets was just bound in the plugin directory (so it
        # exists and is writable): the host's single-instance lock waits for that moment when
        # the directory was missing or read-only at start.
        self.on_dir_usable: Optional[Callable[[], None]] = None
        # When one of our sockets was last bound here (monotonic): see bind_checked.
        self._bound_at = float("-inf")

    def bind_checked(self) -> bool:
        """Whether a socket of ours was bound in the plugin directory a moment ago, so a new
        one needs no plain-socket probe first (host/kubelet/socket_probe.py bind_problem). The probe
        exists for the one-line reason of a directory that cannot take sockets, and costs
        as much as the bind itself (an inode created and removed); once a bind of the burst
        succeeded, the directory takes sockets."""
        return time.monotonic() - self._bound_at < BIND_CHECK_VALID_S

    def bound(self, ok: bool) -> None:
        """A bind in the plugin directory succeeded (or failed: probe again next time)."""
        self._bound_at = time.monotonic() if ok else float("-inf")

    def dir_state(self, problem: str, detail: str = "") -> None:
        """Log the plugin directory's state once per change (problem "" = usable)."""
        self.dir_log.update(
            "plugin_dir", problem,
            f"plugin directory {self.plugin_dir}: {problem}{detail}",
            f"plugin directory {self.plugin_dir} is usable again",
        )

    def short_of(self, problem: str) -> None:
        """The process ran out of file descriptors or memory serving or registering (problem
        "" = a socket could be made again); told once per change, for every resource."""
        self.dir_log.update(
            "short_of", problem,
            f"cannot serve or register every resource: {problem} (the process's fd limit, "
            "RLIMIT_NOFILE / LimitNOFILE=, or memory); each is retried with backoff",
            "resources can be served again: the ones that could not are being retried",
        )

    def kubelet_state(self, problem: str) -> None:
        self.dir_log.update(
            "kubelet", problem,
            f"{self.socket_path} does not accept connections ({problem}): the kubelet is"
            " down; waiting for it",
            f"{self.socket_path} accepts connections again: a kubelet is back",
        )

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

    def accepts(self) -> Optional[str]:
        """Why kubelet.sock does not accept connections now (None: it does)."""
        return accepts(self.socket_path)

    def _channel_of(self, kid: KubeletId) -> grpc.aio.Channel:
        if self._channel_for != kid or self._channel is None:
            self._retire()
            self._channel = grpc.aio.insecure_channel(
                f"unix://{self.socket_path}", options=CHANNEL_OPTIONS
            )
            self._channel_for = kid
        return self._channel

    def _retire(self) -> None:
        old, self._channel, self._channel_for = self._channel, None, None
        if old is not None:
            # Calls still on the old channel belong to a kubelet that is gone; give them
            # a moment to fail on their own instead of cancelling them under their caller.
            self._retired.append(old)
            self._retire_timers.append(asyncio.get_running_loop().call_later(
                RETIRE_AFTER_S, self._close_retired, old))

    async def register(self, kid: KubeletId, request: api.RegisterRequest) -> None:
        channel = self._channel_of(kid)
        stub = api_grpc.RegistrationStub(channel)
        try:
            await stub.Register(request, timeout=self.register_timeout_s)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNAVAILABLE and channel is self._channel:
                # The connection itself failed: drop the channel so its subchannel stops
                # reconnecting in the background; the next attempt dials anew.
                self._retire()
            raise

    def _close_retired(self, channel: grpc.aio.Channel) -> None:
        self._retire_timers = [t for t in self._retire_timers if not t.cancelled()
                               and t.when() > asyncio.get_running_loop().time()]
        if channel in self._retired:
            self._retired.remove(channel)
            self._closing_tasks.add(asyncio.ensure_future(channel.close()))
            self._closing_tasks = {t for t in self._closing_tasks if not t.done()}

    async def close(self) -> None:
        for timer in self._retire_timers:  # the retired channels are closed right here
            timer.cancel()
        self._retire_timers = []
        channel, self._channel, self._channel_for = self._channel, None, None
        retired, self._retired = self._retired, []
        for old in [*retired, channel]:
            if old is not None:
                await old.close()
        if self._closing_tasks:
            await asyncio.gather(*self._closing_tasks, return_exceptions=True)
