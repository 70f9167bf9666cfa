"""The timers that rescan: changes that send no event of their own, or whose event may be
lost. Each keeps one timer (or one per driver) in the host's ``Background``."""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Optional, Sequence, Set

from host.core.model import ResourceConfig
from host.core.tasks import Background

Rescan = Callable[[Optional[Iterable[str]]], None]


class SafetyRescan:
    """Every driver again every ``rescan_interval_s`` (0: never)."""

    def __init__(self, background: Background, interval_s: Callable[[], float],
                 rescan: Rescan) -> None:
        self._background = background
        self._interval_s = interval_s
        self._rescan = rescan

    def arm(self) -> None:
        interval = self._interval_s()
        if interval <= 0 or self._background.closed:
            return
        self._background.later("safety rescan", interval, self._fire)

    def _fire(self) -> None:
        self._rescan(None)
        self.arm()


class HealthChecks:
    """One timer per driver, at its resources' shortest ``health_interval_s``: a rescan
    covers every resource of the driver, so a timer per resource would rescan it N times."""

    def __init__(self, background: Background, rescan: Rescan) -> None:
        self._background = background
        self._rescan = rescan
        self._drivers: Set[str] = set()

    def arm(self, resources: Sequence[ResourceConfig]) -> None:
        """(Re)arm for these resources; drivers no longer checked lose their timer."""
        wanted: Dict[str, float] = {}
        for r in resources:
            if r.health_interval_s > 0:
                wanted[r.driver] = min(wanted.get(r.driver, r.health_interval_s),
                                       r.health_interval_s)
        for name in self._drivers - set(wanted):
            self._background.cancel(("health", name))
        self._drivers = set(wanted)
        for driver, interval in wanted.items():
            self._background.later(("health", driver), interval, self._check, driver,
                                   interval)

    def _check(self, driver: str, interval: float) -> None:
        if self._background.closed:
            return
        self._rescan([driver])
        self._background.later(("health", driver), interval, self._check, driver, interval)


class Expiry:
    """A rescan when the first vanished device's grace ends (``next_expiry``: seconds from
    now, None when none is pending)."""

    def __init__(self, background: Background, next_expiry: Callable[[], Optional[float]],
                 rescan: Rescan) -> None:
        self._background = background
        self._next_expiry = next_expiry
        self._rescan = rescan

    def arm(self) -> None:
        delay = self._next_expiry()
        self._background.cancel("expiry")
        if delay is not None and not self._background.closed:
            self._background.later("expiry", delay + 0.01, self._rescan, [])
