"""The widget driver: compute accelerators of the kernel's accel class, one Device per card.

Rules, chosen so that every device the kubelet sees is either usable or visibly Unhealthy:

* The id is the parent device's name: the PCI address for PCI cards (stable across reboots,
  known even before the vendor stack is up), the platform device name for SoC NPUs (fixed by
  the device tree). The accel index is not an id: it follows probe order and can change
  between boots. Should two minors ever share a parent, both get ``<parent>-<accelN>`` ids.
* A container gets /dev/accel/accelN, plus /dev/accel/accel_controlDN where the kernel driver
  made one (habanalabs): the Gaudi user-space stack opens both.
* Unhealthy, with the reason: a device node missing from /dev, a PCI function with
  ``enable`` = 0, a card whose driver reports a ``status`` other than "operational".
* NUMA comes from the PCI function (or the nearest ancestor for platform devices); -1 or a
  node the machine does not have means no topology at all.
* Gaudi cards carry ``HABANA_VISIBLE_DEVICES=<accel index>``, the variable the Habana runtime
  reads; ``settings.index_env`` names another variable (or "" for none), for stacks that find
  their cards the same way. Several cards' values are joined with "," by the host.
* Sharing a card between containers is the host's ``replicas`` key, not a driver setting.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass, replace
from typing import Dict, List, Mapping, Sequence, Tuple

from device_plugin_host import (
    PCI_SELECTOR_TYPES,
    Device,
    DeviceNode,
    Driver,
    Health,
    HostFS,
    ResourceConfig,
    SelectorError,
    check_pci_selectors,
    selector_values,
)

from dph_widget.accel import AccelDevice, scan_accel

log = logging.getLogger(__name__)

OPERATIONAL = "operational"
HABANA_DRIVER = "habanalabs"
HABANA_ENV = "HABANA_VISIBLE_DEVICES"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

#: Config entries that serve what the vendors' own plugins serve, for a config file or a test.
SUGGESTED: Tuple[ResourceConfig, ...] = (
    ResourceConfig("npu.intel.com/accel", "widget", {"kernel_driver": "intel_vpu"}),
    ResourceConfig("habana.ai/gaudi", "widget", {"kernel_driver": HABANA_DRIVER}),
)


@dataclass(frozen=True)
class AccelEntry:
    accel: AccelDevice
    device: Device


@dataclass(frozen=True)
class AccelInventory:
    entries: Tuple[AccelEntry, ...]


class WidgetDriver(Driver):
    name = "widget"
    subsystems = ("accel", "pci")
    device_globs = ("/dev/accel/*",)
    selector_types = {**PCI_SELECTOR_TYPES, "device_type": (str,)}
    setting_types = {"index_env": (str,)}

    # -- configuration -------------------------------------------------------------------
    def check_selectors(self, selectors: Mapping[str, object]) -> None:
        super().check_selectors(selectors)
        check_pci_selectors(selectors)
        for value in selector_values(selectors, "device_type") or ():
            if not str(value).strip():
                raise SelectorError("device_type", 'empty device type (e.g. "GAUDI2")')

    def check_settings(self, settings: Mapping[str, object]) -> None:
        super().check_settings(settings)
        name = settings.get("index_env")
        if name and not _ENV_NAME.match(str(name)):
            raise SelectorError("index_env", f"{name!r} is not an environment variable name")

    def default_resources(self) -> Sequence[ResourceConfig]:
        """None. device-plugin-host has a built-in ``accel`` driver that serves the same
        devices under the vendors' names (habana.ai/gaudi, npu.intel.com/accel, ...); a second
        set of defaults would advertise each card twice, or be skipped by the host as a name
        another driver took. This package is served where config names ``driver = "widget"``
        (see SUGGESTED for the entries that mirror the vendors' plugins)."""
        return ()

    # -- discovery -----------------------------------------------------------------------
    def scan(self, host: HostFS) -> AccelInventory:
        found = scan_accel(host)
        shared_parents = {p for p, n in Counter(a.parent_name for a in found).items() if n > 1}
        entries = []
        for accel in found:
            device_id = accel.parent_name
            if accel.parent_name in shared_parents:
                device_id = f"{accel.parent_name}-{accel.name}"
                log.warning(
                    "accel %s: %s has several accel minors; using the id %s",
                    accel.name,
                    accel.parent_name,
                    device_id,
                )
            entries.append(AccelEntry(accel, _device(host, accel, device_id)))
        return AccelInventory(tuple(entries))

    def select(self, inventory: AccelInventory, resource: ResourceConfig) -> List[Device]:
        # The host matches the selectors against each Device's attributes (vendor, device,
        # kernel_driver, pci_address, device_type are all there); only index_env, a setting
        # that changes the device itself, needs this method. A PCI selector never matches a
        # platform NPU: it has no vendor or pci_address attribute.
        matches = self.matcher(resource.selectors)
        index_env = resource.settings.get("index_env")
        out: List[Device] = []
        for entry in inventory.entries:
            if not matches(entry.device.attributes):
                continue
            device = entry.device
            if index_env is not None:
                env = {str(index_env): str(entry.accel.index)} if index_env else {}
                device = replace(device, env=env)
            out.append(device)
        return out


def _device(host: HostFS, accel: AccelDevice, device_id: str) -> Device:
    problems: List[str] = []
    paths = [accel.dev_node]
    if accel.control_node:
        paths.append(accel.control_node)
    missing = [path for path in paths if not host.exists(path)]
    if missing:
        problems.append("device node " + ", ".join(missing) + " missing")
    if accel.pci is not None and accel.pci.enabled is False:
        problems.append("PCI function disabled (enable = 0)")
    status = accel.facts.get("status")
    if status is not None and status.lower() != OPERATIONAL:
        problems.append(f"{accel.kernel_driver or 'driver'} reports status {status!r}")
    attributes = _attributes(accel)
    env: Dict[str, str] = {}
    if accel.kernel_driver == HABANA_DRIVER:
        # The Habana runtime finds its cards by accel index; the host joins several with ",".
        env[HABANA_ENV] = str(accel.index)
    reason = "; ".join(problems)
    if problems:
        log.warning("accel %s (%s): unhealthy: %s", accel.name, device_id, reason)
    return Device(
        id=device_id,
        health=Health.UNHEALTHY if problems else Health.HEALTHY,
        health_reason=reason,
        numa_nodes=accel.numa_nodes,
        device_nodes=tuple(DeviceNode(path, path, "rw") for path in paths),
        env=env,
        attributes=attributes,
    )


def _attributes(accel: AccelDevice) -> Dict[str, str]:
    out: Dict[str, str] = {}
    if accel.pci is not None:
        out.update(accel.pci.attributes())
    else:
        out["parent"] = accel.parent_name
        if accel.kernel_driver:
            out["kernel_driver"] = accel.kernel_driver
        if accel.local_cpulist:
            out["local_cpulist"] = accel.local_cpulist
    out["accel"] = accel.name
    out["device_node"] = accel.dev_node
    if accel.control_node:
        out["control_node"] = accel.control_node
    if accel.dev_numbers:
        out["dev"] = accel.dev_numbers
    if accel.bus:
        out["bus"] = accel.bus
    out.update(accel.facts)
    return out
