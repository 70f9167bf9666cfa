"""Promises the repository makes to newcomers and CI."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _readme_commands():
    text = (REPO / "README.md").read_text()
    block = re.search(r"```sh\n(.*?)```", text, re.S).group(1)
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_readme_opens_with_demo_then_tests():
    demo, tests = _readme_commands()[:2]
    assert demo.endswith("device-plugin-host demo")
    assert "pytest" in tests


def test_ci_runs_the_readme_test_command_verbatim():
    tests = _readme_commands()[1]
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert tests in ci


def test_builtin_drivers_come_through_the_public_entry_point_group():
    from host.config.plugins import DriverRegistry
    from host.core.hookspecs import ENTRY_POINT_GROUP

    registry = DriverRegistry()
    registry.load_entry_points(ENTRY_POINT_GROUP)
    assert {"gpu", "usb", "sriov", "fpga", "rdma"} <= set(registry.drivers)
    assert all(s.startswith("entry point") for s in registry.sources.values())




def test_code_states_contracts_not_the_tracker_or_an_outside_sheet():
    """Docstrings and comments say what holds, not which issue or unshipped document asked
    for it: no "issue N" and no section of a facts sheet the repository does not carry."""
    cited = re.compile(r"\bissue #?[0-9]|§[0-9]|facts\.md", re.I)
    found = []
    for top in ("host", "drivers", "device_plugin_host", "testkit", "tests", "benchmarks"):
        for path in sorted((REPO / top).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if cited.search(line) and path.name != "test_repo.py":
                    found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
