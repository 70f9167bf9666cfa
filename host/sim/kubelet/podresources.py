"""The simulated kubelet's PodResources v1 socket, answered from its own bookkeeping.

Tools that map devices to pods (``pods``, the allocated-device metric, monitoring agents) must
cope with what the real kubelet sends: one ContainerDevices entry per (device, NUMA node), no
topology at all for devices that had none, healthy devices only in GetAllocatableResources,
Go-style error texts, and a token-bucket rate limit shared by every call.
"""

from __future__ import annotations

import os
import stat
import time
from typing import TYPE_CHECKING, Callable, Dict, Iterable, List, Optional, Tuple

import grpc

from host.kubelet.protocol import podresources, podresources_grpc

if TYPE_CHECKING:
    from host.sim.kubelet.simulator import KubeletSimulator

RATE_QPS = 100.0  # pkg/kubelet/apis/podresources/grpc/ratelimit.go
RATE_BURST = 10
RATE_LIMITED = "rejected by rate limit"
GET_DISABLED = "PodResources API Get method disabled"


class TokenBucket:
    """golang.org/x/time/rate's Allow(): starts full, refills ``qps`` tokens a second."""

    def __init__(self, qps: float = RATE_QPS, burst: int = RATE_BURST,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.qps = qps
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._at = clock()

    def allow(self) -> bool:
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.qps)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


def container_devices(
    resource: str, ids: Iterable[str], numa: Dict[str, Tuple[int, ...]]
) -> List[podresources.ContainerDevices]:
    """One entry per (device, NUMA node); one entry without topology for a device with none."""
    out = []
    for device_id in ids:
        nodes = sorted({n for n in numa.get(device_id, ()) if n >= 0})
        if not nodes:
            out.append(podresources.ContainerDevices(resource_name=resource,
                                                     device_ids=[device_id]))
        for node in nodes:
            out.append(podresources.ContainerDevices(
                resource_name=resource, device_ids=[device_id],
                topology=podresources.TopologyInfo(nodes=[podresources.NUMANode(ID=node)]),
            ))
    return out


class PodResourcesServicer(podresources_grpc.PodResourcesListerServicer):
    """``get_enabled=False`` is a kubelet with the KubeletPodResourcesGet gate off (< 1.34)."""

    def __init__(self, kubelet: KubeletSimulator, *, limiter: Optional[TokenBucket] = None,
                 get_enabled: bool = True) -> None:
        self.kubelet = kubelet
        self.limiter = limiter or TokenBucket()
        self.get_enabled = get_enabled
        self.calls: Dict[str, int] = {}

    async def _admit(self, method: str, context: grpc.aio.ServicerContext) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1
        if not self.limiter.allow():
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, RATE_LIMITED)

    def pods(self) -> List[podresources.PodResources]:
        """Active pods in admission order, their containers in admission order too."""
        pods: Dict[Tuple[str, str], Dict[str, List[podresources.ContainerDevices]]] = {}
        for (namespace, pod, container, resource), result in (
            self.kubelet.allocation_results.items()
        ):
            containers = pods.setdefault((namespace, pod), {})
            containers.setdefault(container, []).extend(
                container_devices(resource, result.device_ids, result.device_numa)
            )
        return [
            podresources.PodResources(
                name=pod, namespace=namespace,
                containers=[podresources.ContainerResources(name=name, devices=devices)
                            for name, devices in containers.items()],
            )
            for (namespace, pod), containers in pods.items()
        ]

    async def List(
        self, request: podresources.ListPodResourcesRequest, context: grpc.aio.ServicerContext
    ) -> podresources.ListPodResourcesResponse:
        await self._admit("List", context)
        return podresources.ListPodResourcesResponse(pod_resources=self.pods())

    async def GetAllocatableResources(
        self, request: podresources.AllocatableResourcesRequest,
        context: grpc.aio.ServicerContext,
    ) -> podresources.AllocatableResourcesResponse:
        await self._admit("GetAllocatableResources", context)
        devices: List[podresources.ContainerDevices] = []
        for name, state in self.kubelet.resources.items():
            healthy = state.healthy
            ordered = [d for d in dict.fromkeys(d.ID for d in state.snapshot) if d in healthy]
            numa = {d.ID: tuple(n.ID for n in d.topology.nodes) for d in state.snapshot}
            devices.extend(container_devices(name, ordered, numa))
        return podresources.AllocatableResourcesResponse(devices=devices)

    async def Get(
        self, request: podresources.GetPodResourcesRequest, context: grpc.aio.ServicerContext
    ) -> podresources.GetPodResourcesResponse:
        await self._admit("Get", context)
        if not self.get_enabled:
            await context.abort(grpc.StatusCode.UNKNOWN, GET_DISABLED)
        for pod in self.pods():
            if pod.name == request.pod_name and pod.namespace == request.pod_namespace:
                return podresources.GetPodResourcesResponse(pod_resources=pod)
        # The kubelet returns a plain Go error: gRPC code Unknown.
        await context.abort(
            grpc.StatusCode.UNKNOWN,
            f"pod {request.pod_name} in namespace {request.pod_namespace} not found",
        )
        raise AssertionError("unreachable")


class PodResourcesServer:
    """Serves the servicer on ``socket_path`` (the kubelet's pod-resources/kubelet.sock)."""

    def __init__(self, kubelet: KubeletSimulator, socket_path: str) -> None:
        self.socket_path = os.path.abspath(socket_path)
        self.servicer = PodResourcesServicer(kubelet)
        self._server: Optional[grpc.aio.Server] = None

    @property
    def serving(self) -> bool:
        return self._server is not None

    async def start(self) -> None:
        directory = os.path.dirname(self.socket_path)
        os.makedirs(directory, mode=0o750, exist_ok=True)
        try:  # a stale socket from an earlier run: the kubelet removes it too
            if stat.S_ISSOCK(os.lstat(self.socket_path).st_mode):
                os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        server = grpc.aio.server()
        podresources_grpc.add_PodResourcesListerServicer_to_server(self.servicer, server)
        try:
            if server.add_insecure_port("unix:" + self.socket_path) == 0:
                raise OSError(f"could not bind {self.socket_path}")
            await server.start()
        except BaseException:
            await server.stop(None)
            raise
        self._server = server

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(None)

