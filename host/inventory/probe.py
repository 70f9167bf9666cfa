"""One driver scan as it runs in the driver's worker thread: its snapshot, then the host's own
periodic reads for it (AER counters) while the thread is off the event loop anyway.

Reading AER files for thousands of functions on the loop would stall every ListAndWatch
stream; reading them here costs the scan a few stats more and no extra thread hop.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from host.core.driver import Driver
from host.core.health import AerCounts, read_aer
from host.core.hostfs import HostFS
from host.core.model import Device, ResourceConfig


def discover_and_probe(
    host: HostFS, driver: Driver, resources: List[ResourceConfig]
) -> Tuple[Mapping[str, Sequence[Device]], Dict[str, Dict[str, Optional[AerCounts]]]]:
    """Runs in the driver's worker thread: the driver's snapshot, then the host's own
    periodic reads (AER counters) for resources that asked for health checks."""
    result = driver.discover(host, resources)
    if not isinstance(result, Mapping):
        raise TypeError(f"discover returned {type(result).__name__}, not a mapping")
    aer: Dict[str, Dict[str, Optional[AerCounts]]] = {}
    for resource in resources:
        if resource.health_interval_s <= 0:
            continue
        addresses = set()
        try:
            for device in result.get(resource.name, ()):
                address = getattr(device, "attributes", {}).get("pci_address")
                if isinstance(address, str):
                    addresses.add(address)
        except TypeError:
            continue  # garbage: _sanitize reports it
        aer[resource.name] = {a: read_aer(host, a) for a in sorted(addresses)}
    return result, aer
