"""The RDMA driver: HCAs from /sys/class/infiniband, served exclusively or shared.

Ids. Exclusive ids are the PCI address of the HCA's function, not the ibdev name: ``mlx5_N``
numbers follow probe order and rdma-core's udev rules may rename devices (``ibp59s0f0``), so
the same card can change name across a reboot or an OS image, while the kubelet checkpoints
ids. An RDMA device that hangs off an auxiliary device below the function (an mlx5 SF) gets
``<pci address>-<aux device>``. Shared ids are ``<resource suffix>-<n>``: they name slots, not
hardware, so they are stable by construction.

Health. A selected HCA without a usable verbs node (no uverbs entry, or its /dev node gone)
is Unhealthy with the node named. In shared mode such an HCA is left out of the shared set
(logged) so the others stay usable; only when no selected HCA is usable are all slots
Unhealthy. An HCA none of whose ports is ACTIVE is Unhealthy too (ports that report no state
are not judged); the port states are also carried in attributes.

Defaults. None. A default shared pool would put every HCA's char devices in any pod that
asks, which is a fabric-access decision for the operator; and ``rdma/hca_shared_devices_a``
is the name the RDMA shared device plugin registers, so a default here would fight an
existing deployment for the same resource at the kubelet.
"""

from __future__ import annotations

import logging
import posixpath
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from device_plugin_host import (
    PCI_SELECTOR_TYPES,
    Device,
    DeviceNode,
    Driver,
    Health,
    HostFS,
    PciFunction,
    RdmaCharDevice,
    ResourceConfig,
    SelectorError,
    check_pci_selectors,
    read_function,
    scan_char_devices,
    selector_values,
)
from drivers.rdma.sysfs import LINK_LAYERS, IbDevice, count_by_parent, list_ib_devices

log = logging.getLogger(__name__)

def rdma_ports_problem(device: str, states: Iterable[Tuple[int, Optional[str]]]) -> str:
    """An RDMA device none of whose ports is ACTIVE (ports without a state are not judged)."""
    known = [(number, state) for number, state in states if state]
    if not known or any(state.upper() == "ACTIVE" for _, state in known):
        return ""
    listing = ", ".join(f"port {number} {state}" for number, state in known)
    return f"no port of {device} is ACTIVE ({listing})"

EXCLUSIVE = "exclusive"
SHARED = "shared"
#: Each id costs ~50 bytes in every ListAndWatch message; 10000 keeps the list far below the
#: kubelet's 4 MiB gRPC message limit while exceeding any sane number of pods per node.
MAX_SHARED_COUNT = 10000


@dataclass(frozen=True)
class Hca:
    """One RDMA device on a PCI function, with its char devices matched."""

    id: str
    ib: IbDevice
    function: PciFunction
    verbs: Tuple[RdmaCharDevice, ...]
    umad: Tuple[RdmaCharDevice, ...]

    @property
    def problem(self) -> str:
        """Why a container could not use this HCA now; empty when it can."""
        if not self.verbs:
            return (
                f"RDMA device {self.ib.name} ({self.function.address}) has no uverbs device "
                "in /sys/class/infiniband_verbs (is ib_uverbs loaded?)"
            )
        missing = [entry.node for entry in self.verbs if not entry.present]
        if missing:
            return (
                f"RDMA device {self.ib.name} ({self.function.address}): device node "
                f"{', '.join(missing)} is missing"
            )
        return rdma_ports_problem(self.ib.name, ((p.number, p.state) for p in self.ib.ports))

    def nodes(self) -> List[DeviceNode]:
        """The HCA's own char devices that exist now (rdma_cm is added by the caller)."""
        return [DeviceNode(entry.node) for entry in (*self.verbs, *self.umad) if entry.present]

    def attributes(self) -> Dict[str, str]:
        out = self.function.attributes()
        out["ib_device"] = self.ib.name
        if self.ib.node_guid:
            out["node_guid"] = self.ib.node_guid
        if self.ib.link_layers:
            out["link_layer"] = ",".join(self.ib.link_layers)
        if self.ib.netdevs:
            out["netdev"] = ",".join(self.ib.netdevs)
        states = [f"{port.number}:{port.state}" for port in self.ib.ports if port.state]
        if states:
            out["port_state"] = ",".join(states)
        if self.verbs:
            out["uverbs"] = ",".join(entry.name for entry in self.verbs)
        return out


@dataclass(frozen=True)
class RdmaInventory:
    hcas: Tuple[Hca, ...] = ()
    rdma_cm: Optional[str] = None


class RdmaDriver(Driver):
    name = "rdma"
    subsystems = ("infiniband", "pci", "net")
    device_globs = ("/dev/infiniband/*",)
    selector_types = {
        **PCI_SELECTOR_TYPES,
        "ib_device": (str,),
        "link_layer": (str,),
        "netdev": (str,),
    }
    setting_types = {"mode": (str,), "shared_count": (int,)}

    # -- configuration -----------------------------------------------------------------
    def check_selectors(self, selectors: Mapping[str, object]) -> None:
        super().check_selectors(selectors)
        check_pci_selectors(selectors)
        for value in selector_values(selectors, "link_layer") or []:
            if str(value).lower() not in LINK_LAYERS:
                raise SelectorError(
                    "link_layer", f"{value!r} is not a link layer (InfiniBand or Ethernet)"
                )

    def check_settings(self, settings: Mapping[str, object]) -> None:
        super().check_settings(settings)
        mode = settings.get("mode", EXCLUSIVE)
        if mode not in (EXCLUSIVE, SHARED):
            raise SelectorError("mode", f'{mode!r} is not "exclusive" or "shared"')
        count = settings.get("shared_count")
        if mode == EXCLUSIVE:
            if count is not None:
                raise SelectorError("shared_count", 'only meaningful with mode = "shared"')
            return
        if count is None:
            raise SelectorError("shared_count", 'mode = "shared" needs shared_count (1 or more)')
        assert isinstance(count, int)
        if not 1 <= count <= MAX_SHARED_COUNT:
            raise SelectorError("shared_count", f"must be from 1 to {MAX_SHARED_COUNT}")

    # -- discovery ---------------------------------------------------------------------
    def scan(self, host: HostFS) -> RdmaInventory:
        valid_numa = host.machine_numa_nodes()
        devices = list_ib_devices(host)
        chars = scan_char_devices(host)
        per_parent = count_by_parent(devices)
        found: List[Tuple[str, IbDevice, PciFunction]] = []
        for ib in devices:
            if ib.pci_path is None:
                log.info(
                    "RDMA device %s: not on a PCI function (software RDMA such as rxe or "
                    "siw); skipped",
                    ib.name,
                )
                continue
            function = read_function(host, posixpath.basename(ib.pci_path), valid_numa)
            if function is None:
                log.warning(
                    "RDMA device %s: its PCI function %s is not in /sys/bus/pci/devices; skipped",
                    ib.name,
                    posixpath.basename(ib.pci_path),
                )
                continue
            key = function.address
            if ib.parent != function.path:
                key = f"{function.address}-{posixpath.basename(ib.parent)}"
            found.append((key, ib, function))

        taken: Dict[str, int] = {}
        for key, _, _ in found:
            taken[key] = taken.get(key, 0) + 1
        hcas = []
        for key, ib, function in found:
            device_id = key
            if taken[key] > 1:
                device_id = f"{key}-{ib.name}"
                log.warning(
                    "RDMA device %s: %s has %d RDMA devices; its id %s follows the device "
                    "name, which may change across reboots",
                    ib.name,
                    key,
                    taken[key],
                    device_id,
                )
            sole = per_parent.get(ib.parent, 0) == 1
            hcas.append(
                Hca(
                    id=device_id,
                    ib=ib,
                    function=function,
                    verbs=tuple(chars.verbs_of(ib.name, ib.parent, sole)),
                    umad=tuple(chars.umad_of(ib.name, ib.parent, sole)),
                )
            )
            for entry in hcas[-1].umad:
                if not entry.present:
                    log.warning(
                        "RDMA device %s: umad node %s is missing; not handed out",
                        ib.name,
                        entry.node,
                    )
        hcas.sort(key=lambda hca: hca.id)
        return RdmaInventory(hcas=tuple(hcas), rdma_cm=chars.rdma_cm)

    def select(self, inventory: RdmaInventory, resource: ResourceConfig) -> Sequence[Device]:
        # The PCI selectors and ib_device are matched by the host against each HCA's
        # attributes; link_layer and netdev are lists on the HCA (an interface name may hold
        # a comma, so the joined attribute is not the list), matched here.
        selectors = resource.selectors
        matches = self.matcher({k: v for k, v in selectors.items() if k not in _LIST_KEYS})
        hcas = [hca for hca in inventory.hcas
                if matches(hca.attributes()) and _lists_match(hca, selectors)]
        if resource.settings.get("mode", EXCLUSIVE) == SHARED:
            count = resource.settings.get("shared_count", 1)
            assert isinstance(count, int)
            return _shared(resource, hcas, inventory.rdma_cm, count)
        return [_exclusive(hca, inventory.rdma_cm) for hca in hcas]


#: Selector keys the driver matches itself: facts that are lists on the HCA.
_LIST_KEYS = ("link_layer", "netdev")


def _lists_match(hca: Hca, selectors: Mapping[str, object]) -> bool:
    layers = selector_values(selectors, "link_layer")
    if layers is not None:
        wanted = {str(value).lower() for value in layers}
        if not any(layer.lower() in wanted for layer in hca.ib.link_layers):
            return False
    netdevs = selector_values(selectors, "netdev")
    return netdevs is None or any(name in netdevs for name in hca.ib.netdevs)


def _exclusive(hca: Hca, rdma_cm: Optional[str]) -> Device:
    nodes = hca.nodes()
    if rdma_cm:
        nodes.append(DeviceNode(rdma_cm))
    problem = hca.problem
    if problem:
        log.warning("%s; reported Unhealthy", problem)
    return Device(
        id=hca.id,
        health=Health.UNHEALTHY if problem else Health.HEALTHY,
        health_reason=problem,
        numa_nodes=hca.function.numa_nodes,
        device_nodes=tuple(nodes),
        attributes=hca.attributes(),
    )


def _shared(
    resource: ResourceConfig, hcas: Sequence[Hca], rdma_cm: Optional[str], count: int
) -> List[Device]:
    """``count`` ids, each carrying every usable selected HCA; none when nothing matched."""
    if not hcas:
        return []
    usable = [hca for hca in hcas if not hca.problem]
    for hca in hcas:
        if hca.problem:
            log.warning("resource %s: %s; left out of the shared set", resource.name, hca.problem)
    nodes: List[DeviceNode] = []
    for hca in usable:
        nodes.extend(hca.nodes())
    if rdma_cm and usable:
        nodes.append(DeviceNode(rdma_cm))
    numa = tuple(sorted({node for hca in usable for node in hca.function.numa_nodes}))
    reason = "" if usable else "; ".join(hca.problem for hca in hcas)
    attributes = {
        "mode": SHARED,
        "ib_devices": ",".join(hca.ib.name for hca in usable),
        "pci_addresses": ",".join(hca.function.address for hca in usable),
    }
    suffix = resource.name.split("/", 1)[-1]
    return [
        Device(
            id=f"{suffix}-{index}",
            health=Health.HEALTHY if usable else Health.UNHEALTHY,
            health_reason=reason,
            numa_nodes=numa,
            device_nodes=tuple(nodes),
            attributes=dict(attributes),
        )
        for index in range(count)
    ]
