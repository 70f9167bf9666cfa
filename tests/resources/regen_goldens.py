"""Write (or check) the golden ``discover --json`` beside every machine tree.

One convention for every tree in testkit/device_plugin_host_testing/machines: ``<machine>.tree``
(written by its generator in tests/resources/gen_*.py) has ``<machine>.discover.json`` beside it, a
document

    {"config": "<repo-relative config file>", "devices": [<discover --json rows>]}

holding the config discover ran with and what it printed (NVML's reason for being unavailable
normalised, see ``host.sim.fake_gpu.golden_rows``). tests/test_machine_goldens.py globs
every tree and requires its golden. After an intended change of what discover prints:

    .venv/bin/python tests/resources/regen_goldens.py            # every machine
    .venv/bin/python tests/resources/regen_goldens.py qat-node   # some
    .venv/bin/python tests/resources/regen_goldens.py --check    # exit 1 on any difference

and review the diff. A new tree needs its config named once: ``--config PATH`` on its first
regeneration (later runs read it back from the golden).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

REPO = Path(__file__).resolve().parents[2]
MACHINES = REPO / "testkit" / "device_plugin_host_testing" / "machines"
sys.path.insert(0, str(REPO))

from device_plugin_host_testing.machines import load_machine  # noqa: E402
from host.sim.fake_gpu import golden_rows  # noqa: E402


def trees() -> List[str]:
    """Every machine tree, by name: what the golden test parametrises over."""
    return sorted(p.name[: -len(".tree")] for p in MACHINES.glob("*.tree"))


def golden_path(machine: str) -> Path:
    return MACHINES / f"{machine}.discover.json"


def read_golden(machine: str) -> Dict[str, Any]:
    return json.loads(golden_path(machine).read_text(encoding="utf-8"))


def run_discover(machine: str, config: str, *extra: str) -> subprocess.CompletedProcess:
    """``device-plugin-host discover`` on a materialised copy of the tree (a subprocess: the
    real CLI, its exit code and its stderr)."""
    with tempfile.TemporaryDirectory(prefix="dph-golden-") as scratch:
        root = os.path.join(scratch, "root")
        load_machine(machine, root)
        return subprocess.run(
            [sys.executable, "-m", "host", "discover", "--host-root", root,
             "--config", str(REPO / config), *extra],
            capture_output=True, text=True, timeout=120, cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )


Request = Tuple[str, str, List[str]]  # machine, repo-relative config, extra discover args


def discover_many(requests: Sequence[Request]) -> List[Tuple[int, str, str]]:
    """(exit code, stdout, stderr) of ``discover`` for each request, all in ONE child
    interpreter running the CLI's ``main`` once per request: what 24 cold starts of
    ``python -m host`` cost (~1 s of CPU each) is paid once. Each call still parses its own
    argv, loads the drivers and the config, and prints; a crash of one is its exit code."""
    result = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--batch"],
        input=json.dumps(list(requests)), capture_output=True, text=True, timeout=600,
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    if result.returncode != 0:
        raise RuntimeError(f"discover batch failed ({result.returncode}): {result.stderr}")
    return [tuple(r) for r in json.loads(result.stdout)]  # type: ignore[misc]


def _batch() -> int:
    """The child of ``discover_many``: requests as JSON on stdin, results as JSON on stdout."""
    import contextlib
    import io

    from host.process import configure_process

    configure_process()  # what ``python -m host`` does before importing the CLI
    from host.cli import main as cli_main

    requests = json.load(sys.stdin)
    results = []
    roots: Dict[str, str] = {}  # each tree is materialised once (discover only reads it)
    with tempfile.TemporaryDirectory(prefix="dph-golden-") as scratch:
        for machine, config, extra in requests:
            if machine not in roots:
                roots[machine] = os.path.join(scratch, machine)
                load_machine(machine, roots[machine])
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = cli_main(["discover", "--host-root", roots[machine],
                                     "--config", str(REPO / config), *extra])
                except SystemExit as exit_:
                    code = exit_.code if isinstance(exit_.code, int) else 1
            results.append((code, out.getvalue(), err.getvalue()))
    json.dump(results, sys.stdout)
    return 0


def document(config: str, rows: List[Dict[str, Any]]) -> str:
    return json.dumps({"config": config, "devices": golden_rows(rows)}, indent=1,
                      sort_keys=True) + "\n"


def main(argv: List[str]) -> int:
    if argv == ["--batch"]:
        return _batch()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("machines", nargs="*", help="default: every tree")
    parser.add_argument("--config", help="repo-relative config for a machine with no golden")
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args(argv)
    stale = []
    machines = args.machines or trees()
    configs = []
    for machine in machines:
        path = golden_path(machine)
        config = args.config or (read_golden(machine)["config"] if path.exists() else None)
        if config is None:
            parser.error(f"{machine}: no golden yet: name its config with --config")
        configs.append(config)
    results = discover_many([(m, c, ["--json"]) for m, c in zip(machines, configs)])
    for machine, config, (code, out, err) in zip(machines, configs, results):
        path = golden_path(machine)
        if code != 0:
            print(f"{machine}: discover failed: {err.strip()}", file=sys.stderr)
            return 1
        text = document(config, json.loads(out))
        if path.exists() and path.read_text(encoding="utf-8") == text:
            continue
        stale.append(machine)
        if not args.check:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(REPO)}")
    if args.check and stale:
        print("stale goldens: " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
