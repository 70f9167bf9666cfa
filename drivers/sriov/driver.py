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

Beyond NICs. Any PF's VFs are served: a VF on its own non-network driver (QAT's 4xxxvf, nvme)
is mode "kernel" and brings its address only. A QAT PF's service (``qat/cfg_services``) is a
selector, and a PF that is down or whose firmware heartbeat failed makes its VFs Unhealthy
(drivers/sriov/qat.py). ``iommufd = true`` hands vfio VFs out as /dev/iommu plus their
/dev/vfio/devices/vfioN instead of the container and group nodes. Allocate adds the SR-IOV
device plugin's ``PCIDEVICE_<RESOURCE>_INFO`` and, with ``device_info = true``, writes the
NPWG device-info files (host/outputs/devinfo.py, which also removes them).

NVIDIA vGPU. On an Ada/Hopper-or-later GPU with SR-IOV vGPU (vGPU 17+, NVIDIA's
vendor-specific VFIO), the VFs stay bound to ``nvidia``; each carries
``nvidia/current_vgpu_type`` (the numeric type id written by the operator or the vGPU device
manager, "0" for none) and ``nvidia/creatable_vgpu_types`` ("<id> : <name>" lines). Such a VF
is mode "vgpu": a VM gets /dev/vfio/vfio and /dev/vfio/<iommu group> (or, with ``iommufd``,
/dev/iommu and its /dev/vfio/devices/vfioN), as NVIDIA's kubevirt-gpu-device-plugin hands
them out, and ``PCI_RESOURCE_<RESOURCE>=<address>``, the variable KubeVirt's
``permittedHostDevices`` reads. The ``vgpu_type`` selector names the type ("NVIDIA L40S-24Q",
spaces or "_" alike, or its numeric id). Type ids are card-local: a name is resolved from the
catalogs of the VF's own card (its PF and sibling VFs; a configured VF often lists only its
own type, a full card none), else from the other cards' only where they all agree. A VF with
no type set is Unhealthy with that reason.

Defaults. None: an SR-IOV pool is a choice of PF, VF range and driver that only the operator
can make, and a catch-all pool would hand out VFs another pool or the host itself uses.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass, field, replace
from typing import Dict, FrozenSet, Hashable, List, Mapping, Optional, Sequence, Tuple

from device_plugin_host import (
    PCI_SELECTOR_TYPES,
    AttributeTest,
    ContainerAllocation,
    Device,
    DeviceNode,
    Driver,
    Health,
    HostFS,
    RdmaCharIndex,
    ResourceConfig,
    SelectorError,
    TransitionLog,
    check_pci_selectors,
    scan_char_devices,
    selector_values,
    write_device_info,
)
from drivers.sriov.qat import QatPf, parse_services, read_qat
from drivers.sriov.selectors import index_ranges, parse_pf
from drivers.sriov.sysfs import (
    LINK_TYPES,
    NVIDIA_DRIVER,
    VirtualFunction,
    list_virtual_functions,
)

log = logging.getLogger(__name__)

#: Link states that mean "no traffic can pass" (operstate values from the kernel's IF_OPER_*).
LINK_DOWN = frozenset({"down", "lowerlayerdown", "notpresent"})


def link_problem(interface: str, operstate: Optional[str]) -> str:
    """A netdev whose link is down; "unknown"/"dormant"/missing are not judged (many drivers
    never report operstate, and a VF's link only comes up inside its pod)."""
    if operstate and operstate.lower() in LINK_DOWN:
        return f"link of {interface} is {operstate}"
    return ""

VFIO_CONTAINER = "/dev/vfio/vfio"
IOMMUFD = "/dev/iommu"  # the iommufd misc device (drivers/iommu/iommufd/main.c)

VFIO = "vfio"
UIO = "uio"
NETDEVICE = "netdevice"
KERNEL = "kernel"  # bound to its own kernel driver but no network function: 4xxxvf, nvme
VGPU = "vgpu"  # an NVIDIA vGPU VF on ``nvidia`` (vendor-specific VFIO)
NO_VGPU_TYPE = ("", "0")
_CREATABLE = re.compile(r"\s*(\d+)\s*:\s*(.+?)\s*\Z")
UNBOUND = "unbound"


def env_name(resource_name: str) -> str:
    """``intel.com/sriov_netdevice`` -> ``PCIDEVICE_INTEL_COM_SRIOV_NETDEVICE``."""
    return "PCIDEVICE_" + re.sub(r"[^A-Za-z0-9]", "_", resource_name).upper()


def kubevirt_env_name(resource_name: str) -> str:
    """KubeVirt's ``ResourceNameToEnvVar("PCI_RESOURCE", name)``: upper case, "/" and "."
    to "_" (``nvidia.com/NVIDIA_L40S-24Q`` -> ``PCI_RESOURCE_NVIDIA_COM_NVIDIA_L40S-24Q``)."""
    return "PCI_RESOURCE_" + resource_name.upper().replace("/", "_").replace(".", "_")


def vgpu_key(name: str) -> str:
    """A vGPU type name as NVIDIA's plugins name resources: whitespace runs to "_"."""
    return re.sub(r"\s+", "_", name.strip())


def parse_creatable(text: str) -> Dict[str, str]:
    """``creatable_vgpu_types``: {"1155": "NVIDIA L40S-24Q"}; the header ("ID : vGPU Name")
    and odd lines are skipped."""
    out: Dict[str, str] = {}
    for line in text.splitlines():
        match = _CREATABLE.match(line)
        if match:
            out.setdefault(match.group(1), match.group(2))
    return out


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
    # iommufd: the VF's /dev/vfio/devices/vfioN (+ /dev/iommu) and why they are unusable;
    # read only when a resource asks for iommufd.
    cdev_nodes: Tuple[DeviceNode, ...] = ()
    cdev_problem: str = ""
    group_problems: Tuple[str, ...] = ()  # the part of ``problem`` about group nodes
    link_down: str = ""  # the PF's link problem (part of ``problem``), logged once per PF
    vgpu_name: str = ""  # the configured vGPU type's name ("NVIDIA L40S-24Q"), once resolved

    @property
    def kind(self) -> str:
        """The mode as the SR-IOV world names it: a VF on its own kernel driver is a
        "netdevice" only when it is a network function (class 0x02) or has an interface;
        a QAT VF on 4xxxvf or an NVMe VF on nvme is "kernel". By class too, since a VF's
        netdev leaves the host's sysfs while it sits in a pod's network namespace."""
        if self.mode == NETDEVICE and self.vf.netdev is None and \
                self.vf.function.base_class != 0x02:
            return KERNEL
        return self.mode

    def attributes(self, qat: Optional[QatPf] = None) -> Dict[str, str]:
        vf = self.vf
        out = vf.function.attributes()
        out["pf_pci_address"] = vf.pf.function.address
        out["vf_index"] = str(vf.index)
        out["vf_mode"] = self.kind
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
        if vf.pf.function.kernel_driver:
            out["pf_kernel_driver"] = vf.pf.function.kernel_driver
        if vf.vgpu_type is not None:
            out["vgpu_type_id"] = vf.vgpu_type
        if self.vgpu_name:
            out["vgpu_type"] = self.vgpu_name
        if qat is not None:
            if qat.services:
                out["qat_services"] = qat.services
            if qat.state:
                out["qat_state"] = qat.state
            out["qat_heartbeat"] = qat.heartbeat
        return out


@dataclass(frozen=True)
class SriovInventory:
    vfs: Tuple[VfRecord, ...] = ()
    qat: Mapping[str, QatPf] = field(default_factory=dict)  # per QAT PF address
    # Each VF's attributes (``vfs`` order), built once per scan: what selectors are matched
    # against and what its Device carries, in every resource.
    attributes: Tuple[Mapping[str, str], ...] = ()


@functools.lru_cache(maxsize=8192)
def _node(path: str) -> DeviceNode:
    """DeviceNodes are immutable: one per path serves every VF and scan (each vfio VF lists
    /dev/vfio/vfio; building one checks its permissions every time)."""
    return DeviceNode(path)


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
            nodes.append(_node(path))
        else:
            problems.append(f"VF {vf.function.address}: device node {path} is missing")
    return nodes, problems


def _rdma(vf: VirtualFunction, chars: RdmaCharIndex) -> Tuple[List[DeviceNode], List[str], bool]:
    nodes, problems = [], []
    sole = len(vf.rdma_devices) == 1
    has_verbs = False
    for ibdev in vf.rdma_devices:
        verbs = chars.verbs_of(ibdev, vf.function.path, sole)
        for entry in verbs:
            if entry.present:
                nodes.append(_node(entry.node))
                has_verbs = True
            else:
                problems.append(
                    f"VF {vf.function.address} ({ibdev}): device node {entry.node} is missing"
                )
        if verbs:
            nodes.extend(
                _node(entry.node)
                for entry in chars.umad_of(ibdev, vf.function.path, sole)
                if entry.present
            )
    if has_verbs and chars.rdma_cm:
        nodes.append(_node(chars.rdma_cm))
    return nodes, problems, has_verbs


def build_record(host: HostFS, vf: VirtualFunction, chars: Optional[RdmaCharIndex]) -> VfRecord:
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
    elif driver == NVIDIA_DRIVER and vf.vgpu_type is not None:
        mode = VGPU
        if vf.vgpu_type in NO_VGPU_TYPE:
            problems.append(f"VF {vf.function.address}: no vGPU type set "
                            "(nvidia/current_vgpu_type is 0)")
        else:
            nodes, problems = _vfio(host, vf)
    elif vf.uio:
        mode = UIO
        for name in vf.uio:
            path = f"/dev/{name}"
            if host.exists(path):
                nodes.append(_node(path))
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
    device_globs = ("/dev/vfio/*", "/dev/vfio/devices/*", "/dev/iommu")
    selector_types = {
        **PCI_SELECTOR_TYPES,
        "pf_name": (str,),
        "pf_pci_address": (str,),
        "vf_index": (int, str),
        "link_type": (str,),
        "rdma": (bool,),
        "pf_kernel_driver": (str,),
        "qat_services": (str,),
        "vgpu_type": (str, int),
    }
    setting_types = {
        "iommufd": (bool,),
        "device_info": (bool,),
        "device_info_dir": (str,),
    }

    def __init__(self) -> None:
        # What was last logged about each PF link and VF: health lines on change only.
        self._health_log = TransitionLog(log)

    # -- selection: the SR-IOV keys that are more than one attribute -------------------------
    def selector_test(self, key: str, values: Sequence[object]) -> AttributeTest:
        if key == "pf_name":
            return _pf_test(values, "pf_name", short=False)
        if key == "pf_pci_address":
            return _pf_test(values, "pf_pci_address", short=True)
        if key == "vf_index":
            return _vf_index_test(values)
        if key == "link_type":
            types = {str(v).lower() for v in values}
            return lambda attributes: attributes.get("link_type") in types
        if key == "rdma":
            wanted = {bool(v) for v in values}
            return lambda attributes: ("rdma_device" in attributes) in wanted
        if key == "qat_services":
            return _qat_services_test(values)
        if key == "vgpu_type":
            return _vgpu_type_test(values)
        return super().selector_test(key, values)

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
        for value in selector_values(selectors, "vgpu_type") or []:
            if isinstance(value, bool) or not str(value).strip():
                raise SelectorError("vgpu_type", 'a vGPU type name ("NVIDIA L40S-24Q") or id')
        for value in selector_values(selectors, "qat_services") or []:
            try:
                parse_services(str(value))
            except ValueError as error:
                raise SelectorError("qat_services", str(error)) from None

    def check_settings(self, settings: Mapping[str, object]) -> None:
        super().check_settings(settings)
        directory = settings.get("device_info_dir")
        if directory is not None and not str(directory).startswith("/"):
            raise SelectorError("device_info_dir", f"must be an absolute path, got {directory!r}")

    # -- discovery ---------------------------------------------------------------------
    def discover(
        self, host: HostFS, resources: Sequence[ResourceConfig]
    ) -> Mapping[str, Sequence[Device]]:
        inventory = self._scan(host, iommufd=any(_iommufd(r) for r in resources))
        return {resource.name: list(self.select(inventory, resource)) for resource in resources}

    def scan(self, host: HostFS) -> SriovInventory:
        return self._scan(host, iommufd=False)

    def _scan(self, host: HostFS, iommufd: bool) -> SriovInventory:
        vfs = list_virtual_functions(host, host.machine_numa_nodes())
        chars = scan_char_devices(host) if any(vf.rdma_devices for vf in vfs) else None
        seen: Dict[str, Optional[QatPf]] = {}  # per PF: read once, not once per VF
        records = []
        for vf in vfs:
            record = build_record(host, vf, chars)
            pf_address = vf.pf.function.address
            if pf_address not in seen:
                seen[pf_address] = read_qat(host, vf.pf.function)
            if iommufd and _vfio_device(record):
                nodes, problems = _cdev(host, vf)
                record = replace(record, cdev_nodes=tuple(nodes),
                                 cdev_problem="; ".join(problems),
                                 group_problems=tuple(_vfio(host, vf)[1]))
            records.append(record)
        if any(r.mode == VGPU for r in records):
            records = _with_vgpu_names(host, records)
        qat = {address: facts for address, facts in seen.items() if facts is not None}
        attributes = tuple(r.attributes(qat.get(r.vf.pf.function.address)) for r in records)
        inventory = SriovInventory(vfs=tuple(records), qat=qat, attributes=attributes)
        self._log_links(inventory)
        return inventory

    def _log_links(self, inventory: SriovInventory) -> None:
        """One line when a PF's link goes down (with how many VFs it takes), one when it is
        back: not one per VF per scan per resource."""
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
        present_pfs = {record.vf.pf.function.address for record in inventory.vfs}
        keep: List[Hashable] = [("pf", name) for name in pfs]
        keep += [key for key in self._health_log.active if isinstance(key, tuple) and (
            (key[0] == "vf" and key[2] in present) or (key[0] == "qat" and key[2] in present_pfs))]
        self._health_log.retain(keep)

    def select(self, inventory: SriovInventory, resource: ResourceConfig) -> Sequence[Device]:
        key = env_name(resource.name)
        want_rdma = resource.selectors.get("rdma")
        iommufd = _iommufd(resource)
        matches = self.matcher(resource.selectors)
        qat_problems = {address: facts.problem(address) for address, facts in
                        inventory.qat.items()}
        out = []
        qat_vfs: Dict[str, int] = {}  # QAT PF address -> how many of its VFs this resource has
        for record, attributes in zip(inventory.vfs, inventory.attributes):
            pf_address = record.vf.pf.function.address
            if not matches(attributes):
                continue
            problem = record.problem
            pf_down = qat_problems.get(pf_address)
            if pf_down:
                problem = f"{problem}; {pf_down}" if problem else pf_down
            nodes = record.nodes
            if iommufd and _vfio_device(record):
                # The device's cdev replaces the legacy container and group nodes.
                nodes = record.cdev_nodes
                kept = [p for p in problem.split("; ") if p and p not in record.group_problems]
                problem = "; ".join([*kept, *([record.cdev_problem] if record.cdev_problem
                                              else [])])
            if want_rdma is True and record.mode == NETDEVICE and not record.has_verbs:
                problem = problem or (
                    f"VF {record.vf.function.address} has RDMA device "
                    f"{','.join(record.vf.rdma_devices)} but no usable uverbs node"
                )
            # Logged here, not in scan: a VF no resource selects is nobody's problem. The PF's
            # link is logged once per PF in scan; each problem once, when it starts.
            own = "; ".join(p for p in problem.split("; ")
                            if p and p != record.link_down and p != pf_down)
            if pf_address in inventory.qat:
                qat_vfs[pf_address] = qat_vfs.get(pf_address, 0) + 1
            self._health_log.update(
                ("vf", resource.name, record.vf.function.address), own,
                f"resource {resource.name}: {own}; reported Unhealthy",
            )
            env = {key: record.vf.function.address}
            if record.mode == VGPU:
                env[kubevirt_env_name(resource.name)] = record.vf.function.address
            out.append(
                Device(
                    id=record.vf.function.address,
                    health=Health.UNHEALTHY if problem else Health.HEALTHY,
                    health_reason=problem,
                    numa_nodes=record.vf.function.numa_nodes,
                    device_nodes=nodes,
                    env=env,
                    attributes=dict(attributes),
                )
            )
        # A QAT PF's own problem (down, firmware heartbeat) reads the same for each of its
        # VFs: one line per PF and resource with the count, when it starts and when it clears.
        for pf_address, count in qat_vfs.items():
            pf_problem = qat_problems.get(pf_address) or ""
            self._health_log.update(
                ("qat", resource.name, pf_address), pf_problem,
                f"resource {resource.name}: {pf_problem}: its {count} VF(s) are reported "
                "Unhealthy",
                f"resource {resource.name}: QAT PF {pf_address} is usable again",
            )
        return out

    # -- allocation ------------------------------------------------------------------------
    def allocate(
        self, resource: ResourceConfig, devices: Sequence[Device], merged: ContainerAllocation
    ) -> ContainerAllocation:
        """Add the SR-IOV device plugin's ``PCIDEVICE_<RESOURCE>_INFO`` (one JSON object over
        all allocated VFs, which the host's ","-join of per-device env cannot build) and, with
        ``device_info = true``, write the NPWG device-info file of each VF before the kubelet
        can start the pod's CNI. A file that cannot be written fails the Allocate with the
        path named: a pod whose network attachment would miss it must not start."""
        envs = dict(merged.envs)
        envs[env_name(resource.name) + "_INFO"] = json.dumps(
            {d.id: extra_info(d) for d in devices}, separators=(",", ":"), sort_keys=True)
        write_device_info(resource, devices)
        return replace(merged, envs=envs)


def extra_info(device: Device) -> Dict[str, Dict[str, str]]:
    """The per-VF map of ``PCIDEVICE_<RESOURCE>_INFO``, keyed like sriov-network-device-plugin's
    info providers: "generic" (deviceID), "vfio" (mount = the container node, dev-mount = the
    group node), "uio" (mount = its /dev/uioN) and "rdma" (its char devices and rdma_dev).
    For an iommufd resource "vfio" names the device cdev as dev-mount and /dev/iommu as
    "iommufd" (no container node exists there)."""
    out: Dict[str, Dict[str, str]] = {"generic": {"deviceID": device.id}}
    mode = device.attributes.get("vf_mode")
    paths = [node.container_path for node in device.device_nodes]
    if mode in (VFIO, VGPU):
        vfio: Dict[str, str] = {}
        for path in paths:
            if path == VFIO_CONTAINER:
                vfio["mount"] = path
            elif path == IOMMUFD:
                vfio["iommufd"] = path
            elif path.startswith("/dev/vfio/"):
                vfio["dev-mount"] = path
        out["vfio"] = vfio
    elif mode == UIO:
        uio = [p for p in paths if p.rsplit("/", 1)[-1].startswith("uio")]
        out["uio"] = {"mount": uio[0]} if uio else {}
    rdma: Dict[str, str] = {}
    for path in paths:
        name = path.rsplit("/", 1)[-1]
        for kind in ("uverbs", "umad", "issm", "rdma_cm"):
            if name.startswith(kind):
                rdma[kind] = path
    if rdma:
        if device.attributes.get("rdma_device"):
            rdma["rdma_dev"] = device.attributes["rdma_device"]
        out["rdma"] = rdma
    return out


def _vfio_device(record: VfRecord) -> bool:
    """A VF handed out through vfio: on vfio-pci (or a variant), or a vGPU VF with a type."""
    return record.mode == VFIO or (
        record.mode == VGPU and record.vf.vgpu_type not in NO_VGPU_TYPE)


def _with_vgpu_names(host: HostFS, records: List[VfRecord]) -> List[VfRecord]:
    """Each configured vGPU VF with its type's name, from its own card's catalog (the PF's
    and every sibling VF's creatable_vgpu_types), else from the host's where no two cards
    disagree about the id (ids are card-local). Unresolved: left without a name (logged)."""
    by_pf: Dict[str, Dict[str, str]] = {}
    for record in records:
        if record.mode != VGPU:
            continue
        pf = record.vf.pf.function
        catalog = by_pf.get(pf.address)
        if catalog is None:
            catalog = by_pf[pf.address] = parse_creatable(
                host.read(f"{pf.path}/nvidia/creatable_vgpu_types") or "")
        for type_id, type_name in parse_creatable(record.vf.vgpu_creatable).items():
            catalog.setdefault(type_id, type_name)
    host_wide: Dict[str, str] = {}
    ambiguous = set()
    for catalog in by_pf.values():
        for type_id, type_name in catalog.items():
            if host_wide.setdefault(type_id, type_name) != type_name:
                ambiguous.add(type_id)
    out = []
    for record in records:
        configured = record.vf.vgpu_type
        if record.mode != VGPU or configured is None or configured in NO_VGPU_TYPE:
            out.append(record)
            continue
        name: Optional[str] = by_pf[record.vf.pf.function.address].get(configured)
        if name is None and configured not in ambiguous:
            name = host_wide.get(configured)
        if name is None:
            log.debug("VF %s: vGPU type %s is in no creatable_vgpu_types of its card; "
                      "it matches vgpu_type by id only", record.vf.function.address, configured)
            out.append(record)
            continue
        out.append(replace(record, vgpu_name=name))
    return out


def _iommufd(resource: ResourceConfig) -> bool:
    return resource.settings.get("iommufd") is True


def _cdev(host: HostFS, vf: VirtualFunction) -> Tuple[List[DeviceNode], List[str]]:
    """iommufd: the VF's vfio device cdev, found as ``<function>/vfio-dev/vfioN`` (the
    "vfio-dev" class of drivers/vfio/vfio_main.c, parent = the PCI function; the node is
    /dev/vfio/devices/vfioN, drivers/vfio/device_cdev.c), plus /dev/iommu. A kernel built
    without CONFIG_VFIO_DEVICE_CDEV has no vfio-dev directory: the VF is Unhealthy with that
    reason rather than handed out with a group node the container was not asked to use."""
    address = vf.function.address
    names = [n for n in host.listdir(f"{vf.function.path}/vfio-dev")
             if n.startswith("vfio") and n[4:].isdigit()]
    if not names:
        return [], [f"VF {address} has no vfio-dev/vfioN (kernel without "
                    "CONFIG_VFIO_DEVICE_CDEV?); iommufd needs the device cdev"]
    nodes, problems = [], []
    for path in (IOMMUFD, f"/dev/vfio/devices/{names[0]}"):
        if host.exists(path):
            nodes.append(_node(path))
        else:
            problems.append(f"VF {address}: device node {path} is missing")
    return nodes, problems


def _short(address: str) -> str:
    return address[5:] if address.startswith("0000:") else address


def _pf_test(values: Sequence[object], attribute: str, short: bool) -> AttributeTest:
    """``pf_name`` / ``pf_pci_address``: the PF (by interface, or by address in either form)
    with an optional ``#<VF ranges>`` suffix."""
    pfs = [parse_pf(str(v)) for v in values]

    def test(attributes: Mapping[str, str]) -> bool:
        pf = attributes.get(attribute)
        index = attributes.get("vf_index")
        if pf is None or index is None:
            return False
        names = (pf, _short(pf)) if short else (pf,)
        return any(selector.matches(names, int(index)) for selector in pfs)

    return test


@functools.lru_cache(maxsize=64)
def _services(text: str) -> FrozenSet[str]:
    """A PF's ``qat_services`` attribute parsed (read_qat keeps only values that parse)."""
    return parse_services(text)


def _vf_index_test(values: Sequence[object]) -> AttributeTest:
    ranges = [index_ranges(v) for v in values]

    def test(attributes: Mapping[str, str]) -> bool:
        index = attributes.get("vf_index")
        return index is not None and any(int(index) in r for r in ranges)

    return test


def _qat_services_test(values: Sequence[object]) -> AttributeTest:
    wanted = [parse_services(str(v)) for v in values]

    def test(attributes: Mapping[str, str]) -> bool:
        services = attributes.get("qat_services")
        return services is not None and _services(services) in wanted

    return test


def _vgpu_type_test(values: Sequence[object]) -> AttributeTest:
    """A configured type (never "0") whose id or name (whitespace as "_") is selected."""
    wanted = {vgpu_key(str(v)) for v in values}

    def test(attributes: Mapping[str, str]) -> bool:
        type_id = attributes.get("vgpu_type_id")
        if type_id is None or type_id in NO_VGPU_TYPE:
            return False
        name = attributes.get("vgpu_type")
        return type_id in wanted or bool(name and vgpu_key(name) in wanted)

    return test
