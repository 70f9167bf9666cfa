"""What the simulated kubelet remembers: per-resource state, allocation records, errors.

Health is derived the kubelet's way (exact "Healthy", per-set counting, all unhealthy while
disconnected or before the first snapshot of a new registration) so tests asserting on
capacity/allocatable see what a node's status would show.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Iterable, List, Optional, Set, Tuple

import grpc

from host.kubelet.protocol import HEALTHY, api, api_grpc


class AllocationError(Exception):
    """Admission or container start failed the way the kubelet would fail it.

    ``code``/``details`` carry the plugin's gRPC status when an RPC failed (None otherwise);
    ``stage`` says where: "admission", "topology", "preferred", "allocate" or "pre_start".
    """

    def __init__(
        self,
        message: str,
        *,
        stage: str = "admission",
        code: Optional[grpc.StatusCode] = None,
        details: Optional[str] = None,
    ) -> None:
        super().__init__(message)
        self.stage = stage
        self.code = code
        self.details = details


class NotRegisteredError(LookupError):
    """A raw call named a resource with no live registration."""


@dataclass
class AllocationResult:
    resource: str
    device_ids: List[str]
    response: api.ContainerAllocateResponse
    numa_nodes: Set[int]
    preferred: Optional[List[str]]  # what GetPreferredAllocation answered, if it was called
    namespace: str = "default"
    pod: str = "pod"
    container: str = "main"
    # The NUMA affinity the topology manager admitted the container with (None: no alignment).
    affinity: Optional[FrozenSet[int]] = None
    # Each id's NUMA nodes at allocation time, as PodResources reports them.
    device_numa: Dict[str, Tuple[int, ...]] = field(default_factory=dict)


@dataclass(eq=False)
class Endpoint:
    """One accepted registration, with its own channel and stream task, so that a replaced
    registration's late stream end can be told apart from the current one's."""

    socket_path: str
    channel: grpc.aio.Channel
    stub: api_grpc.DevicePluginStub
    options: api.DevicePluginOptions
    task: Optional[asyncio.Task[None]] = None
    call: Optional[grpc.aio.UnaryStreamCall] = None  # its ListAndWatch, once opened
    superseded: bool = False  # a newer Register of the name replaced it; its stream runs on

    async def close(self) -> None:
        """Hang up as the kubelet's ``conn.Close()`` does: the plugin sees its stream end.

        The stream is cancelled before the channel closes: grpcio's ``channel.close()``
        (1.80 at least) can fail the call locally and leave the plugin's server stream
        open, where Go's ClientConn.Close tears the connection down under every stream."""
        if self.call is not None:
            self.call.cancel()
        await self.channel.close(None)


def numa_of(device: api.Device) -> Tuple[int, ...]:
    return tuple(node.ID for node in device.topology.nodes)


@dataclass
class ResourceState:
    """What the kubelet knows about one resource name (node status and the device manager)."""

    name: str
    endpoint: str = ""  # as sent in RegisterRequest
    socket_path: str = ""  # where the kubelet dialed
    options: api.DevicePluginOptions = field(default_factory=api.DevicePluginOptions)
    devices: Dict[str, api.Device] = field(default_factory=dict)
    snapshot: List[api.Device] = field(default_factory=list)  # the latest message, as sent
    connected: bool = False
    registrations: int = 0
    snapshots: int = 0
    last_snapshot_at: float = 0.0
    registered_at: float = 0.0
    live_at: float = 0.0  # time.monotonic() of the current registration's first snapshot
    stopped_at: Optional[float] = None
    last_error: Optional[str] = None  # why the last stream ended
    current: Optional[Endpoint] = field(default=None, repr=False)
    # True once the current registration sent a snapshot; until then every device is unhealthy.
    live: bool = field(default=False, repr=False)

    @property
    def healthy(self) -> Set[str]:
        if not self.live:
            return set()
        return {d.ID for d in self.snapshot if d.health == HEALTHY}

    @property
    def unhealthy(self) -> Set[str]:
        if not self.live:
            return {d.ID for d in self.snapshot}
        return {d.ID for d in self.snapshot if d.health != HEALTHY}

    @property
    def capacity(self) -> int:
        # Counted per set like GetCapacity: an id sent both Healthy and Unhealthy counts twice.
        return len(self.healthy) + len(self.unhealthy)

    @property
    def allocatable(self) -> int:
        return len(self.healthy)

    @property
    def topology_aware(self) -> bool:
        return any(d.topology.nodes for d in self.devices.values())

    def apply(self, devices: Iterable[api.Device]) -> None:
        self.snapshot = list(devices)
        self.devices = {d.ID: d for d in self.snapshot}
        self.snapshots += 1
        self.last_snapshot_at = time.monotonic()
        if not self.live:
            self.live_at = self.last_snapshot_at
        self.live = True

    def attach(self, request: api.RegisterRequest, endpoint: Endpoint) -> Optional[Endpoint]:
        """Make ``endpoint`` current; returns the one it replaces."""
        old, self.current = self.current, endpoint
        self.endpoint = request.endpoint
        self.socket_path = endpoint.socket_path
        self.options = endpoint.options
        # PluginConnected only stores the endpoint: the health sets stay as they are (the
        # old plugin's devices while it is connected; all unhealthy after a disconnect)
        # until this registration's first snapshot.
        self.connected = True
        self.stopped_at = None  # a fresh endpoint cancels the removal clock
        self.last_error = None
        self.registered_at = time.monotonic()
        return old

    def disconnect(self, reason: str) -> None:
        self.connected = False
        self.live = False
        self.stopped_at = time.monotonic()
        self.last_error = reason

    def forget_devices(self) -> None:
        """A restarted kubelet knows the name from its checkpoint but no devices."""
        self.snapshot, self.devices, self.live = [], {}, False

    def summary(self) -> str:
        text = (
            f"{self.name}: {'connected' if self.connected else 'disconnected'}"
            f" endpoint={self.endpoint!r} registrations={self.registrations}"
            f" snapshots={self.snapshots} healthy={len(self.healthy)}"
            f" unhealthy={len(self.unhealthy)}"
        )
        return text + (f" last_error={self.last_error!r}" if self.last_error else "")


def go_error(err: grpc.aio.AioRpcError) -> str:
    """A gRPC failure worded as Go's status error, the way the kubelet reports it."""
    code = "".join(part.capitalize() for part in err.code().name.split("_"))
    return f"rpc error: code = {code} desc = {err.details()}"


def go_quote(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)
