"""What a driver hands over, checked before it can reach the kubelet.

A third-party driver can return anything: not a Device, an id with whitespace or control
characters (the kubelet's checkpoint and the CDI name would break), duplicates, NUMA nodes this
machine does not have. Each such device is dropped or fixed here with a logged reason (at most
five lines per scan), so one bad record never fails the resource.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Collection, List, Optional, Set

from host.core.model import BAD_ID, MAX_ID_LENGTH, Device, Health

log = logging.getLogger("host.inventory")  # the lines operators know from the inventory


def sanitize(driver: str, resource: str, devices: object,
             machine_numa: Optional[Collection[int]]) -> List[Device]:
    """The driver's devices for one resource, checked: garbage from a third-party driver is
dropped or fixed, with at most five lines about it, and never reaches the kubelet."""
    out: List[Device] = []
    seen: Set[str] = set()
    problems: List[str] = []
    try:
        items = list(devices)  # type: ignore[call-overload]
    except TypeError:
        log.error("driver %r returned %s for resource %s, not a list of devices", driver,
                  type(devices).__name__, resource)
        return []
    for device in items:
        if not isinstance(device, Device):
            problems.append(f"a {type(device).__name__} instead of a Device")
            continue
        device_id = device.id
        if not isinstance(device_id, str) or not device_id or len(device_id) > MAX_ID_LENGTH \
                or BAD_ID.search(device_id):
            problems.append(f"invalid device id {device_id!r:.80}")
            continue
        if device_id in seen:
            problems.append(f"duplicate device id {device_id!r}")
            continue
        seen.add(device_id)
        if not isinstance(device.health, Health):
            device = device.with_health(
                Health.HEALTHY if device.health == Health.HEALTHY.value else Health.UNHEALTHY,
                device.health_reason,
            )
        numa = device.numa_nodes
        if numa and not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0
            and (machine_numa is None or n in machine_numa)
            for n in numa
        ):
            problems.append(f"device {device_id}: NUMA nodes {numa!r} are not on this machine")
            device = replace(device, numa_nodes=())
        out.append(device)
    for problem in problems[:5]:
        log.error("driver %r, resource %s: dropped or fixed %s", driver, resource, problem)
    if len(problems) > 5:
        log.error("driver %r, resource %s: %d more problems", driver, resource,
                  len(problems) - 5)
    return out
