"""The public driver API (``device_plugin_host``): one import surface, documented, typed, and
free of side effects on the importing process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import device_plugin_host
import device_plugin_host_testing

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "drivers.md"
EXAMPLE = REPO / "examples" / "widget-driver"


def _fresh(code: str, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter whose environment has no GRPC_* settings."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GRPC_")}
    clean.update(PYTHONPATH=str(REPO), **env)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, env=clean, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_importing_the_public_api_changes_no_environment_variable_and_imports_no_grpc():
    seen = _fresh(
        "import json, os, sys\n"
        "before = dict(os.environ)\n"
        "import device_plugin_host\n"
        "from device_plugin_host import *\n"
        "print(json.dumps({'changed': sorted(k for k in set(before) | set(os.environ)\n"
        "                                    if before.get(k) != os.environ.get(k)),\n"
        "                  'grpc': sorted(m for m in sys.modules if m.split('.')[0] == 'grpc')}))")
    assert seen == {"changed": [], "grpc": []}


def test_the_program_entry_points_still_apply_the_grpc_settings_before_grpc_loads():
    # The console script named in pyproject, and python -m host (host/__main__.py).
    script = re.search(r'^device-plugin-host = "([\w.]+):(\w+)"$',
                       (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert script, "no device-plugin-host console script in pyproject.toml"
    module, function = script.groups()
    seen = _fresh(
        "import json, os, sys\n"
        "seen = {}\n"
        "class Spy:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'grpc' and 'at_grpc' not in seen:\n"
        "            seen['at_grpc'] = os.environ.get('GRPC_VERBOSITY')\n"
        "sys.meta_path.insert(0, Spy())\n"
        f"import {module}\n"
        "sys.argv = ['device-plugin-host', 'check-config', os.devnull]\n"
        "try:\n"
        f"    {module}.{function}()\n"
        "except SystemExit:\n"
        "    pass\n"
        "during = seen.get('at_grpc', 'not loaded')\n"
        "import host.app  # the daemon's half: grpc loads here, after the entry point ran\n"
        "print(json.dumps([during, seen.get('at_grpc'),\n"
        "                  os.environ.get('GRPC_ENABLE_FORK_SUPPORT')]))")
    # check-config needs no grpc at all (every command imports only what it uses).
    assert seen == ["not loaded", "ERROR", "false"]
    seen = _fresh(
        "import json, os, runpy, sys\n"
        "seen = {}\n"
        "class Spy:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'grpc' and 'at_grpc' not in seen:\n"
        "            seen['at_grpc'] = os.environ.get('GRPC_VERBOSITY')\n"
        "sys.meta_path.insert(0, Spy())\n"
        "sys.argv = ['host', 'check-config', os.devnull]\n"
        "try:\n"
        "    runpy.run_module('host', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "during = seen.get('at_grpc', 'not loaded')\n"
        "import host.app  # the daemon's half: grpc loads here, after the entry point ran\n"
        "print(json.dumps([during, seen.get('at_grpc'),\n"
        "                  os.environ.get('GRPC_ENABLE_FORK_SUPPORT')]))")
    # check-config needs no grpc at all (every command imports only what it uses).
    assert seen == ["not loaded", "ERROR", "false"]
    # An operator's own value wins.
    seen = _fresh("import json, os\nfrom host.process import configure_process\n"
                  "configure_process()\nprint(json.dumps(os.environ['GRPC_VERBOSITY']))",
                  GRPC_VERBOSITY="DEBUG")
    assert seen == "DEBUG"


def test_every_public_name_is_exported_and_is_what_the_host_uses():
    from host.core.driver import Driver
    from host.core.hostfs import HostFS
    from host.core.model import Device

    assert device_plugin_host.Driver is Driver
    assert device_plugin_host.Device is Device
    assert device_plugin_host.HostFS is HostFS
    for module in (device_plugin_host, device_plugin_host_testing):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name} is listed but missing"


def _documented_names(text: str) -> set:
    """Names with an entry of their own in docs/drivers.md: a heading naming them, or a
    bullet that starts with them (``* `name`...`` or ``* `name(args)`...``)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("#"):
            names.update(re.findall(r"`([A-Za-z_][\w.]*)", line))
        else:
            bullet = re.match(r"\s*\*\s+(.*)", line)
            if bullet:
                names.update(re.findall(r"`([A-Za-z_][\w.]*)[^`]*`", bullet.group(1))[:3])
    return {name.rsplit(".", 1)[-1] for name in names}


def test_every_public_name_has_its_entry_in_docs_drivers_md():
    documented = _documented_names(DOC.read_text(encoding="utf-8"))
    missing = [f"{module.__name__}.{name}"
               for module in (device_plugin_host, device_plugin_host_testing)
               for name in module.__all__ if name != "__version__" and name not in documented]
    assert not missing, "docs/drivers.md has no entry for: " + ", ".join(missing)


def test_the_documented_names_check_can_fail():
    assert "Driver" in _documented_names("## The `Driver` class\n")
    assert "HostFS" not in _documented_names("`HostFS` is mentioned in passing prose.\n")


def test_the_package_is_typed_and_shipped():
    assert (REPO / "device_plugin_host" / "py.typed").is_file()
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"device_plugin_host*"' in pyproject
    assert '"device_plugin_host" = ["py.typed"]' in pyproject


def test_the_widget_example_imports_only_the_public_api():
    offenders = []
    for path in sorted(EXAMPLE.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.match(r"\s*(from|import)\s+(host|drivers)\b", line):
                offenders.append(f"{path.relative_to(EXAMPLE)}:{number}: {line.strip()}")
    assert not offenders, "the example reaches into the host's internals:\n" + "\n".join(
        offenders)


def test_the_collector_is_off_only_while_the_program_starts():
    """The entry points pause the cyclic collector for the start (host/process.py); a command
    turns it back on once parsed, and importing the program or the public API never touches
    it (a driver's or a test's process keeps its own collector)."""
    seen = _fresh(
        "import gc, json, os, sys\n"
        "import device_plugin_host, host.cli, host.process\n"
        "untouched = gc.isenabled()\n"
        "seen = {}\n"
        "parser, dispatch = host.cli._parser, host.cli._dispatch\n"
        "def parsing(*args):\n"
        "    seen['parsing'] = gc.isenabled()\n"
        "    return parser(*args)\n"
        "def dispatching(args):\n"
        "    seen['running'] = gc.isenabled()\n"
        "    return dispatch(args)\n"
        "host.cli._parser, host.cli._dispatch = parsing, dispatching\n"
        "sys.argv = ['device-plugin-host', 'check-config', os.devnull]\n"
        "host.process.main()\n"
        "print(json.dumps([untouched, seen['parsing'], seen['running'], gc.isenabled()]))")
    assert seen == [True, False, True, True]
    seen = _fresh(
        "import gc, json\n"
        "import host.process\n"
        "host.process.configure_process()\n"
        "import host.memory\n"
        "host.memory.pause_collector()\n"
        "print(json.dumps(gc.isenabled()))")
    assert seen is False


def test_the_built_in_drivers_import_only_the_public_api_and_their_own_modules():
    """Every built-in driver is written against ``device_plugin_host`` alone, as a third
    party's would be: no ``host.*`` import, and no other built-in's modules."""
    import ast

    found = []
    for path in sorted((REPO / "drivers").rglob("*.py")):
        own = "drivers." + path.relative_to(REPO / "drivers").parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom)
                     and not node.level else [])
            for name in names:
                top = name.split(".")[0]
                if top == "host" or (top == "drivers" and name != own
                                     and not name.startswith(own + ".")):
                    found.append(f"{path.relative_to(REPO)}: {name}")
    assert not found, found
