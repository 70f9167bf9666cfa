"""Intel FPGA cards through the kernel's Device Feature List framework, read once.

Enumeration follows Documentation/fpga/dfl.rst: every /sys/class/fpga_region/regionX whose
directory holds ``dfl-fme.N`` or ``dfl-port.N`` children is a card's *base* region (the other
regions are the FME's partial-reconfiguration regions, one per port). The owning PCI function
is the nearest PCI directory above the region. The interface id (what a green bitstream must
be built for) is the ``compat_id`` of the FME's PR region,
``dfl-fme.N/dfl-fme-region.P/fpga_region/regionM/compat_id``; the accelerator loaded into a port
is that port's ``afu_id``. A port released to a VF lives in the VF's own base region without an
FME, so its interface id is the PF's (found through the VF's ``physfn`` link).

The out-of-tree OPAE driver (intel-fpga, /sys/class/fpga/intel-fpga-dev.N with
``intel-fpga-fme.N/pr/interface_id``) has the same shape and is read by the same code.
"""

from __future__ import annotations

import logging
import posixpath
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

from device_plugin_host import HostFS, PciFunction, read_function

log = logging.getLogger(__name__)

FPGA_REGIONS = "/sys/class/fpga_region"
OPAE_FPGA = "/sys/class/fpga"
DFL_BUS = "/sys/bus/dfl/devices"
#: What afu_id / compat_id read as when the card's firmware has crashed (the Intel FPGA
#: plugin reports such a port Unhealthy, and so do we).
ALL_ONES = "f" * 32


@dataclass(frozen=True)
class FpgaNode:
    """A /dev node; ``present`` says whether /dev has it at scan time."""

    name: str
    dev_path: str
    present: bool


@dataclass(frozen=True)
class DflFme:
    name: str  # dfl-fme.0
    path: str
    node: FpgaNode
    interface_id: Optional[str]  # 32 lowercase hex digits, or None when unknown
    bitstream_id: Optional[str]


@dataclass(frozen=True)
class DflPort:
    name: str  # dfl-port.0
    path: str
    port_id: Optional[int]  # the ``id`` attribute: the port's index on its card
    afu_id: Optional[str]
    node: FpgaNode


@dataclass(frozen=True)
class DflRegion:
    name: str  # region0 (DFL) or intel-fpga-dev.0 (OPAE)
    path: str
    stack: str  # "dfl" or "intel-fpga"
    function: Optional[PciFunction]
    numa_nodes: Tuple[int, ...]
    fme: Optional[DflFme]  # its own, or for a VF the PF's
    fme_owned: bool
    ports: Tuple[DflPort, ...]
    pf_address: Optional[str] = None  # for a VF: the PF whose FME manages it
    feature_ids: Tuple[str, ...] = ()  # dfl bus private features below this region

    @property
    def interface_id(self) -> Optional[str]:
        return self.fme.interface_id if self.fme is not None else None

    @property
    def address(self) -> Optional[str]:
        return self.function.address if self.function is not None else None


def normalise_uuid(text: Optional[str]) -> Optional[str]:
    """A 128-bit id as 32 lowercase hex digits: the kernel prints compat_id and afu_id that
    way; operators paste them with dashes (UUID form) or a 0x. None when it is not one."""
    if text is None:
        return None
    value = text.strip().lower().replace("-", "")
    if value.startswith("0x"):
        value = value[2:]
    if len(value) != 32 or any(ch not in "0123456789abcdef" for ch in value):
        return None
    return value


def scan_dfl(host: HostFS, valid_numa: Optional[Sequence[int]]) -> List[DflRegion]:
    regions: List[DflRegion] = []
    stacks = (
        (FPGA_REGIONS, "region", "dfl", "dfl-fme.", "dfl-port."),
        (OPAE_FPGA, "intel-fpga-dev.", "intel-fpga", "intel-fpga-fme.", "intel-fpga-port."),
    )
    for class_dir, prefix, stack, fme_prefix, port_prefix in stacks:
        for name in host.listdir(class_dir):
            if not name.startswith(prefix):
                continue
            path = host.resolve(f"{class_dir}/{name}")
            if path is None:
                log.info("fpga region %s: its sysfs link dangles; skipped", name)
                continue
            region = _read_region(host, name, path, stack, fme_prefix, port_prefix, valid_numa)
            if region is not None:
                regions.append(region)
    regions = _borrow_pf_fme(host, regions)
    return _attach_features(host, regions)


def _read_region(
    host: HostFS,
    name: str,
    path: str,
    stack: str,
    fme_prefix: str,
    port_prefix: str,
    valid_numa: Optional[Sequence[int]],
) -> Optional[DflRegion]:
    children = host.listdir(path)
    fme_names = [c for c in children if c.startswith(fme_prefix)]
    port_names = sorted((c for c in children if c.startswith(port_prefix)), key=_number)
    if not fme_names and not port_names:
        return None  # an FME's PR region, or a region of another FPGA framework
    pci = host.pci_ancestor(path)
    function = read_function(host, posixpath.basename(pci), valid_numa) if pci else None
    if function is None:
        log.info("fpga region %s: no PCI function above %s; ids use the port names", name, path)
    if len(fme_names) > 1:
        log.warning(
            "fpga region %s: %d FMEs (%s); using %s",
            name,
            len(fme_names),
            ", ".join(fme_names),
            fme_names[0],
        )
    fme = _read_fme(host, f"{path}/{fme_names[0]}", fme_names[0]) if fme_names else None
    ports = tuple(_read_port(host, f"{path}/{p}", p) for p in port_names)
    return DflRegion(
        name=name,
        path=path,
        stack=stack,
        function=function,
        numa_nodes=function.numa_nodes if function is not None else host.numa_of(path),
        fme=fme,
        fme_owned=fme is not None,
        ports=ports,
    )


def _number(name: str) -> Tuple[int, str]:
    tail = name.rsplit(".", 1)[-1]
    return (int(tail), name) if tail.isdigit() else (1 << 30, name)


def _node(host: HostFS, sys_path: str, name: str) -> FpgaNode:
    """The /dev node of a char device: the uevent's DEVNAME when sane, else /dev/<name>."""
    devname = None
    for line in (host.read(f"{sys_path}/uevent") or "").splitlines():
        key, _, value = line.partition("=")
        if key == "DEVNAME" and value and not value.startswith("/") and ".." not in value:
            devname = value.strip()
    dev_path = f"/dev/{devname or name}"
    return FpgaNode(name, dev_path, host.exists(dev_path))


def _read_fme(host: HostFS, path: str, name: str) -> DflFme:
    interface_id = None
    raw = None
    for child in host.listdir(path):
        if not child.startswith("dfl-fme-region."):
            continue
        for region in host.listdir(f"{path}/{child}/fpga_region"):
            raw = host.read(f"{path}/{child}/fpga_region/{region}/compat_id")
            interface_id = normalise_uuid(raw)
            if interface_id is not None:
                break
        if interface_id is not None:
            break
    if interface_id is None:
        legacy = host.read(f"{path}/pr/interface_id")
        interface_id = normalise_uuid(legacy)
        raw = raw if legacy is None else legacy
    if interface_id is None and raw is not None:
        log.warning("fpga %s: interface id %r is not a 128-bit hex id; ignored", name, raw)
    return DflFme(
        name=name,
        path=path,
        node=_node(host, path, name),
        interface_id=interface_id,
        bitstream_id=host.read(f"{path}/bitstream_id") or None,
    )


def _read_port(host: HostFS, path: str, name: str) -> DflPort:
    raw = host.read(f"{path}/afu_id")
    afu_id = normalise_uuid(raw)
    if afu_id is None:
        if raw is None:
            log.info("fpga %s: afu_id unreadable (port in reset?)", name)
        else:
            log.warning("fpga %s: afu_id %r is not a 128-bit hex id; ignored", name, raw)
    return DflPort(
        name=name,
        path=path,
        port_id=host.read_int(f"{path}/id", 10),
        afu_id=afu_id,
        node=_node(host, path, name),
    )


def _borrow_pf_fme(host: HostFS, regions: List[DflRegion]) -> List[DflRegion]:
    """Give a VF's region the FME of its PF: the interface id a bitstream for that port must
    match, and the node that programs it."""
    owners: Dict[str, DflRegion] = {
        r.function.address: r for r in regions if r.function is not None and r.fme_owned
    }
    out = []
    for region in regions:
        if region.fme is None and region.function is not None:
            pf = host.link_name(f"{region.function.path}/physfn")
            if pf is not None:
                owner = owners.get(pf)
                if owner is None:
                    log.info("fpga region %s: VF of %s, whose FME was not found", region.name, pf)
                region = replace(region, pf_address=pf, fme=owner.fme if owner else None)
        out.append(region)
    return out


def _attach_features(host: HostFS, regions: List[DflRegion]) -> List[DflRegion]:
    """Private features on the dfl bus (dfl_dev.N: feature_id, type), credited to the base
    region they sit under; shown as attributes, they tell an N3000 from a D5005 at a glance."""
    names = host.listdir(DFL_BUS)
    if not names:
        return regions
    found: Dict[str, List[str]] = {}
    for name in names:
        path = host.resolve(f"{DFL_BUS}/{name}")
        feature = host.read_int(f"{path}/feature_id", 16) if path else None
        if path is None or feature is None:
            continue
        for region in regions:
            if path.startswith(region.path + "/"):
                found.setdefault(region.path, []).append(f"0x{feature:x}")
    return [
        replace(r, feature_ids=tuple(sorted(set(found[r.path]), key=lambda f: int(f, 16))))
        if r.path in found
        else r
        for r in regions
    ]
