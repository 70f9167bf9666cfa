"""check-config over the hostile corpus (tests/resources/hostile_configs.py): every case is
exit 0 with a reason or exit 2 with one ``file: key: reason`` line; none is exit 1 or a
traceback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from host.cli import main
from host.sim import fake_gpu
from host.sim.tree import FakeTree

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "resources"))
import hostile_configs  # noqa: E402

CASES = hostile_configs.cases()
#: The cases that are valid; check-config must still say what they mean.
VALID = {"empty", "only-comments", "only-whitespace", "host-only", "crlf-line-endings",
         "bom-then-valid", "valid-two-gpus-shared"}


@pytest.fixture(scope="module")
def gpu_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile") / "root"
    tree = FakeTree(root)
    tree.numa_nodes(1)
    fake_gpu.add_nvidia_control_nodes(tree)
    fake_gpu.add_nvidia_gpu(tree, "0000:18:00.0", minor=0, numa_node=0)
    fake_gpu.add_nvidia_gpu(tree, "0000:3b:00.0", minor=1, numa_node=0)
    return root


def test_the_corpus_is_at_least_the_63_cases_of_the_issue():
    assert len(CASES) >= 63
    assert set(CASES) >= VALID


@pytest.mark.parametrize("name", sorted(CASES))
def test_check_config_answers_every_hostile_case(name, tmp_path, gpu_root, capsys):
    path = hostile_configs.write(tmp_path, name, CASES[name])
    code = main(["check-config", str(path), "--host-root", str(gpu_root)])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    if name in VALID:
        assert code == 0, err
        assert out.startswith(f"{path}: valid: "), out
        if name in ("empty", "only-comments", "only-whitespace", "host-only"):
            assert "built-in defaults" in out
        return
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    match = re.search(re.escape(str(path)) + r": (\S.*?): (\S.*)$", lines[0])
    assert match, lines[0]
    assert len(lines[0]) < 1000  # a 1 MiB value is cut short, not echoed


@pytest.mark.parametrize("name", ["nested-arrays-5000", "binary-random", "not-a-file-fifo",
                                  "huge-5mib-comment", "overlap-two-gpu-resources", "empty"])
def test_the_real_command_exits_0_or_2(name, tmp_path, gpu_root):
    path = hostile_configs.write(tmp_path, name, CASES[name])
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-m", "host", "check-config", str(path), "--host-root", str(gpu_root)],
        capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert result.returncode == (0 if name in VALID else 2), result.stderr
    assert "Traceback" not in result.stderr
