"""The CLI for DRA resources: discover shows each device's DRA name and slice attributes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from host.dra import naming
from host.sim import fake_gpu
from host.sim.tree import FakeTree

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str, env_extra=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NODE_NAME"}
    env["PYTHONPATH"] = str(REPO)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "host", *args], capture_output=True, text=True,
                          timeout=60, env=env, cwd=REPO)


def test_discover_json_shows_dra_names_and_attributes(tmp_path):
    tree = FakeTree(tmp_path / "root")
    tree.numa_nodes(2)
    fake_gpu.add_nvidia_control_nodes(tree)
    fake_gpu.add_nvidia_gpu(tree, "0000:18:00.0", minor=0, numa_node=0)
    fake_gpu.add_nvidia_gpu(tree, "0000:86:00.0", minor=1, numa_node=-1)
    config = tmp_path / "config.toml"
    config.write_text('[[resource]]\nname = "nvidia.com/gpu"\ndriver = "gpu"\napi = "dra"\n'
                      '[resource.selectors]\nvendor = "0x10de"\n')
    result = _cli("discover", "--config", str(config), "--host-root", str(tmp_path / "root"),
                  "--json", env_extra={"NODE_NAME": "worker-7"})
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [r["id"] for r in rows] == ["0000:18:00.0", "0000:86:00.0"]
    for row in rows:
        dra = row["dra"]
        assert dra["device_name"] == naming.dra_device_name(row["id"])
        assert naming.is_dns_label(dra["device_name"])
        assert dra["driver"] == naming.driver_name("nvidia.com/gpu", None)
        assert dra["pool"] == naming.pool_name("nvidia.com/gpu", "worker-7")
        assert dra["attributes"]  # the slice's attribute map, upstream's JSON shape
        for value in dra["attributes"].values():
            assert len(value) == 1 and set(value) <= {"int", "bool", "string", "version"}
    table = _cli("discover", "--config", str(config), "--host-root", str(tmp_path / "root"))
    assert table.returncode == 0, table.stderr
    assert f"dra={rows[0]['dra']['device_name']}" in table.stdout


def test_pods_shows_the_claims_this_host_prepared(tmp_path):
    from host.dra.checkpoint import Checkpoint, PreparedClaim, PreparedDevice

    state = tmp_path / "state"
    checkpoint = Checkpoint(str(state))
    checkpoint.put(PreparedClaim(
        uid="1f0c", namespace="ml", name="train-gpu",
        devices=(PreparedDevice(("gpu",), "worker-7/nvidia.com/gpu", "gpu-0000-18-00-0",
                                ("nvidia.com/gpu=claim-1f0c-0000_18_00.0",), "nvidia.com/gpu",
                                "0000:18:00.0"),),
        pod_uids=("pod-1",)))
    result = _cli("pods", "--claims", "--dra-state-dir", str(state), "--json")
    assert result.returncode == 0, result.stderr
    [row] = json.loads(result.stdout)
    assert row["claim"] == "train-gpu" and row["device_id"] == "0000:18:00.0"
    assert row["cdi_device_ids"] == ["nvidia.com/gpu=claim-1f0c-0000_18_00.0"]
    table = _cli("pods", "--claims", "--dra-state-dir", str(state))
    assert "ml/train-gpu" in table.stdout and "gpu-0000-18-00-0" in table.stdout
    other = _cli("pods", "--claims", "--dra-state-dir", str(state), "--resource", "amd.com/*")
    assert other.stdout == "" and "no prepared DRA claims" in other.stderr
    (state / "prepared-claims.json").write_text("{not json")
    broken = _cli("pods", "--claims", "--dra-state-dir", str(state))
    assert broken.returncode == 1 and "Traceback" not in broken.stderr
    assert (state / "prepared-claims.json").exists()  # a viewer never moves it aside


def test_demo_shows_one_dra_resource_end_to_end():
    result = _cli("demo")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "amd.com/gpu through DRA" in out and "v1.DRAPlugin" in out
    assert "ResourceSlice " in out and "NodePrepareResources for claim" in out
    assert "amd.com/gpu=claim-" in out and "/dev/kfd" in out
    assert "claim spec removed (0 claim specs left)" in out
