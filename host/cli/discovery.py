"""`device-plugin-host discover`: one scan with the real drivers, shown as a table or JSON.

Also says why a configured resource found nothing (a selector that matches no device, a
driver that failed), so an operator can fix a config before serving it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import sys
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from host.config import DEFAULT_CONFIG_PATH, Config
from host.config.plugins import DriverRegistry
from host.core.driver import Driver
from host.core.hostfs import HostFS
from host.core.isolation import DriverCalls
from host.core.model import Device, Health, ResourceConfig
from host.inventory import Inventory

if TYPE_CHECKING:
    pass

log = logging.getLogger("host")


def discover(config: Config, registry: DriverRegistry, *, as_json: bool) -> int:
    drivers = registry.with_unavailable()
    inventory, empty = asyncio.run(scan_once(config, drivers))
    rows: List[Dict[str, Any]] = []
    for resource in config.resources:
        devices = inventory.devices.get(resource.name, [])
        layout = _partitions(devices) if resource.api == "dra" else None
        for device in devices:
            rows.append(device_record(resource.name, resource.driver, device))
            if resource.api == "dra":
                rows[-1]["dra"] = _dra_record(resource, device, config.host.node_name, layout)
    summary = _resource_summary(config, inventory, empty)
    if as_json:
        # stdout stays the documented array of devices; what has none is told on stderr.
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
        for line in summary:
            print(line, file=sys.stderr)
    else:
        _print_table(rows)
        print()
        for line in summary:
            print(line)
    if not rows:
        kinds = ", ".join(sorted(registry.drivers)) or "none"
        print(
            f"nothing to serve: the drivers ({kinds}) found no devices under "
            f"{config.host.host_root} for {config_source(config, short=True)}",
            file=sys.stderr,
        )
    return 0


def config_source(config: Config, *, short: bool = False) -> str:
    """Where the resources come from, in words: a file, or the drivers' built-in defaults."""
    if not config.is_default:
        count = len(config.resources)
        return f"the {count} resource{'s' * (count != 1)} configured in {config.path}"
    if short:
        return "the built-in defaults"
    if config.path is None:
        return f"the built-in defaults (no config file at {DEFAULT_CONFIG_PATH})"
    return f"the built-in defaults ({config.path} has no [[resource]])"


def _resource_summary(config: Config, inventory: Inventory, empty: Dict[str, str]) -> List[str]:
    """One line per resource, devices or not: a resource that advertises nothing is exactly
    the one an operator runs discover for."""
    lines = [f"resources: {config_source(config)}"]
    for resource in config.resources:
        devices = inventory.devices.get(resource.name, [])
        if devices:
            healthy = sum(1 for d in devices if d.healthy)
            word = "device" if len(devices) == 1 else "devices"
            lines.append(f"  {resource.name}: {len(devices)} {word} ({healthy} Healthy)")
            continue
        line = f"  {resource.name}: 0 devices: {empty.get(resource.name, 'reason unknown')}"
        if not resource.register_when_empty:
            line += " (a built-in default: registers once it has a device)"
        lines.append(line)
    return lines


async def scan_once(config: Config, drivers: Dict[str, Driver],
                     warn: bool = True) -> Tuple[Inventory, Dict[str, str]]:
    """One scan, and for each resource that found nothing, why (while the pools exist)."""
    calls = DriverCalls()
    inventory = Inventory(
        HostFS(config.host.host_root), drivers, config.resources, calls,
        discover_timeout_s=config.host.discover_timeout_s, vanished_grace_s=0,
    )
    inventory.warn_overlaps = warn
    try:
        await inventory.scan()
        empty = {}
        for resource in config.resources:
            if not inventory.devices.get(resource.name):
                empty[resource.name] = await _why_empty(inventory, resource, config, calls)
    finally:
        calls.shutdown()
    return inventory, empty


async def _why_empty(inventory: Inventory, resource: ResourceConfig, config: Config,
                     calls: DriverCalls) -> str:
    """A driver failure, selectors that match nothing the driver sees, or a host without any
    such device. Selectors are told apart by asking the driver again without them."""
    status = inventory.status.get(resource.driver)
    if status is not None and status.last_error:
        return f"the driver failed: {status.last_error}"
    for overlap in inventory.overlaps:
        if overlap.second == resource.name:  # it matched them; file order gave them away
            return (f"its {overlap.describe()} are advertised by {overlap.first}, which comes"
                    f" first in the config (set shared_with to share them)")
    root = config.host.host_root
    if not resource.selectors:
        return f"the {resource.driver} driver found no devices under {root}"
    shown = ", ".join(f"{key}={json.dumps(value)}" for key, value in resource.selectors.items())
    driver = inventory.drivers[resource.driver]
    probe = dataclasses.replace(resource, selectors={})
    logging.disable(logging.WARNING)  # the scan above already said what the driver warns
    try:
        result = await calls.call(resource.driver, "discover", config.host.discover_timeout_s,
                                  driver.discover, inventory.host, [probe])
        seen: Optional[int] = len(list(result.get(resource.name, ())))
    except Exception:  # the answer is only a hint; the real scan already succeeded
        seen = None
    finally:
        logging.disable(logging.NOTSET)
    if seen:
        return (f"no match for its selectors ({shown}); the {resource.driver} driver sees "
                f"{seen} device{'s' * (seen != 1)} without them")
    if seen == 0:
        return f"the {resource.driver} driver found no devices under {root} (selectors: {shown})"
    return f"no match for its selectors ({shown})"


def device_record(resource: str, driver: str, device: Device) -> Dict[str, Any]:
    """The JSON shape of one advertised device; scripts rely on these keys."""
    return {
        "resource": resource,
        "id": device.id,
        "health": device.health.value,
        "health_reason": device.health_reason,
        "numa_nodes": list(device.numa_nodes),
        "device_nodes": [
            {"host_path": n.host_path, "container_path": n.container_path,
             "permissions": n.permissions}
            for n in device.device_nodes
        ],
        "mounts": [
            {"host_path": m.host_path, "container_path": m.container_path,
             "read_only": m.read_only}
            for m in device.mounts
        ],
        "env": dict(device.env),
        "annotations": dict(device.annotations),
        "cdi_devices": list(device.cdi_devices),
        "driver": driver,
        "attributes": dict(device.attributes),
    }


def _partitions(devices: List[Device]) -> Any:
    from host.dra import slices

    return slices.Partitions(devices)


def _dra_record(resource: ResourceConfig, device: Device, node_name: str,
                layout: Any = None) -> Dict[str, Any]:
    """How a DRA resource's device appears in its ResourceSlice (names, attributes, and for
    a GPU and its partitions the counter set it owns and the counters it consumes)."""
    from host.dra import naming, slices

    try:
        pool: Optional[str] = naming.pool_name(resource.name, node_name) if node_name else None
    except ValueError:
        pool = None
    record = {
        "driver": naming.driver_name(resource.name, resource.dra_driver_name, resource.driver),
        "pool": pool,
        "device_name": naming.dra_device_name(device.id),
        "attributes": slices.device_attributes(device),
        "capacity": slices.device_capacity(device),
    }
    if layout is not None:
        name = naming.dra_device_name(device.id)
        owned = [s for s in layout.counter_sets if s["name"] == name]
        if owned:
            record["shared_counters"] = owned[0]
        if device.id in layout.consumes:
            record["consumes_counters"] = layout.consumes[device.id]
    return record


def _print_table(rows: List[Dict[str, Any]]) -> None:
    headers = ("RESOURCE", "ID", "HEALTH", "NUMA", "DEVICE NODES", "DETAILS")
    table = []
    for row in rows:
        attrs = row["attributes"]
        details = " ".join(
            f"{k}={attrs[k]}" for k in ("vendor", "device", "kernel_driver", "model") if k in attrs
        )
        if "dra" in row:
            details = f"dra={row['dra']['device_name']} {details}".strip()
        if row["health"] != Health.HEALTHY.value and row["health_reason"]:
            details = f"({row['health_reason']}) {details}".strip()
        table.append((
            row["resource"], row["id"], row["health"],
            ",".join(str(n) for n in row["numa_nodes"]) or "-",
            ",".join(n["host_path"] for n in row["device_nodes"]) or "-",
            details,
        ))
    widths = [max([len(h)] + [len(r[i]) for r in table]) for i, h in enumerate(headers[:-1])]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)) + "  " + headers[-1])
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
