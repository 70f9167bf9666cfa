"""The records that flow from drivers to the kubelet.

Everything Allocate needs is carried on the Device itself, so answering the kubelet is a lookup
and a merge: no sysfs read happens on the allocation path. These types do no I/O.
"""

from __future__ import annotations

import enum
import re
import sys
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Optional, Sequence, Tuple

#: Device ids: what the kubelet's checkpoint, CDI names and drain marks can all carry.
MAX_ID_LENGTH = 256
BAD_ID = re.compile(r"[\s\x00-\x1f\x7f]")

# A node may carry 10,000 devices: __slots__ saves about a third of their memory (3.10+).
_SLOTS = {"slots": True} if sys.version_info >= (3, 10) else {}
# One shared, immutable empty mapping instead of a fresh dict per device.
_EMPTY: Mapping[str, str] = MappingProxyType({})


class Health(str, enum.Enum):
    """The two strings the kubelet knows; anything but exactly "Healthy" counts as unhealthy."""

    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"


@dataclass(frozen=True, **_SLOTS)
class DeviceNode:
    """A device node handed to the container; host_path is a host path, never under --host-root."""

    host_path: str
    container_path: str = ""
    permissions: str = "rw"

    def __post_init__(self) -> None:
        if not self.container_path:
            object.__setattr__(self, "container_path", self.host_path)
        if not self.permissions or set(self.permissions) - set("rwm"):
            raise ValueError(f"device node {self.host_path}: permissions must be of 'rwm'")


@dataclass(frozen=True, **_SLOTS)
class Mount:
    host_path: str
    container_path: str
    read_only: bool = True


@dataclass(frozen=True, **_SLOTS)
class Device:
    """One schedulable unit of a resource.

    ``id`` must be stable across reboots (PCI address, serial, UUID): the kubelet checkpoints it.
    ``numa_nodes`` is empty when the kernel does not know (numa_node = -1); the kubelet then gets
    no topology at all, never a -1. ``attributes`` carries driver facts for selectors, policies
    and display; the kubelet never sees them.
    """

    id: str
    health: Health = Health.HEALTHY
    numa_nodes: Tuple[int, ...] = ()
    device_nodes: Tuple[DeviceNode, ...] = ()
    mounts: Tuple[Mount, ...] = ()
    env: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    annotations: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    cdi_devices: Tuple[str, ...] = ()
    attributes: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    health_reason: str = ""

    __hash__ = None  # type: ignore[assignment]  # mappings inside: compare, never hash

    @property
    def healthy(self) -> bool:
        return self.health is Health.HEALTHY

    def with_health(self, health: Health, reason: str = "") -> Device:
        from dataclasses import replace

        return replace(self, health=health, health_reason=reason)


@dataclass(frozen=True)
class ContainerAllocation:
    """What one container gets for one resource: the model of ContainerAllocateResponse."""

    envs: Mapping[str, str] = field(default_factory=dict)
    mounts: Tuple[Mount, ...] = ()
    device_nodes: Tuple[DeviceNode, ...] = ()
    annotations: Mapping[str, str] = field(default_factory=dict)
    cdi_devices: Tuple[str, ...] = ()


@dataclass(frozen=True)
class PreferredRequest:
    """One container's GetPreferredAllocation question, with ids resolved to current devices."""

    available: Sequence[Device]
    must_include: Sequence[Device]
    size: int


@dataclass(frozen=True)
class ResourceConfig:
    """One resource the host serves: a name, the driver that finds its devices, its selectors."""

    name: str
    driver: str
    selectors: Mapping[str, object] = field(default_factory=dict)
    # Driver knobs that are not about *which* devices: RDMA shared mode, USB sharing, an FPGA
    # pre-start step. Validated by the driver like selectors.
    settings: Mapping[str, object] = field(default_factory=dict)
    # Built-in defaults register a resource only once it has a device, so a node without AMD
    # GPUs does not advertise amd.com/gpu = 0. Configured resources register even when empty.
    register_when_empty: bool = True
    # Sharing: each device is advertised ``replicas`` times as ``<id>::<k>`` (time-slicing
    # style); ``replica_policy`` "pack" fills one device's replicas first, "spread" uses
    # distinct devices first.
    replicas: int = 1
    replica_policy: str = "pack"
    # Periodic health checks (link state, AER counters) need reads no uevent announces:
    # rescan this resource's driver this often; 0 relies on events and the safety rescan.
    health_interval_s: float = 0.0
    # CDI: write a spec for the devices and return their CDI names from Allocate; with
    # ``cdi_fallback`` the device nodes and mounts are returned as well, for runtimes
    # without CDI support.
    cdi: bool = False
    cdi_fallback: bool = True
    # Other resources allowed to advertise the same devices as this one (otherwise a device
    # matched by two resources belongs to the first in file order: see host/core/overlap.py).
    shared_with: Tuple[str, ...] = ()
    # Which kubelet API serves it: "device-plugin" (the default) or "dra" (a ResourceSlice pool
    # and NodePrepareResources; the DRA driver name is ``dra_driver_name`` or derived from the
    # resource name). ``registration``: how a device plugin registers, "kubelet" (Register on
    # kubelet.sock) or "plugin-watcher" (a socket in plugins_registry).
    api: str = "device-plugin"
    dra_driver_name: Optional[str] = None
    registration: str = "kubelet"
