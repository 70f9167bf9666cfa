"""NVIDIA SR-IOV vGPU for fake trees: an Ada-or-later GPU whose VFs stay on ``nvidia``.

The layout NVIDIA's own kubevirt-gpu-device-plugin (its vendor-specific VFIO discovery) and
vgpu-device-manager read, with vGPU 17+ on an L40S:

* The PF (10de:26b9 L40S, class 0x030200) bound to ``nvidia`` with ``sriov_totalvfs`` and
  ``virtfnN`` links once ``sriov-manage -e`` ran; its VFs at function 4 on (first VF offset 4,
  stride 1: 0000:41:00.4, .5, .6, .7, 0000:41:01.0, ...), each with ``physfn`` and its own
  IOMMU group, all bound to ``nvidia``.
* Each function's ``nvidia/`` folder: ``current_vgpu_type`` (the numeric type id, "0" until
  one is written) and ``creatable_vgpu_types`` (a header "ID    : vGPU Name", then
  "<id> : <name>" lines; what can still be created there: a configured VF or a card whose
  time-sliced capacity is used lists only the header).
* A VF with a type set is a VFIO device: /dev/vfio/<group> (and /dev/vfio/vfio) and, with
  CONFIG_VFIO_DEVICE_CDEV, ``vfio-dev/vfioN`` with /dev/vfio/devices/vfioN; one with no type
  has neither.

The numeric type ids below are stand-ins (ids are per card and per driver release); the names
follow NVIDIA's L40S profiles.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence

from host.sim.fake_net import sriov_pf, vfio_cdev, vfio_nodes
from host.sim.tree import FakeTree

NVIDIA = 0x10DE
L40S = 0x26B9
THREE_D_CONTROLLER = 0x030200
#: type id -> name on an L40S (stand-in ids, NVIDIA's profile names)
L40S_TYPES: Mapping[str, str] = {
    "1150": "NVIDIA L40S-48Q", "1151": "NVIDIA L40S-24Q", "1152": "NVIDIA L40S-16Q",
    "1153": "NVIDIA L40S-12Q", "1154": "NVIDIA L40S-8Q", "1155": "NVIDIA L40S-48C",
}
HEADER = "ID    : vGPU Name"


def catalog(types: Mapping[str, str]) -> str:
    return "\n".join([HEADER, *(f"{i} : {n}" for i, n in types.items())])


def l40s_vgpu(
    tree: FakeTree,
    address: str = "0000:41:00.0",
    *,
    vf_types: Sequence[Optional[str]] = ("1151", "1151", None, None),
    numa_node: Optional[int] = 0,
    vf_iommu_group: int = 70,
    creatable: Optional[Dict[str, str]] = None,
    full: bool = False,
    vfio_dev_base: int = 0,
) -> List[str]:
    """An L40S with one VF per entry of ``vf_types`` (a type id, or None for a VF with no type
    yet). Unconfigured functions list ``creatable`` (default: the types of the configured
    VFs, else every L40S type); configured VFs list only the header, as do all when
    ``full``. Returns the VFs' addresses."""
    pf = sriov_pf(
        tree, address, vendor=NVIDIA, device=L40S, vf_device=L40S,
        pci_class=THREE_D_CONTROLLER, numvfs=len(vf_types), totalvfs=32, driver="nvidia",
        vf_driver="nvidia", ifname=None, numa_node=numa_node, iommu_group=vf_iommu_group - 1,
        vf_iommu_group=vf_iommu_group, vf_offset=4, vf_stride=1, dev_nodes=False,
    )
    configured = {t for t in vf_types if t}
    if creatable is None:
        creatable = ({i: L40S_TYPES[i] for i in sorted(configured)} if configured
                     else dict(L40S_TYPES))
    free = HEADER if full else catalog(creatable)
    tree.attr(f"{pf.path}/nvidia/creatable_vgpu_types", free)
    cdev = vfio_dev_base
    for index, (vf_path, type_id) in enumerate(zip(pf.vf_paths, vf_types)):
        tree.attr(f"{vf_path}/nvidia/current_vgpu_type", type_id or "0")
        tree.attr(f"{vf_path}/nvidia/creatable_vgpu_types", HEADER if type_id else free)
        if type_id:
            group = pf.vf_groups[index]
            assert group is not None
            vfio_nodes(tree, group, index)
            vfio_cdev(tree, vf_path, cdev)
            cdev += 1
    return pf.vf_addresses
