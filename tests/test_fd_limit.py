"""An fd limit hit once must not leave resources unregistered: every failed serve or Register is
retried with backoff until it succeeds, and the retry path itself allocates nothing that can
run out (a lazy import there failed with EMFILE and ended the resource's reconcile loop).

The host runs as a child with ``RLIMIT_NOFILE`` lowered to 64 before it starts (``setrlimit``
in the child, as ``ulimit -n 64`` would) and 32 resources, each needing a listening socket and
the kubelet's connection to it: some cannot be served at first. The test then raises the
child's limit with ``prlimit`` (fds available again) and restarts the kubelet."""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Tuple

import pytest

from host.sim.kubelet import KubeletSimulator

REPO = Path(__file__).resolve().parents[1]
COUNT = 32
NAMES = [f"example.com/r{n:02d}" for n in range(COUNT)]
LOW = 64

pytestmark = pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="needs prlimit(2)")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _config(tmp_path: Path, plugin_dir: str, port: int) -> Path:
    (tmp_path / "sys").mkdir(exist_ok=True)
    text = (f'[host]\nplugin_dir = "{plugin_dir}"\nmetrics_address = "127.0.0.1:{port}"\n'
            f'drain_file = "{tmp_path}/state/drained"\ncdi_dir = "{tmp_path}/cdi"\n'
            'liveness_grace_s = 1\nrescan_interval_s = 0\n')
    for name in NAMES:  # usb resources with no devices still register (an empty list)
        text += f'[[resource]]\nname = "{name}"\ndriver = "usb"\n'
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def _healthz(port: int) -> Tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _registered(sim: KubeletSimulator) -> int:
    return sum(1 for n in NAMES if n in sim.resources and sim.resources[n].connected
               and sim.resources[n].live)


def test_resources_refused_fds_register_once_fds_are_available(tmp_path, short_dir, run):
    plugin_dir = os.path.join(short_dir, "dp")
    os.mkdir(plugin_dir)
    port = _free_port()
    config = _config(tmp_path, plugin_dir, port)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def low_limit() -> None:  # in the child, before exec: ``ulimit -n 64``
        resource.setrlimit(resource.RLIMIT_NOFILE, (LOW, hard))

    async def body() -> None:
        async with KubeletSimulator(plugin_dir, dial_timeout=2.0) as sim:
            host = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "host", "run", "--config", str(config),
                "--host-root", str(tmp_path), cwd=str(REPO),
                env=dict(os.environ, PYTHONPATH=str(REPO)), preexec_fn=low_limit,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
            lines = []

            async def read() -> None:
                assert host.stderr is not None
                async for raw in host.stderr:
                    lines.append(raw.decode(errors="replace").rstrip())

            reader = asyncio.ensure_future(read())
            try:
                loop = asyncio.get_running_loop()
                # Fds run out: not everything can be served and registered. (The metrics
                # endpoint cannot accept either meanwhile: a refused or timed-out probe is a
                # failed one; its 503 naming a resource is covered in test_metrics.)
                # Past the kubelet's dial-back timeout: Register calls fail and are retried
                # while fds are still short.
                await asyncio.sleep(8)
                assert host.returncode is None, lines[-20:]
                assert _registered(sim) < COUNT, "the limit did not bite: the test shows nothing"
                # Fds available again: every resource registers, with no kubelet restart...
                resource.prlimit(host.pid, resource.RLIMIT_NOFILE, (4096, hard))
                await sim.wait_for(lambda s: _registered(s) == COUNT, timeout=30,
                                   what=f"all {COUNT} registered once fds were available")
                # ...and again after one.
                await sim.restart(0.2)
                await sim.wait_for(lambda s: _registered(s) == COUNT, timeout=30,
                                   what=f"all {COUNT} registered after a kubelet restart")
                for _ in range(50):
                    status, text = await loop.run_in_executor(None, _healthz, port)
                    if status == 200:
                        break
                    await asyncio.sleep(0.2)
                assert status == 200, text
                failed = [line for line in lines if "reconcile failed" in line]
                assert failed == [], failed[:3]
            finally:
                if host.returncode is None:
                    host.terminate()
                await asyncio.wait_for(host.wait(), 30)
                await asyncio.wait_for(reader, 10)

    run(body(), timeout=120)
