"""AMD GPUs and their compute partitions (MI300 SPX/DPX/QPX/CPX, memory NPS1/NPS4).

A partitioned GPU is not one device any more: ROCm sees each partition as its own agent, and
handing out the PCI function's render node gives a container partition 0 only. So:

* The mode comes from the PCI function's ``current_compute_partition`` and
  ``current_memory_partition`` (amdgpu_gfx.c, amdgpu_gmc.c); a GPU without them (MI200 and
  older, Radeon) is never partitioned.
* The partitions come from the KFD topology (see kfd.py): one node per live partition, with its
  render minor and its index OR-ed into location_id. Render nodes alone would count the idle
  ``amdgpu_xcp`` devices an SPX GPU still has.
* A GPU with more than one KFD node is served as its partitions: each gets ``/dev/kfd`` and its
  own render node, the parent's NUMA node, and the id ``<parent address>-p<index>``,
  stable across reboots and repartitions to the same mode. An SPX GPU stays one device with
  the id it always had, its PCI address.
* A mode that says partitioned while KFD lists one agent or none (a repartition half done, KFD
  not loaded) cannot be served correctly either way: the whole GPU is listed Unhealthy, naming
  what disagrees, and the next rescan (the repartition's events, or the safety rescan) fixes it.
"""

from __future__ import annotations

import re
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from drivers.gpu.kfd import KfdNode

COMPUTE_MODES = ("SPX", "DPX", "TPX", "QPX", "CPX")
MEMORY_MODES = ("NPS1", "NPS2", "NPS4", "NPS8")
_MODE = re.compile(r"(spx|dpx|tpx|qpx|cpx)(?:_(nps[1248]))?\Z")


class PartitionMode(NamedTuple):
    compute: Optional[str]  # "CPX"; None when the GPU has no such attribute
    memory: Optional[str]  # "NPS4"
    available: Tuple[str, ...]

    @property
    def name(self) -> Optional[str]:
        """ROCm's resource suffix: "cpx_nps4"; "spx" when the memory mode is unknown."""
        if self.compute is None:
            return None
        if self.memory is None:
            return self.compute.lower()
        return f"{self.compute.lower()}_{self.memory.lower()}"

    @property
    def partitioned(self) -> bool:
        return self.compute is not None and self.compute != "SPX"


def read_mode(read, function_path: str) -> PartitionMode:
    """``read`` is HostFS.read (kept a parameter so this stays a pure parser)."""
    compute = (read(f"{function_path}/current_compute_partition") or "").strip().upper()
    memory = (read(f"{function_path}/current_memory_partition") or "").strip().upper()
    available = read(f"{function_path}/available_compute_partition") or ""
    return PartitionMode(
        compute=compute if compute in COMPUTE_MODES else None,
        memory=memory if memory in MEMORY_MODES else None,
        available=tuple(
            part.strip().upper() for part in available.replace(",", " ").split() if part.strip()
        ),
    )


def mode_selector_error(value: str) -> Optional[str]:
    if _MODE.match(value.strip().lower()):
        return None
    return (
        f'{value!r} is not a partition mode: use ROCm\'s "<compute>_<memory>" such as'
        ' "cpx_nps4" or "spx_nps1", or the compute mode alone ("cpx")'
    )


def mode_matches(mode_name: Optional[str], wanted: Sequence[str]) -> bool:
    """"cpx" matches any memory mode; "cpx_nps4" only that one."""
    if mode_name is None:
        return False
    compute = mode_name.split("_", 1)[0]
    for value in wanted:
        value = value.strip().lower()
        if value == mode_name or ("_" not in value and value == compute):
            return True
    return False


class Partition(NamedTuple):  # 64 per scan on an MI300X node: a tuple is cheapest
    number: int  # the partition index (KFD's node id in location_id)
    render: str  # "renderD129"


def partitions_of(nodes: Sequence[KfdNode]) -> List[Partition]:
    """The live partitions of one GPU (its KFD nodes), in index order.

    A partition is used through its render node and /dev/kfd only: ROCm opens the render
    nodes of the agents KFD lists (AMD documents ``--device /dev/kfd --device
    /dev/dri/renderD<N>`` to hand a container one GPU); the xcp devices' card nodes serve
    no compute purpose, so they are not handed out (whole GPUs keep theirs, as before)."""
    return [Partition(node.partition, f"renderD{node.render_minor}")
            for node in sorted(nodes, key=lambda n: n.partition)]


def partition_id(address: str, index: int) -> str:
    return f"{address}-p{index}"


def duplicate_indices(partitions: Sequence[Partition]) -> Dict[int, int]:
    counts: Dict[int, int] = {}
    for part in partitions:
        counts[part.number] = counts.get(part.number, 0) + 1
    return {index: count for index, count in counts.items() if count > 1}
