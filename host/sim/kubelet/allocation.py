"""The device manager's admission path for one container and one resource.

Follows devicesToAllocate / allocateContainerResources: candidates are healthy ids not in use;
NUMA-aligned ones come first, then the plugin's preference (only when its options offer one),
then unaligned, then topology-less ones; one Allocate with all ids; only the first container
response counts. Iteration follows the plugin's snapshot order, so runs are reproducible where
the kubelet's Go sets would pick arbitrarily.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import grpc

from host.kubelet.protocol import api
from host.sim.kubelet.state import (
    AllocationError,
    AllocationResult,
    Endpoint,
    ResourceState,
    go_error,
    numa_of,
)
from host.sim.kubelet.topology import Mask, choose_affinity, split_by_affinity

PRE_START_TIMEOUT_S = 30.0  # KubeletPreStartContainerRPCTimeoutInSecs
MAX_NUMA_NODES = 8  # the topology manager refuses larger machines by default
STRICT_POLICIES = ("restricted", "single-numa-node")

Key = Tuple[str, str, str, str]  # (namespace, pod, container, resource)


def preferred_request(
    available: Sequence[str], must_include: Sequence[str], size: int
) -> api.PreferredAllocationRequest:
    return api.PreferredAllocationRequest(
        container_requests=[
            api.ContainerPreferredAllocationRequest(
                available_deviceIDs=list(available),
                must_include_deviceIDs=list(must_include),
                allocation_size=size,
            )
        ]
    )


async def admit(
    state: ResourceState,
    key: Key,
    count: int,
    in_use: Set[str],
    policy: str,
    machine_nodes: Optional[Sequence[int]],
) -> AllocationResult:
    """Pick ids for the container ``key`` and Allocate them; raises AllocationError."""
    namespace, pod, container, resource = key
    healthy = state.healthy
    if not healthy:
        raise AllocationError(
            f"no healthy devices present; cannot allocate unhealthy devices {resource}"
        )
    endpoint = state.current
    if endpoint is None:
        raise AllocationError(f"unknown Device Plugin {resource}")
    ordered = list(dict.fromkeys(d.ID for d in state.snapshot))
    available = [d for d in ordered if d in healthy and d not in in_use]
    numa = {dev_id: numa_of(dev) for dev_id, dev in state.devices.items()}

    affinity: Optional[Mask] = None
    if policy != "none" and state.topology_aware:
        nodes = machine_nodes
        if nodes is None:  # 1.36: hints only over the nodes that hold this resource's devices
            nodes = sorted({n for ids in numa.values() for n in ids if n >= 0})
        if len(nodes) > MAX_NUMA_NODES:
            raise AllocationError(
                f"topology manager: more than {MAX_NUMA_NODES} NUMA nodes", stage="topology"
            )
        affinity, preferred_hint = choose_affinity(nodes, numa, available, count, policy)
        if not preferred_hint and policy in STRICT_POLICIES:
            raise AllocationError(
                "Resources cannot be allocated with Topology locality (TopologyAffinityError)",
                stage="topology",
            )
    if len(available) < count:
        raise AllocationError(
            f"requested number of devices unavailable for {resource}."
            f" Requested: {count}, Available: {len(available)}"
        )
    chosen, preferred = await _choose(endpoint, available, numa, affinity, count)
    response = await _allocate(endpoint, chosen)
    device_numa = {dev: numa.get(dev, ()) for dev in chosen}
    return AllocationResult(
        resource=resource,
        device_ids=chosen,
        response=response,
        numa_nodes={n for nodes in device_numa.values() for n in nodes if n >= 0},
        preferred=preferred,
        namespace=namespace,
        pod=pod,
        container=container,
        affinity=affinity,
        device_numa=device_numa,
    )


async def _choose(
    endpoint: Endpoint,
    available: List[str],
    numa: Dict[str, Tuple[int, ...]],
    affinity: Optional[Mask],
    count: int,
) -> Tuple[List[str], Optional[List[str]]]:
    aligned: List[str]
    unaligned: List[str]
    if affinity is None:
        aligned, unaligned, without = [], [], list(available)
    else:
        aligned, unaligned, without = split_by_affinity(available, numa, affinity)
    chosen: List[str] = []

    def take(ids: Iterable[str]) -> bool:
        for dev in ids:
            if dev not in chosen:
                chosen.append(dev)
                if len(chosen) == count:
                    return True
        return False

    if count < len(aligned):
        # Enough aligned ids: the plugin may choose among them.
        preferred = await _preferred(endpoint, aligned, [], count)
        allowed = set(aligned)
        if take(d for d in preferred or () if d in allowed) or take(aligned):
            return chosen, preferred
    else:
        # Take every aligned id (must_include), let the plugin pick the rest from all candidates.
        if take(aligned):
            return chosen, None
        preferred = await _preferred(endpoint, available, list(chosen), count)
        allowed = set(available)
        if take(d for d in preferred or () if d in allowed) or take(unaligned) or take(without):
            return chosen, preferred
    raise AllocationError(
        f"unexpectedly allocated less resources than required. Requested: {count},"
        f" Got: {len(chosen)}"
    )


async def _preferred(
    endpoint: Endpoint, available: Sequence[str], must_include: Sequence[str], size: int
) -> Optional[List[str]]:
    if not endpoint.options.get_preferred_allocation_available:
        return None
    try:
        reply = await endpoint.stub.GetPreferredAllocation(
            preferred_request(available, must_include, size)
        )
    except grpc.aio.AioRpcError as err:
        raise AllocationError(
            f"device plugin GetPreferredAllocation rpc failed with err: {go_error(err)}",
            stage="preferred",
            code=err.code(),
            details=err.details(),
        ) from err
    if not reply.container_responses:
        return []
    return list(reply.container_responses[0].deviceIDs)


async def _allocate(endpoint: Endpoint, ids: List[str]) -> api.ContainerAllocateResponse:
    container = api.ContainerAllocateRequest(devices_ids=ids)
    request = api.AllocateRequest(container_requests=[container])
    try:
        reply = await endpoint.stub.Allocate(request)
    except grpc.aio.AioRpcError as err:
        raise AllocationError(
            f"Allocate failed due to {go_error(err)}, which is unexpected",
            stage="allocate",
            code=err.code(),
            details=err.details(),
        ) from err
    if not reply.container_responses:
        raise AllocationError(
            "Allocate failed due to no containers return in allocation response,"
            " which is unexpected",
            stage="allocate",
        )
    return reply.container_responses[0]


async def pre_start(state: ResourceState, ids: Sequence[str]) -> None:
    """PreStartContainer runs on every container start; its failure fails the start only."""
    endpoint = state.current
    if endpoint is None or not state.connected:
        raise AllocationError(
            f"device plugin PreStartContainer rpc failed with err: endpoint {state.name} stopped",
            stage="pre_start",
        )
    try:
        await endpoint.stub.PreStartContainer(
            api.PreStartContainerRequest(devices_ids=list(ids)), timeout=PRE_START_TIMEOUT_S
        )
    except grpc.aio.AioRpcError as err:
        raise AllocationError(
            f"device plugin PreStartContainer rpc failed with err: {go_error(err)}",
            stage="pre_start",
            code=err.code(),
            details=err.details(),
        ) from err
