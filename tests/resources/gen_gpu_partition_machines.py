"""Regenerate the partitioned-GPU machines in testkit/device_plugin_host_testing/machines and their
goldens.

* mi300x-cpx-nps4: an 8x MI300X OAM platform (2x EPYC 9004, Supermicro AS-8125GS class), every
  GPU in CPX compute / NPS4 memory mode: 64 partitions. GPUs at 05, 26, 46, 65 (NUMA 0) and
  85, a6, c6, e5 (NUMA 1) under their root ports; the ASPEED BMC VGA takes drm card0, so the
  GPUs' DRM minors start at card1 / renderD128 and each takes 8 (its own + 7 amdgpu_xcp).
  All eight form one XGMI hive (fully connected, one hop each).
* mi300x-spx: the same platform in SPX / NPS1: 8 GPUs, still 64 render nodes.
* hgx-h100-mig: gpu-server-8x (an HGX H100) with GPUs 0-1 in MIG mode (GPU 0: seven
  1g.10gb, GPU 1: 4g.40gb + 3g.40gb, as procfs shows them: GI/CI ids and cap minors), GPUs
  2-7 whole; served without NVML, so the resource names are the operator's.

The builders are host/sim/fake_gpu.py's (each layout detail is sourced there). Each tree
gets a config beside it and the golden ``discover --json`` output of that config.

Run: python tests/resources/gen_gpu_partition_machines.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator, List

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from host.sim import fake_gpu  # noqa: E402
from host.sim.tree import FakeTree  # noqa: E402

MACHINES = ROOT / "testkit" / "device_plugin_host_testing" / "machines"
MI300X_BUSES = [0x05, 0x26, 0x46, 0x65, 0x85, 0xA6, 0xC6, 0xE5]


def serialise(root: str) -> Iterator[str]:
    """A FakeTree as ``.tree`` lines: device nodes under /dev as ``c``, links, files, and
    directories only where empty (loading creates parents)."""
    entries: List[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        host_dir = dirpath[len(root):] or "/"
        for name in list(dirnames):
            full = os.path.join(dirpath, name)
            if os.path.islink(full):
                dirnames.remove(name)
                filenames.append(name)
            elif not os.listdir(full):
                entries.append(f"d {host_dir.rstrip('/')}/{name}")
        for name in filenames:
            full = os.path.join(dirpath, name)
            path = f"{host_dir.rstrip('/')}/{name}"
            if os.path.islink(full):
                entries.append(f"l {path} -> {os.readlink(full)}")
                continue
            with open(full, encoding="utf-8") as handle:
                text = handle.read()
            if path.startswith("/dev/"):
                entries.append(f"c {path} {text.strip()}")
            else:
                entries.append(f"f {path} {json.dumps(text.rstrip(chr(10)))}")
    yield from sorted(entries, key=lambda line: line[2:])


def _platform(tree: FakeTree) -> None:
    tree.numa_nodes(2, cpus_per_node=96)
    bmc = tree.pci_function("0000:c1:00.0", vendor=0x1A03, device=0x2000, pci_class=0x030000,
                            numa_node=1, driver="ast")
    fake_gpu.add_drm(tree, bmc, card=0)


def mi300x(compute: str, memory: str) -> Callable[[FakeTree], None]:
    def build(tree: FakeTree) -> None:
        _platform(tree)
        machine = fake_gpu.AmdMachine(tree, first_card=1, cpu_nodes=2)
        for number, bus in enumerate(MI300X_BUSES):
            node = number // 4
            port = tree.pci_bridge(f"0000:{bus - 1:02x}:01.0", numa_node=node)
            machine.add_gpu(f"0000:{bus:02x}:00.0", numa_node=node, compute=compute,
                            memory=memory, parent=port)
        machine.write_kfd()
    return build


def hgx_mig(tree: FakeTree) -> None:
    """gpu-server-8x's HGX H100 with MIG on GPUs 0 and 1 (minors 0, 1): GPU 0 as seven
    1g.10gb (GPU instances 7..13, H100's ids for that profile), GPU 1 as 4g.40gb + 3g.40gb
    (GPU instances 1 and 2), each with compute instance 0; the driver's mig-minors table,
    the config/monitor capabilities and the cap nodes nvidia-modprobe creates."""
    tree.load((MACHINES / "gpu-server-8x.tree").read_text(encoding="utf-8"))
    fake_gpu.add_mig_minors_table(tree, gpus=8)
    fake_gpu.add_mig_config_caps(tree)
    for gi in range(7, 14):
        fake_gpu.add_mig_device(tree, 0, gi, 0)
    for gi in (1, 2):
        fake_gpu.add_mig_device(tree, 1, gi, 0)


MACHINE_BUILDERS = {
    "mi300x-cpx-nps4": (mi300x("CPX", "NPS4"), [
        ("amd.com/cpx_nps4", {"vendor": "0x1002", "partition_mode": "cpx_nps4"}),
        ("amd.com/spx_nps1", {"vendor": "0x1002", "partition_mode": "spx_nps1"}),
    ], "8x MI300X, CPX/NPS4: 64 partitions; ROCm's mixed naming"),
    "mi300x-spx": (mi300x("SPX", "NPS1"), [
        ("amd.com/gpu", {"vendor": "0x1002"}),
    ], "8x MI300X, SPX/NPS1: 8 GPUs (and 56 idle xcp render nodes); single naming"),
    "hgx-h100-mig": (hgx_mig, [
        ("nvidia.com/gpu", {"vendor": "0x10de"}, {"mig_strategy": "mixed"}),
        ("nvidia.com/mig-1g.10gb", {"mig_parent": "0000:18:00.0"}),
        ("nvidia.com/mig-4g.40gb", {"mig_parent": "0000:2a:00.0", "mig_gi": 1}),
        ("nvidia.com/mig-3g.40gb", {"mig_parent": "0000:2a:00.0", "mig_gi": 2}),
    ], "HGX H100 8-GPU, MIG on GPUs 0-1 (procfs only); mixed strategy, names by operator"),
}


def config_text(resources) -> str:
    lines = []
    for name, selectors, *settings in resources:
        lines += ["[[resource]]", f'name = "{name}"', 'driver = "gpu"', "[resource.selectors]"]
        lines += [f"{key} = {json.dumps(value)}" for key, value in selectors.items()]
        if settings:
            lines.append("[resource.settings]")
            lines += [f"{key} = {json.dumps(value)}" for key, value in settings[0].items()]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    for name, (build, resources, header) in MACHINE_BUILDERS.items():
        with tempfile.TemporaryDirectory() as scratch:
            tree = FakeTree(scratch)
            build(tree)
            lines = [f"# {name}: {header}",
                     "# Generated by tests/resources/gen_gpu_partition_machines.py"]
            lines += serialise(tree.root)
        tree_path = MACHINES / f"{name}.tree"
        tree_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        config_path = MACHINES / f"{name}.config.toml"
        config_path.write_text(
            f"# The config {name}.discover.json was produced with.\n" + config_text(resources),
            encoding="utf-8",
        )
        print(f"wrote {tree_path.name} ({len(lines)} lines): now run "
              f"tests/resources/regen_goldens.py {name}")


if __name__ == "__main__":
    main()
