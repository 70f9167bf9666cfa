"""Keeps the node's ResourceSlices in the API server equal to what the drivers see.

One owner task reconciles desired pools against what the server holds. ``set_pool`` only
records the newest device list and wakes that task, so a burst of events costs one reconcile
with the last state (coalesced), and the event path never waits on the network. A reconcile
sends at most one request per slice that differs: it works from the objects its own writes
returned, and lists the pool again only when that view may be stale (first sync, a 409, a 404,
``republish()`` after a kubelet start deleted the node's slices).

Failures: no answer or 5xx/429 -> retry with exponential backoff (0.05 s doubling to 30 s,
jittered, never sooner than the server's Retry-After) with whatever is desired by then, so
nothing is lost while the API server is away; 409 -> re-read and retry at once (bounded, then
backoff); 422 -> the server's reason logged once per distinct reason and counted in
``device_plugin_host_dra_slice_rejections_total``, and not retried until the pool's devices
change (the same content would be rejected again).

Slices deleted by someone else are published again without waiting for a device change: a
second owned task watches the node's slices (as upstream's resourceslice controller does
with an informer). The kubelet deletes all slices of its node when it starts, but in the
background and with retries (DRAPluginManager.wipeResourceSlices: Node GET first, backoff
from 1 s), so the wipe can land after our plugin registered and republished; and the DRA
manager wipes a driver's slices 30 s after its plugin's connection dropped.

Slices changed by someone else (a device removed, an attribute edited) are written back the
same way: an ADDED or MODIFIED event of a slice of ours newer than what we already know (its
resourceVersion, an integer as upstream's mutation cache reads it) marks the pool, as
upstream's controller queues a pool on update events. An event that arrives while our own
write of that slice is in flight is judged by the write's answer: ours when the answer has
its resourceVersion, someone else's when it is newer. Content is never the test, since the
server changes what we send (defaults, fields of features it has off).

Taint times the server set (``timeAdded``) are copied from the stored slice before comparing
and writing, as upstream's copyTaintTimeAdded does: they are kept, and never make an
unchanged pool look changed.

Answers in flight while a pool's view is dropped are stale: the view carries an epoch, bumped
by every invalidation (a watched deletion or foreign change, ``republish()``), and a reconcile
that finds it changed after any await throws its answer away and leaves the pool pending. The
kubelet's wipe can delete slices between the server reading a LIST and answering it, and the
watch can deliver that deletion before the answer arrives: keeping that answer would make a
deleted pool look published. So would a LIST read before the watch began: the watch starts
from the resourceVersion of a LIST of its own (again after 410 Expired, comparing that LIST
with each pool's view), and a pool's LIST read at an older revision is read again.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from host.core.model import Device
from host.core.tasks import cancel_and_wait
from host.dra.kube import KubeClient, KubeError
from host.dra.slices import build_slices, has_taints, is_shareable, same_content, uses_counters

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 30.0
CONFLICT_RETRIES = 5
PoolKey = Tuple[str, str]  # (driver, pool)


@dataclass
class _Pool:
    devices: Optional[Sequence[Device]]  # None: remove the pool
    version: int = 0  # bumped by every set_pool/remove_pool
    synced_version: int = -1
    # What the server holds, by slice name, as our last read or write returned it.
    observed: Optional[Dict[str, Dict[str, Any]]] = None
    rejected_version: int = -1  # the version a 422 was answered for
    rejected_reasons: Set[str] = field(default_factory=set)
    taints_dropped: bool = False
    counters_dropped: bool = False  # the server drops sharedCounters / consumesCounters
    shares: int = 0  # > 1: the devices are replicas of shared devices (host.dra.sharing)
    # The server drops allowMultipleAllocations / requestPolicy (DRAConsumableCapacity off):
    # the replicas are published as devices of their own.
    capacity_dropped: bool = False
    # Bumped whenever ``observed`` is dropped: an answer that was in flight meanwhile is stale.
    epoch: int = 0
    # The newest resourceVersion known per slice name (reads, our writes, events): an event
    # no newer than that is old news.
    known_rv: Dict[str, int] = field(default_factory=dict)
    # Slices with a write of ours in flight, with the newest resourceVersion an event showed
    # for them meanwhile (-1: none): whether that event was our write is known only from the
    # answer's resourceVersion, which may arrive after it.
    writing: Dict[str, int] = field(default_factory=dict)

    def invalidate(self) -> None:
        """Forget the server's view and make the pool pending (the caller holds the lock)."""
        self.observed = None
        self.epoch += 1
        self.version += 1

    def event(self, name: str, rv: Optional[int],
              obj: Optional[Dict[str, Any]]) -> Optional[bool]:
        """Someone else's write of slice ``name`` (``obj`` None: its deletion), the caller
        holding the lock. None: old news; False: a write of ours to it is in flight, whose
        answer decides; True: news, and the pool is pending again. The view takes the event
        in place (no LIST needed), unless it is dropped already: a LIST may be in flight,
        whose answer must then be thrown away."""
        newest = rv if rv is not None else 1 << 62  # unreadable: newer than anything
        if newest <= self.known_rv.get(name, -1):
            return None
        if rv is not None:
            self.known_rv[name] = rv
        if name in self.writing:
            self.writing[name] = max(self.writing[name], newest)
            return False
        if self.observed is None:
            self.invalidate()
        else:
            if obj is None:
                self.observed.pop(name, None)
            else:
                self.observed[name] = obj
            self.version += 1
        return True

    def remember(self, obj: Dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        rv = _rv(meta)
        name = meta.get("name")
        if rv is not None and name and rv > self.known_rv.get(name, -1):
            self.known_rv[name] = rv


def _rv(meta: Dict[str, Any]) -> Optional[int]:
    try:
        return int(meta.get("resourceVersion") or "")
    except ValueError:
        return None


def copy_taint_times(desired: Sequence[Dict[str, Any]],
                     stored: Sequence[Dict[str, Any]]) -> None:
    """Give each taint of ``desired`` slices without ``timeAdded`` the time of the same taint
    (key, value, effect) on the same device in ``stored`` slices, in place: the server sets
    that time when a taint is first written, and a write without it would reset it."""
    times: Dict[Tuple[str, str, str, str], Any] = {}
    for piece in stored:
        for device in (piece.get("spec") or {}).get("devices") or []:
            for taint in device.get("taints") or []:
                if taint.get("timeAdded"):
                    times[(device.get("name"), taint.get("key"), taint.get("value"),
                           taint.get("effect"))] = taint["timeAdded"]
    if not times:
        return
    for piece in desired:
        for device in piece["spec"].get("devices") or []:
            for taint in device.get("taints") or []:
                if not taint.get("timeAdded"):
                    when = times.get((device.get("name"), taint.get("key"), taint.get("value"),
                                      taint.get("effect")))
                    if when:
                        taint["timeAdded"] = when


def _pool_of(obj: Dict[str, Any]) -> str:
    return str(((obj.get("spec") or {}).get("pool") or {}).get("name"))


def holds(desired: Dict[str, Any], stored: Dict[str, Any]) -> bool:
    """Whether ``stored`` says what ``desired`` says, its generation included; a taint time
    the server set is no difference (``same_content``)."""
    if (desired["spec"]["pool"].get("generation") !=
            ((stored.get("spec") or {}).get("pool") or {}).get("generation")):
        return False
    return same_content(desired, stored)


class _Metrics:
    """Counters on the host's registry (host/metrics/__init__.py HostMetrics.registry), made once
    per registry: a publisher rebuilt on reload must not register the names twice."""

    @classmethod
    def of(cls, metrics: Any) -> _Metrics:
        made = getattr(metrics, "_dra_publisher_metrics", None)
        if made is None:
            made = cls(metrics)
            metrics._dra_publisher_metrics = made
        return made

    def __init__(self, metrics: Any) -> None:
        from host.metrics import PREFIX
        from host.metrics.prom import Counter

        registry = getattr(metrics, "registry", None)
        self.requests = Counter(PREFIX + "dra_api_requests", "ResourceSlice API requests",
                                ("verb", "outcome"), registry=registry)
        self.rejections = Counter(PREFIX + "dra_slice_rejections",
                                  "ResourceSlices the API server rejected (422)",
                                  ("driver", "pool"), registry=registry)
        self.retries = Counter(PREFIX + "dra_publish_retries",
                               "Reconciles retried after an API failure", ("reason",),
                               registry=registry)


class SlicePublisher:
    """See the module docstring. All methods are for the event loop's thread, except
    ``set_pool``/``remove_pool``/``republish``, which may also be called from others."""

    def __init__(self, client: KubeClient, node_name: str, metrics: Any = None,
                 taint_unhealthy: bool = False) -> None:
        self.client = client
        self.node_name = node_name
        self.taint_unhealthy = taint_unhealthy
        self._pools: Dict[PoolKey, _Pool] = {}
        self._lock = threading.Lock()
        self._wake: Optional[asyncio.Event] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._task: Optional[asyncio.Task] = None
        self._watch_task: Optional[asyncio.Task] = None
        # UIDs of slices we deleted ourselves: their DELETED events are not news.
        self._deleted_uids: Set[str] = set()
        self.republished_after_delete = 0  # pools marked again after someone deleted a slice
        self.repaired_after_change = 0  # pools marked again after someone changed a slice
        self._node_epoch = 0  # bumped when the Node's UID must be read again
        # The revision after which the watch reports every change (the resourceVersion of
        # its LIST); None while it has none (not started yet, or expired).
        self._covered_from: Optional[int] = None
        self._idle: Optional[asyncio.Event] = None
        self._node_uid: Optional[str] = None
        self._node_warned = False
        # Set by set_node_uid (a NodeWatch follows the Node): the uid is then always the
        # current one, never read here, and while it is None (no Node) nothing is written.
        self._node_followed = False
        self._counters_warned = False
        self._capacity_warned = False
        self._metrics = _Metrics.of(metrics) if metrics is not None else None
        self.requests = 0  # API requests sent, for the benchmarks
        self.failures = 0  # reconcile rounds that ended in a retry
        self.last_error: Optional[KubeError] = None

    # -- the event side -----------------------------------------------------------------------

    def set_pool(self, driver: str, pool: str, devices: Sequence[Device],
                 shares: int = 0) -> None:
        """Record the pool's devices (``shares`` > 1: replicas of devices shared that many
        ways); never blocks, never fails on the API server's state."""
        self._mark((driver, pool), tuple(devices), shares)

    def remove_pool(self, driver: str, pool: str) -> None:
        self._mark((driver, pool), None)

    def set_taint_unhealthy(self, taint: bool) -> None:
        """A reload changed ``dra_unhealthy``: every pool is written again the new way (a
        server found dropping taints is tried again, since it may have been upgraded)."""
        with self._lock:
            if taint == self.taint_unhealthy:
                return
            self.taint_unhealthy = taint
            for state in self._pools.values():
                state.taints_dropped = False
                state.counters_dropped = False
                state.capacity_dropped = False
                state.version += 1
        self._poke()

    def set_node_uid(self, uid: Optional[str]) -> None:
        """The Node's current uid (None: there is no Node, so write nothing until there is
        one). A new uid makes every pool be written again, naming the new Node as owner."""
        with self._lock:
            followed, self._node_followed = self._node_followed, True
            if followed and uid == self._node_uid:
                return
            self._node_uid = uid
            for state in self._pools.values():
                state.version += 1
        self._poke()

    def republish(self) -> None:
        """Our slices may be gone (the kubelet deletes a node's slices when it starts)."""
        with self._lock:
            for state in self._pools.values():
                state.invalidate()
        self._poke()

    def _mark(self, key: PoolKey, devices: Optional[Sequence[Device]],
              shares: int = 0) -> None:
        with self._lock:
            state = self._pools.get(key)
            if state is None:
                state = self._pools[key] = _Pool(devices)
            state.devices = devices
            if devices is not None:
                state.shares = shares
            state.version += 1
        self._poke()

    def _poke(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is None or wake is None:
            return  # start() reconciles whatever was set before it
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            wake.set()
            if self._idle is not None:
                self._idle.clear()
        else:
            loop.call_soon_threadsafe(self._poke)

    # -- life cycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._wake.set()
        self._covered_from = None
        self._task = asyncio.create_task(self._run(), name="dra-slice-publisher")
        self._watch_task = asyncio.create_task(self._watch(), name="dra-slice-watch")

    async def stop(self, delete: bool = False, timeout_s: float = 5.0) -> None:
        """Stop the owner task; with ``delete``, remove our slices (best effort, bounded)."""
        for task in (self._watch_task, self._task):
            await cancel_and_wait(task)
        self._task = self._watch_task = None
        if delete:
            try:
                await asyncio.wait_for(self._delete_all(), timeout_s)
            except (asyncio.TimeoutError, KubeError) as err:
                log.warning("DRA: could not delete our ResourceSlices on stop: %s", err)
        self._loop = self._wake = self._idle = None

    async def wait_synced(self, timeout_s: float = 10.0) -> bool:
        """True once every pool's newest state is in the API server (tests, benchmarks)."""
        if self._idle is None:
            return False
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def pending(self) -> List[PoolKey]:
        with self._lock:
            return [k for k, s in self._pools.items() if s.synced_version != s.version
                    and s.rejected_version != s.version]

    # -- the watch task -----------------------------------------------------------------------

    async def _watch(self) -> None:
        """Follow the node's slices; one of a pool we publish that was deleted or changed by
        someone else marks that pool.

        As an informer does: LIST the node's slices, then watch from that LIST's
        resourceVersion, so no change after it goes unseen; resumed from the last
        resourceVersion seen after the stream ends or breaks, so deletions during an outage
        still arrive. After 410 Expired the events in between are lost: the LIST is made
        again, and compared with what each pool's view holds (``_relisted``)."""
        version: Optional[str] = None  # the watch reports every change after it
        backoff = BACKOFF_MIN_S
        warned = False
        while True:
            try:
                if version is None:
                    version = await self._relist()
                async for event in self.client.watch_node_slices(self.node_name,
                                                                 version or None):
                    backoff, warned = BACKOFF_MIN_S, False
                    obj = event.get("object") or {}
                    seen = (obj.get("metadata") or {}).get("resourceVersion")
                    if seen:
                        version = str(seen)
                    kind = event.get("type")
                    if kind == "DELETED":
                        self._deleted_elsewhere(obj)
                    elif kind in ("ADDED", "MODIFIED"):
                        self._changed_elsewhere(obj)
            except KubeError as err:
                if err.status == 410:
                    log.info("DRA: the ResourceSlice watch expired (%s); reading our pools "
                             "again", err.message)
                    with self._lock:
                        self._covered_from = None
                    version = None
                    continue
                refused = 400 <= err.status < 500 and err.status != 429
                if refused and not warned:
                    # 403: the account may not watch resourceslices (RBAC of an older
                    # overlay, a kubeconfig user); slices deleted by others then stay gone.
                    warned = True
                    log.warning("DRA: cannot watch ResourceSlices (%s %s: %s); slices deleted "
                                "by others are not published again until this works",
                                err.status, err.reason, err.message)
                log.debug("DRA: ResourceSlice watch failed (%s); again in %.2f s", err,
                          backoff)
                await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
                backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _relist(self) -> str:
        """LIST the node's slices for the watch to start from; returns the LIST's
        resourceVersion ("" when the server sent none: the watch then starts from "now" and
        every pool is read again, the best that can be done without one)."""
        items, version = await self._call("list", self.client.list_slices_at(self.node_name))
        self._deleted_uids.clear()  # their DELETED events may have gone by unseen
        read_at = _rv({"resourceVersion": version})
        if read_at is None:
            with self._lock:
                self._covered_from = None
            self.republish()
            return ""
        self._relisted(items, read_at)
        return version

    def _relisted(self, items: Sequence[Dict[str, Any]], read_at: int) -> None:
        """The node's slices as the server held them at revision ``read_at``: from now on the
        watch reports every change after it. Each pool's view is compared with them, as
        client-go's Replace does with an informer's store: a slice of the view missing here
        was deleted (at ``read_at`` at the latest), one listed newer than we know of was
        changed. A pool without a view is reading it: an answer read before ``read_at`` is
        thrown away (``_reconcile_once``)."""
        listed = {str((o.get("metadata") or {}).get("name") or ""): o for o in items}
        changed: Dict[str, List[str]] = {}
        deleted: List[Tuple[str, str]] = []
        with self._lock:
            self._covered_from = read_at
            for key, state in self._pools.items():
                if state.devices is None or state.observed is None:
                    continue
                for name, obj in listed.items():
                    spec = obj.get("spec") or {}
                    if (str(spec.get("driver")), _pool_of(obj)) != key and \
                            name not in state.observed:
                        continue
                    if state.event(name, _rv(obj.get("metadata") or {}), obj):
                        changed.setdefault(name, []).append(key[1])
                for name in [n for n in state.observed if n not in listed]:
                    if state.event(name, read_at, None):
                        deleted.append((name, key[1]))
            if deleted and not self._node_followed:
                # As for a watched deletion (_deleted_elsewhere): the garbage collector may
                # have deleted them with a replaced Node.
                self._node_uid = None
                self._node_epoch += 1
        for name, pools in changed.items():
            self._foreign_change(name, pools)
        for name, pool in deleted:
            self.republished_after_delete += 1
            log.info("DRA: ResourceSlice %s of pool %s was deleted by someone else while the "
                     "watch was away; publishing it again", name, pool)
        if deleted:
            self._poke()

    def _deleted_elsewhere(self, obj: Dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        uid = meta.get("uid")
        if uid in self._deleted_uids:
            self._deleted_uids.discard(uid)
            return
        spec = obj.get("spec") or {}
        key = (str(spec.get("driver")), str((spec.get("pool") or {}).get("name")))
        name = str(meta.get("name") or "")
        with self._lock:
            state = self._pools.get(key)
            if state is None or state.devices is None:
                return
            news = state.event(name, _rv(meta), None)
            if news is None:
                return  # we have seen the slice made again since
            # The garbage collector deletes slices whose Node owner is gone (a Node deleted
            # and registered again has a new UID): read the Node again, or the next slices
            # would carry the dead UID and be collected again, over and over (unless a
            # NodeWatch follows the Node: it sets the new uid itself).
            if not self._node_followed:
                self._node_uid = None
                self._node_epoch += 1
        if not news:
            return
        self.republished_after_delete += 1
        log.info("DRA: ResourceSlice %s of pool %s was deleted by someone else; publishing it "
                 "again", name, key[1])
        self._poke()

    def _changed_elsewhere(self, obj: Dict[str, Any]) -> None:
        """An ADDED or MODIFIED slice: news when it belongs to a pool we publish (by its
        pool, or by a name we wrote or read) and is newer than anything we know of it."""
        meta = obj.get("metadata") or {}
        name, rv = str(meta.get("name") or ""), _rv(meta)
        spec = obj.get("spec") or {}
        key = (str(spec.get("driver")), str((spec.get("pool") or {}).get("name")))
        marked: List[str] = []
        with self._lock:
            for pool_key, state in self._pools.items():
                if state.devices is None or (pool_key != key and name not in state.known_rv
                                             and name not in state.writing):
                    continue
                if state.event(name, rv, obj):
                    marked.append(pool_key[1])
        if marked:
            self._foreign_change(name, marked)

    def _foreign_change(self, name: str, pools: Sequence[str]) -> None:
        self.repaired_after_change += 1
        log.info("DRA: ResourceSlice %s of pool %s was changed by someone else; writing it "
                 "again", name, ", ".join(pools))
        self._poke()

    # -- the owner task -----------------------------------------------------------------------

    async def _run(self) -> None:
        assert self._wake is not None and self._idle is not None
        backoff = BACKOFF_MIN_S
        streak = 0
        while True:
            await self._wake.wait()
            self._wake.clear()
            failed = await self._reconcile_all()
            if failed is None:
                if streak:
                    log.info("DRA: ResourceSlices published again after %d failed attempts",
                             streak)
                streak, backoff = 0, BACKOFF_MIN_S
                if not self.pending():
                    self._idle.set()
                continue
            if streak == 0:
                # Once an outage (or a refusal: 403 from RBAC or the admission policy), not
                # once a retry; the next line is the recovery.
                log.warning("DRA: cannot publish ResourceSlices (%s %s: %s); retrying with "
                            "backoff", failed.status or "no answer", failed.reason,
                            failed.message)
            streak += 1
            self.failures += 1
            self._retry_count(failed.reason)
            delay = backoff * random.uniform(0.8, 1.2)
            if failed.retry_after_s:
                delay = max(delay, min(failed.retry_after_s, BACKOFF_MAX_S))
            backoff = min(backoff * 2, BACKOFF_MAX_S)
            log.debug("DRA: API request failed (%s); retrying in %.2f s", failed, delay)
            try:
                # A new event does not cut the backoff short: the server is what is failing.
                await asyncio.sleep(delay)
            finally:
                self._wake.set()

    async def _reconcile_all(self) -> Optional[KubeError]:
        """Reconcile each pending pool; the first transient failure ends the round. While
        the followed Node does not exist nothing is written (the pools stay pending)."""
        if self._node_followed and self._node_uid is None:
            return None
        for key in self.pending():
            try:
                await self._reconcile(key)
            except KubeError as err:
                self.last_error = err
                return err
        self.last_error = None
        return None

    def _count(self, verb: str, outcome: str) -> None:
        self.requests += 1
        if self._metrics is not None:
            self._metrics.requests.labels(verb, outcome).inc()

    def _retry_count(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.retries.labels(reason or "Unavailable").inc()

    async def _call(self, verb: str, coro: Any) -> Any:
        try:
            result = await coro
        except KubeError as err:
            self._count(verb, str(err.status or "no-answer"))
            raise
        self._count(verb, "ok")
        return result

    async def _node_owner_uid(self) -> Optional[str]:
        if self._node_uid is None and not self._node_followed:
            epoch = self._node_epoch
            try:
                node = await self._call("get", self.client.get_node(self.node_name))
                uid = (node.get("metadata") or {}).get("uid")
                if self._node_epoch != epoch:
                    return uid  # read before a replacement was seen: not kept
                self._node_uid = uid
            except KubeError as err:
                if err.status == 0 or err.status >= 500:
                    raise
                # No Node object (yet) or no RBAC for it: publish without the owner rather
                # than not at all; the next reconcile asks again.
                if not self._node_warned:
                    self._node_warned = True
                    log.warning("DRA: cannot read Node %s for the slice owner: %s",
                                self.node_name, err)
        return self._node_uid

    async def _observe(self, key: PoolKey) -> Tuple[Dict[str, Dict[str, Any]], Optional[int]]:
        """The pool's slices by name, and the revision they were read at (None: unknown)."""
        driver, pool = key
        items, version = await self._call("list", self.client.list_slices_at(self.node_name,
                                                                             driver))
        return ({s["metadata"]["name"]: s for s in items
                 if (s.get("spec") or {}).get("pool", {}).get("name") == pool},
                _rv({"resourceVersion": version}))

    async def _reconcile(self, key: PoolKey) -> None:
        conflicts = 0
        while True:
            try:
                await self._reconcile_once(key)
                return
            except KubeError as err:
                if err.status in (404, 409) and conflicts < CONFLICT_RETRIES:
                    # Someone else wrote (or deleted) a slice of ours: read again, retry now.
                    conflicts += 1
                    with self._lock:
                        self._pools[key].observed = None
                    continue
                raise

    async def _reconcile_once(self, key: PoolKey) -> None:
        """One pass over the pool. Returns without marking it synced when its view was
        dropped while a request was in flight (the pool is pending again then)."""
        driver, pool = key
        with self._lock:
            state = self._pools[key]
            version, devices, epoch = state.version, state.devices, state.epoch
            observed, shares = state.observed, state.shares
        while observed is None:
            listed, read_at = await self._observe(key)
            with self._lock:
                if state.epoch != epoch:
                    return  # read before a deletion or change we have seen since
                covered = self._covered_from
                if covered is not None and read_at is not None and read_at < covered:
                    # Read before the revision the watch reports changes after: one in
                    # between (the kubelet's wipe while the watch was away) would never be
                    # seen. Read again.
                    continue
                observed = state.observed = listed
                for obj in listed.values():
                    state.remember(obj)
        if devices is None:
            for name, obj in list(observed.items()):
                if not await self._delete(state, epoch, name, obj):
                    return
            self._synced(key, state, version)
            return
        node_uid = await self._node_owner_uid()
        if state.epoch != epoch:
            return
        taint = self.taint_unhealthy and not state.taints_dropped
        current = max((s["spec"]["pool"].get("generation", 0) for s in observed.values()),
                      default=0)
        desired = build_slices(driver, self.node_name, pool, devices, current, node_uid,
                               taint_unhealthy=taint, counters=not state.counters_dropped,
                               partition_taints=not state.taints_dropped, shares=shares,
                               consumable=not state.capacity_dropped)
        copy_taint_times(desired, list(observed.values()))
        names = {d["metadata"]["name"] for d in desired}
        in_sync = set(observed) == names and all(
            holds(d, observed[d["metadata"]["name"]]) for d in desired)
        if in_sync:
            self._synced(key, state, version)
            return
        # Any change makes a new generation of the whole pool: the scheduler uses only the
        # slices of a pool's newest generation, and resourceSliceCount of them make it whole.
        generation = current + 1
        try:
            for obj in desired:
                obj["spec"]["pool"]["generation"] = generation
                name = obj["metadata"]["name"]
                old = observed.get(name)
                stored = await self._write(state, obj, old)
                with self._lock:
                    if state.epoch != epoch:
                        return  # the view was dropped meanwhile: read the pool again
                    observed[name] = stored
                if self._taints_lost(obj, stored):
                    state.taints_dropped = True
                    if taint:
                        log.warning("DRA: the API server dropped device taints "
                                    "(DRADeviceTaints is off); unhealthy devices of %s are "
                                    "left out instead", pool)
                if is_shareable(obj) and not is_shareable(stored):
                    state.capacity_dropped = True
                    if not self._capacity_warned:
                        self._capacity_warned = True
                        log.warning("DRA: the API server dropped allowMultipleAllocations "
                                    "(DRAConsumableCapacity is off or not known); shared "
                                    "devices are published as one device per replica "
                                    "instead")
                if uses_counters(obj) and not uses_counters(stored):
                    state.counters_dropped = True
                    if not self._counters_warned:
                        self._counters_warned = True
                        log.warning("DRA: the API server dropped shared counters "
                                    "(DRAPartitionableDevices is off or not known); GPUs "
                                    "served as their partitions are left out of the slices "
                                    "instead")
            for name in [n for n in observed if n not in names]:
                gone = observed.get(name)  # the watch may have taken it out meanwhile
                if gone is not None and not await self._delete(state, epoch, name, gone):
                    return
            if (state.taints_dropped and any(has_taints(d) for d in desired)) or (
                    state.counters_dropped and any(uses_counters(d) for d in desired)) or (
                    state.capacity_dropped and any(is_shareable(d) for d in desired)):
                # What we wrote shows unhealthy devices as usable: write it again without them.
                await self._reconcile_once(key)
                return
        except KubeError as err:
            if err.status == 422:
                self._rejected(key, state, version, err)
                return
            if err.status in (404, 409):
                raise
            state.observed = None if err.status == 0 else state.observed
            raise
        self._synced(key, state, version)

    async def _write(self, state: _Pool, obj: Dict[str, Any],
                     old: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        """Create or update one slice; an event of it seen meanwhile that is not this write
        drops the pool's view (someone else wrote it after us)."""
        name = obj["metadata"]["name"]
        with self._lock:
            state.writing[name] = -1
        stored: Optional[Dict[str, Any]] = None
        try:
            if old is None:
                stored = await self._call("create", self.client.create_resource_slice(obj))
            else:
                obj["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
                stored = await self._call("update", self.client.update_resource_slice(obj))
            return stored
        finally:
            with self._lock:
                seen = state.writing.pop(name, -1)
                ours = _rv(stored.get("metadata") or {}) if stored is not None else None
                if stored is not None:
                    state.remember(stored)
                foreign = seen >= 0 and (ours is None or seen > ours)
                if foreign:
                    state.invalidate()
            if foreign:
                self._foreign_change(name, [_pool_of(obj)])

    async def _delete(self, state: _Pool, epoch: int, name: str, obj: Dict[str, Any]) -> bool:
        """Delete one slice of ours; False when the pool's view was dropped meanwhile."""
        uid = obj["metadata"].get("uid")
        if uid:
            self._deleted_uids.add(uid)
        try:
            await self._call("delete", self.client.delete_resource_slice(
                name, obj["metadata"].get("resourceVersion")))
        except KubeError as err:
            if uid and err.status != 404:
                self._deleted_uids.discard(uid)  # still there: its deletion is not ours
            if err.status != 404:
                raise
        with self._lock:
            if state.epoch != epoch:
                return False
            if state.observed is not None:
                state.observed.pop(name, None)
        return True

    @staticmethod
    def _taints_lost(sent: Dict[str, Any], stored: Dict[str, Any]) -> bool:
        had = any(d.get("taints") for d in sent["spec"].get("devices") or [])
        kept = any(d.get("taints") for d in (stored.get("spec") or {}).get("devices") or [])
        return had and not kept

    def _synced(self, key: PoolKey, state: _Pool, version: int) -> None:
        with self._lock:
            state.synced_version = version
            state.rejected_reasons.clear()
            if state.devices is None and state.version == version:
                del self._pools[key]

    def _rejected(self, key: PoolKey, state: _Pool, version: int, err: KubeError) -> None:
        driver, pool = key
        with self._lock:
            state.rejected_version = version
            first = err.message not in state.rejected_reasons
            state.rejected_reasons.add(err.message)
            state.observed = None  # part of the pool may have been written
        if self._metrics is not None:
            self._metrics.rejections.labels(driver, pool).inc()
        if first:
            log.error("DRA: the API server rejected a ResourceSlice of pool %s (driver %s): %s",
                      pool, driver, err.message)

    async def _delete_all(self) -> None:
        for key in list(self._pools):
            state = self._pools[key]
            if state.observed is None:
                state.observed = (await self._observe(key))[0]
            for name, obj in list(state.observed.items()):
                await self._delete(state, state.epoch, name, obj)
