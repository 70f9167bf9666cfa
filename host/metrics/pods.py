"""``allocated_device``: which container holds which of our devices, from the kubelet.

The join of the kubelet's PodResources List with the resources we serve, refreshed at most
once per ``min_interval_s`` whatever the scrape rate (the kubelet rate-limits the API at
100/s, and scrape storms share one List), under a timeout (a scrape must not hang on a stuck
kubelet). The PodResources client is made at the first scrape: the serving path never loads
its modules.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Collection, Iterator, List, Optional, Tuple

from host.metrics.prom import Family

if TYPE_CHECKING:
    from host.kubelet.podresources import PodResourcesClient

log = logging.getLogger("host.metrics")

POD_LIST_TIMEOUT_S = 2.0  # a scrape must not hang on a stuck kubelet
POD_LIST_MIN_INTERVAL_S = 1.0  # scrape storms share one List: the kubelet rate-limits at 100/s

PodRow = Tuple[str, str, str, str, str]  # resource, device, pod, namespace, container


class PodAllocations:
    """The rows of the last PodResources List; ``up`` (a gauge) says whether it answered."""

    def __init__(self, socket: Optional[str], *, timeout_s: float = POD_LIST_TIMEOUT_S,
                 min_interval_s: float = POD_LIST_MIN_INTERVAL_S,
                 up: Optional[Any] = None) -> None:
        self.rows: List[PodRow] = []
        self.up = up
        self._socket = socket
        self._timeout_s = timeout_s
        self._min_interval_s = min_interval_s
        self._client: Optional[PodResourcesClient] = None  # made at the first scrape
        self._at: Optional[float] = None
        self._lock: Optional[asyncio.Lock] = None
        self._error: Optional[str] = None

    async def refresh(self) -> None:
        """At most one PodResources List, shared by scrapes that arrive together."""
        if not self._socket:
            return
        if self._client is None:
            from host.kubelet.podresources import PodResourcesClient

            self._client = PodResourcesClient(self._socket, timeout_s=self._timeout_s)
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            now = time.monotonic()
            if self._at is not None and now - self._at < self._min_interval_s:
                return
            self._at = now
            from host.kubelet.podresources import PodResourcesError

            try:
                pods = await self._client.list()
            except PodResourcesError as error:
                self._failed(str(error))
                return
            except Exception as error:  # the scrape must still answer
                self._failed(f"{type(error).__name__}: {error}")
                return
            rows: List[PodRow] = []
            for pod in pods:
                for container in pod.containers:
                    for entry in container.devices:
                        for device_id in entry.device_ids:
                            rows.append((entry.resource_name, device_id, pod.name,
                                         pod.namespace, container.name))
            self.rows = list(dict.fromkeys(rows))  # one id per NUMA node: once here
            if self.up is not None:
                self.up.set(1)
            if self._error is not None:
                log.info("metrics: the kubelet's PodResources API answers again")
            self._error = None

    def _failed(self, reason: str) -> None:
        self.rows = []
        if self.up is not None:
            self.up.set(0)
        if reason != self._error:
            log.warning("metrics: allocated_device is empty: %s", reason)
        self._error = reason

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()


class AllocatedDevices:
    """The ``allocated_device`` collector: the last List's rows, our resources only."""

    labels = ("resource", "device", "pod", "namespace", "container")
    documentation = "1 for each device of ours that a container holds (from the kubelet)"

    def __init__(self, name: str, pods: PodAllocations, ours: Collection[str]) -> None:
        self.name = name
        self._pods = pods
        self._ours = ours

    def collect(self) -> Iterator[Family]:
        family = Family(self.name, self.documentation, "gauge", self.labels)
        for row in self._pods.rows:
            if row[0] in self._ours:
                family.add_metric(list(row), 1.0)
        yield family
