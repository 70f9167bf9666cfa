"""The AMD KFD topology: which compute agents (whole GPUs or partitions) ROCm will see, and how
they are linked.

ROCm does not enumerate render nodes: it enumerates KFD topology nodes
(/sys/class/kfd/kfd/topology/nodes/<n>), and a render node without a KFD node is not a GPU it
will use. That matters on MI300: every GPU owns 8 DRM devices (its own and 7 ``amdgpu_xcp``
platform devices, allocated at probe whatever the partition mode), but only the live partitions
have KFD nodes. So KFD is the truth for "how many agents does this GPU have now".

Layout (kfd_topology.c): ``properties`` holds ``<key> <value>`` lines; a GPU node has
``location_id`` = PCI bus << 8 | devfn, with the partition id in bits 31:28 when the device has
more than one node (kfd_topology_add_device), ``domain`` = the PCI domain, and
``drm_render_minor`` = the render minor of that agent. CPU nodes have gpu_id 0 and no SIMDs.
``io_links/<m>/properties`` name the peer (``node_to``) and the link ``type`` (kfd_crat.h:
2 = PCIe, 11 = XGMI) with a ``weight`` (XGMI: 15 per hop).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

from host.hostfs import HostFS

TOPOLOGY = "/sys/class/kfd/kfd/topology/nodes"
IOLINK_XGMI = 11
XGMI_DIRECT_WEIGHT = 15  # one hop (kfd_crat.c KFD_CRAT_XGMI_WEIGHT)
_PARTITION_SHIFT = 28


@dataclass(frozen=True)
class KfdLink:
    to: int
    kind: int
    weight: int


@dataclass(frozen=True)
class KfdNode:
    """One GPU agent as KFD lists it."""

    node: int
    address: str  # the PCI function it belongs to, "0000:0c:00.0"
    partition: int  # location_id[31:28]; 0 on single-agent devices
    render_minor: int
    mem_bytes: Optional[int]
    links: Tuple[KfdLink, ...]


def parse_properties(text: str) -> Dict[str, str]:
    fields: Dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        if key:
            fields[key] = value.strip()
    return fields


def _int(fields: Mapping[str, str], key: str) -> Optional[int]:
    value = fields.get(key)
    if value is None:
        return None
    try:
        return int(value, 0)
    except ValueError:
        return None


def pci_address(domain: int, location_id: int) -> Tuple[str, int]:
    """("0000:0c:00.0", partition) from KFD's domain and location_id."""
    partition = (location_id >> _PARTITION_SHIFT) & 0xF
    bdf = location_id & 0xFFFF
    bus, devfn = bdf >> 8, bdf & 0xFF
    return f"{domain:04x}:{bus:02x}:{devfn >> 3:02x}.{devfn & 7}", partition


def read_topology(host: HostFS) -> List[KfdNode]:
    """Every GPU agent KFD lists; empty when KFD is not loaded or not visible."""
    out: List[KfdNode] = []
    for name in host.listdir(TOPOLOGY):
        if not name.isdigit():
            continue
        base = f"{TOPOLOGY}/{name}"
        text = host.read(f"{base}/properties")
        if not text:
            continue
        fields = parse_properties(text)
        if not _int(fields, "simd_count") or _int(fields, "cpu_cores_count"):
            continue  # a CPU node (APUs have both; their GPU is not a partition case)
        location = _int(fields, "location_id")
        domain = _int(fields, "domain") or 0
        render = _int(fields, "drm_render_minor")
        if location is None or not render or render < 0:
            continue
        address, partition = pci_address(domain, location)
        out.append(KfdNode(
            node=int(name),
            address=address,
            partition=partition,
            render_minor=render,
            mem_bytes=_mem_bytes(host, base),
            links=_links(host, base),
        ))
    return out


def _mem_bytes(host: HostFS, base: str) -> Optional[int]:
    total = 0
    found = False
    for bank in host.listdir(f"{base}/mem_banks"):
        text = host.read(f"{base}/mem_banks/{bank}/properties")
        size = _int(parse_properties(text or ""), "size_in_bytes")
        if size:
            total += size
            found = True
    return total if found else None


def _links(host: HostFS, base: str) -> Tuple[KfdLink, ...]:
    links = []
    for link in host.listdir(f"{base}/io_links"):
        fields = parse_properties(host.read(f"{base}/io_links/{link}/properties") or "")
        to, kind = _int(fields, "node_to"), _int(fields, "type")
        if to is None or kind is None:
            continue
        links.append(KfdLink(to, kind, _int(fields, "weight") or 0))
    return tuple(links)


def xgmi_peers(nodes: List[KfdNode]) -> Dict[str, set]:
    """PCI address -> addresses of other GPUs it reaches over one XGMI hop (partitions of one
    GPU fold into that GPU)."""
    by_node = {n.node: n.address for n in nodes}
    peers: Dict[str, set] = {}
    for node in nodes:
        for link in node.links:
            if link.kind != IOLINK_XGMI or link.weight > XGMI_DIRECT_WEIGHT:
                continue
            other = by_node.get(link.to)
            if other is not None and other != node.address:
                peers.setdefault(node.address, set()).add(other)
    return peers
