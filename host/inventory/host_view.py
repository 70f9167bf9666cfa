"""What the host adds to a driver's report before it is advertised: devices left to an
earlier resource dropped, host-level health (AER errors rising, operator drains), replicas.

Pure: the same report and marks give the same list, so a drain mark or a config change
re-publishes from what the driver last reported, without rescanning.
"""

from __future__ import annotations

from typing import AbstractSet, List, Mapping, Optional

from host.core.allocation import replicate
from host.core.drains import DrainKey
from host.core.model import Device, Health, ResourceConfig


def host_view(resource: ResourceConfig, devices: List[Device], *,
              excluded: Optional[AbstractSet[str]], aer: Mapping[str, str],
              drains: Mapping[DrainKey, str]) -> List[Device]:
    """``excluded``: ids an earlier resource advertises; ``aer``: PCI address -> problem;
    ``drains``: (resource, id) -> the operator's reason (a replica can be drained alone)."""
    out: List[Device] = []
    if excluded:
        devices = [d for d in devices if d.id not in excluded]
    for device in devices:
        reasons = [device.health_reason] if not device.healthy and device.health_reason \
            else []
        address = device.attributes.get("pci_address")
        if address and aer.get(address):
            reasons.append(aer[address])
        drained = drains.get((resource.name, device.id))
        if drained:
            reasons.append(f"drained by an operator: {drained}")
        if reasons and (device.healthy or len(reasons) > 1):
            device = device.with_health(Health.UNHEALTHY, "; ".join(reasons))
        out.append(device)
    if resource.replicas <= 1:
        return out
    expanded = []
    for device in out:
        for replica in replicate(device, resource.replicas):
            drained = drains.get((resource.name, replica.id))
            if drained and replica.healthy:
                replica = replica.with_health(Health.UNHEALTHY,
                                              f"drained by an operator: {drained}")
            expanded.append(replica)
    return expanded

