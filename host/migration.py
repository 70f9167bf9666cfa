"""Moving a resource between the device plugin API and DRA while the host runs.

One node must never advertise an extended resource name through a device plugin and through
DRA at once (KEP-5004): the scheduler would admit pods against both. A change of a resource's
``api`` (a live reload of the config file) is therefore done in steps, each one
waiting until the previous is visible where the scheduler looks:

* device plugin -> DRA: the resource's ListAndWatch stream sends an empty list (the kubelet's
  capacity for the name becomes 0), the endpoint stops serving, the host waits until the
  Node's status lists neither capacity nor allocatable for the name (the kubelet's next node
  status sync), and only then publishes the pool;
* DRA -> device plugin: the pool is withdrawn, the host waits until the API server holds no
  ResourceSlice of that pool, and only then serves and registers the device plugin.

Pods keep the devices they hold. Devices the kubelet allocated through the device plugin (its
PodResources API) are left out of the pool, and devices of claims prepared here (the DRA
checkpoint) are left out of the device plugin's list, until they are released: the holds are
read again every ``HOLD_POLL_S`` while any remains. A DRA driver stays registered while it has
prepared claims, so the kubelet can still unprepare them (host/dra/frontend.py).

At start, a DRA resource whose name a stopped device plugin still holds in the Node's status
(the kubelet keeps it for 5 minutes after the plugin's stream ended) waits the same way.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Dict, List, Optional, Sequence, Set

from host.config import Config
from host.core.model import Device, ResourceConfig
from host.core.tasks import Background
from host.outputs.devinfo import Held

if TYPE_CHECKING:
    from host.outputs.device_plugin import DevicePluginOutput
    from host.outputs.dra import DraOutput

log = logging.getLogger("host.app")

#: What serves each resource, for ``device-plugin-host pods`` (in ``dra_state_dir``).
STATE_FILE = "apis.json"
#: How often holds by the other API are read again while any remains.
HOLD_POLL_S = 1.0
#: How long the empty ListAndWatch message may take to leave before the server stops anyway.
EMPTY_SENT_S = 2.0
SLICES_POLL_MAX_S = 1.0

DEVICE_PLUGIN = "device-plugin"
DRA = "dra"


def base_id(device_id: str) -> str:
    """A replica's id (``<id>::<k>``) names its device."""
    return device_id.split("::", 1)[0]


@dataclass
class Move:
    to: str  # DRA or DEVICE_PLUGIN
    step: str
    since: float  # time.monotonic()
    task: Optional[asyncio.Task] = None


class Migrations:
    """The moves in progress, and the devices held through the API a resource left."""

    def __init__(self, config: Callable[[], Config], background: Background,
                 device_plugin: DevicePluginOutput, dra: DraOutput,
                 resource: Callable[[str], Optional[ResourceConfig]],
                 sync: Callable[[ResourceConfig], None], check_ready: Callable[[], None],
                 held_devices: Callable[[], Awaitable[Held]]) -> None:
        """``resource``: a resource's config by name (None once it left); ``sync``: hand
        a resource's devices to the outputs again; ``held_devices``: what containers hold
        through the device plugin (the kubelet's PodResources API; None when it does not
        answer)."""
        self._config = config
        self._background = background
        self._device_plugin = device_plugin
        self._dra = dra
        self._resource = resource
        self._sync = sync
        self._check_ready = check_ready
        self._held_devices = held_devices
        self.moves: Dict[str, Move] = {}
        # resource -> device ids (replica suffix dropped) held through the other API
        self.held: Dict[str, Set[str]] = {}
        self.finished: List[tuple] = []  # (resource, to, seconds) of each completed move
        self._poll: Optional[asyncio.Task] = None
        self._done = asyncio.Condition()

    # -- what the conductor asks ----------------------------------------------------------------

    def blocked(self, name: str) -> bool:
        """The resource is between APIs: served by neither."""
        return name in self.moves

    def visible(self, name: str, devices: Sequence[Device]) -> Sequence[Device]:
        """``devices`` without the ones the other API still holds."""
        held = self.held.get(name)
        if not held:
            return devices
        return [d for d in devices if base_id(d.id) not in held]

    def serving(self) -> Dict[str, str]:
        """Resource -> what serves it now: "device-plugin", "dra", or "moving to ... (step)"."""
        out: Dict[str, str] = {}
        for resource in self._config().resources:
            move = self.moves.get(resource.name)
            if move is not None:
                out[resource.name] = f"moving to {move.to}: {move.step}"
            else:
                out[resource.name] = resource.api
            held = self.held.get(resource.name)
            if held and move is None:
                other = DEVICE_PLUGIN if resource.api == DRA else DRA
                out[resource.name] += (f" ({len(held)} device(s) still held through {other}: "
                                       f"{', '.join(sorted(held))})")
        return out

    def notes(self) -> List[str]:
        """One /healthz note per move in progress (a transient state, shown, not failed)."""
        now = time.monotonic()
        return [f"resource {name} moving to {move.to} ({now - move.since:.0f} s): {move.step}"
                for name, move in sorted(self.moves.items())]

    def write_state(self) -> None:
        """Write what serves each resource to ``<dra_state_dir>/apis.json`` (0600, atomic),
        where the host has a DRA side; ``pods`` shows it."""
        from host.core import fileio

        if not self._dra.started and not self.finished:
            return
        directory = self._config().host.dra_state_dir
        try:
            fileio.make_private_dir(directory)
            fileio.write_atomic(os.path.join(directory, STATE_FILE), json.dumps(
                {"resources": self.serving()}, indent=1, sort_keys=True) + "\n", mode=0o600)
        except OSError as error:
            log.debug("cannot write %s in %s: %s", STATE_FILE, directory, error)

    async def wait_idle(self, timeout_s: Optional[float] = None) -> None:
        """Until no move is in progress (tests, benchmarks)."""
        async with self._done:
            await asyncio.wait_for(self._done.wait_for(lambda: not self.moves), timeout_s)

    # -- starting moves ----------------------------------------------------------------------

    def begin(self, resource: ResourceConfig) -> None:
        """Move ``resource`` (its config already names the new api) to that api. A move the
        other way still in progress is abandoned where it is: every step is safe to redo."""
        old = self.moves.pop(resource.name, None)
        if old is not None and old.task is not None:
            old.task.cancel()
        log.info("resource %s: moving to api = %r (served by neither API until the "
                 "old one is gone from %s)", resource.name, resource.api,
                 "the Node's status" if resource.api == DRA else "the API server")
        self._start(resource.name, resource.api, "starting")

    def cancel(self, name: str) -> None:
        """The resource left the config: its move ends where it is."""
        move = self.moves.pop(name, None)
        self.held.pop(name, None)
        if move is not None and move.task is not None:
            move.task.cancel()

    def hold_at_start(self, name: str, node: Optional[Dict[str, Any]]) -> None:
        """A DRA resource whose name the Node's status still lists from a device plugin that
        is no longer serving: publish it once the kubelet has dropped it."""
        status = (node or {}).get("status") or {}
        log.warning("resource %s: the Node still lists %s (capacity %s, allocatable %s) from "
                    "a device plugin that stopped; its DRA pool is published once the kubelet "
                    "drops it (up to 5 minutes after that plugin stopped)", name, name,
                    (status.get("capacity") or {}).get(name, "0"),
                    (status.get("allocatable") or {}).get(name, "0"))
        self._start(name, DRA, "waiting for the kubelet to drop the device plugin's capacity")

    def _start(self, name: str, to: str, step: str) -> None:
        move = Move(to=to, step=step, since=time.monotonic())
        self.moves[name] = move
        move.task = self._background.spawn(self._run(name, move), f"move {name} to {to}",
                                              on_error=_move_failed)
        self.write_state()

    # -- the steps ---------------------------------------------------------------------------

    async def _run(self, name: str, move: Move) -> None:
        if move.to == DRA:
            await self._leave_device_plugin(name, move)
            move.step = "waiting for the kubelet to drop the device plugin's capacity"
            await self._node_clear(name)
            move.step = "reading the devices pods hold through the device plugin"
            held = await self._device_plugin_holds(name)
        else:
            await self._leave_dra(name, move)
            move.step = "reading the devices of prepared claims"
            held = self._claim_holds(name)
        if self.moves.get(name) is not move:
            return  # superseded meanwhile
        del self.moves[name]
        self.held[name] = held
        seconds = time.monotonic() - move.since
        self.finished.append((name, move.to, seconds))
        log.info("resource %s: now served through %s, %.0f ms after the move began%s", name,
                 move.to, seconds * 1000,
                 f"; {len(held)} device(s) stay out until released ({', '.join(sorted(held))})"
                 if held else "")
        resource = self._resource(name)
        if resource is not None:
            self._sync(resource)
            self._check_ready()
        self._arm_poll()
        self.write_state()
        async with self._done:
            self._done.notify_all()

    async def _leave_device_plugin(self, name: str, move: Move) -> None:
        service = self._device_plugin.services.get(name)
        snapshot = self._device_plugin.snapshots.get(name)
        if service is not None and snapshot is not None:
            move.step = "the device plugin sends an empty list"
            snapshot.update([])
            await _sent_empty(service, EMPTY_SENT_S)
        move.step = "the device plugin stops serving"
        await self._device_plugin.unserve(name)

    async def _node_clear(self, name: str) -> None:
        from host.dra.startup import advertised

        watch = self._dra.node_watch
        if watch is None:
            return
        await watch.wait_for_node(lambda node: not advertised(node, name))

    async def _leave_dra(self, name: str, move: Move) -> None:
        dra = self._dra.frontend
        if dra is None:
            return
        pool = dra.pools.get(name)
        driver = dra.driver_of(name)
        if pool is not None and driver is not None:
            move.step = "withdrawing the DRA pool"
            await dra.remove(name)
            move.step = "waiting for the API server to drop the pool's ResourceSlices"
            await self._slices_gone(driver, pool.pool_name)

    async def _slices_gone(self, driver: str, pool: str) -> None:
        from host.dra.kube import KubeError

        delay = 0.01
        while self._dra.kube is not None:
            try:
                slices = await self._dra.kube.list_resource_slices(
                    driver, self._config().host.node_name)
            except KubeError as error:
                log.debug("listing ResourceSlices of pool %s failed (%s); again", pool, error)
            else:
                if not any(((s.get("spec") or {}).get("pool") or {}).get("name") == pool
                           for s in slices):
                    return
            await asyncio.sleep(delay)
            delay = min(delay * 2, SLICES_POLL_MAX_S)

    # -- holds -------------------------------------------------------------------------------

    async def _device_plugin_holds(self, name: str) -> Set[str]:
        """Device ids pods hold through the device plugin (the kubelet's PodResources API),
        read until it answers (a kubelet restarting); empty, with a warning, where there is
        no PodResources socket at all (not configured, not mounted)."""
        socket = self._config().host.pod_resources_socket
        if not socket or not os.path.lexists(socket):
            log.warning("resource %s: no PodResources socket (%s): devices pods still hold "
                        "through the device plugin cannot be seen and are published too", name,
                        socket or "pod_resources_socket unset")
            return set()
        said = False
        while True:
            held = await self._held_devices()
            if held is not None:
                return {base_id(device) for resource, device in held if resource == name}
            if not said:
                said = True
                log.warning("resource %s: the kubelet's PodResources API does not answer; the "
                            "DRA pool is published once it says which devices pods hold",
                            name)
            await asyncio.sleep(HOLD_POLL_S)

    def _claim_holds(self, name: str) -> Set[str]:
        dra = self._dra.frontend
        if dra is None:
            return set()
        return {device.device_id for claim in dra.prepared_claims()
                for device in claim.devices if device.resource == name}

    def _arm_poll(self) -> None:
        dra = self._dra.frontend
        if self._poll is None and (any(self.held.values())
                                   or (dra is not None and dra.draining())):
            self._poll = self._background.spawn(self._poll_holds(), "move holds",
                                                   on_error=_move_failed)

    async def _poll_holds(self) -> None:
        try:
            while True:
                await asyncio.sleep(HOLD_POLL_S)
                for name, held in list(self.held.items()):
                    if not held or name in self.moves:
                        continue
                    resource = self._resource(name)
                    if resource is None:
                        self.held.pop(name, None)
                        continue
                    if resource.api == DRA:
                        socket = self._config().host.pod_resources_socket
                        if not socket or not os.path.lexists(socket):
                            now: Set[str] = set()
                        else:
                            got = await self._held_devices()
                            if got is None:
                                continue
                            now = {base_id(d) for r, d in got if r == name}
                    else:
                        now = self._claim_holds(name)
                    now &= held  # a device released is never held again through that API
                    if now != held:
                        log.info("resource %s: %d device(s) released by the other API (%s)",
                                 name, len(held - now), ", ".join(sorted(held - now)))
                        self.held[name] = now
                        self._sync(resource)
                        self.write_state()
                dra = self._dra.frontend
                if dra is not None:
                    await dra.close_drained()
                if not any(self.held.values()) and (dra is None or not dra.draining()):
                    return
        finally:
            self._poll = None


async def _sent_empty(service: Any, timeout_s: float) -> None:
    """Until every ListAndWatch stream of ``service`` has been handed the empty list."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        told = getattr(service, "_told", {})
        if all(not latest for _, latest, _ in told.values()):
            return
        await asyncio.sleep(0.005)


def _move_failed(error: BaseException) -> None:
    log.error("moving a resource between APIs failed: %s: %s", type(error).__name__, error,
              exc_info=error)
