"""Regenerate the accelerator machines in testkit/device_plugin_host_testing/machines (then their
goldens).

    python tests/resources/gen_accel_machines.py && python tests/resources/regen_goldens.py

Each machine is built with the fixture helpers (testkit/device_plugin_host_testing/fake_accel.py,
fake_neuron.py, fake_pci.py, fake_gpu.py), whose docstrings say which kernel or driver source each
detail comes from, then written out in the ``.tree`` format; ``<machine>.discover.json`` beside it
(tests/resources/regen_goldens.py) is what ``device-plugin-host discover --json`` prints for it with
its example config (config/examples/<example>.toml). tests/test_accel_machines.py checks that the
trees are what these builders make, tests/test_machine_goldens.py that the goldens are what discover
prints.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Tuple

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from device_plugin_host_testing import fake_accel as fa  # noqa: E402
from device_plugin_host_testing import fake_neuron as fn  # noqa: E402
from device_plugin_host_testing import fake_pci as fp  # noqa: E402
from device_plugin_host_testing import fake_vgpu as fv  # noqa: E402
from host.sim import fake_gpu as fg  # noqa: E402
from host.sim.tree import FakeTree  # noqa: E402

MACHINES = REPO / "testkit" / "device_plugin_host_testing" / "machines"


def gaudi_node(tree: FakeTree) -> None:
    """An HLS-2 style Gaudi2 server: 8 cards behind two sockets' root ports, BMC VGA."""
    fa.gaudi_server(tree)
    tree.pci_function("0000:03:00.0", vendor=0x1A03, device=0x2000, pci_class=0x030000,
                      numa_node=0, driver="ast")


def gaudi3_node(tree: FakeTree) -> None:
    """An HLS-3 style Gaudi 3 server: 8 cards, each with its hbl_N RDMA device registered in
    probe order after the two host NICs, BMC VGA."""
    fa.gaudi3_server(tree)
    tree.pci_function("0000:03:00.0", vendor=0x1A03, device=0x2000, pci_class=0x030000,
                      numa_node=0, driver="ast")


def npu_laptop(tree: FakeTree) -> None:
    """A Core Ultra (Meteor Lake) laptop: the i915 iGPU and the NPU, numa_node -1 on both."""
    tree.numa_nodes(1, cpus_per_node=22)
    fg.add_intel_gpu(tree, "0000:00:02.0", card=1, render=128, device=0x7D55,
                     pci_class=0x030000)
    fa.add_intel_npu(tree)


def trainium_node(tree: FakeTree) -> None:
    """A trn1.32xlarge-like node: 16 Trainium devices over two sockets, the driver's own
    numbering (routing ids), no link from neuronN to its PCI function."""
    fn.trn1_node(tree)


def edge_npu_box(tree: FakeTree) -> None:
    """An edge box with a Hailo-8 M.2 module behind a root port and the iGPU."""
    tree.numa_nodes(1, cpus_per_node=8)
    fg.add_intel_gpu(tree, "0000:00:02.0", card=0, render=128, device=0x4626,
                     pci_class=0x030000)
    bridge = tree.pci_bridge("0000:00:1c.0", numa_node=-1)
    fp.add_hailo8(tree, "0000:02:00.0", parent=bridge, iommu_group=14)


def vgpu_node(tree: FakeTree) -> None:
    """A KubeVirt host with two L40S in SR-IOV vGPU mode: on the first, two of four VFs set to
    L40S-24Q (the others free, listing only 24Q as creatable); the second card full with two
    24Q VFs, its catalogs reduced to the header (the name comes from the first card's)."""
    tree.numa_nodes(2, cpus_per_node=16)
    fv.l40s_vgpu(tree, "0000:41:00.0", vf_types=("1151", "1151", None, None), numa_node=0,
                 vf_iommu_group=70)
    fv.l40s_vgpu(tree, "0000:c1:00.0", vf_types=("1151", "1151"), numa_node=1,
                 vf_iommu_group=90, full=True, vfio_dev_base=2)


#: machine name -> (builder, example config)
BUILDERS: Dict[str, Tuple[Callable[[FakeTree], None], str]] = {
    "gaudi-node": (gaudi_node, "gaudi-node"),
    "gaudi3-node": (gaudi3_node, "gaudi3-node"),
    "npu-laptop": (npu_laptop, "npu-laptop"),
    "trainium-node": (trainium_node, "trainium-node"),
    "edge-npu-box": (edge_npu_box, "edge-npu"),
    "vgpu-node": (vgpu_node, "vgpu-node"),
}


def dump(root: str, header: List[str]) -> Iterator[str]:
    """The tree under ``root`` as sorted .tree lines, /dev files as ``c`` entries."""
    yield from (f"# {line}" if line else "#" for line in header)
    entries = []
    for dirpath, dirnames, filenames in os.walk(root):
        host_dir = dirpath[len(root):] or "/"
        for name in sorted(dirnames + filenames):
            real = os.path.join(dirpath, name)
            host = f"{host_dir.rstrip('/')}/{name}"
            if os.path.islink(real):
                entries.append(f"l {host} -> {os.readlink(real)}")
            elif os.path.isdir(real):
                if not os.listdir(real):
                    entries.append(f"d {host}")
            elif host.startswith("/dev/"):
                with open(real, encoding="utf-8") as handle:
                    entries.append(f"c {host} {handle.read().strip()}")
            else:
                with open(real, encoding="utf-8") as handle:
                    entries.append(f"f {host} {json.dumps(handle.read().rstrip(chr(10)))}")
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
    yield from sorted(entries)


def tree_text(name: str) -> str:
    builder, _ = BUILDERS[name]
    with tempfile.TemporaryDirectory() as root:
        builder(FakeTree(root))
        doc = " ".join((builder.__doc__ or "").split())
        header = [f"{name}: {doc}", "Generated by tests/resources/gen_accel_machines.py."]
        return "\n".join(dump(root, header)) + "\n"


def main() -> None:
    for name in BUILDERS:
        path = MACHINES / f"{name}.tree"
        path.write_text(tree_text(name), encoding="utf-8")
        print(f"wrote {path.name}: now run tests/resources/regen_goldens.py {name}")


if __name__ == "__main__":
    main()
