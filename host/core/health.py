"""Health state the host keeps across scans: problem transitions logged once, AER counters.

Each check names its cause, so a device's ``health_reason`` tells the operator what to fix,
and every check is re-evaluated on each scan: an Unhealthy device comes back Healthy as soon as
its cause clears (peers that never let a device recover are a common complaint). Checks that
need state across scans (AER error counters *rising*) live in ``AerTracker`` on the host side;
drivers stay stateless. Checks that only one driver understands live in that driver (a PF's
link state in drivers/sriov, RDMA port states in drivers/rdma).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, Hashable, Iterable, NamedTuple, Optional, Set, Tuple

from host.core.hostfs import HostFS


class TransitionLog:
    """Logs a condition when it starts and when it clears, never again while it lasts.

    Health is re-evaluated on every scan (each ``health_interval_s``, each uevent); logging
    each scan's verdict would repeat one warning per VF per scan per resource. Keyed by what the
    condition is about (a PF, a resource's VF), so one PF
    down is one line however many VFs and resources it affects. Thread-safe: scans run in
    the driver's worker thread.
    """

    def __init__(self, logger: logging.Logger) -> None:
        self._log = logger
        self._active: Dict[Hashable, str] = {}
        self._lock = threading.Lock()

    def update(self, key: Hashable, problem: str, message: str, cleared: str = "") -> None:
        """``problem`` is the condition now ("" when fine); ``message``/``cleared`` are logged
        (WARNING / INFO) when it appears or changes / when it clears."""
        with self._lock:
            before = self._active.get(key, "")
            if problem == before:
                return
            if problem:
                self._active[key] = problem
            else:
                del self._active[key]
        if problem:
            self._log.warning("%s", message)
        elif cleared:
            self._log.info("%s", cleared)

    def retain(self, keys: Iterable[Hashable]) -> None:
        """Forget conditions about things that are gone (a removed VF logs nothing more)."""
        keep = set(keys)
        with self._lock:
            for key in [k for k in self._active if k not in keep]:
                del self._active[key]

    @property
    def active(self) -> Dict[Hashable, str]:
        with self._lock:
            return dict(self._active)


class AerCounts(NamedTuple):
    fatal: int
    nonfatal: int


def read_aer(host: HostFS, pci_address: str) -> Optional[AerCounts]:
    """The function's AER totals (``TOTAL_ERR_FATAL``/``TOTAL_ERR_NONFATAL``), or None where
    the kernel has no AER statistics for it."""
    totals = []
    for name, key in (("aer_dev_fatal", "TOTAL_ERR_FATAL"),
                      ("aer_dev_nonfatal", "TOTAL_ERR_NONFATAL")):
        text = host.read(f"/sys/bus/pci/devices/{pci_address}/{name}")
        if text is None:
            return None
        value = None
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == key and parts[1].isascii() and parts[1].isdigit():
                value = int(parts[1])
        if value is None:
            return None
        totals.append(value)
    return AerCounts(*totals)


class AerTracker:
    """Turns cumulative AER counters into "errors since the last check".

    A device whose fatal or non-fatal count rose since the previous check is Unhealthy for at
    least ``hold_s`` after that check (the resource's health interval), then until a check
    sees no new errors: old errors from boot time never condemn a device forever, and a rise
    stays visible for a whole interval however many scans (events, reloads, the safety
    rescan) come in between.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last: Dict[Tuple[str, str], AerCounts] = {}
        self._risen: Dict[Tuple[str, str], Tuple[float, str]] = {}  # when, and the problem

    def problem(self, resource: str, pci_address: str, counts: Optional[AerCounts],
                hold_s: float = 0.0) -> str:
        key = (resource, pci_address)
        if counts is None:
            self._last.pop(key, None)
            self._risen.pop(key, None)
            return ""
        before = self._last.get(key)
        self._last[key] = counts
        rises = []
        if before is not None and counts.fatal > before.fatal:
            rises.append(f"fatal {before.fatal}->{counts.fatal}")
        if before is not None and counts.nonfatal > before.nonfatal:
            rises.append(f"non-fatal {before.nonfatal}->{counts.nonfatal}")
        now = self._clock()
        if rises:
            problem = f"PCIe AER errors rising on {pci_address} ({', '.join(rises)})"
            self._risen[key] = (now, problem)
            return problem
        risen = self._risen.get(key)
        if risen is not None and now - risen[0] < hold_s:
            return risen[1]
        self._risen.pop(key, None)
        return ""

    def retain(self, resource: str, addresses: Iterable[str]) -> None:
        """Drop the counters of the resource's functions not in ``addresses`` (gone from the
        host, no longer selected, or the resource stopped checking): without this, every
        function ever seen kept its entry for the life of the process."""
        keep = set(addresses)
        for key in [k for k in self._last if k[0] == resource and k[1] not in keep]:
            del self._last[key]
        for key in [k for k in self._risen if k[0] == resource and k[1] not in keep]:
            del self._risen[key]

    def tracked(self) -> Set[Tuple[str, str]]:
        """(resource, pci address) pairs with counters kept, for tests and debugging."""
        return set(self._last)
