"""One host per plugin directory: a second `run` exits 2 naming the first (issue 11 item 4)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from host.lock import HostLock, LockHeld, lock_path, running_host, started_by
from host.testing.kubelet import KubeletSimulator
from host.testing.tree import FakeTree

REPO = Path(__file__).resolve().parents[1]
USB = '[[resource]]\nname = "example.com/a"\ndriver = "usb"\n'


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("INVOCATION_ID", "KUBERNETES_SERVICE_HOST", "POD_NAME", "POD_NAMESPACE")}
    env.update(PYTHONPATH=str(REPO), **extra)
    return env


def test_started_by_names_the_systemd_unit_or_the_pod(tmp_path):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    # cgroup v2 as systemd lays it out (man systemd.unit, "slices"); v1 has one line per
    # hierarchy with the same path on the name=systemd line.
    (proc / "self" / "cgroup").write_text("0::/system.slice/device-plugin-host.service\n")
    assert started_by({"INVOCATION_ID": "0123abcd"}, str(proc)) == \
        "systemd unit device-plugin-host.service"
    (proc / "self" / "cgroup").write_text(
        "12:pids:/system.slice/device-plugin-host.service\n"
        "1:name=systemd:/system.slice/device-plugin-host.service\n")
    assert started_by({"INVOCATION_ID": "0123abcd"}, str(proc)) == \
        "systemd unit device-plugin-host.service"
    pod = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "HOSTNAME": "device-plugin-host-x7k2p",
           "POD_NAMESPACE": "device-plugin-host"}
    assert started_by(pod, str(proc)) == \
        "Kubernetes pod device-plugin-host/device-plugin-host-x7k2p (DaemonSet)"
    (proc / "self" / "cmdline").write_bytes(b"python3\0-m\0host\0run\0")
    assert started_by({}, str(proc)) == "hand: python3 -m host run"


def test_the_lock_survives_the_kubelets_cleanup_and_is_released_on_close(tmp_path):
    plugin_dir = tmp_path / "device-plugins"
    plugin_dir.mkdir()
    first = HostLock(str(plugin_dir))
    first.acquire({"INVOCATION_ID": "x"})
    try:
        # kubelet 1.32 deletes every non-directory file directly in the plugin dir at start
        # (dm/manager.go CleanupPluginDirectory); the lock is one level down.
        for entry in plugin_dir.iterdir():
            if not entry.is_dir():
                entry.unlink()
        second = HostLock(str(plugin_dir))
        try:
            second.acquire({})
        except LockHeld as error:
            assert error.holder.pid == os.getpid()
            assert "a systemd unit" in str(error) or "systemd unit " in str(error)
        else:
            raise AssertionError("two locks on one plugin directory")
        holder = running_host(str(plugin_dir))
        assert holder is not None and holder.pid == os.getpid()
    finally:
        first.release()
    assert running_host(str(plugin_dir)) is None
    record = json.loads(Path(lock_path(str(plugin_dir))).read_text())
    assert set(record) == {"pid", "how", "since"}


def test_a_second_run_exits_2_naming_the_first_and_discover_says_so(tmp_path, short_dir):
    root = tmp_path / "root"
    FakeTree(root).numa_nodes(1)
    config = tmp_path / "config.toml"
    config.write_text(f'[host]\nplugin_dir = "{short_dir}"\n' + USB)
    args = [sys.executable, "-m", "host", "run", "--config", str(config), "--plugin-dir",
            short_dir, "--host-root", str(root)]
    pod = dict(KUBERNETES_SERVICE_HOST="10.96.0.1", POD_NAME="device-plugin-host-x7k2p",
               POD_NAMESPACE="device-plugin-host")

    async def scenario():
        sim = KubeletSimulator(short_dir)
        await sim.start()
        first = await asyncio.create_subprocess_exec(
            *args, env=_env(**pod), cwd=str(REPO), stderr=asyncio.subprocess.PIPE)
        try:
            await sim.wait_for(lambda s: s.resources["example.com/a"].connected, timeout=30)
            second = await asyncio.create_subprocess_exec(
                *args, env=_env(INVOCATION_ID="1"), cwd=str(REPO),
                stderr=asyncio.subprocess.PIPE)
            _, err = await asyncio.wait_for(second.communicate(), 30)
            assert second.returncode == 2
            message = err.decode()
            assert "Traceback" not in message and len(message.strip().splitlines()) == 1
            assert f"PID {first.pid}" in message
            assert "Kubernetes pod device-plugin-host/device-plugin-host-x7k2p" in message
            assert short_dir in message
            assert sim.resources["example.com/a"].registrations == 1  # no fight

            for command in (["discover", "--config", str(config), "--host-root", str(root)],
                            ["check-config", str(config), "--host-root", str(root)]):
                done = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "host", *command, env=_env(), cwd=str(REPO),
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
                _, err = await asyncio.wait_for(done.communicate(), 30)
                assert done.returncode == 0, err
                assert f"note: a device-plugin-host already serves {short_dir}: PID " \
                       f"{first.pid}, started by Kubernetes pod".encode() in err, err
            first.terminate()
            await asyncio.wait_for(first.communicate(), 20)
            assert first.returncode == 0
        finally:
            if first.returncode is None:
                first.kill()
                await first.wait()
            await sim.stop()

    asyncio.run(scenario())


def test_a_missing_plugin_dir_is_not_created_by_the_lock(tmp_path):
    missing = tmp_path / "device-plugins"
    try:
        HostLock(str(missing)).acquire({})
    except FileNotFoundError:
        pass
    else:
        raise AssertionError("locked a directory that does not exist")
    assert not missing.exists()


def test_hosts_started_before_the_plugin_dir_exists_still_lock_it_when_it_appears(
        tmp_path, short_dir):
    """A missing plugin directory at start (a node whose kubelet is not installed yet) must
    not leave two hosts unlocked: the lock is taken once a socket could be bound there, and
    the host that finds it taken stops with exit 2 (before the fix both served)."""
    root = tmp_path / "root"
    FakeTree(root).numa_nodes(1)
    plugin_dir = os.path.join(short_dir, "dp")
    config = tmp_path / "config.toml"
    config.write_text(f'[host]\nplugin_dir = "{plugin_dir}"\nmetrics_address = ""\n'
                      f'drain_file = "{tmp_path}/drained"\n' + USB)
    args = [sys.executable, "-m", "host", "run", "--config", str(config), "--host-root",
            str(root)]

    async def scenario():
        hosts = [await asyncio.create_subprocess_exec(
            *args, env=_env(INVOCATION_ID=str(n)), cwd=str(REPO),
            stderr=asyncio.subprocess.PIPE) for n in range(2)]
        try:
            await asyncio.sleep(1.0)  # both past start-up, waiting for the directory
            assert all(h.returncode is None for h in hosts)
            os.mkdir(plugin_dir)
            done, _ = await asyncio.wait([asyncio.ensure_future(h.wait()) for h in hosts],
                                         timeout=20, return_when=asyncio.FIRST_COMPLETED)
            assert len(done) == 1, "neither host stopped: both serve one plugin directory"
            loser = next(h for h in hosts if h.returncode is not None)
            winner = next(h for h in hosts if h is not loser)
            assert loser.returncode == 2
            err = (await loser.stderr.read()).decode()
            assert f"PID {winner.pid}" in err and "Traceback" not in err, err
            holder = running_host(plugin_dir)
            assert holder is not None and holder.pid == winner.pid
            winner.terminate()
            await asyncio.wait_for(winner.communicate(), 20)
            assert winner.returncode == 0
        finally:
            for h in hosts:
                if h.returncode is None:
                    h.kill()
                    await h.wait()

    asyncio.run(scenario())
