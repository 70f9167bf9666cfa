"""The accelerator machines (testkit/device_plugin_host_testing/machines: gaudi-node, gaudi3-node,
npu-laptop, trainium-node, edge-npu-box, vgpu-node): each tree is what its fixture builders make,
and ``discover --json`` on it with its example config prints exactly the golden stored beside it
(<name>.discover.json, checked by tests/test_machine_goldens.py with every other machine)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from device_plugin_host_testing.machines import load_machine

REPO = Path(__file__).resolve().parents[1]
MACHINES = REPO / "testkit" / "device_plugin_host_testing" / "machines"
_spec = importlib.util.spec_from_file_location(
    "gen_accel_machines", REPO / "tests" / "resources" / "gen_accel_machines.py")
assert _spec is not None and _spec.loader is not None
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)


@pytest.mark.parametrize("name", sorted(gen.BUILDERS))
def test_the_tree_is_what_the_fixture_builders_make(name):
    assert (MACHINES / f"{name}.tree").read_text(encoding="utf-8") == gen.tree_text(name), (
        f"{name}.tree is stale: run tests/resources/gen_accel_machines.py")


# ``discover --json`` on each tree printing exactly its golden (<name>.discover.json) is
# tests/test_machine_goldens.py, for every machine tree alike.


def _golden(name):
    return json.loads((MACHINES / f"{name}.discover.json").read_text(encoding="utf-8"))


def test_the_goldens_show_what_each_machine_is_about():
    rows = {name: _golden(name)["devices"] for name in gen.BUILDERS}
    gaudi = [r for r in rows["gaudi-node"] if r["resource"] == "habana.ai/gaudi"]
    assert [r["numa_nodes"] for r in gaudi] == [[0]] * 4 + [[1]] * 4
    assert all(len(r["device_nodes"]) == 2 for r in gaudi)
    gaudi3 = rows["gaudi3-node"]
    assert [r["numa_nodes"] for r in gaudi3] == [[0]] * 4 + [[1]] * 4
    # accel, control and the card's own verbs node; the host NICs' uverbs0/1 in none
    assert [n["host_path"] for n in gaudi3[0]["device_nodes"]] == [
        "/dev/accel/accel0", "/dev/accel/accel_controlD0", "/dev/infiniband/uverbs3"]
    assert sorted(r["device_nodes"][2]["host_path"] for r in gaudi3) == [
        f"/dev/infiniband/uverbs{n}" for n in range(2, 10)]
    neuron = rows["trainium-node"]
    assert [r["id"] for r in neuron] == [f"neuron{i}" for i in range(16)]
    assert all(r["numa_nodes"] == [] for r in neuron)
    (hailo,) = [r for r in rows["edge-npu-box"] if r["driver"] == "pci"]
    assert [n["host_path"] for n in hailo["device_nodes"]] == ["/dev/hailo0"]
    vgpu = rows["vgpu-node"]
    assert [(r["id"], [n["host_path"] for n in r["device_nodes"]]) for r in vgpu] == [
        ("0000:41:00.4", ["/dev/vfio/vfio", "/dev/vfio/70"]),
        ("0000:41:00.5", ["/dev/vfio/vfio", "/dev/vfio/71"]),
        ("0000:c1:00.4", ["/dev/vfio/vfio", "/dev/vfio/90"]),
        ("0000:c1:00.5", ["/dev/vfio/vfio", "/dev/vfio/91"])]
    assert all(r["env"]["PCI_RESOURCE_NVIDIA_COM_NVIDIA_L40S-24Q"] == r["id"] for r in vgpu)
    (npu,) = [r for r in rows["npu-laptop"] if r["driver"] == "accel"]
    assert npu["resource"] == "npu.intel.com/accel" and npu["numa_nodes"] == []


@pytest.mark.parametrize("name", sorted(gen.BUILDERS))
def test_each_machine_survives_a_capture(name, tmp_path):
    """``device-plugin-host capture`` keeps what the accel, neuron and pci drivers read
    (the accel and neuron_device classes, /sys/dev/char, their attributes and /dev nodes):
    discover on the recaptured tree gives the golden devices back."""
    from host.cli.capture import capture_tree
    from host.sim.tree import FakeTree

    _, example = gen.BUILDERS[name]
    original = load_machine(name, tmp_path / "original")
    lines = list(capture_tree(original.root, [
        "/dev/accel/*", "/dev/neuron*", "/dev/hailo*", "/dev/dri/*", "/dev/dri/by-path/*",
        "/dev/infiniband/*", "/dev/vfio/*", "/dev/vfio/devices/*", "/dev/iommu"]))
    FakeTree(tmp_path / "recaptured").load("\n".join(lines))
    result = subprocess.run(
        [sys.executable, "-m", "host", "discover", "--host-root", str(tmp_path / "recaptured"),
         "--config", str(REPO / "config" / "examples" / f"{example}.toml"), "--json"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr
    golden = _golden(name)["devices"]

    def essentials(rows):
        return [(r["resource"], r["id"], r["health"], r["numa_nodes"],
                 [n["host_path"] for n in r["device_nodes"]], r["env"]) for r in rows]

    assert essentials(json.loads(result.stdout)) == essentials(golden)
