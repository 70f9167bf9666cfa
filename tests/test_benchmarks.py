"""The benchmark suite runs and keeps its output contract. Shapes only: nothing here is timed,
so no assertion is about speed (a loaded CI runner must not fail these)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import report
from benchmarks.core import Context, Figure, Skipped, percentile
from benchmarks.suite import FAMILIES, SuiteResult, all_keys, family_name, run_suite

REPO = Path(__file__).resolve().parents[1]
CONTRACT_KEYS = {
    "allocate_median_us", "allocate_p99_us", "preferred_median_us",
    "startup_ms_1", "startup_ms_16", "startup_ms_64",
    "reregister_p99_ms_16", "reregister_p99_ms_64",
    "reregister_p99_ms_64_outage_0.5", "reregister_p99_ms_64_outage_2",
    "reregister_p99_ms_64_outage_10", "reregister_attempts_64",
    "listwatch_p99_ms_10", "listwatch_p99_ms_1000", "listwatch_p99_ms_10000",
    "discovery_ms_2048", "discovery_ms_sriov_1024", "discovery_ms_qat_256", "discovery_ms_cpx_64",
    "rss_mb_1r", "rss_mb_16r", "rss_mb_64r_10k", "idle_cpu_pct_64r", "preferred_ms_1024_8numa",
    "event_to_kubelet_p99_ms_1", "event_to_kubelet_p99_ms_16", "event_to_kubelet_p99_ms_64",
    "idle_cpu_pct_watching", "reload_max_stall_ms_256",
    "dra_prepare_median_ms", "dra_prepare_p99_ms", "dra_prepare_again_median_us",
    "dra_unprepare_median_ms", "dra_prepare_shared_median_ms",
    "dra_slice_p99_ms_8", "dra_slice_p99_ms_300",
    "dra_requests_per_change_8", "dra_requests_per_change_300",
    "dra_slice_event_p99_ms", "dra_republish_p99_ms",
    "upgrade_gap_ms_device_plugin", "upgrade_gap_ms_dra",
    "migrate_ms_to_dra", "migrate_ms_to_device_plugin",
    "image_startup_ratio",
    "node_dp_pod_running_ms", "node_dra_pod_running_ms", "node_host_restart_device_ms",
}
# Families measured only on a whole real node (root, ../shared/k8s): a tiny run skips them.
NODE_ONLY = {"node"}
# An idle process can truly use no CPU in a short window; everything else takes time or memory.
MAY_BE_ZERO = {"idle_cpu_pct_64r", "idle_cpu_pct_watching", "upgrade_gap_ms_device_plugin",
               "upgrade_gap_ms_dra"}


def _check_entry(key: str, entry: dict) -> None:
    assert set(entry) == {"value", "unit", "floor", "ratio"}, key
    value = entry["value"]
    assert isinstance(value, (int, float)) and math.isfinite(value), key
    assert value >= 0 if key in MAY_BE_ZERO else value > 0, (key, value)
    assert isinstance(entry["unit"], str) and entry["unit"], key
    floor, ratio = entry["floor"], entry["ratio"]
    assert floor is None or (isinstance(floor, (int, float)) and floor >= 0), key
    if floor:
        assert ratio == pytest.approx(value / floor, rel=0.01, abs=0.001), key
    else:
        assert ratio is None, key


def test_the_suite_has_exactly_the_contract_keys():
    assert set(all_keys()) == CONTRACT_KEYS
    assert len(all_keys()) == len(CONTRACT_KEYS)  # no key produced by two families
    assert set(report.TARGETS) <= CONTRACT_KEYS


@pytest.mark.parametrize("family", FAMILIES, ids=family_name)
def test_each_family_in_a_tiny_run_gives_all_its_keys(family):
    result = run_suite(Context(tiny=True), [family])
    assert result.missing == {}
    if family_name(family) == "image" and result.skipped:  # no podman or no image built
        assert sorted(result.skipped) == sorted(family.KEYS) and not result.figures
        pytest.skip(next(iter(result.skipped.values())))
    if family_name(family) in NODE_ONLY:
        assert sorted(result.skipped) == sorted(family.KEYS) and not result.figures
        return
    assert sorted(result.figures) == sorted(family.KEYS)
    for key, figure in result.figures.items():
        _check_entry(key, figure.as_json())
        if figure.key in report.TARGETS:
            assert report.status(figure) in ("PASS", "MISS", "n/a")


def test_only_runs_the_keys_asked_for():
    ctx = Context(tiny=True, prefixes=["listwatch_p99_ms_10"])
    result = run_suite(ctx)
    # "listwatch_p99_ms_10" is a prefix of the 1000 and 10000 keys too.
    assert sorted(result.figures) == sorted(k for k in CONTRACT_KEYS if k.startswith("listwatch"))


def test_a_failing_family_reports_missing_keys_never_a_figure():
    def broken(ctx):
        raise RuntimeError("fixture not ready")

    family = SimpleNamespace(__name__="benchmarks.broken", KEYS=("broken_ms",), run=broken)
    short = SimpleNamespace(__name__="benchmarks.short", KEYS=("a_ms", "b_ms"),
                            run=lambda ctx: [Figure("a_ms", 1.0, "ms")])
    result = run_suite(Context(), [family, short])
    assert "fixture not ready" in result.missing["broken_ms"]
    assert "no figure" in result.missing["b_ms"]
    assert list(result.figures) == ["a_ms"]


def test_a_skipped_family_is_neither_figures_nor_missing():
    def cannot(ctx):
        raise Skipped("not root")

    family = SimpleNamespace(__name__="benchmarks.cannot", KEYS=("c_ms",), run=cannot)
    result = run_suite(Context(), [family])
    assert result.skipped == {"c_ms": "not root"}
    assert result.missing == {} and result.figures == {}


def test_figures_refuse_non_numbers():
    with pytest.raises(ValueError):
        Figure("x_ms", float("nan"), "ms")
    assert Figure("x_ms", 2.0, "ms", 0.0).ratio is None
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0
    assert percentile([5.0], 99) == 5.0


def test_json_command_prints_one_object_of_the_contract_shape():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--json", "--quick", "--quiet", "--only",
         "preferred_ms"], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert list(data) == ["preferred_ms_1024_8numa"]
    _check_entry("preferred_ms_1024_8numa", data["preferred_ms_1024_8numa"])


def test_unknown_prefix_is_refused():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "benchmarks", "--only", "no_such_key"],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert done.returncode == 2 and "no_such_key" in done.stderr


def test_table_and_report_show_figures_floors_targets_and_the_machine(tmp_path):
    result = SuiteResult(
        figures={
            "allocate_median_us": Figure("allocate_median_us", 300.0, "us", 250.0, ["n=5"]),
            "rss_mb_64r_10k": Figure("rss_mb_64r_10k", 60.0, "MB", 40.0),
        },
        missing={"discovery_ms_sriov_1024": "discovery failed: RuntimeError: no tree"},
    )
    text = report.table(result)
    assert "PASS" in text and "MISS" in text and "MISSING" in text
    assert "1.20x" in text and "no tree" in text
    path = tmp_path / "README.md"
    report.write_readme(result, quick=True, command="python -m benchmarks --quick", path=str(path))
    written = path.read_text()
    info = report.machine()
    for fact in (info["python"], info["grpcio"], f"{info['cpus']} CPUs"):
        assert fact in written
    assert "| allocate_median_us | 300 | us | 250 | 1.20x | <= 1.2x bare | PASS |" in written
    assert "discovery_ms_sriov_1024" in written and "no tree" in written
    for family in FAMILIES:  # every method is described
        assert f"### {family_name(family)}" in written
