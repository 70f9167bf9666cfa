"""systemd notification (Type=notify): READY once every resource is registered, watchdog pings.

The protocol is a datagram to $NOTIFY_SOCKET; no libsystemd needed. Outside systemd (no
NOTIFY_SOCKET) every call is a no-op, so the host runs the same everywhere.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Mapping, Optional

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, environ: Optional[dict] = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):  # abstract namespace
            address = "\0" + address[1:]
        self.address = address or None
        self.watchdog_s = self._watchdog_interval(env)
        self._timer: Optional[asyncio.TimerHandle] = None
        self._ready_sent = False

    @staticmethod
    def _watchdog_interval(env: Mapping[str, str]) -> Optional[float]:
        usec = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        if not usec or (pid and pid != str(os.getpid())):
            return None
        try:
            value = int(usec)
        except ValueError:
            return None
        return value / 1e6 if value > 0 else None

    def send(self, *states: str) -> bool:
        if not self.address:
            return False
        message = "\n".join(states).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(self.address)
                sock.sendall(message)
            return True
        except OSError as error:
            log.warning("systemd notify to %s failed: %s", self.address, error)
            return False

    def ready(self, status: str) -> None:
        """READY=1 once per process; later calls only update the status line."""
        if self._ready_sent:
            self.status(status)
            return
        self._ready_sent = True
        self.send("READY=1", f"STATUS={status}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status}")

    def stopping(self) -> None:
        self.send("STOPPING=1")

    def start_watchdog(self) -> None:
        """Ping at half the interval systemd expects; the pings ride the event loop, so a
        wedged loop (the thing worth restarting for) stops them."""
        interval = self.watchdog_s
        if interval is None or not self.address:
            return
        loop = asyncio.get_running_loop()

        def ping() -> None:
            self.send("WATCHDOG=1")
            self._timer = loop.call_later(interval / 2, ping)

        ping()

    def stop_watchdog(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
