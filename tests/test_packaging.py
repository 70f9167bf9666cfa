"""The daemon's wheel carries no test code: the test kit is a distribution of its own
(testkit/, ``device-plugin-host-testing``), which the daemon's wheel names only as its
``testing`` extra. What the .deb bundles and the image installs is this same wheel
(deploy/debian/build_deb.py builds it; deploy/container/build runs the same ``pip wheel``)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import List

import pytest

REPO = Path(__file__).resolve().parents[1]
KIT = REPO / "testkit"
BUILDER = REPO / "deploy" / "debian" / "build_deb.py"


def _builder():
    """deploy/ is no package: load the .deb builder as a module (dataclasses need it
    registered)."""
    if "build_deb" not in sys.modules:
        spec = importlib.util.spec_from_file_location("build_deb", BUILDER)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["build_deb"] = module
        spec.loader.exec_module(module)
    return sys.modules["build_deb"]


def _read(wheel: Path, suffix: str) -> str:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(suffix))
        return archive.read(name).decode()


def _names(wheel: Path) -> List[str]:
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


@pytest.fixture(scope="module")
def daemon_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    build = _builder()
    return build.build_project_wheel(REPO, tmp_path_factory.mktemp("wheel"), build.read_project())


@pytest.fixture(scope="module")
def kit_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built from a copy: setuptools writes build/ and *.egg-info beside its sources."""
    work = tmp_path_factory.mktemp("kit")
    source = work / "testkit"
    shutil.copytree(KIT, source, ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "wheel",
                    "--no-deps", "--quiet", "--wheel-dir", str(work / "dist"), str(source)],
                   check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = (work / "dist").glob("device_plugin_host_testing-*.whl")
    return wheel


def test_the_daemon_wheel_carries_no_test_kit(daemon_wheel: Path):
    names = _names(daemon_wheel)
    kit = [n for n in names if n.startswith(("device_plugin_host_testing/", "host/testing/",
                                             "device_plugin_host/testing"))
           or n.endswith(".tree")]
    assert kit == []
    # what `demo` runs on is the program's own, so the image's `demo` works without the kit
    assert "host/sim/kubelet/simulator.py" in names and "host/cli/demo.py" in names
    assert "[pytest11]" not in _read(daemon_wheel, ".dist-info/entry_points.txt")
    metadata = _read(daemon_wheel, ".dist-info/METADATA")
    assert "Provides-Extra: testing" in metadata
    assert 'Requires-Dist: device-plugin-host-testing==0.1.0; extra == "testing"' in metadata


def test_the_kit_wheel_carries_the_kit_its_machines_and_the_pytest_plugin(kit_wheel: Path):
    names = _names(kit_wheel)
    assert all(n.startswith(("device_plugin_host_testing/", "device_plugin_host_testing-"))
               for n in names), names
    machines = sorted(p.name for p in (KIT / "device_plugin_host_testing" / "machines")
                      .glob("*.tree"))
    assert machines and sorted(n.rsplit("/", 1)[1] for n in names
                               if n.endswith(".tree")) == machines
    assert "device_plugin_host_testing/py.typed" in names
    entry_points = _read(kit_wheel, ".dist-info/entry_points.txt")
    assert "[pytest11]\ndevice_plugin_host = device_plugin_host_testing.pytest_plugin" \
        in entry_points
    assert "Requires-Dist: device-plugin-host==0.1.0" in _read(kit_wheel, ".dist-info/METADATA")
