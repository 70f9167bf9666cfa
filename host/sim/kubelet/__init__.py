"""A kubelet device-manager stand-in that drives device plugins over real gRPC and unix sockets.

Tests, benchmarks, ``demo`` and third-party driver authors need to see their plugin treated the
way a real kubelet treats it: dial-back inside Register, options taken from
GetDevicePluginOptions (never from the request), every ListAndWatch message a full snapshot, no
reconnect after a stream ends, every socket in the directory wiped on restart, the topology
manager's NUMA choice, and the exact GetPreferredAllocation / Allocate / PreStartContainer calls.
A stand-in kinder than the kubelet would let plugin bugs through, so this follows the kubelet's
behaviour (``pkg/kubelet/cm/devicemanager``).

Typical use::

    async with KubeletSimulator(plugin_dir) as kubelet:
        ...  # start the plugin, which registers
        await kubelet.wait_for(lambda k: k.resources["vendor.com/gpu"].allocatable == 4)
        result = await kubelet.allocate("vendor.com/gpu", 2, pod="p1")
"""

from host.sim.kubelet.simulator import KubeletSimulator
from host.sim.kubelet.state import (
    AllocationError,
    AllocationResult,
    NotRegisteredError,
    ResourceState,
)
from host.sim.kubelet.topology import merge_hints, split_by_affinity, topology_hints

__all__ = [
    "AllocationError",
    "AllocationResult",
    "KubeletSimulator",
    "NotRegisteredError",
    "ResourceState",
    "merge_hints",
    "split_by_affinity",
    "topology_hints",
]
