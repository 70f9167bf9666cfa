"""Kernel device events on the event loop, turned into coalesced rescans of the drivers that care.

A uevent only *triggers* a rescan; the scan is the truth (events can be lost, reordered or
arrive before sysfs settles). pyudev's netlink monitor is non-blocking once started, so its
file descriptor goes straight to ``loop.add_reader``: no observer thread, no polling. Without
udevd (containers, minimal nodes) it listens to the kernel's own events.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Callable, Iterable, List, Optional, Protocol, Sequence, Set

from host.core.tasks import Background

log = logging.getLogger(__name__)
_TIMER = "event coalescing"

COALESCE_S = 0.004  # a hot-plug is a burst of events (device, interfaces, nodes): one rescan


class EventSource(Protocol):
    """Where device events come from; ``start`` hands each event's subsystem to ``emit``."""

    def start(self, emit: Callable[[str], None]) -> None: ...

    def close(self) -> None: ...


class UdevSource:
    """The kernel's (or udevd's) netlink uevents through pyudev, read on the loop."""

    def __init__(self, subsystems: Iterable[str], source: Optional[str] = None) -> None:
        self.subsystems = sorted(set(subsystems))
        # After udevd has processed an event its device nodes exist; without udevd, take the
        # kernel's events directly (the rescan tolerates nodes that appear a moment later).
        self.source = source or ("udev" if os.path.exists("/run/udev/control") else "kernel")
        self._monitor = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    def start(self, emit: Callable[[str], None]) -> None:
        import pyudev

        context = pyudev.Context()
        monitor = pyudev.Monitor.from_netlink(context, source=self.source)
        if self.source == "udev":  # kernel-source monitors cannot filter in the kernel
            for subsystem in self.subsystems:
                monitor.filter_by(subsystem)
        try:  # hot-plug bursts must not overflow; forcing the size needs CAP_NET_ADMIN
            monitor.set_receive_buffer_size(4 * 1024 * 1024)
        except OSError as error:
            log.debug("udev monitor: keeping the default receive buffer: %s", error)
        monitor.start()
        self._monitor = monitor
        self._loop = asyncio.get_running_loop()
        wanted = set(self.subsystems)

        def readable() -> None:
            while True:
                try:
                    device = monitor.poll(timeout=0)
                except Exception as error:  # ENOBUFS after a burst: events lost
                    log.warning("udev monitor: %s; rescanning everything", error)
                    emit("*")
                    return
                if device is None:
                    return
                subsystem = device.subsystem or ""
                if subsystem in wanted:
                    emit(subsystem)

        self._loop.add_reader(monitor.fileno(), readable)
        log.info("watching %s events for subsystems %s", self.source, ", ".join(self.subsystems))

    def close(self) -> None:
        if self._monitor is not None and self._loop is not None:
            self._loop.remove_reader(self._monitor.fileno())
            self._monitor = None


class CombinedSource:
    """Several sources feeding one scheduler; one that cannot start (no netlink permission,
    no pyudev) costs only its own events, and only all of them failing is an error."""

    def __init__(self, sources: Sequence[EventSource]) -> None:
        self.sources = list(sources)
        self._started: List[EventSource] = []

    def start(self, emit: Callable[[str], None]) -> None:
        failures = []
        for source in self.sources:
            try:
                source.start(emit)
            except Exception as error:
                failures.append(error)
                log.warning("%s unavailable: %s", type(source).__name__, error)
            else:
                self._started.append(source)
        if not self._started and failures:
            raise failures[0]

    def close(self) -> None:
        for source in self._started:
            source.close()
        self._started.clear()


def device_events(subsystems: Iterable[str]) -> EventSource:
    """uevents for the subsystems, plus rtnetlink link changes when a driver watches ``net``:
    link up/down has no uevent."""
    wanted = set(subsystems)
    udev = UdevSource(wanted)
    if "net" not in wanted:
        return udev
    from host.triggers.netlink import LinkSource

    return CombinedSource([udev, LinkSource()])


class InjectedSource:
    """A source tests (and the benchmarks) drive by hand: the one seam in event handling."""

    def __init__(self) -> None:
        self._emit: Optional[Callable[[str], None]] = None

    def start(self, emit: Callable[[str], None]) -> None:
        self._emit = emit

    def inject(self, subsystem: str) -> None:
        if self._emit is None:
            raise RuntimeError("the event source is not started")
        self._emit(subsystem)

    def close(self) -> None:
        self._emit = None


class RescanScheduler:
    """Collects events for a few milliseconds, then rescans only the drivers that watch them."""

    def __init__(
        self,
        drivers_for: Callable[[str], Set[str]],
        rescan: Callable[[Optional[Set[str]]], None],
        coalesce_s: float = COALESCE_S,
        background: Optional[Background] = None,
    ) -> None:
        # The coalescing timer belongs to the host's owner of background work.
        self._background = background if background is not None else Background("events")
        self._drivers_for = drivers_for
        self._rescan = rescan
        self._coalesce_s = coalesce_s
        self._pending: Set[str] = set()
        self._everything = False

    def event(self, subsystem: str) -> None:
        if subsystem == "*":
            self._everything = True
        else:
            drivers = self._drivers_for(subsystem)
            if not drivers:
                return
            self._pending |= drivers
        if not self._background.armed(_TIMER):
            self._background.later(_TIMER, self._coalesce_s, self._fire)

    def _fire(self) -> None:
        drivers: Optional[Set[str]] = None if self._everything else self._pending
        self._pending = set()
        self._everything = False
        self._rescan(drivers)

    def close(self) -> None:
        self._background.cancel(_TIMER)
