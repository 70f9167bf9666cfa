"""Follows this node's Node object by name: whether it exists, and its uid.

The kubelet registers the Node some time after it starts (a node booting or joining the
cluster) and registers it again, with a new uid, after ``kubectl delete node``. Neither is a
configuration error: the host serves its device plugin resources meanwhile, and the slice
publisher waits for the Node (it publishes nothing while there is none) and names the Node's
current uid as the owner of every slice, as the kubelet's own slices do, so that the garbage
collector removes them once the node leaves the cluster for good.

An informer for one object: a list by ``metadata.name`` (the Node or nothing, and the
resourceVersion to watch from), then a watch from there, resumed from the last version seen;
after 410 Expired, or a stream that ended before it delivered a version, the list is read again.
A creation is seen within one watch event's latency. Where the account may not list or watch
Nodes (an older RBAC that grants only get), the Node is read with get every
``POLL_S`` seconds instead (one warning says so).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any, Callable, Dict, List, Optional

from host.core.tasks import cancel_and_wait
from host.dra.kube import KubeError

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 30.0
POLL_S = 1.0


class NodeWatch:
    """``on_uid(uid)`` is called on the event loop whenever the Node's uid changes: a string
    once it exists (or exists again), None once it is deleted. ``uid`` is the current one."""

    def __init__(self, client: Any, node_name: str,
                 on_uid: Callable[[Optional[str]], None], gauge: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.node_name = node_name
        self.on_uid = on_uid
        self.uid: Optional[str] = None
        self.node: Optional[Dict[str, Any]] = None  # the Node as last seen (None: none)
        self._changed: Optional[asyncio.Event] = None  # set on the next _seen
        self.known = False  # the API server has told us once whether the Node exists
        self._gauge = gauge  # 1 while the Node exists, 0 while the host waits for it
        self._clock = clock
        self._missing_since: Optional[float] = None
        self._said_missing = False
        self._task: Optional[asyncio.Task] = None

    # -- what others read -----------------------------------------------------------------------

    def waiting(self) -> List[str]:
        """One line while the host waits for the Node (for /healthz: a transient state that
        a restart would not cure, so it is shown, not failed); empty otherwise."""
        since = self._missing_since
        if since is None:
            return []
        return [f"waiting for Node {self.node_name!r} to be registered by the kubelet "
                f"({self._clock() - since:.0f} s): DRA ResourceSlices are published once it "
                "is; device plugin resources are served meanwhile"]

    async def wait_for_node(self, predicate: Callable[[Optional[Dict[str, Any]]], bool]
                            ) -> None:
        """Return once ``predicate(node)`` holds for the Node as last seen (None while there
        is none), re-checked on every list and watch event; never before the API server has
        answered once."""
        while not (self.known and predicate(self.node)):
            if self._changed is None:
                self._changed = asyncio.Event()
            await self._changed.wait()

    # -- life cycle -----------------------------------------------------------------------------

    def start(self, node: Optional[Dict[str, Any]] = None) -> None:
        """Follow the Node from now on; ``node`` (the Node read at start, if it was) is the
        state until the first list answers."""
        if node is not None:
            self._seen([node])
        self._task = asyncio.create_task(self._run(), name="dra-node-watch")

    async def close(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    # -- the state ------------------------------------------------------------------------------

    def _seen(self, nodes: List[Dict[str, Any]]) -> None:
        uid: Optional[str] = None
        self.node = nodes[-1] if nodes else None
        for node in nodes:
            uid = str((node.get("metadata") or {}).get("uid") or "") or None
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()
        first = not self.known
        self.known = True
        if self._gauge is not None:
            self._gauge.set(1 if uid else 0)
        if uid is None:
            if self._missing_since is None:
                self._missing_since = self._clock()
            if self.uid is not None:
                log.info("DRA: Node %r was deleted (uid %s); waiting for it to be registered "
                         "again, ResourceSlices are not written meanwhile", self.node_name,
                         self.uid)
            elif not self._said_missing:
                self._said_missing = True
                log.warning("DRA: Node %r does not exist (yet): waiting for the kubelet to "
                            "register it; device plugin resources are served meanwhile, "
                            "DRA ResourceSlices are published once it exists", self.node_name)
            else:
                log.debug("DRA: still no Node %r", self.node_name)
        else:
            since, self._missing_since = self._missing_since, None
            if since is not None:
                log.info("DRA: Node %r registered (uid %s) after %.1f s of waiting; publishing "
                         "ResourceSlices", self.node_name, uid, self._clock() - since)
            elif self.uid is not None and uid != self.uid:
                log.info("DRA: Node %r was registered again (uid %s, was %s); the "
                         "ResourceSlices name the new Node as their owner", self.node_name, uid,
                         self.uid)
        if uid != self.uid or first:
            self.uid = uid
            self.on_uid(uid)

    # -- the task -------------------------------------------------------------------------------

    async def _run(self) -> None:
        version: Optional[str] = None
        backoff = BACKOFF_MIN_S
        warned = False
        while True:
            try:
                if version is None:
                    items, listed = await self.client.list_nodes_named(self.node_name)
                    self._seen(items)
                    version = listed or None
                    if version is None:  # nothing to watch from: read the list again later
                        await asyncio.sleep(POLL_S)
                        continue
                async for event in self.client.watch_node(self.node_name, version):
                    backoff, warned = BACKOFF_MIN_S, False
                    obj = event.get("object") or {}
                    seen = (obj.get("metadata") or {}).get("resourceVersion")
                    if seen:
                        version = str(seen)
                    kind = event.get("type")
                    if kind in ("ADDED", "MODIFIED"):
                        self._seen([obj])
                    elif kind == "DELETED":
                        self._seen([])
            except KubeError as err:
                if err.status == 410:
                    version = None  # the events in between are gone: list again
                    continue
                if err.status in (401, 403, 404, 405):
                    if not warned:
                        warned = True
                        log.warning("DRA: cannot list/watch Node %r (%s %s); reading it every "
                                    "%.0f s instead (grant list and watch on nodes, as the dra "
                                    "overlay's RBAC does)", self.node_name, err.status,
                                    err.reason, POLL_S)
                    await self._poll_once()
                    await asyncio.sleep(POLL_S)
                    version = None
                    continue
                log.debug("DRA: Node watch failed (%s); again in %.2f s", err, backoff)
                await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
                backoff = min(backoff * 2, BACKOFF_MAX_S)
                version = None

    async def _poll_once(self) -> None:
        try:
            node = await self.client.get_node(self.node_name)
        except KubeError as err:
            if err.status == 404:
                self._seen([])
            return
        self._seen([node])
