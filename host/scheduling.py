"""When the host looks again: the timers and watches that start rescans and re-syncs.

Five mechanisms, each for a change that sends no event of its own or whose event may be
lost: device events (udev, rtnetlink) coalesced by the RescanScheduler; the safety rescan
every ``rescan_interval_s``; the expiry of vanished devices at the end of their grace; health
checks per driver at its resources' shortest ``health_interval_s``; CDI specs deleted or not
written (a watch on the directory, and a retry with backoff for a full disk). Operator drain
marks are watched here too. Every timer is the HostApp's (``app.background``), so stop()
cancels them all before it removes any file.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Dict, List, Optional

from host.cdi import FILE_PREFIX
from host.drain import DrainError, read_drains
from host.inotify import DirectoryWatch
from host.watch import EventSource, device_events

if TYPE_CHECKING:
    from host.app import HostApp

log = logging.getLogger("host.app")  # the lines operators know


async def check_cdi(app: HostApp) -> None:
    """Write again every CDI spec that should be on disk and is not (a failed write, a
    file deleted by hand); cheap when all are there (one stat each). The stats and writes
    run in the CDI writer's thread, like every spec write (HostApp._write_specs)."""
    if app._stopped:
        return
    wanted = [r for r in app.config.resources if r.cdi and r.name in app.snapshots]
    if wanted:
        changed = await app._in_cdi_thread(
            lambda: [r for r in wanted if app.cdi.retry(r.name)])
        for resource in changed or ():
            if app._stopped:
                return
            if resource in app.config.resources:  # not replaced by a reload meanwhile
                app._sync(resource)
    arm_cdi_retry(app)


def schedule_cdi_check(app: HostApp) -> None:
    """check_cdi from a timer or a directory event: one owned task at a time, and one more
    pass when asked again while it runs (a burst of events is one check, not one each)."""
    if app._cdi_check is not None and not app._cdi_check.done():
        app._cdi_check_again = True
        return

    async def run() -> None:
        while True:
            app._cdi_check_again = False
            await check_cdi(app)
            if not app._cdi_check_again:
                return

    app._cdi_check = app.background.spawn(run(), "cdi check")


def arm_cdi_retry(app: HostApp) -> None:
    """While a spec is missing, retry with backoff (1 s doubling to 30 s) besides the
    rescans: freeing space elsewhere on the filesystem sends no event."""
    app.background.cancel("cdi retry")
    if not app.cdi.problems or app._stopped:
        app._cdi_backoff = 1.0
        return
    app.background.later("cdi retry", app._cdi_backoff, schedule_cdi_check, app)
    app._cdi_backoff = min(app._cdi_backoff * 2, 30.0)


def watch_cdi(app: HostApp) -> None:
    """Notice at once when someone deletes one of our spec files."""
    if not any(r.cdi for r in app.config.resources):
        return

    def changed(names: Optional[List[str]]) -> None:
        if names is None or any(n.startswith(FILE_PREFIX) for n in names):
            schedule_cdi_check(app)

    try:
        app._cdi_watch = DirectoryWatch(app.cdi.directory, changed)
        app._cdi_watch.start()
    except OSError as error:
        log.warning("cannot watch the CDI directory %s: %s; specs are checked at every "
                    "rescan", app.cdi.directory, error)
        app._cdi_watch = None


def arm_health_checks(app: HostApp) -> None:
    # One timer per driver, at its resources' shortest interval: a rescan covers every
    # resource of the driver, so a timer per resource rescanned it N times.
    wanted: Dict[str, float] = {}
    for r in app.config.resources:
        if r.health_interval_s > 0:
            wanted[r.driver] = min(wanted.get(r.driver, r.health_interval_s),
                                   r.health_interval_s)
    for name in app._health_checked - set(wanted):
        app.background.cancel(("health", name))
    app._health_checked = set(wanted)

    def check(driver: str, interval: float) -> None:
        if app._stopped:
            return
        app.request_rescan([driver])
        app.background.later(("health", driver), interval, check, driver, interval)

    for driver, interval in wanted.items():
        app.background.later(("health", driver), interval, check, driver, interval)


def watch_drains(app: HostApp) -> None:
    path = app.config.host.drain_file
    apply_drains(app)
    directory = os.path.dirname(path)
    try:  # watching the directory itself, not a busy ancestor such as /var/lib or /tmp
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError as error:
        log.debug("cannot create %s (%s); watching for it", directory, error)
    name = os.path.basename(path)

    def changed(names: Optional[List[str]]) -> None:
        if names is None or name in names:
            apply_drains(app)

    try:
        app._drain_watch = DirectoryWatch(directory, changed)
        app._drain_watch.start()
    except OSError as error:
        log.warning("cannot watch the drain file %s: %s", path, error)
        app._drain_watch = None


def apply_drains(app: HostApp) -> None:
    try:
        drains = read_drains(app.config.host.drain_file)
    except DrainError as error:  # unreadable now: the marks already applied stay
        log.error("%s; keeping the %d marks applied before", error, len(app.inventory.drains))
        return
    for (name, device), reason in drains.items():
        if (name, device) not in app.inventory.drains:
            log.warning("resource %s: device %s drained by an operator: %s", name,
                        device, reason)
    for name in app.inventory.set_drains(drains):
        resource = app.inventory.resources.get(name)
        if resource is not None:
            app._sync(resource)


#: The kernel's uevent monitor (pyudev: an import and an ``ldconfig -p`` run
#: to find libudev) is armed a moment after every resource is registered, or this long after
#: start if that takes longer: registration is what the kubelet waits for. Not in
#: the registration callback itself: the kubelet opens ListAndWatch right after Register
#: returns, and a loop busy arming would hold back that first snapshot. A rescan right after
#: arming catches whatever was plugged, unplugged or changed since the first scan.
EVENTS_AT_THE_LATEST_S = 0.5
EVENTS_AFTER_READY_S = 0.05


def arm_events(app: HostApp) -> None:
    """Start the event source: the real one after registration, an injected one at once."""
    if app._events_spec != "udev":
        start_events(app)
        return
    armed = False

    def arm() -> None:
        nonlocal armed
        if armed or app._stopped:
            return
        armed = True
        start_events(app)
        if app.events is not None:
            app.request_rescan()  # what changed before the monitor listened

    app.on_ready.append(
        lambda: app.background.later("arm device events", EVENTS_AFTER_READY_S, arm))
    app.background.later("arm device events", EVENTS_AT_THE_LATEST_S, arm)


def start_events(app: HostApp) -> None:
    spec = app._events_spec
    if spec is None:
        return
    if spec == "udev":
        subsystems = {s for name in app.inventory.by_driver
                      for s in getattr(app.drivers.get(name), "subsystems", ())}
        if not subsystems:
            return
        source: EventSource = device_events(subsystems)  # + rtnetlink for "net"
    elif isinstance(spec, str):
        raise ValueError(f"unknown event source {spec!r}")
    else:
        source = spec
    try:
        source.start(app.scheduler.event)
    except Exception as error:
        log.debug("event source failed to start", exc_info=True)
        log.warning("device events unavailable (%s); relying on the safety rescan every "
                    "%g s", error, app.config.host.rescan_interval_s)
        return
    app.events = source


def arm_safety_rescan(app: HostApp) -> None:
    interval = app.config.host.rescan_interval_s
    if interval <= 0 or app._stopped:
        return

    def fire() -> None:
        app.request_rescan()
        arm_safety_rescan(app)

    app.background.later("safety rescan", interval, fire)


def arm_expiry(app: HostApp) -> None:
    delay = app.inventory.next_expiry()
    app.background.cancel("expiry")
    if delay is not None and not app._stopped:
        app.background.later("expiry", delay + 0.01, app.request_rescan, [])
