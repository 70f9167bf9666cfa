"""The AMD KFD topology: which compute agents (whole GPUs or partitions) ROCm will see, and how
they are linked.

ROCm does not enumerate render nodes: it enumerates KFD topology nodes
(/sys/class/kfd/kfd/topology/nodes/<n>), and a render node without a KFD node is not a GPU it
will use. That matters on MI300: every GPU owns 8 DRM devices (its own and 7 ``amdgpu_xcp``
platform devices, allocated at probe whatever the partition mode), but only the live partitions
have KFD nodes. So KFD is the truth for "how many agents does this GPU have now".

Layout (kfd_topology.c): ``properties`` holds ``<key> <value>`` lines; a GPU node has
``location_id`` = PCI bus << 8 | devfn, with the partition (node) id OR-ed into it when the
device has more than one node (kfd_topology_add_device). Where depends on the kernel: ROCm's
amdgpu and mainline OR it into the low bits (partition 3 of 0c:00.0 reads as 0c:00.3), a
short-lived mainline form (925c7bd1d1cf, reverted) put it in bits 31:28; ``_owner`` maps
both back to the GPU's own function. ``domain`` = the PCI domain, and
``drm_render_minor`` = the render minor of that agent. CPU nodes have gpu_id 0 and no SIMDs.
``io_links/<m>/properties`` name the peer (``node_to``) and the link ``type`` (kfd_crat.h:
2 = PCIe, 11 = XGMI) with a ``weight`` (XGMI: 15 per hop). Memory is not read here: a
partition's share is the GPU's mem_info_vram_total over its partition count (an NPS4 memory
partition is shared by two CPX partitions, so a KFD memory bank is not a partition's own).
"""

from __future__ import annotations

from typing import AbstractSet, Dict, List, Mapping, NamedTuple, Optional, Set, Tuple

from device_plugin_host import HostFS

TOPOLOGY = "/sys/class/kfd/kfd/topology/nodes"
IOLINK_XGMI = 11
XGMI_DIRECT_WEIGHT = 15  # one hop (kfd_crat.c KFD_CRAT_XGMI_WEIGHT)
_PARTITION_SHIFT = 28


class KfdNode(NamedTuple):
    """One GPU agent as KFD lists it."""

    node: int
    address: str  # the PCI function it belongs to, "0000:0c:00.0"
    partition: int  # the node id KFD OR-ed into location_id; 0 on single-agent devices
    render_minor: int
    xgmi: Tuple[Tuple[int, int], ...]  # (node_to, weight) of its XGMI io_links


def parse_properties(text: str) -> Dict[str, str]:
    """``<key> <value>`` lines (kfd_topology.c prints every one with "%s %u\n"-style
    formats). A big MI300X node has thousands of these files, so the common shape, one key
    and one value a line, is split in one C call; anything else goes line by line."""
    tokens = text.split()
    if not len(tokens) % 2:  # (an odd line out would need a second one to stay even)
        return dict(zip(tokens[::2], tokens[1::2]))
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


def _owner(address: str, partition: int, gpus: AbstractSet[str]) -> Tuple[str, int]:
    """The GPU function a KFD node belongs to, and its partition index.

    With the low-bits encoding (``location_id |= node_id``), partition k of a GPU at
    bb:dd.0 decodes to bb:dd.k, a function that is not that GPU (MI300 GPUs are function 0
    of their slot; KFD would give two nodes one location_id for any other function, which
    the driver reports as duplicate partitions). So a node whose address is not one of the
    GPUs, on a slot whose function 0 is, is that GPU's partition k."""
    if address in gpus or partition or address.endswith(".0"):
        return address, partition
    parent = address[:-1] + "0"
    if parent in gpus:
        return parent, int(address[-1])
    return address, partition


GENERATION = "/sys/class/kfd/kfd/topology/generation_id"
Agents = Dict[str, List[KfdNode]]


class TopologyCache:
    """The last topology read, keyed by the host root and KFD's generation_id.

    kfd_topology.c increments generation_count whenever it adds, removes or updates a node
    (a GPU probed or removed, a repartition, a property change) and shows it as
    ``generation_id``: an unchanged generation means an unchanged topology, so a rescan
    (every pci/drm event on the node) reads one file instead of ~700 on an 8x MI300X in CPX.
    A tree without generation_id is read in full every time.
    """

    def __init__(self) -> None:
        self._last: Optional[Tuple[str, str, AbstractSet[str], Agents, Dict[str, Set[str]]]]
        self._last = None

    def read(
        self, host: HostFS, gpus: AbstractSet[str] = frozenset()
    ) -> Tuple[Agents, Dict[str, Set[str]]]:
        """Each GPU's agents by PCI address, and each GPU's XGMI peers (shared between scans:
        callers must not modify them). ``gpus``: the AMD GPU functions on the machine, which
        partitions in the low-bits encoding of location_id are folded into."""
        generation = host.read(GENERATION)
        last = self._last
        if (generation and last is not None and last[0] == host.root and last[1] == generation
                and last[2] == gpus):
            return last[3], last[4]
        found = read_topology(host, gpus)
        peers = xgmi_peers(found)
        nodes: Agents = {}
        for node in found:
            nodes.setdefault(node.address, []).append(node)
        # Read it again after: a generation that moved while we read means a torn read,
        # which must not be remembered as the truth for that generation.
        if generation and host.read(GENERATION) == generation:
            self._last = (host.root, generation, frozenset(gpus), nodes, peers)
        return nodes, peers


def read_topology(host: HostFS, gpus: AbstractSet[str] = frozenset()) -> List[KfdNode]:
    """Every GPU agent KFD lists; empty when KFD is not loaded or not visible. ``gpus`` (the
    GPU functions present) lets a partition in location_id's low bits find its GPU."""
    out: List[KfdNode] = []
    linked: Set[str] = set()
    for name in sorted(host.listdir(TOPOLOGY), key=lambda n: (len(n), n)):
        if not name.isdigit():
            continue
        base = f"{TOPOLOGY}/{name}"
        text = host.read(f"{base}/properties")
        if not text:
            continue
        simd, cpus, location, domain, render = _node_values(text)
        if not simd or cpus:
            continue  # a CPU node (APUs have both; their GPU is not a partition case)
        domain = domain or 0
        if location is None or not render or render < 0:
            continue
        address, partition = _owner(*pci_address(domain, location), gpus)
        # XGMI links belong to the GPU, not to a partition: every partition of one GPU
        # lists the same peers, so one partition's io_links per GPU tell it all (an MI300X
        # node in CPX has 64 x 65 link files; this reads 8 x 65).
        first = address not in linked
        linked.add(address)
        out.append(KfdNode(  # (node, address, partition, render_minor, xgmi)
            int(name), address, partition, render, _xgmi_links(host, base) if first else ()))
    return out


_NODE_KEYS = ("simd_count", "cpu_cores_count", "location_id", "domain", "drm_render_minor")
_NODE_NEEDLES = tuple(f"\n{key} " for key in _NODE_KEYS)


def _node_values(text: str) -> List[Optional[int]]:
    """simd_count, cpu_cores_count, location_id, domain and drm_render_minor of a node's
    ``properties`` (None where missing or not a number), as parse_properties + int would
    give them. node_show's own layout (kfd_topology.c: "cpu_cores_count" first, then one
    "<key> <value>" a line, each key once) is searched for the five keys instead of split
    into a dict of ~40 (66 such files on an MI300X node in CPX); anything else is parsed."""
    if not text.startswith("cpu_cores_count "):
        fields = parse_properties(text)
        return [_int(fields, key) for key in _NODE_KEYS]
    # node_show prints simd_count second and location_id, domain, drm_render_minor one
    # after the other: two splits and one search, when the file has that shape.
    head = text.split("\n", 2)
    at = text.find("\nlocation_id ")
    if len(head) == 3 and head[1][:11] == "simd_count " and at > 0:
        tail = text[at + 1:].split("\n", 3)
        if len(tail) > 2 and tail[1][:7] == "domain " and tail[2][:17] == "drm_render_minor ":
            try:
                return [int(head[1][11:], 0), int(head[0][16:], 0), int(tail[0][12:], 0),
                        int(tail[1][7:], 0), int(tail[2][17:], 0)]
            except ValueError:
                pass  # one of them is not a number: the search below says which
    lined = f"\n{text}\n"
    out: List[Optional[int]] = []
    for needle in _NODE_NEEDLES:
        start = lined.find(needle)
        if start < 0:
            out.append(None)
            continue
        start += len(needle)
        try:
            out.append(int(lined[start:lined.index("\n", start)], 0))
        except ValueError:
            out.append(None)
    return out


def _xgmi_links(host: HostFS, base: str) -> Tuple[Tuple[int, int], ...]:
    links: List[Tuple[int, int]] = []
    append = links.append
    folder = f"{base}/io_links/"
    read = host.read
    xgmi = _XGMI_TYPE[:-1]
    texts = [read(f"{folder}{link}/properties") for link in host.listdir(folder[:-1])]
    for text in texts:
        text = text or ""
        # An MI300X node has hundreds of these 13-line files and only two values of each
        # matter. iolink_show's own layout ("type" first, then version_major,
        # version_minor, node_from, node_to, weight, ... one "<key> <value>" a line) has
        # them on the 5th and 6th lines: one split finds them. Anything else goes the
        # slower way below (string searches, or the general parser), with the same result.
        lines = text.split("\n", 6)
        if (lines[0] == xgmi and len(lines) > 5 and lines[4][:8] == "node_to "
                and lines[5][:7] == "weight "):
            try:
                append((int(lines[4][8:]), int(lines[5][7:])))
            except ValueError:  # not a number
                pass
            continue
        try:
            if text.startswith("type "):
                if not text.startswith(_XGMI_TYPE):
                    continue  # PCIe to the CPU, or another kind: says nothing about peers
                to = _value_after(text, "\nnode_to ")
                weight = _value_after(text, "\nweight ")
            else:
                fields = parse_properties(text)
                if int(fields["type"]) != IOLINK_XGMI:
                    continue
                to, weight = int(fields["node_to"]), int(fields["weight"])
            append((to, weight))
        except (KeyError, ValueError):  # a key missing or a value that is not a number
            continue
    return tuple(links)


_XGMI_TYPE = f"type {IOLINK_XGMI}\n"


def _value_after(text: str, key: str) -> int:
    start = text.index(key) + len(key)  # ValueError when the key is missing
    end = text.find("\n", start)
    return int(text[start:] if end < 0 else text[start:end])


def xgmi_peers(nodes: List[KfdNode]) -> Dict[str, set]:
    """PCI address -> addresses of other GPUs it reaches over one XGMI hop (partitions of one
    GPU fold into that GPU)."""
    by_node = {n.node: n.address for n in nodes}
    peers: Dict[str, set] = {}
    for node in nodes:
        if not node.xgmi:
            continue
        # One hop only; a set per node, since one GPU's partitions repeat every peer GPU.
        found = {by_node.get(to) for to, weight in node.xgmi if weight <= XGMI_DIRECT_WEIGHT}
        found.discard(None)
        found.discard(node.address)
        if found:
            peers.setdefault(node.address, set()).update(found)
    return peers
