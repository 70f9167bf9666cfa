"""``device-plugin-host capture`` is part of the program: the daemon's modules do not import
the test kit, and the /dev nodes a capture records are the ones each installed driver says it
owns (``Driver.device_globs``), a third-party driver's included."""

from __future__ import annotations

import ast
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator, Tuple

from host.cli.capture import capture_tree, driver_dev_globs
from host.config.plugins import load_drivers
from host.sim.tree import FakeTree

REPO = Path(__file__).resolve().parents[1]

#: What cli.py listed by hand before the drivers said it themselves: none may be lost.
OLD_CLI_GLOBS = (
    "/dev/nvidia*", "/dev/nvidia-caps/*", "/dev/kfd", "/dev/dri/*", "/dev/dri/by-path/*",
    "/dev/infiniband/*", "/dev/vfio/*", "/dev/bus/usb/*/*", "/dev/dfl-*", "/dev/xclmgmt*",
    "/dev/ttyUSB*", "/dev/ttyACM*", "/dev/hidraw*", "/dev/video*", "/dev/accel/*",
    "/dev/neuron*", "/dev/hailo*",
)


def _imported_modules(path: Path) -> Iterator[Tuple[int, str]]:
    """Every module ``path`` imports (``import a.b``, ``from a.b import c`` as ``a.b.c``), with
    its line, relative imports resolved against the file's package."""
    package = path.relative_to(REPO).with_suffix("").parts[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[:len(package) - node.level + 1], base]).rstrip(".")
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def test_the_program_never_imports_the_test_kit_and_only_demo_the_simulated_node():
    """No module of the program (host/, drivers/, device_plugin_host/) imports the test kit
    (device_plugin_host_testing, a distribution the daemon does not install), and only
    ``demo`` and the simulated node itself import the simulated node (host.sim)."""
    offenders = []
    for top in ("host", "drivers", "device_plugin_host"):
        for path in sorted((REPO / top).rglob("*.py")):
            relative = path.relative_to(REPO).as_posix()
            sim_allowed = relative.startswith("host/sim/") or relative == "host/cli/demo.py"
            for number, module in _imported_modules(path):
                if (module.split(".")[0] == "device_plugin_host_testing"
                        or (module.startswith("host.sim") and not sim_allowed)):
                    offenders.append(f"{relative}:{number}: imports {module}")
    assert not offenders, "the program stands on its test kit:\n" + "\n".join(offenders)


def test_every_built_in_driver_names_its_device_nodes_and_none_of_the_old_list_is_lost():
    drivers = load_drivers().drivers
    builtin = {"gpu", "usb", "sriov", "fpga", "rdma", "accel", "neuron", "pci"}
    assert builtin <= set(drivers)
    for name in builtin:
        assert drivers[name].device_globs, f"driver {name} names no /dev nodes"
    globs = driver_dev_globs(drivers.values())
    assert set(OLD_CLI_GLOBS) <= set(globs)
    assert len(globs) == len(set(globs))  # each once, however many drivers share it


def test_a_glob_outside_dev_is_skipped_with_a_warning(caplog):
    class Greedy:
        name = "greedy"
        device_globs = ("/etc/*", "/dev/../etc/shadow", "dev/relative*", 7, "/dev/greedy*")

    with caplog.at_level(logging.WARNING, logger="host.cli.capture"):
        assert driver_dev_globs([Greedy()]) == ["/dev/greedy*"]
    assert len([r for r in caplog.records if "greedy" in r.getMessage()]) == 4
    assert driver_dev_globs([object()]) == []  # a duck-typed driver without the attribute


def test_capture_records_the_nodes_a_third_party_driver_owns(tmp_path):
    """A driver package on sys.path (entry_points.txt, as pip installs one) adds its nodes to
    what ``capture`` records, with no change to the host."""
    site = tmp_path / "site"
    (site / "dph_capture_probe-0.1.dist-info").mkdir(parents=True)
    (site / "dph_capture_probe-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: dph-capture-probe\nVersion: 0.1\n")
    (site / "dph_capture_probe-0.1.dist-info" / "entry_points.txt").write_text(
        "[device_plugin_host.drivers]\nprobe = dph_capture_probe\n")
    (site / "dph_capture_probe.py").write_text(textwrap.dedent("""
        from device_plugin_host import Driver, hookimpl

        class Probe(Driver):
            name = "probe"
            device_globs = ("/dev/probe*",)

            def scan(self, host):
                return []

        @hookimpl
        def device_plugin_host_drivers():
            return [Probe()]
    """))
    root = tmp_path / "root"
    tree = FakeTree(root)
    tree.numa_nodes(1)
    tree.chardev("/dev/probe0", 240, 0)
    tree.chardev("/dev/accel/accel0", 261, 0)  # a built-in driver's node
    tree.chardev("/dev/unowned0", 241, 0)  # nobody's: not recorded
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(site)]))
    done = subprocess.run([sys.executable, "-m", "host", "capture", "--host-root", str(root)],
                          capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    nodes = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("c ")]
    assert "/dev/probe0" in nodes and "/dev/accel/accel0" in nodes
    assert "/dev/unowned0" not in nodes


def test_capture_tree_records_only_what_the_globs_name(tmp_path):
    tree = FakeTree(tmp_path)
    tree.numa_nodes(1)
    tree.chardev("/dev/hailo0", 511, 0)
    tree.chardev("/dev/other0", 512, 0)
    lines = list(capture_tree(str(tmp_path), ["/dev/hailo*"]))
    assert [line for line in lines if line.startswith("c ")] == ["c /dev/hailo0 0:0"]
