"""ResourceSlices built from the same Device records the device plugin side serves.

Shapes and limits are upstream's (staging/src/k8s.io/api/resource/v1/types.go,
pkg/apis/resource/validation/validation.go): an attribute is ``{"int"|"bool"|"string"|
"version": value}`` under a C-identifier key (<= 32) that may carry a domain; strings <= 64;
at most 32 attributes + capacities a device; capacity ``{"value": <quantity>}``; at most 128
devices a slice, 64 once any has taints or consumes counters. Standard attributes
(kubernetes/dynamic-resource-allocation deviceattribute/): ``resource.kubernetes.io/pcieRoot``
(string "pci<domain>:<bus>"), ``resource.kubernetes.io/pciBusID`` (string BDF), and
``resource.kubernetes.io/numaNode`` (int; standard from 1.37, already what the SR-IOV, CPU and
memory DRA drivers publish).

Unhealthy devices are left out of the slice, not tainted. Device taints (KEP-5055) are behind
the DRADeviceTaints gate: alpha and off by default in 1.33-1.35, beta and on only from 1.36
(pkg/features/kube_features.go). A 1.34 or 1.35 API server drops ``devices[].taints`` on write
(dropDisabledFields), so a tainted device would be published as schedulable; leaving it out
is correct on every version we support. ``taint_unhealthy=True`` is there for clusters known
to run the gate (1.36+): the taint's effect is ``host.dra.taints.effect`` (NoExecute for hard
failures, NoSchedule for drains and soft ones), key ``device-plugin-host.io/unhealthy``,
value the health reason reduced to a label value (taint values must be label values).

Partitions (KEP-4815, DRAPartitionableDevices: beta and on by default from 1.36). A device
whose ``parent`` fact names another device of the same pool is a partition of it (a MIG device
of its GPU, an AMD compute partition of its GPU); a device with ``partitioned = "true"`` is a
GPU served as its partitions, never whole. Each such parent gets a counter set named after it
(``sharedCounters``, in slices of their own with no devices: at most 8 sets a slice) with one
counter, ``partitions``: how many partitions of it the pool holds. The parent consumes all of
it, each partition one, so the scheduler never allocates a GPU and one of its partitions
together. The scheduler counts what allocated devices consume from the devices it finds in the
slices (structured allocator, checkAvailableCounters), so the parent stays published while
partitioned: a whole GPU allocated before it was partitioned keeps its partitions from being
allocated. No consumption ever exceeds a counter: the allocator compares every counter set of
the pool on each allocation, and one negative counter would block every partition of the
pool. What keeps a partitioned parent from being allocated while nothing holds it is a
``NoSchedule`` taint (key ``device-plugin-host.io/partitioned``) and the DeviceClasses, which
select ``type == "gpu"`` devices that are not ``partitioned``; a claim that tolerates the
taint gets it only while none of its partitions is allocated. With ``counters=False`` (a
server that dropped the fields) partitioned parents are left out, nothing consumes counters.
"""

from __future__ import annotations

import copy
import hashlib
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set

from host.core.model import Device
from host.dra import sharing, taints
from host.dra.naming import DNS_LABEL_MAX, dra_device_name

API_VERSION = "resource.k8s.io/v1"
MAX_DEVICES = 128
MAX_DEVICES_WITH_TAINTS = 64
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_VALUE_LEN = 64
MAX_ID_LEN = 32
STANDARD = "resource.kubernetes.io/"
PCIE_ROOT = STANDARD + "pcieRoot"
PCI_BUS_ID = STANDARD + "pciBusID"
NUMA_NODE = STANDARD + "numaNode"
TAINT_KEY = "device-plugin-host.io/unhealthy"
MAX_COUNTER_SETS = 8
PARENT = "parent"  # the fact naming the device a partition belongs to (its id)
PARTITIONED = "partitioned"  # "true": a parent served as its partitions, never whole
COUNTER_PARTITIONS = "partitions"
PARTITIONED_TAINT_KEY = "device-plugin-host.io/partitioned"

# Facts our drivers record as decimal strings that selectors compare as numbers.
_INT_ATTRIBUTES = frozenset({"device_minor", "iommu_group", "port_id", "numa_node",
                             "vf_index", "pf_index", "busnum", "devnum", "num_vfs",
                             "mig_gi", "mig_ci", "mig_parent_minor", "mig_gi_cap",
                             "mig_ci_cap", "partition_index", "partition_count"})
_BOOL_ATTRIBUTES = frozenset({PARTITIONED})
# Sizes in bytes that sysfs reports (amdgpu mem_info_vram_total; a driver's memory_bytes).
_MEMORY_ATTRIBUTES = ("memory_bytes", "mem_info_vram_total", "vram_total_bytes")
_C_IDENT_BAD = re.compile(r"[^A-Za-z0-9_]")
_INT = re.compile(r"-?(0|[1-9][0-9]*)\Z")
_LABEL_VALUE_BAD = re.compile(r"[^A-Za-z0-9_.-]+")


def attribute_key(name: str) -> str:
    """Our attribute name as a C identifier (upstream validateCIdentifier), <= 32 chars."""
    key = _C_IDENT_BAD.sub("_", name)
    if not key or not (key[0].isalpha() or key[0] == "_"):
        key = "_" + key
    return key[:MAX_ID_LEN]


def _too_long(value: str) -> bool:
    """The server's limit counts bytes (Go's len of the UTF-8 string), not characters: a
    64-character USB product string with a "®" in it is 65 bytes and a 422."""
    return len(value.encode("utf-8", "surrogatepass")) > MAX_VALUE_LEN


def _value(name: str, raw: str) -> Optional[Dict[str, Any]]:
    if name in _BOOL_ATTRIBUTES and raw in ("true", "false"):
        return {"bool": raw == "true"}
    if name in _INT_ATTRIBUTES and _INT.match(raw) and -(2 ** 63) <= int(raw) < 2 ** 63:
        return {"int": int(raw)}
    if _too_long(raw):
        # A truncated value would match selectors it should not; the full one would get the
        # whole slice rejected (422). Such facts stay visible in `discover`.
        return None
    return {"string": raw}


def device_attributes(device: Device) -> Dict[str, Dict[str, Any]]:
    """The upstream attribute map of ``device``: standard attributes first, then driver facts.

    Bare keys (no domain) belong to the driver's own domain, as upstream's DeviceAttribute
    documentation says, so selectors read them as ``device.attributes["<driver>"].vendor``.
    """
    facts = device.attributes
    out: Dict[str, Dict[str, Any]] = {}
    root = facts.get("pcie_root")
    if root and not _too_long(root):
        out[PCIE_ROOT] = {"string": root}
    address = facts.get("pci_address")
    if address and not _too_long(address):
        out[PCI_BUS_ID] = {"string": address}
    if len(device.numa_nodes) == 1:
        out[NUMA_NODE] = {"int": int(device.numa_nodes[0])}
    room = MAX_ATTRIBUTES_AND_CAPACITIES - len(out) - len(device_capacity(device))
    for name in sorted(facts):
        if room <= 0:
            break
        if name in ("pcie_root",) or name in _MEMORY_ATTRIBUTES:
            continue
        key = attribute_key(name)
        if key in out:
            continue
        value = _value(name, str(facts[name]))
        if value is not None:
            out[key] = value
            room -= 1
    return out


def _quantity(size: int) -> str:
    """``size`` bytes as the API server stores it (resource.Quantity's canonical form), so a
    slice read back compares equal to the one we would write: binary suffixes when the size
    is a whole number of KiB, else decimal ones ("16000000000" is stored as "16G")."""
    for suffix, scale in (("Ei", 1 << 60), ("Pi", 1 << 50), ("Ti", 1 << 40), ("Gi", 1 << 30),
                          ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{suffix}"
    for suffix, scale in (("E", 10 ** 18), ("P", 10 ** 15), ("T", 10 ** 12), ("G", 10 ** 9),
                          ("M", 10 ** 6), ("k", 10 ** 3)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{suffix}"
    return str(size)


def device_capacity(device: Device) -> Dict[str, Dict[str, str]]:
    """Capacities sysfs knows: ``memory`` from a byte count the driver read."""
    for name in _MEMORY_ATTRIBUTES:
        raw = device.attributes.get(name)
        if raw and _INT.match(raw) and int(raw) > 0:
            return {"memory": {"value": _quantity(int(raw))}}
    return {}


def taint_value(reason: str) -> str:
    """A health reason as a label value (<= 63, alphanumerics and -_. inside)."""
    value = _LABEL_VALUE_BAD.sub("-", reason).strip("-_.")[:DNS_LABEL_MAX]
    return value.rstrip("-_.") or "unhealthy"


def slice_device(device: Device, taint: bool = False,
                 consumes: Optional[List[Dict[str, Any]]] = None,
                 partitioned: bool = False, shares: int = 0) -> Dict[str, Any]:
    """One device entry; ``shares`` > 1: a device several claims share (host.dra.sharing)."""
    entry: Dict[str, Any] = {"name": dra_device_name(device.id)}
    attributes = device_attributes(device)
    if attributes:
        entry["attributes"] = attributes
    capacity = device_capacity(device)
    if shares > 1:
        entry["allowMultipleAllocations"] = True
        capacity = sharing.capacity(shares, capacity.get("memory"))
    if capacity:
        entry["capacity"] = capacity
    if consumes:
        entry["consumesCounters"] = consumes
    marks = []
    if partitioned:
        marks.append({"key": PARTITIONED_TAINT_KEY, "value": "true", "effect": "NoSchedule"})
    if taint:
        marks.append({"key": TAINT_KEY, "value": taint_value(device.health_reason),
                      "effect": taints.effect(device.health_reason)})
    if marks:
        entry["taints"] = marks
    return entry


def is_partitioned(device: Device) -> bool:
    return device.attributes.get(PARTITIONED) == "true"


class Partitions:
    """The pool's counter sets and what each device consumes (see the module docstring)."""

    def __init__(self, devices: Sequence[Device]) -> None:
        ids = {device.id for device in devices}
        children: Dict[str, Set[str]] = {}
        for device in devices:
            parent = device.attributes.get(PARENT)
            if parent and parent in ids and parent != device.id:
                children.setdefault(parent, set()).add(device.id)
        parents = {d.id for d in devices if is_partitioned(d)} | set(children)
        self.counter_sets: List[Dict[str, Any]] = []
        self.consumes: Dict[str, List[Dict[str, Any]]] = {}  # by device id
        for parent in sorted(parents):
            name = dra_device_name(parent)
            count = len(children.get(parent, ()))
            own = {COUNTER_PARTITIONS: {"value": str(count)}}
            self.counter_sets.append({"name": name, "counters": own})
            self.consumes[parent] = [{"counterSet": name, "counters": copy.deepcopy(own)}]
            for child in children.get(parent, ()):
                self.consumes[child] = [{"counterSet": name, "counters": {
                    COUNTER_PARTITIONS: {"value": "1"}}}]


def slice_name(node_name: str, driver: str, pool: str, index: int) -> str:
    """A fixed name per (node, driver, pool, index): a create retried after a lost answer is a
    409 AlreadyExists, never a second slice (generateName would make one)."""
    digest = hashlib.sha256(f"{driver}\0{pool}".encode()).hexdigest()[:8]
    head = f"{node_name}-{driver.split('.')[0]}"
    name = f"{head}-{digest}-{index}"
    if len(name) > 253:
        name = f"{node_name[:200].rstrip('.-')}-{digest}-{index}"
    return name


def build_slices(driver: str, node_name: str, pool: str, devices: Sequence[Device],
                 generation: int, node_uid: Optional[str] = None,
                 taint_unhealthy: bool = False, counters: bool = True,
                 partition_taints: bool = True, shares: int = 0,
                 consumable: bool = True) -> List[Dict[str, Any]]:
    """The pool's ResourceSlices: devices sorted by name, chunked, then the counter sets
    (partitions, see the module docstring) in slices of their own; one slice even when empty.

    ``shares`` > 1: ``devices`` are the replicas of shared devices (host.dra.sharing), each
    published once as shareable (``consumable``) or, where the server drops those fields,
    each replica as a device of its own.

    An empty pool still gets a slice (resourceSliceCount 1, no devices): it tells the
    scheduler the driver runs on this node and has nothing, unlike a missing pool.
    """
    shared = shares > 1 and consumable
    if shared:
        devices = sharing.bases(devices)
    layout = Partitions(devices) if counters else None
    entries: Dict[str, Dict[str, Any]] = {}
    for device in devices:
        partitioned = is_partitioned(device)
        if partitioned and layout is None:
            continue  # without counters nothing would keep it from being allocated
        if not device.healthy and not taint_unhealthy and not partitioned:
            continue
        consumes = layout.consumes.get(device.id) if layout is not None else None
        entry = slice_device(device, taint=not device.healthy, consumes=consumes,
                             partitioned=partitioned and partition_taints,
                             shares=shares if shared else 0)
        entries.setdefault(entry["name"], entry)
    ordered = [entries[name] for name in sorted(entries)]
    advanced = taint_unhealthy or any("consumesCounters" in e or "taints" in e for e in ordered)
    per_slice = MAX_DEVICES_WITH_TAINTS if advanced else MAX_DEVICES
    chunks: List[Dict[str, Any]] = [
        {"devices": ordered[i:i + per_slice]} for i in range(0, len(ordered), per_slice)]
    sets = layout.counter_sets if layout is not None else []
    chunks += [{"sharedCounters": sets[i:i + MAX_COUNTER_SETS]}
               for i in range(0, len(sets), MAX_COUNTER_SETS)]
    if not chunks:
        chunks = [{"devices": []}]
    owner: List[Dict[str, Any]] = []
    if node_uid:
        owner = [{"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid,
                  "controller": True}]
    out = []
    for index, chunk in enumerate(chunks):
        meta: Dict[str, Any] = {"name": slice_name(node_name, driver, pool, index)}
        if owner:
            meta["ownerReferences"] = owner
        out.append({
            "apiVersion": API_VERSION, "kind": "ResourceSlice", "metadata": meta,
            "spec": {"driver": driver, "nodeName": node_name,
                     "pool": {"name": pool, "generation": generation,
                              "resourceSliceCount": len(chunks)},
                     **chunk},
        })
    return out


def uses_counters(obj: Mapping[str, Any]) -> bool:
    """Whether a slice carries counter sets or devices that consume counters."""
    spec = obj.get("spec") or {}
    return bool(spec.get("sharedCounters")) or any(
        d.get("consumesCounters") for d in spec.get("devices") or [])


def is_shareable(obj: Mapping[str, Any]) -> bool:
    """Whether a slice has a device published for several allocations."""
    return any(d.get("allowMultipleAllocations")
               for d in (obj.get("spec") or {}).get("devices") or [])


def has_taints(obj: Mapping[str, Any]) -> bool:
    return any(d.get("taints") for d in (obj.get("spec") or {}).get("devices") or [])


def _without_server_fields(devices: Any) -> Any:
    """Devices less what the API server sets itself (a taint's ``timeAdded``)."""
    if not devices or not any(d.get("taints") for d in devices):
        return devices
    out = []
    for device in devices:
        if device.get("taints"):
            device = {**device, "taints": [{k: v for k, v in t.items() if k != "timeAdded"}
                                           for t in device["taints"]]}
        out.append(device)
    return out


def same_content(desired: Mapping[str, Any], stored: Mapping[str, Any]) -> bool:
    """Whether ``stored`` already says what ``desired`` says, the generation and the taint
    times the server sets aside (either side may carry them)."""
    want = desired.get("spec") or {}
    have = stored.get("spec") or {}
    for key in ("driver", "nodeName", "sharedCounters"):
        if (want.get(key) or None) != (have.get(key) or None):
            return False
    if (_without_server_fields(want.get("devices")) or None) != \
            (_without_server_fields(have.get("devices")) or None):
        return False
    want_pool, have_pool = want.get("pool") or {}, have.get("pool") or {}
    if want_pool.get("name") != have_pool.get("name") or \
            want_pool.get("resourceSliceCount") != have_pool.get("resourceSliceCount"):
        return False
    want_owner = (desired.get("metadata") or {}).get("ownerReferences") or []
    have_owner = (stored.get("metadata") or {}).get("ownerReferences") or []
    return not want_owner or want_owner == have_owner
