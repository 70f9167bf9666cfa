"""The neuron driver: AWS Inferentia/Trainium devices, one Device per /dev/neuronN.

Rules, chosen so that every device the kubelet sees is usable or visibly Unhealthy, and no
topology is claimed that the tree does not prove:

* The id is ``neuron<N>``, the driver's own device index: the name the Neuron runtime, the
  tools (neuron-ls "NEURON DEVICE") and AWS_NEURON_VISIBLE_DEVICES use. It is stable across
  reboots on Inf2/Trn1/Trn2, where it is the firmware routing id. It is never matched to a
  PCI function by position: the routing id does not follow PCI order, and sysfs has no link
  from neuronN to its function.
* NUMA: from the class device's own PCI parent where a driver links one; otherwise only when
  every PCI function bound to the Neuron driver (``neuron-driver``, module ``neuron``) sits
  on the same known NUMA node and there are as many functions as devices (an inf2.xlarge,
  or a node whose cards are all behind one socket).
  Anywhere else (a trn1.32xlarge spans two sockets) there is no topology: a wrong one would
  make the kubelet's topology manager pin pods to the wrong socket.
* Unhealthy, with the reason: /dev/neuronN missing, or the driver's device state (``reset``
  attribute) 0 "in reset" or 2 "invalid" (a reset that failed). An unreadable state claims
  nothing.
* A container gets /dev/neuronN and AWS_NEURON_VISIBLE_DEVICES=<N> (what AWS's device plugin
  sets and the Neuron OCI hook reads); several devices are joined with ",".
* GetPreferredAllocation prefers devices wired to each other (``connected_devices``, the
  firmware's torus/ring) so collectives stay on device links (drivers/neuron/topology.py).
* ``settings.unit = "core"`` advertises each NeuronCore instead (``neuron<N>-core<K>``), with
  NEURON_RT_VISIBLE_CORES=<N * core_count + K>, the runtime's global core numbering, and the
  device's node (shared by the containers holding its cores, as AWS's neuroncore resource does).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from device_plugin_host import (
    Device,
    DeviceNode,
    Driver,
    Health,
    HostFS,
    PreferredRequest,
    ResourceConfig,
    SelectorError,
    selector_values,
)
from drivers.neuron.sysfs import NeuronDevice, NeuronScan, scan
from drivers.neuron.topology import connected_preferred, cores_preferred

log = logging.getLogger(__name__)

DEVICES_ENV = "AWS_NEURON_VISIBLE_DEVICES"
CORES_ENV = "NEURON_RT_VISIBLE_CORES"
STATES: Mapping[str, str] = {"0": "in reset", "1": "", "2": "invalid (reset failed)"}
UNITS = ("device", "core")
HEALTH_INTERVAL_S = 30.0


@dataclass(frozen=True)
class NeuronEntry:
    neuron: NeuronDevice
    device: Device  # the whole device; its cores are derived only for unit = "core"


@dataclass(frozen=True)
class NeuronInventory:
    entries: Tuple[NeuronEntry, ...]


class NeuronDriver(Driver):
    name = "neuron"
    subsystems = ("neuron_device", "pci")
    device_globs = ("/dev/neuron*",)
    selector_types = {"index": (int,), "device_name": (str,), "instance_type": (str,)}
    selector_attributes = {"index": "neuron_index"}
    setting_types = {"unit": (str,)}

    def check_selectors(self, selectors: Mapping[str, object]) -> None:
        super().check_selectors(selectors)
        for value in selector_values(selectors, "index") or ():
            if isinstance(value, int) and value < 0:
                raise SelectorError("index", "a neuron device index is 0 or more")

    def check_settings(self, settings: Mapping[str, object]) -> None:
        super().check_settings(settings)
        unit = settings.get("unit")
        if unit is not None and unit not in UNITS:
            raise SelectorError("unit", f"{unit!r}: expected one of {', '.join(UNITS)}")

    def default_resources(self) -> Sequence[ResourceConfig]:
        # AWS's k8s-neuron-device-plugin (aws-neuron-sdk src/k8/) advertises
        # aws.amazon.com/neuron for whole devices. Its neuroncore resource counts the same
        # silicon again, so cores are served only where config asks (unit = "core").
        # The device state (reset attribute) changes without a uevent: look every 30 s.
        return (ResourceConfig("aws.amazon.com/neuron", self.name, {}, register_when_empty=False,
                               health_interval_s=HEALTH_INTERVAL_S),)

    def scan(self, host: HostFS) -> NeuronInventory:
        found = scan(host)
        shared_numa, why = _shared_numa(found)
        entries = []
        for neuron in found.devices:
            numa, source = shared_numa, why
            if neuron.pci is not None:
                numa, source = neuron.pci.numa_nodes, f"PCI function {neuron.pci.address}"
            device = _device(host, neuron, numa, source)
            entries.append(NeuronEntry(neuron, device))
        return NeuronInventory(tuple(entries))

    def select(self, inventory: NeuronInventory, resource: ResourceConfig) -> List[Device]:
        # index, device_name and instance_type are matched by the host against the
        # attributes (index as neuron_index); unit = "core" shapes the devices here.
        matches = self.matcher(resource.selectors)
        cores = resource.settings.get("unit") == "core"
        out: List[Device] = []
        for entry in inventory.entries:
            if matches(entry.device.attributes):
                out.extend(_cores(entry.neuron, entry.device) if cores else (entry.device,))
        return out

    def preferred(
        self, resource: ResourceConfig, request: PreferredRequest
    ) -> Optional[Sequence[str]]:
        """Linked devices (connected_devices) for whole devices, cores packed onto few devices
        for unit = "core"; None (the host's NUMA-compact policy) with replicas, whose ids are
        the host's, or when no connected set of the size is available."""
        if resource.replicas > 1:
            return None
        healthy = [d for d in request.available if d.healthy]
        if resource.settings.get("unit") == "core":
            return cores_preferred(healthy, request.must_include, request.size)
        must = list(request.must_include)
        pool = healthy + [d for d in must if not d.healthy]
        return connected_preferred(pool, must, request.size)

    def preferred_useful(self, resource: ResourceConfig, devices: Sequence[Device]) -> bool:
        """Cores are packed onto few devices; whole devices follow connected_devices."""
        if resource.replicas > 1:
            return False
        if resource.settings.get("unit") == "core":
            return True
        return any(d.attributes.get("connected_devices") for d in devices)



def _shared_numa(found: NeuronScan) -> Tuple[Tuple[int, ...], str]:
    """The NUMA node every device must be on, with the proof, or () with why not."""
    nodes = {fn.numa_nodes for fn in found.functions}
    if not found.functions:
        return (), "unknown: no PCI function bound to neuron-driver"
    if len(found.functions) != len(found.devices):
        return (), (f"unknown: {len(found.functions)} neuron PCI functions for "
                    f"{len(found.devices)} devices")
    if len(nodes) != 1 or () in nodes:
        return (), ("unknown: neuron PCI functions span NUMA nodes and sysfs does not say"
                    " which device is which")
    (only,) = nodes
    return only, "every neuron PCI function is on this node"


def _device(
    host: HostFS, neuron: NeuronDevice, numa: Tuple[int, ...], numa_source: str
) -> Device:
    problems = []
    if not host.exists(neuron.dev_node):
        problems.append(f"device node {neuron.dev_node} missing")
    state = STATES.get(neuron.state or "")
    if state:
        problems.append(f"neuron driver reports device state {neuron.state} ({state})")
    attributes: Dict[str, str] = {"neuron_index": str(neuron.index), "numa_source": numa_source}
    if neuron.pci is not None:
        attributes.update(neuron.pci.attributes())
    for key, value in (
        ("dev", neuron.dev_numbers), ("device_state", neuron.state),
        ("core_count", None if neuron.core_count is None else str(neuron.core_count)),
        ("connected_devices", neuron.connected), ("arch_type", neuron.arch_type),
        ("instance_type", neuron.instance_type), ("device_name", neuron.device_name),
    ):
        if value:
            attributes[key] = value
    if neuron.device_name:
        attributes["model"] = neuron.device_name  # what discover's table shows as the model
    reason = "; ".join(problems)
    if problems:
        log.warning("neuron %s: unhealthy: %s", neuron.name, reason)
    return Device(
        id=neuron.name,
        health=Health.UNHEALTHY if problems else Health.HEALTHY,
        health_reason=reason,
        numa_nodes=numa,
        device_nodes=(DeviceNode(neuron.dev_node, neuron.dev_node, "rw"),),
        env={DEVICES_ENV: str(neuron.index)},
        attributes=attributes,
    )


def _cores(neuron: NeuronDevice, device: Device) -> Tuple[Device, ...]:
    if not neuron.core_count or neuron.core_count < 0:
        return ()
    out = []
    for core in range(neuron.core_count):
        global_core = neuron.index * neuron.core_count + core
        out.append(Device(
            id=f"{neuron.name}-core{core}",
            health=device.health,
            health_reason=device.health_reason,
            numa_nodes=device.numa_nodes,
            device_nodes=device.device_nodes,
            env={CORES_ENV: str(global_core)},
            attributes={**device.attributes, "neuron_core": str(core),
                        "global_core": str(global_core)},
        ))
    return tuple(out)
