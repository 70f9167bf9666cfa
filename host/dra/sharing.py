"""Devices shared by several claims through consumable capacity (KEP-5075, DRAConsumableCapacity).

A resource with ``replicas = N`` (N > 1) and ``api = "dra"`` is served the way the device plugin
side serves replicas, but to the scheduler's allocator (k8s.io/dynamic-resource-allocation
structured, consumable capacity): each device is published once with
``allowMultipleAllocations: true`` and a capacity ``shares`` of N whose ``requestPolicy`` is
``default: 1, validRange: {min: 1, max: N, step: 1}``. A claim that asks for nothing consumes
one share; one that asks ``capacity.requests.shares: k`` consumes k; the allocator never
hands out more than N in all. Each allocation of a share carries a ``shareID`` (a UID) and its
``consumedCapacity``; NodePrepareResources returns that ``share_id`` for the device.

Every capacity of a multi-allocatable device is consumed by every allocation, the full value
where there is no policy (the allocator's fillEmptyRequest): a ``memory`` capacity the driver
knows is therefore published with ``default: 0, validRange: {min: 0}``, a budget a claim may
ask for (``capacity.requests.memory``) and that nothing else consumes.

The inventory hands the DRA front end the replicas (``<id>::<k>``, ``replica_of``) as it hands
them to the device plugin side; ``bases`` folds them back into the device they share. Where
the API server drops the fields (the gate off, an older server), the publisher publishes the
replicas themselves as N separate devices, each allocated whole: the same N-way sharing with
one share a claim.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, List, Mapping, Optional, Sequence

from host.core.model import Device, Health

CAPACITY = "shares"
REPLICA_OF = "replica_of"
# What a share's container receives (its device's own CDI entry): which share, how much.
ENV_SHARE_ID = "DEVICE_PLUGIN_HOST_SHARE_ID"
ENV_SHARES = "DEVICE_PLUGIN_HOST_SHARES"
ENV_SHARES_TOTAL = "DEVICE_PLUGIN_HOST_SHARES_TOTAL"
ENV_SHARE_PERCENT = "DEVICE_PLUGIN_HOST_SHARE_PERCENT"
# Honoured by CUDA clients of an MPS server only (nvidia-cuda-mps-control running for the GPU):
# the share of the GPU's SMs the client may use. Without MPS, CUDA ignores it.
ENV_MPS_PERCENT = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
NVIDIA_VENDOR = "0x10de"


def is_replica(device: Device) -> bool:
    return bool(device.attributes.get(REPLICA_OF))


def bases(devices: Sequence[Device]) -> List[Device]:
    """The shared devices behind ``devices`` (replicas folded into their device, in first-seen
    order; a device that is no replica stays as it is). A shared device is Unhealthy while any
    of its replicas is: the reasons are the device's own (AER, a vanished node) or a drain of
    one replica, which under DRA drains the device."""
    out: Dict[str, Device] = {}
    reasons: Dict[str, List[str]] = {}
    for device in devices:
        base_id = device.attributes.get(REPLICA_OF) or device.id
        if base_id not in out:
            attributes = {k: v for k, v in device.attributes.items() if k != REPLICA_OF}
            out[base_id] = replace(device, id=base_id, attributes=attributes,
                                   health=Health.HEALTHY, health_reason="")
            reasons[base_id] = []
        if not device.healthy:
            reason = device.health_reason or "Unhealthy"
            if reason not in reasons[base_id]:
                reasons[base_id].append(reason)
    return [d.with_health(Health.UNHEALTHY, "; ".join(reasons[i])) if reasons[i] else d
            for i, d in out.items()]


def capacity(shares: int, memory: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """The capacities of a shared device (see the module docstring)."""
    total = str(shares)
    out: Dict[str, Any] = {CAPACITY: {"value": total, "requestPolicy": {
        "default": "1", "validRange": {"min": "1", "max": total, "step": "1"}}}}
    if memory:
        out["memory"] = {"value": memory["value"],
                         "requestPolicy": {"default": "0", "validRange": {"min": "0"}}}
    return out


def consumed_shares(result: Mapping[str, Any]) -> int:
    """How many shares an allocation result consumed (1 where it does not say)."""
    raw = (result.get("consumedCapacity") or {}).get(CAPACITY)
    try:
        value = int(str(raw)) if raw is not None else 1
    except ValueError:
        value = 1
    return max(value, 1)


def share_env(device: Device, shares: int, total: int, share_id: str = "") -> Dict[str, str]:
    """What one share's container gets in its device's CDI entry."""
    percent = max(1, shares * 100 // max(total, 1))
    env = {ENV_SHARES: str(shares), ENV_SHARES_TOTAL: str(total),
           ENV_SHARE_PERCENT: str(percent)}
    if share_id:
        env[ENV_SHARE_ID] = share_id
    if device.attributes.get("vendor") == NVIDIA_VENDOR:
        env[ENV_MPS_PERCENT] = str(percent)
    return env
