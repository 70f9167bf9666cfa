"""The SR-IOV driver: one device per VF, id = the VF's PCI address.

What a container gets depends on the VF's driver, as with the SR-IOV network device plugin:
a vfio-pci VF (or a vendor vfio variant such as mlx5_vfio_pci) brings /dev/vfio/vfio and its
group node; a uio VF (igb_uio, uio_pci_generic) its /dev/uioN; a netdev VF nothing but its
RDMA char devices when it has an RDMA device. Every VF also sets
``PCIDEVICE_<RESOURCE>=<address>``: DPDK and CNIs need the address whatever the driver, and
the host joins the values of all allocated VFs with ",".

Health. A missing device node (vfio group or container, uio, uverbs), a vfio-bound VF without
an IOMMU group, and a VF bound to no driver (mid-rebind, unusable) are Unhealthy with the
reason named. The PF's link state is carried (``pf_operstate``/``pf_carrier`` and on the
inventory) but not yet used for health.

Defaults. None: an SR-IOV pool is a choice of PF, VF range and driver that only the operator
can make, and a catch-all pool would hand out VFs another pool or the host itself uses.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from drivers.rdma.sysfs import CharIndex, scan_char_devices
from drivers.sriov.selectors import index_ranges, parse_pf
from drivers.sriov.sysfs import LINK_TYPES, VirtualFunction, list_virtual_functions
from host.driver import Driver, SelectorError, selector_values
from host.health import TransitionLog, link_problem
from host.hostfs import HostFS
from host.model import Device, DeviceNode, Health, ResourceConfig
from host.pci import PCI_SELECTOR_TYPES, check_pci_selectors, matches_pci

log = logging.getLogger(__name__)

VFIO_CONTAINER = "/dev/vfio/vfio"

VFIO = "vfio"
UIO = "uio"
NETDEVICE = "netdevice"
UNBOUND = "unbound"


def env_name(resource_name: str) -> str:
    """``intel.com/sriov_netdevice`` -> ``PCIDEVICE_INTEL_COM_SRIOV_NETDEVICE``."""
    return "PCIDEVICE_" + re.sub(r"[^A-Za-z0-9]", "_", resource_name).upper()


def is_vfio_driver(driver: Optional[str]) -> bool:
    """vfio-pci, or a vendor variant of it (mlx5_vfio_pci, ice_vfio_pci, hisi_acc_vfio_pci)
    that hands out the same /dev/vfio group node."""
    return bool(driver) and (driver == "vfio-pci" or driver.endswith("_vfio_pci"))  # type: ignore[union-attr]


@dataclass(frozen=True)
class VfRecord:
    """A VF with what a container would get, decided once per scan."""

    vf: VirtualFunction
    mode: str
    nodes: Tuple[DeviceNode, ...]
    problem: str  # why it is unusable now; empty when it is
    has_verbs: bool  # an RDMA device with a usable verbs node
    link_down: str = ""  # the PF's link problem (part of ``problem``), logged once per PF

    def attributes(self) -> Dict[str, str]:
        vf = self.vf
        out = vf.function.attributes()
        out["pf_pci_address"] = vf.pf.function.address
        out["vf_index"] = str(vf.index)
        out["vf_mode"] = self.mode
        if vf.pf.netdev:
            out["pf_name"] = vf.pf.netdev.name
            if vf.pf.netdev.operstate:
                out["pf_operstate"] = vf.pf.netdev.operstate
            if vf.pf.netdev.carrier is not None:
                out["pf_carrier"] = "1" if vf.pf.netdev.carrier else "0"
        if vf.netdev:
            out["netdev"] = vf.netdev.name
        if vf.link_type:
            out["link_type"] = vf.link_type
        if vf.rdma_devices:
            out["rdma_device"] = ",".join(vf.rdma_devices)
        return out


@dataclass(frozen=True)
class SriovInventory:
    vfs: Tuple[VfRecord, ...] = ()


def _vfio(host: HostFS, vf: VirtualFunction) -> Tuple[List[DeviceNode], List[str]]:
    group = vf.function.iommu_group
    if group is None:
        return [], [
            f"VF {vf.function.address} is bound to {vf.function.kernel_driver} but has no "
            "iommu_group (IOMMU off?)"
        ]
    nodes, problems = [], []
    group_node = f"/dev/vfio/{group}"
    if not host.exists(group_node) and host.exists(f"/dev/vfio/noiommu-{group}"):
        group_node = f"/dev/vfio/noiommu-{group}"  # vfio's no-IOMMU mode names it so
    for path in (VFIO_CONTAINER, group_node):
        if host.exists(path):
            nodes.append(DeviceNode(path))
        else:
            problems.append(f"VF {vf.function.address}: device node {path} is missing")
    return nodes, problems


def _rdma(vf: VirtualFunction, chars: CharIndex) -> Tuple[List[DeviceNode], List[str], bool]:
    nodes, problems = [], []
    sole = len(vf.rdma_devices) == 1
    has_verbs = False
    for ibdev in vf.rdma_devices:
        verbs = chars.verbs_of(ibdev, vf.function.path, sole)
        for entry in verbs:
            if entry.present:
                nodes.append(DeviceNode(entry.node))
                has_verbs = True
            else:
                problems.append(
                    f"VF {vf.function.address} ({ibdev}): device node {entry.node} is missing"
                )
        if verbs:
            nodes.extend(
                DeviceNode(entry.node)
                for entry in chars.umad_of(ibdev, vf.function.path, sole)
                if entry.present
            )
    if has_verbs and chars.rdma_cm:
        nodes.append(DeviceNode(chars.rdma_cm))
    return nodes, problems, has_verbs


def build_record(host: HostFS, vf: VirtualFunction, chars: Optional[CharIndex]) -> VfRecord:
    driver = vf.function.kernel_driver
    nodes: List[DeviceNode] = []
    problems: List[str] = []
    has_verbs = False
    if not driver:
        mode = UNBOUND
        problems.append(f"VF {vf.function.address} is not bound to any driver")
    elif is_vfio_driver(driver):
        mode = VFIO
        nodes, problems = _vfio(host, vf)
    elif vf.uio:
        mode = UIO
        for name in vf.uio:
            path = f"/dev/{name}"
            if host.exists(path):
                nodes.append(DeviceNode(path))
            else:
                problems.append(f"VF {vf.function.address}: device node {path} is missing")
    else:
        mode = NETDEVICE
        if vf.rdma_devices and chars is not None:
            nodes, problems, has_verbs = _rdma(vf, chars)
    down = ""
    if vf.pf.netdev:  # a VF of a PF whose link is down can carry no traffic
        down = link_problem(f"PF {vf.pf.netdev.name}", vf.pf.netdev.operstate)
        if down:
            problems.append(down)
    return VfRecord(
        vf=vf, mode=mode, nodes=tuple(nodes), problem="; ".join(problems), has_verbs=has_verbs,
        link_down=down,
    )


class SriovDriver(Driver):
    name = "sriov"
    subsystems = ("pci", "net")
    selector_types = {
        **PCI_SELECTOR_TYPES,
        "pf_name": (str,),
        "pf_pci_address": (str,),
        "vf_index": (int, str),
        "link_type": (str,),
        "rdma": (bool,),
    }

    def __init__(self) -> None:
        # What was last logged about each PF link and VF: health lines on change only.
        self._health_log = TransitionLog(log)

    # -- configuration -----------------------------------------------------------------
    def check_selectors(self, selectors: Mapping[str, object]) -> None:
        super().check_selectors(selectors)
        check_pci_selectors(selectors)
        for key in ("pf_name", "pf_pci_address"):
            for value in selector_values(selectors, key) or []:
                try:
                    parse_pf(str(value))
                except ValueError as error:
                    raise SelectorError(key, str(error)) from None
        for value in selector_values(selectors, "vf_index") or []:
            try:
                index_ranges(value)
            except ValueError as error:
                raise SelectorError("vf_index", str(error)) from None
        known = sorted(set(LINK_TYPES.values()))
        for value in selector_values(selectors, "link_type") or []:
            if str(value).lower() not in known:
                raise SelectorError(
                    "link_type", f"{value!r} is not a link type ({' or '.join(known)})"
                )

    # -- discovery ---------------------------------------------------------------------
    def scan(self, host: HostFS) -> SriovInventory:
        vfs = list_virtual_functions(host, host.machine_numa_nodes())
        chars = scan_char_devices(host) if any(vf.rdma_devices for vf in vfs) else None
        inventory = SriovInventory(vfs=tuple(build_record(host, vf, chars) for vf in vfs))
        self._log_links(inventory)
        return inventory

    def _log_links(self, inventory: SriovInventory) -> None:
        """One line when a PF's link goes down (with how many VFs it takes), one when it is
        back: not one per VF per scan per resource (issues 10.5, 11.16)."""
        pfs: Dict[str, Tuple[str, int]] = {}
        for record in inventory.vfs:
            netdev = record.vf.pf.netdev
            if netdev is None:
                continue
            down, count = pfs.get(netdev.name, ("", 0))
            pfs[netdev.name] = (record.link_down or down, count + 1)
        for name, (down, count) in pfs.items():
            self._health_log.update(
                ("pf", name), down,
                f"{down}: its {count} VF(s) are reported Unhealthy",
                f"link of PF {name} is up again; its VFs are usable",
            )
        present = {record.vf.function.address for record in inventory.vfs}
        self._health_log.retain([("pf", name) for name in pfs] + [
            key for key in self._health_log.active if key[0] == "vf" and key[2] in present])

    def select(self, inventory: SriovInventory, resource: ResourceConfig) -> Sequence[Device]:
        key = env_name(resource.name)
        want_rdma = resource.selectors.get("rdma")
        out = []
        for record in inventory.vfs:
            if not _matches(record, resource.selectors):
                continue
            problem = record.problem
            if want_rdma is True and record.mode == NETDEVICE and not record.has_verbs:
                problem = problem or (
                    f"VF {record.vf.function.address} has RDMA device "
                    f"{','.join(record.vf.rdma_devices)} but no usable uverbs node"
                )
            # Logged here, not in scan: a VF no resource selects is nobody's problem. The PF's
            # link is logged once per PF in scan; each problem once, when it starts.
            own = "; ".join(p for p in problem.split("; ") if p and p != record.link_down)
            self._health_log.update(
                ("vf", resource.name, record.vf.function.address), own,
                f"resource {resource.name}: {own}; reported Unhealthy",
            )
            out.append(
                Device(
                    id=record.vf.function.address,
                    health=Health.UNHEALTHY if problem else Health.HEALTHY,
                    health_reason=problem,
                    numa_nodes=record.vf.function.numa_nodes,
                    device_nodes=record.nodes,
                    env={key: record.vf.function.address},
                    attributes=record.attributes(),
                )
            )
        return out


def _short(address: str) -> str:
    return address[5:] if address.startswith("0000:") else address


def _matches(record: VfRecord, selectors: Mapping[str, object]) -> bool:
    vf = record.vf
    if not matches_pci(vf.function, selectors):
        return False
    pf_names = selector_values(selectors, "pf_name")
    if pf_names is not None:
        names = (vf.pf.netdev.name,) if vf.pf.netdev else ()
        if not any(parse_pf(str(value)).matches(names, vf.index) for value in pf_names):
            return False
    pf_addresses = selector_values(selectors, "pf_pci_address")
    if pf_addresses is not None:
        address = vf.pf.function.address
        names = (address, _short(address))
        if not any(parse_pf(str(value)).matches(names, vf.index) for value in pf_addresses):
            return False
    indexes = selector_values(selectors, "vf_index")
    if indexes is not None and not any(vf.index in index_ranges(value) for value in indexes):
        return False
    link_types = selector_values(selectors, "link_type")
    if link_types is not None and vf.link_type not in {str(v).lower() for v in link_types}:
        return False
    rdma = selectors.get("rdma")
    return rdma is None or bool(vf.rdma_devices) == rdma
