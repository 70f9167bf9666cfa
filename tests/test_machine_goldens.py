"""Every machine tree in testkit/device_plugin_host_testing/machines has a golden ``discover``
beside it, and still discovers exactly that.

One convention (tests/resources/regen_goldens.py, which also regenerates them): ``<m>.tree``
has ``<m>.discover.json`` beside it, ``{"config": ..., "devices": [...]}``. A change in what a
driver reports shows up here as a diff to review (and regenerate when it is intended). The
table form is checked on the same tree: every device of the golden is in it. All 24 runs of
``discover`` happen in one child interpreter (``discover_many``), which spares 23 cold starts.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "regen_goldens", REPO / "tests" / "resources" / "regen_goldens.py")
assert _spec is not None and _spec.loader is not None
goldens = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(goldens)
TREES = goldens.trees()


@pytest.fixture(scope="module")
def outputs():
    """{(machine, form): (exit code, stdout, stderr)} for every tree, ``--json`` and table."""
    requests = []
    for machine in TREES:
        config = goldens.read_golden(machine)["config"]
        requests += [(machine, config, ["--json"]), (machine, config, [])]
    results = goldens.discover_many(requests)
    return {(m, "json" if extra else "table"): r for (m, _, extra), r in zip(requests, results)}


def test_every_machine_tree_has_a_golden_beside_it():
    assert len(TREES) >= 12
    missing = [m for m in TREES if not goldens.golden_path(m).is_file()]
    assert missing == [], (
        f"no golden for {missing}: run tests/resources/regen_goldens.py NAME --config PATH")
    orphans = sorted(p.name for p in goldens.MACHINES.glob("*.discover.json")
                     if p.name[: -len(".discover.json")] not in TREES)
    assert orphans == []


@pytest.mark.parametrize("machine", TREES)
def test_discover_json_matches_the_golden(machine, outputs):
    golden = goldens.read_golden(machine)
    code, stdout, stderr = outputs[machine, "json"]
    assert code == 0, stderr
    assert goldens.golden_rows(json.loads(stdout)) == golden["devices"], (
        f"discover differs from {machine}.discover.json: if intended, run "
        "tests/resources/regen_goldens.py and review the diff")


@pytest.mark.parametrize("machine", TREES)
def test_the_table_lists_every_golden_device(machine, outputs):
    golden = goldens.read_golden(machine)
    code, stdout, stderr = outputs[machine, "table"]
    assert code == 0, stderr
    for row in golden["devices"]:
        assert row["id"] in stdout


def test_the_batch_prints_what_a_cold_python_m_host_prints():
    """discover_many runs the CLI's main in one interpreter; a separate ``python -m host``
    gives the same output (so the batch is no kinder than the real command)."""
    machine = "edge-box"
    config = goldens.read_golden(machine)["config"]
    cold = goldens.run_discover(machine, config, "--json")
    ((code, stdout, _),) = goldens.discover_many([(machine, config, ["--json"])])
    assert (cold.returncode, json.loads(cold.stdout)) == (code, json.loads(stdout))


def test_the_partitioned_machines_have_goldens():
    assert {"mi300x-cpx-nps4", "mi300x-spx", "hgx-h100-mig"} <= set(TREES)
