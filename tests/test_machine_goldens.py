"""Every machine tree with a golden ``discover --json`` beside it still discovers exactly that.

The goldens are written by tests/resources/gen_gpu_partition_machines.py; a change in what a
driver reports shows up here as a diff to review (and regenerate when it is intended).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from host.testing.fake_gpu import golden_rows
from host.testing.tree import load_machine

REPO = Path(__file__).resolve().parents[1]
MACHINES = REPO / "host" / "testing" / "machines"
GOLDENS = sorted(p.name[: -len(".discover.json")] for p in MACHINES.glob("*.discover.json"))


@pytest.mark.parametrize("machine", GOLDENS)
def test_discover_json_matches_the_golden(tmp_path, machine):
    load_machine(machine, tmp_path / "root")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-m", "host", "discover", "--host-root", str(tmp_path / "root"),
         "--config", str(MACHINES / f"{machine}.config.toml"), "--json"],
        capture_output=True, text=True, timeout=60, env=env, cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    expected = json.loads((MACHINES / f"{machine}.discover.json").read_text(encoding="utf-8"))
    assert golden_rows(json.loads(out.stdout)) == expected


def test_the_partitioned_machines_have_goldens():
    assert {"mi300x-cpx-nps4", "mi300x-spx", "hgx-h100-mig"} <= set(GOLDENS)
