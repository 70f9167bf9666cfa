"""SR-IOV physical and virtual functions as the kernel links them in sysfs.

A PF lists its VFs as ``virtfnN`` links (N is the VF index the PF driver and ``ip link set vf``
use); each VF points back with ``physfn``. The index only exists on the PF side, so VFs are
found from the PFs and ``physfn`` is the cross-check: a VF whose two directions disagree, or a
link that dangles while ``sriov_numvfs`` is being changed, is logged and left out rather than
reported with a guessed index. No driver policy lives here.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

from device_plugin_host import PCI_DEVICES, HostFS, PciFunction, read_function

log = logging.getLogger(__name__)

#: ARPHRD_* values of ``net/<if>/type`` the SR-IOV world names (if_arp.h).
LINK_TYPES = {1: "ether", 32: "infiniband"}

_VIRTFN = re.compile(r"virtfn(\d+)\Z")
#: The driver NVIDIA's vGPU VFs stay bound to (vendor-specific VFIO, vGPU 17+).
NVIDIA_DRIVER = "nvidia"
_UPLINK_PORT = re.compile(r"p\d+\Z")  # mlx5/ice switchdev uplink: phys_port_name "p0"
_REPRESENTOR = re.compile(r"(c\d+)?pf\d+(vf|sf)\d+\Z")  # "pf0vf3": a VF representor


@dataclass(frozen=True)
class NetInterface:
    name: str
    link_type: Optional[str]  # "ether" / "infiniband"; None for other or unreadable types
    operstate: Optional[str]  # "up", "down", "lowerlayerdown", ...
    carrier: Optional[bool]  # None when unreadable (the kernel refuses it while admin-down)


@dataclass(frozen=True)
class PhysicalFunction:
    function: PciFunction
    netdev: Optional[NetInterface]
    numvfs: Optional[int]
    totalvfs: Optional[int]


@dataclass(frozen=True)
class VirtualFunction:
    function: PciFunction
    index: int
    pf: PhysicalFunction
    netdev: Optional[NetInterface]
    rdma_devices: Tuple[str, ...]  # names in the VF's infiniband/ dir (mlx5_4)
    uio: Tuple[str, ...]  # uioN of a VF on igb_uio / uio_pci_generic
    # NVIDIA vGPU (vendor-specific VFIO, vGPU 17+): a VF left on ``nvidia`` carries
    # nvidia/current_vgpu_type (the numeric type id, "0" for none) and
    # nvidia/creatable_vgpu_types ("<id> : <name>" lines); None/"" elsewhere.
    vgpu_type: Optional[str] = None
    vgpu_creatable: str = ""

    @property
    def link_type(self) -> Optional[str]:
        """The PF's link type (the port's), else the VF's own interface's."""
        if self.pf.netdev and self.pf.netdev.link_type:
            return self.pf.netdev.link_type
        return self.netdev.link_type if self.netdev else None


def read_interface(host: HostFS, device_path: str, name: str) -> NetInterface:
    base = f"{device_path}/net/{name}"
    kind = host.read_int(f"{base}/type", 10)
    carrier = host.read_int(f"{base}/carrier", 10)
    return NetInterface(
        name=name,
        link_type=LINK_TYPES.get(kind) if kind is not None else None,
        operstate=host.read(f"{base}/operstate") or None,
        carrier=None if carrier is None else carrier == 1,
    )


def read_netdev(host: HostFS, device_path: str) -> Optional[NetInterface]:
    """The function's own interface. In switchdev mode the PF's net/ also holds its VF
    representors (phys_port_name "pf0vf3"); the uplink (phys_port_name "p0") is the PF's."""
    names = host.listdir(f"{device_path}/net")
    if not names:
        return None
    if len(names) > 1:
        ports = {
            name: host.read(f"{device_path}/net/{name}/phys_port_name") or "" for name in names
        }
        uplinks = [name for name in names if _UPLINK_PORT.match(ports[name])]
        others = [name for name in names if not _REPRESENTOR.match(ports[name])]
        names = uplinks or others or names
    return read_interface(host, device_path, names[0])


def _virtfns(host: HostFS, pf_link: str) -> List[Tuple[int, str]]:
    """(index, link name) of a PF's virtfnN links, in index order."""
    out = []
    for name in host.listdir(pf_link):
        match = _VIRTFN.match(name)
        if match:
            out.append((int(match.group(1)), name))
    return sorted(out)


def _with_pf_locality(function: PciFunction, pf: PciFunction) -> PciFunction:
    """A VF sits on the PF's card: when its own numa_node/local_cpulist say nothing, the PF's
    are the truth (the kernel copies them, but not every kernel or hypervisor does)."""
    changes: Dict[str, object] = {}
    if not function.numa_nodes and pf.numa_nodes:
        changes["numa_nodes"] = pf.numa_nodes
    if not function.local_cpulist and pf.local_cpulist:
        changes["local_cpulist"] = pf.local_cpulist
    return replace(function, **changes) if changes else function  # type: ignore[arg-type]


def list_virtual_functions(
    host: HostFS, valid_numa: Optional[Sequence[int]] = None
) -> List[VirtualFunction]:
    """Every VF of every PF, in (PF address, index) order."""
    addresses = host.listdir(PCI_DEVICES)
    claimed: Dict[str, str] = {}  # VF address -> PF address, from physfn links
    pf_addresses = []
    for address in addresses:
        link = f"{PCI_DEVICES}/{address}"
        physfn = host.link_name(f"{link}/physfn")
        if physfn:
            claimed[address] = physfn
        elif host.exists(f"{link}/sriov_totalvfs") or host.exists(f"{link}/sriov_numvfs"):
            pf_addresses.append(address)

    listed = set()
    out = []
    for pf_address in pf_addresses:
        pf_function = read_function(host, pf_address, valid_numa)
        if pf_function is None:
            continue
        link = f"{PCI_DEVICES}/{pf_address}"
        pf = PhysicalFunction(
            function=pf_function,
            netdev=read_netdev(host, pf_function.path),
            numvfs=host.read_int(f"{link}/sriov_numvfs", 10),
            totalvfs=host.read_int(f"{link}/sriov_totalvfs", 10),
        )
        virtfns = _virtfns(host, link)
        if pf.numvfs is not None and pf.numvfs != len(virtfns):
            log.info(
                "PF %s: sriov_numvfs is %d but %d virtfn links exist (VFs being changed?); "
                "using the links",
                pf_address,
                pf.numvfs,
                len(virtfns),
            )
        for index, name in virtfns:
            vf_address = host.link_name(f"{link}/{name}")
            if vf_address is None or not host.exists(f"{link}/{name}"):
                log.warning("PF %s: %s is a dangling link; VF %d skipped", pf_address, name, index)
                continue
            listed.add(vf_address)
            back = claimed.get(vf_address)
            if back is not None and back != pf_address:
                log.warning(
                    "VF %s: listed by PF %s as %s but its physfn names %s; skipped",
                    vf_address,
                    pf_address,
                    name,
                    back,
                )
                continue
            function = read_function(host, vf_address, valid_numa)
            if function is None:
                log.warning(
                    "VF %s (PF %s %s): not in %s; skipped",
                    vf_address,
                    pf_address,
                    name,
                    PCI_DEVICES,
                )
                continue
            function = _with_pf_locality(function, pf_function)
            vgpu_type: Optional[str] = None
            vgpu_creatable = ""
            if function.kernel_driver == NVIDIA_DRIVER:
                vgpu_type = host.read(f"{function.path}/nvidia/current_vgpu_type")
                if vgpu_type is not None:
                    vgpu_creatable = host.read(
                        f"{function.path}/nvidia/creatable_vgpu_types") or ""
            out.append(
                VirtualFunction(
                    function=function,
                    index=index,
                    pf=pf,
                    netdev=read_netdev(host, function.path),
                    rdma_devices=tuple(host.listdir(f"{function.path}/infiniband")),
                    uio=tuple(
                        name
                        for name in host.listdir(f"{function.path}/uio")
                        if name.startswith("uio") and name[3:].isdigit()
                    ),
                    vgpu_type=vgpu_type,
                    vgpu_creatable=vgpu_creatable,
                )
            )
    for vf_address, pf_address in sorted(claimed.items()):
        if vf_address not in listed:
            log.warning(
                "VF %s: its physfn names PF %s, which has no virtfn link to it; skipped "
                "(its VF index is unknown)",
                vf_address,
                pf_address,
            )
    return out
