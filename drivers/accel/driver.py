"""The accel driver: one Device per accel minor of the kernel's accel class.

Rules, chosen so that every device the kubelet sees is either usable or visibly Unhealthy:

* The id is the parent's name: the PCI address of a card (stable across reboots), the
  platform device name of a SoC NPU. Never the accel index: drm_accel.c hands indexes out in
  probe order. Two minors under one parent (not done by any driver today) get
  ``<parent>-accelN``.
* A container gets /dev/accel/accelN, plus /dev/accel/accel_controlDN where habanalabs made
  one (the Gaudi stack, hl-thunk, opens both; HabanaAI's device plugin hands out both), plus
  the verbs node of each RDMA device whose parent is the card (a Gaudi 3's scale-out ports,
  ``hbl_N`` -> /dev/infiniband/uverbsM), as Intel's Gaudi DRA driver does in its CDI spec. A
  card whose RDMA device has no verbs device (ib_uverbs not loaded) is served without one,
  as there; a verbs device whose /dev node is missing makes it Unhealthy.
* Unhealthy, with the reason: a device node missing from /dev, a PCI function with
  ``enable`` = 0, a Gaudi whose habanalabs ``status`` is not "operational" ("needs reset",
  "in reset", "disabled", "in device creation", "in reset after device release" are the
  driver's other states, habanalabs_drv.c). An unreadable status claims nothing.
* NUMA comes from the PCI function (or the platform device's nearest ancestor); -1 or a node
  the machine lacks means no topology.
* Default resources use the names the vendors' own device plugins advertise, so pod specs
  written for those keep working (see VENDOR_DEFAULTS). AMD publishes no device plugin for
  its XDNA NPU, so ``amdxdna`` devices are served only where config names them.
* Gaudi cards carry HABANA_VISIBLE_DEVICES=<accel index> (HabanaAI's OCI hook keeps only the
  /dev/accel nodes whose index is listed there); ``settings.index_env`` names another
  variable for other stacks ("" for none). The host joins several cards' values with ",".
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
    check_class_selector,
    check_pci_selectors,
    selector_values,
)
from drivers.accel.sysfs import AccelMinor, scan_minors

log = logging.getLogger(__name__)

HABANA_DRIVER = "habanalabs"
HABANA_ENV = "HABANA_VISIBLE_DEVICES"
OPERATIONAL = "operational"
HABANA_HEALTH_INTERVAL_S = 30.0

#: kernel driver -> default resource name, and where the name comes from.
VENDOR_DEFAULTS: Mapping[str, Tuple[str, str]] = {
    # HabanaAI/habanalabs-k8s-device-plugin registers "habana.ai/gaudi".
    HABANA_DRIVER: ("habana.ai/gaudi", "HabanaAI habanalabs-k8s-device-plugin"),
    # intel/intel-device-plugins-for-kubernetes cmd/npu_plugin: namespace npu.intel.com,
    # device type "accel".
    "intel_vpu": ("npu.intel.com/accel", "Intel device plugins for Kubernetes, NPU plugin"),
    # Qualcomm's Cloud AI 100 device plugin advertises "qualcomm.com/qaic".
    "qaic": ("qualcomm.com/qaic", "Qualcomm Cloud AI 100 device plugin"),
}

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class AccelEntry:
    minor: AccelMinor
    device: Device


@dataclass(frozen=True)
class AccelInventory:
    entries: Tuple[AccelEntry, ...]


class AccelDriver(Driver):
    name = "accel"
    subsystems = ("accel", "pci", "infiniband", "infiniband_verbs")
    device_globs = ("/dev/accel/*", "/dev/infiniband/uverbs*")
    selector_types = {**PCI_SELECTOR_TYPES, "class": (str,), "device_type": (str,)}
    setting_types = {"index_env": (str,)}

    # -- configuration -------------------------------------------------------------------
    def check_selectors(self, selectors: Mapping[str, object]) -> None:
        super().check_selectors(selectors)
        check_pci_selectors(selectors)
        check_class_selector(selectors)
        for value in selector_values(selectors, "device_type") or ():
            if not str(value).strip():
                raise SelectorError("device_type", 'empty device type (e.g. "GAUDI2")')

    def check_settings(self, settings: Mapping[str, object]) -> None:
        super().check_settings(settings)
        name = settings.get("index_env")
        if name and not _ENV_NAME.match(str(name)):
            raise SelectorError("index_env", f"{name!r} is not an environment variable name")

    def default_resources(self) -> Sequence[ResourceConfig]:
        """The vendors' names. habanalabs changes ``status`` without a uevent, so the Gaudi
        resource is looked at every HABANA_HEALTH_INTERVAL_S as well."""
        return tuple(
            ResourceConfig(
                name, self.name, {"kernel_driver": driver}, register_when_empty=False,
                health_interval_s=HABANA_HEALTH_INTERVAL_S if driver == HABANA_DRIVER else 0.0,
            )
            for driver, (name, _) in VENDOR_DEFAULTS.items()
        )

    # -- discovery -----------------------------------------------------------------------
    def scan(self, host: HostFS) -> AccelInventory:
        minors = scan_minors(host)
        shared = {p for p, n in Counter(m.parent_name for m in minors).items() if n > 1}
        entries = []
        for minor in minors:
            device_id = minor.parent_name
            if minor.parent_name in shared:
                device_id = f"{minor.parent_name}-{minor.name}"
                log.warning("accel: %s has several accel minors; %s is %s",
                            minor.parent_name, minor.name, device_id)
            entries.append(AccelEntry(minor, _device(host, minor, device_id)))
        return AccelInventory(tuple(entries))

    def select(self, inventory: AccelInventory, resource: ResourceConfig) -> List[Device]:
        # Selectors are matched by the host against the attributes (PCI facts, class,
        # device_type); a platform NPU has no PCI attributes, so a PCI selector never
        # matches one. Only index_env (a setting) shapes the device here.
        matches = self.matcher(resource.selectors)
        index_env = resource.settings.get("index_env")
        out: List[Device] = []
        for entry in inventory.entries:
            if not matches(entry.device.attributes):
                continue
            device = entry.device
            if index_env is not None:
                env = {str(index_env): str(entry.minor.index)} if index_env else {}
                device = replace(device, env=env)
            out.append(device)
        return out


def _device(host: HostFS, minor: AccelMinor, device_id: str) -> Device:
    problems: List[str] = []
    paths = [minor.dev_node]
    if minor.control_node:
        paths.append(minor.control_node)
    elif minor.kernel_driver == HABANA_DRIVER:
        problems.append(f"habanalabs made no control node accel_controlD{minor.index}")
    paths.extend(verbs.node for rdma in minor.rdma for verbs in rdma.verbs)
    problems.extend(f"device node {p} missing" for p in paths if not host.exists(p))
    if minor.pci is not None and minor.pci.enabled is False:
        problems.append("PCI function disabled (enable = 0)")
    status = minor.facts.get("status")
    if status is not None and status.lower() != OPERATIONAL:
        problems.append(f"habanalabs reports status {status!r}")
    env: Dict[str, str] = {}
    if minor.kernel_driver == HABANA_DRIVER:
        env[HABANA_ENV] = str(minor.index)
    reason = "; ".join(problems)
    if problems:
        log.warning("accel %s (%s): unhealthy: %s", minor.name, device_id, reason)
    return Device(
        id=device_id,
        health=Health.UNHEALTHY if problems else Health.HEALTHY,
        health_reason=reason,
        numa_nodes=minor.numa_nodes,
        device_nodes=tuple(DeviceNode(p, p, "rw") for p in paths),
        env=env,
        attributes=_attributes(minor),
    )


def _attributes(minor: AccelMinor) -> Dict[str, str]:
    out: Dict[str, str] = {}
    if minor.pci is not None:
        out.update(minor.pci.attributes())
    else:
        out["parent"] = minor.parent_name
        if minor.kernel_driver:
            out["kernel_driver"] = minor.kernel_driver
    out["accel"] = minor.name
    out["accel_index"] = str(minor.index)
    out["device_node"] = minor.dev_node
    if minor.control_node:
        out["control_node"] = minor.control_node
    if minor.rdma:
        out["rdma_devices"] = ",".join(r.name for r in minor.rdma)
        out["rdma_verbs"] = ",".join(v.node for r in minor.rdma for v in r.verbs)
    if minor.dev_numbers:
        out["dev"] = minor.dev_numbers
    out.update(minor.facts)
    if "device_type" in minor.facts:
        out["model"] = minor.facts["device_type"]  # what discover's table shows as the model
    return out
