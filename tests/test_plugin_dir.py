"""plugin_dir problems say what is wrong: a regular file is a config error at
start; missing, read-only or full is one log line with the path and the OS reason (JSON with
``log_format = "json"``, gRPC's own lines included), then retried with backoff until it works.

Read-only and full are real tmpfs mounts this test makes (and unmounts): a read-only mount
gives EROFS, one with no free inode ENOSPC, exactly what a node's disk gives."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from host.sim.kubelet import KubeletSimulator

REPO = Path(__file__).resolve().parents[1]
RESOURCES = ("example.com/a", "example.com/b")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs")


def _config(tmp_path: Path, plugin_dir: str) -> Path:
    (tmp_path / "sys").mkdir(exist_ok=True)  # tmp_path is also the host root: it needs sys/
    path = tmp_path / "config.toml"
    text = (f'[host]\nplugin_dir = "{plugin_dir}"\nlog_format = "json"\n'
            f'drain_file = "{tmp_path}/state/drained"\ncdi_dir = "{tmp_path}/cdi"\n'
            'metrics_address = ""\n')
    for name in RESOURCES:  # usb resources with no devices still register (empty list)
        text += f'[[resource]]\nname = "{name}"\ndriver = "usb"\n'
    path.write_text(text)
    return path


@pytest.fixture
def mount_dir():
    made = []

    def mount(*options: str) -> str:
        path = tempfile.mkdtemp(prefix="dphm", dir="/tmp")
        subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(("size=1m", *options)),
                        "tmpfs", path], check=True, capture_output=True, timeout=20)
        made.append(path)
        return path

    yield mount
    for path in made:
        subprocess.run(["umount", "-l", path], capture_output=True, timeout=20)
        os.rmdir(path)


class HostProcess:
    """``python -m host run`` with its stderr read line by line (each must be JSON)."""

    def __init__(self, config: Path, host_root: Path) -> None:
        self.args = [sys.executable, "-m", "host", "run", "--config", str(config),
                     "--host-root", str(host_root)]
        self.lines: list = []
        self._changed = asyncio.Event()

    async def __aenter__(self) -> HostProcess:
        self.proc = await asyncio.create_subprocess_exec(
            *self.args, cwd=str(REPO), env=dict(os.environ, PYTHONPATH=str(REPO)),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        self._reader = asyncio.ensure_future(self._read())
        return self

    async def _read(self) -> None:
        assert self.proc.stderr is not None
        async for raw in self.proc.stderr:
            self.lines.append(raw.decode().rstrip("\n"))
            self._changed.set()

    async def wait_line(self, text: str, timeout: float = 10) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not any(text in line for line in self.lines):
            self._changed.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise AssertionError(f"no line with {text!r}: {self.lines}")
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    async def __aexit__(self, *exc: object) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
        await asyncio.wait_for(self.proc.wait(), 20)
        await asyncio.wait_for(self._reader, 5)

    def messages(self) -> list:
        out = []
        for line in self.lines:
            entry = json.loads(line)  # every line, gRPC's too, is JSON
            out.append(entry["message"])
        return out


def _registered(sim: KubeletSimulator) -> bool:
    return all(sim.resources[n].connected and sim.resources[n].live for n in RESOURCES)


def test_a_plugin_dir_that_is_a_file_is_a_config_error_at_start(tmp_path):
    target = tmp_path / "plugins"
    target.write_text("")
    config = _config(tmp_path, str(target))
    for args in (("check-config", str(config)), ("run", "--config", str(config))):
        done = subprocess.run([sys.executable, "-m", "host", *args], capture_output=True,
                              text=True, timeout=60, cwd=REPO,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))
        assert done.returncode == 2, done.stderr
        assert f"{target} exists and is not a directory" in done.stderr
        assert "Traceback" not in done.stderr


def _check(host: HostProcess, reason: str, plugin_dir: str) -> None:
    messages = host.messages()
    about = [m for m in messages if reason in m]
    assert len(about) == 1, messages  # one line for all resources and retries
    assert plugin_dir in about[0]
    assert not any("Traceback" in m for m in messages), messages
    assert any(f"plugin directory {plugin_dir} is usable again" in m for m in messages)


@needs_root
def test_read_only_plugin_dir_is_one_line_then_serves_once_writable(tmp_path, mount_dir, run):
    plugin_dir = mount_dir("ro")

    async def body():
        async with HostProcess(_config(tmp_path, plugin_dir), tmp_path) as host:
            await host.wait_line("Read-only file system")
            subprocess.run(["mount", "-o", "remount,rw", plugin_dir], check=True, timeout=20)
            async with KubeletSimulator(plugin_dir) as sim:
                await sim.wait_for(_registered, timeout=15, what="registered once writable")
            return host

    _check(run(body(), timeout=60), "Read-only file system", plugin_dir)


@needs_root
def test_full_plugin_dir_is_one_line_then_serves_once_space_is_freed(tmp_path, mount_dir, run):
    plugin_dir = mount_dir("nr_inodes=16")

    async def body():
        async with KubeletSimulator(plugin_dir) as sim:
            fillers = []
            while True:  # take every free inode
                try:
                    path = os.path.join(plugin_dir, f"filler{len(fillers)}")
                    with open(path, "w"):
                        pass
                    fillers.append(path)
                except OSError:
                    break
            async with HostProcess(_config(tmp_path, plugin_dir), tmp_path) as host:
                await host.wait_line("No space left on device")
                for path in fillers:
                    os.unlink(path)
                await sim.wait_for(_registered, timeout=15, what="registered once freed")
                return host

    _check(run(body(), timeout=60), "No space left on device", plugin_dir)


def test_missing_plugin_dir_is_one_line_then_serves_when_it_appears(tmp_path, short_dir, run):
    plugin_dir = os.path.join(short_dir, "dp")

    async def body():
        async with HostProcess(_config(tmp_path, plugin_dir), tmp_path) as host:
            await host.wait_line("No such file or directory")
            async with KubeletSimulator(plugin_dir) as sim:  # creates the directory
                await sim.wait_for(_registered, timeout=15, what="registered once created")
            return host

    _check(run(body(), timeout=60), "No such file or directory", plugin_dir)


def test_a_recreated_plugin_dir_is_served_again_through_kubelet_restarts(tmp_path, short_dir, run):
    """The plugin directory deleted and made again under a running host (a kubelet root
    re-mounted, ``kubeadm reset`` + ``join``): a file some process keeps open in the old
    directory pins its inode, so no delete event of its own arrives; the host still moves to
    the new directory, serves there and registers with the kubelet that starts in it, and
    again through two more kubelet restarts."""
    plugin_dir = os.path.join(short_dir, "dp")
    os.mkdir(plugin_dir)
    held = os.path.join(plugin_dir, "held")

    async def body():
        async with HostProcess(_config(tmp_path, plugin_dir), tmp_path):
            async with KubeletSimulator(plugin_dir) as sim:
                await sim.wait_for(_registered, timeout=15, what="registered at start")
            with open(held, "w"):  # another process's file in the old directory, kept open
                # The host puts back a socket it sees vanish, so, as with ``rm -rf`` by
                # hand, a removal can meet a freshly made socket: try again until it is gone.
                for _ in range(100):
                    try:
                        shutil.rmtree(plugin_dir)
                        break
                    except OSError:
                        await asyncio.sleep(0.01)
                assert not os.path.exists(plugin_dir)
                os.mkdir(plugin_dir, 0o750)
                # The host serves in the new directory before any kubelet is there: the
                # kubelet.sock that appears next is the only news it gets.
                for _ in range(1000):
                    if len(os.listdir(plugin_dir)) >= len(RESOURCES):
                        break
                    await asyncio.sleep(0.01)
                assert len(os.listdir(plugin_dir)) == len(RESOURCES), os.listdir(plugin_dir)
                await asyncio.sleep(0.2)
                sim = KubeletSimulator(plugin_dir)
                await sim.start()
                try:
                    # Well within the 10 s recheck: the directory watch itself moved.
                    await sim.wait_for(_registered, timeout=5,
                                       what="registered in the re-created directory")
                    for _ in range(2):
                        await sim.restart(0.2)
                        await sim.wait_for(_registered, timeout=15,
                                           what="registered after a kubelet restart")
                    assert {os.path.dirname(sim.resources[n].socket_path)
                            for n in RESOURCES} == {os.path.abspath(plugin_dir)}
                finally:
                    await sim.stop()

    run(body(), timeout=90)
