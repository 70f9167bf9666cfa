"""Device events: the kernel's uevents (and rtnetlink for "net") turned into coalesced
rescans of the drivers whose subsystems changed."""

from __future__ import annotations

import logging
from typing import Callable, Iterable, List, Optional, Set, Union

from host.core.tasks import Background
from host.triggers.uevents import EventSource, RescanScheduler, device_events

log = logging.getLogger("host.app")  # the lines operators know

#: The kernel's uevent monitor (pyudev: an import and an ``ldconfig -p`` run to find
#: libudev) is armed a moment after every resource is registered, or this long after start
#: if that takes longer: registration is what the kubelet waits for. Not in the registration
#: callback itself: the kubelet opens ListAndWatch right after Register returns, and a loop
#: busy arming would hold back that first snapshot. A rescan right after arming catches
#: whatever was plugged, unplugged or changed since the first scan.
EVENTS_AT_THE_LATEST_S = 0.5
EVENTS_AFTER_READY_S = 0.05


class DeviceEvents:
    """``spec``: "udev" for the kernel's uevents, an EventSource (tests inject events), or
    None for none (the safety rescan still runs). ``subsystems``: the subsystems of the
    drivers in use; ``drivers_for``: the drivers a subsystem's event concerns; ``rescan``:
    rescan those drivers (None: all)."""

    def __init__(self, spec: Union[str, EventSource, None], background: Background,
                 subsystems: Callable[[], Set[str]],
                 drivers_for: Callable[[str], Set[str]],
                 rescan: Callable[[Optional[Iterable[str]]], None],
                 rescan_interval_s: Callable[[], float]) -> None:
        self._spec = spec
        self._background = background
        self._subsystems = subsystems
        self._rescan = rescan
        self._rescan_interval_s = rescan_interval_s
        self.scheduler = RescanScheduler(drivers_for, rescan, background=background)
        #: The source listening now; None before it starts, or when it could not.
        self.source: Optional[EventSource] = None

    def arm(self, on_ready: List[Callable[[], None]]) -> None:
        """Start the source: the real one after registration (``on_ready``), an injected one
        at once."""
        if self._spec != "udev":
            self._start()
            return
        armed = False

        def arm() -> None:
            nonlocal armed
            if armed or self._background.closed:
                return
            armed = True
            self._start()
            if self.source is not None:
                self._rescan(None)  # what changed before the monitor listened

        on_ready.append(
            lambda: self._background.later("arm device events", EVENTS_AFTER_READY_S, arm))
        self._background.later("arm device events", EVENTS_AT_THE_LATEST_S, arm)

    def _start(self) -> None:
        spec = self._spec
        if spec is None:
            return
        if spec == "udev":
            subsystems = self._subsystems()
            if not subsystems:
                return
            source: EventSource = device_events(subsystems)  # + rtnetlink for "net"
        elif isinstance(spec, str):
            raise ValueError(f"unknown event source {spec!r}")
        else:
            source = spec
        try:
            source.start(self.scheduler.event)
        except Exception as error:
            log.debug("event source failed to start", exc_info=True)
            log.warning("device events unavailable (%s); relying on the safety rescan every "
                        "%g s", error, self._rescan_interval_s())
            return
        self.source = source

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
        self.scheduler.close()
