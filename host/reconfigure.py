"""Applying a new, already validated config to a running host, without a blip for what stays.

Unchanged resources keep their socket, registration and stream; changed ones keep them too
when the kubelet-visible options are the same (new selectors or replicas just send a new
snapshot), otherwise they re-register; new ones register; removed ones stop serving. A trial
scan first finds devices two of the new resources would claim (``overlaps_in``), which the
reloader rejects like a bad file (host/reload.py reads and checks the file).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, List, Set

from host import devinfo, scheduling
from host.config import Config
from host.driver import UnavailableDriver
from host.inventory import Inventory
from host.overlap import Overlap
from host.settings import restart_only

if TYPE_CHECKING:
    from host.app import HostApp

log = logging.getLogger("host.app")  # the reload lines operators know


async def overlaps_in(app: HostApp, config: Config) -> List[Overlap]:
    """Scan with a config's resources, without applying them, for devices two of them
    claim: a reload that would double-advertise a device is rejected like a bad file."""
    trial = Inventory(
        app.host, app.drivers, config.resources, app.calls,
        discover_timeout_s=config.host.discover_timeout_s, vanished_grace_s=0,
    )
    trial.warn_overlaps = False
    await trial.scan()
    return trial.overlaps


async def apply_config(app: HostApp, config: Config) -> None:
    """Apply a new, already validated config without a blip for unchanged resources.

    Unchanged resources keep their socket, registration and stream. Changed ones keep
    them too when the kubelet-visible options are the same (new selectors or replicas
    just send a new snapshot); otherwise they re-register (also when replicas turn
    GetPreferredAllocation on or off, see _sync). New ones register; removed
    ones stop serving. Host settings that need a restart are reported, not applied.
    """
    if app._stopped:
        return
    old = {r.name: r for r in app.config.resources}
    new = {r.name: r for r in config.resources}
    for field in restart_only(app.config.host, config.host):
        log.warning("reload: [host] %s changed; it takes effect at the next restart", field)
    app.inventory.discover_timeout_s = config.host.discover_timeout_s
    app.inventory.vanished_grace_s = config.host.vanished_grace_s
    if app.publisher is not None:  # applied live: every pool is rewritten the new way
        app.publisher.set_taint_unhealthy(config.host.dra_unhealthy == "taint")
    app.config = config
    app.inventory.set_resources(config.resources)
    removed = [name for name in old if name not in new]
    for name in removed:
        log.info("reload: resource %s removed; it stops serving", name)
        app.moves.cancel(name)
        app.cdi.remove(name)
        app.metrics.remove_resource(name)
        app.nfd.forget(name)
        if devinfo.enabled(old[name]):
            app.devinfo.remove_resource(old[name])
        app.snapshots.pop(name, None)
        app.services.pop(name, None)
    # Together, not one after the other: each stop waits for its server's grace period
    # (255 removals one by one took 13 s).
    await asyncio.gather(*(app._unserve(name) for name in removed))
    rescan: Set[str] = set()
    for name, resource in new.items():
        before = old.get(name)
        if before == resource:
            continue
        rescan.add(resource.driver)
        if before is not None and (before.api != resource.api or before.api == "dra"):
            if before.api != resource.api:
                app.moves.begin(resource)  # never served by both (host/migration.py)
            elif before.dra_driver_name != resource.dra_driver_name:
                log.info("reload: resource %s changed its DRA driver name", name)
                await app._unserve(name)  # the old driver's registration goes with it
            continue  # served again (or its DRA pool updated) by _sync after the rescan
        service = app.services.get(name)
        if before is None or service is None:
            log.info("reload: resource %s added", name)
            continue  # served by _sync after the rescan
        driver = app.drivers.get(resource.driver) or UnavailableDriver(
            resource.driver, "not installed")
        if before.driver != resource.driver or service.needs_options_change(
                resource, driver) or before.registration != resource.registration:
            log.info("reload: resource %s changed its driver or options; re-registering",
                     name)
            await app._unserve(name)
            app.snapshots.pop(name, None)
            app.services.pop(name, None)
        else:
            log.info("reload: resource %s changed; same stream, new snapshot", name)
            service.resource = resource
        if before.cdi and not resource.cdi:
            app.cdi.remove(name)
        if devinfo.enabled(before) and not devinfo.enabled(resource):
            app.devinfo.remove_resource(before)
    await app.rescan(rescan)
    await app._write_specs(config.resources)
    for resource in config.resources:
        app._sync(resource)
        # Each new resource starts an endpoint task (server, socket, Register): let the
        # loop run between them, so a reload to 256 resources never holds it for long.
        await asyncio.sleep(0)
    if app._stopped:
        return  # stop() came meanwhile: start no watch, arm no timer
    app.moves.write_state()
    if app._cdi_watch is None:
        scheduling.watch_cdi(app)
    app.nfd.schedule()
    app.devinfo.start()
    scheduling.arm_health_checks(app)
