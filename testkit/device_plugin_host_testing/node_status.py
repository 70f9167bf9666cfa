"""The kubelet's node status sync for extended resources, written to an API server.

Every ``interval_s`` (the kubelet's ``nodeStatusUpdateFrequency``, 10 s by default) the
kubelet asks the device manager for ``GetCapacity`` and writes each resource's capacity and
allocatable into the Node's status; a resource the device manager removed (its endpoint
stopped ``endpoint_stop_grace_s`` ago) is written as an explicit 0 and the key stays
(``pkg/kubelet/nodestatus/setters.go``). Nothing is written between syncs, so a plugin that
stops serving is still listed at its old capacity until the next sync, and for the whole
grace period when it stopped without first sending an empty ListAndWatch message.

``api`` is either API server of host/sim/apiserver.py (``set_node_status``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Dict, Optional

from host.core.tasks import cancel_and_wait
from host.sim.kubelet.simulator import KubeletSimulator

log = logging.getLogger(__name__)

NODE_STATUS_UPDATE_S = 10.0  # the kubelet's nodeStatusUpdateFrequency default


class NodeStatusSync:
    """Writes ``kubelet``'s extended resources into Node ``node_name``'s status on ``api``."""

    def __init__(self, kubelet: KubeletSimulator, api: Any, node_name: str,
                 interval_s: float = NODE_STATUS_UPDATE_S) -> None:
        self.kubelet = kubelet
        self.api = api
        self.node_name = node_name
        self.interval_s = interval_s
        self.written: Dict[str, str] = {}  # capacity last written, by resource
        self.written_allocatable: Dict[str, str] = {}
        self.syncs = 0
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kubelet-node-status")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def sync(self) -> bool:
        """One node status sync; True when the Node's status was written."""
        capacity, allocatable, removed = self.kubelet.get_capacity()
        cap = {name: str(value) for name, value in capacity.items()}
        alloc = {name: str(value) for name, value in allocatable.items()}
        for name in removed:
            cap[name] = alloc[name] = "0"
        self.syncs += 1
        changed = {k: v for k, v in cap.items() if self.written.get(k) != v}
        changed_alloc = {k: v for k, v in alloc.items()
                         if self.written_allocatable.get(k) != v}
        if not changed and not changed_alloc:
            return False
        await asyncio.to_thread(self.api.set_node_status, self.node_name, cap, alloc)
        self.written.update(cap)
        self.written_allocatable.update(alloc)
        return True

    async def _run(self) -> None:
        while True:
            try:
                await self.sync()
            except Exception as error:  # the API server away: the next sync tries again
                log.debug("kubelet node status sync failed: %s", error)
            await asyncio.sleep(self.interval_s)
