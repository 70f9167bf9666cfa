"""The rules behind the DevicePlugin RPCs that need no service state.

How a request is refused (one warning line, then a gRPC status and a reason the kubelet shows
in the pod's events), how a failed or timed-out driver hook maps to a status, how CDI names
enter an Allocate answer, and when GetPreferredAllocation is worth advertising at all.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable, NoReturn, Optional, Sequence

import grpc

from host.core.capabilities import preferred_useful
from host.core.cdi import qualified_names
from host.core.isolation import DriverCallError
from host.core.model import ContainerAllocation, Device, ResourceConfig

log = logging.getLogger("host.kubelet.service")  # the refusal lines operators know


def with_cdi(
    resource: ResourceConfig, devices: Sequence[Device], merged: ContainerAllocation,
    resolvable: Optional[Callable[[str, Sequence[str]], bool]] = None,
) -> ContainerAllocation:
    """Add the devices' CDI names (and drop what the spec already carries, unless the
    resource keeps device specs as a fallback for runtimes without CDI).

    ``resolvable`` says whether the spec on disk holds the names: a name a runtime cannot
    resolve fails the container, so without it the fallback's device nodes go alone, and
    without a fallback the request is refused."""
    ours = qualified_names(resource.name, devices)
    if resolvable is not None and not resolvable(
            resource.name, [name.partition("=")[2] for name in ours]):
        if resource.cdi_fallback:
            return merged
        raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"the CDI spec of {resource.name} is not on disk; its devices "
                           "cannot be resolved by the container runtime now")
    names = tuple(dict.fromkeys([*merged.cdi_devices, *ours]))
    if resource.cdi_fallback:
        return replace(merged, cdi_devices=names)
    return replace(merged, cdi_devices=names, device_nodes=(), mounts=())


def preferred_allocation_useful(
    resource: ResourceConfig, driver: object, devices: Sequence[Device]
) -> bool:
    """Whether GetPreferredAllocation can change what the kubelet would pick on its own.

    The kubelet calls it before every Allocate when it is advertised (one more round trip in
    each pod's admission), so it is advertised only where our answer can differ in a way that
    matters: replicas (pack/spread over the shared devices), a driver's own policy where it has
    something to go by (its ``preferred_useful``: link information such as NVLink, XGMI or
    a Neuron ring, partitions of one card), or devices on more than one NUMA node
    (NUMA-compact). Devices on one node or none are interchangeable to the host.
    """
    if resource.replicas > 1:
        return True
    if preferred_useful(driver, resource, devices):
        return True
    first: Optional[int] = None
    for device in devices:
        for node in device.numa_nodes:
            if first is None:
                first = node
            elif node != first:
                return True
    return False


class RequestError(Exception):
    """A request the host refuses: the gRPC status and the reason the kubelet is told."""

    def __init__(self, code: grpc.StatusCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason

    @classmethod
    def from_driver(cls, error: DriverCallError, code: grpc.StatusCode) -> RequestError:
        """A driver hook that failed (``code``) or did not answer in time (DEADLINE_EXCEEDED)."""
        return cls(grpc.StatusCode.DEADLINE_EXCEEDED if error.timed_out else code, str(error))


async def refuse(context: grpc.aio.ServicerContext, resource: str, what: str,
                 error: RequestError) -> NoReturn:
    """The one way an RPC refuses: one warning line naming the resource, then the status and
    reason to the kubelet (``abort`` raises; nothing after it runs)."""
    log.warning("resource %s: %s: %s", resource, what, error.reason)
    await context.abort(error.code, error.reason)
    raise AssertionError("unreachable")  # abort always raises
