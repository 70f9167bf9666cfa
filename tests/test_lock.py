"""One host per plugin directory: a second `run` exits 2 naming the first; the lock lives in
the state directory, so wiping the plugin directory does not drop it."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shutil
import sys
from pathlib import Path

from host.cli.lock import (
    HostLock,
    LockHeld,
    legacy_lock_path,
    lock_path,
    running_host,
    started_by,
)
from host.sim.kubelet import KubeletSimulator
from host.sim.tree import FakeTree

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


def test_the_lock_survives_the_plugin_dir_wiped_and_is_released_on_close(tmp_path):
    plugin_dir = tmp_path / "device-plugins"
    plugin_dir.mkdir()
    state = str(tmp_path / "state")
    first = HostLock(str(plugin_dir), state)
    first.acquire({"INVOCATION_ID": "x"})
    try:
        assert os.path.dirname(first.path) == state
        assert os.stat(first.path).st_mode & 0o777 == 0o600
        assert os.stat(state).st_mode & 0o777 == 0o700
        # kubeadm reset / a re-mounted kubelet root: the whole directory goes and comes back.
        shutil.rmtree(plugin_dir)
        plugin_dir.mkdir()
        second = HostLock(str(plugin_dir), state)
        try:
            second.acquire({})
        except LockHeld as error:
            assert error.holder.pid == os.getpid()
            assert "a systemd unit" in str(error) or "systemd unit " in str(error)
        else:
            raise AssertionError("two locks on one plugin directory")
        holder = running_host(str(plugin_dir), state)
        assert holder is not None and holder.pid == os.getpid()
        assert first.still_held()
        # Another plugin directory has a lock of its own in the same state directory.
        other = HostLock(str(tmp_path / "other-plugins"), state)
        other.acquire({})
        other.release()
    finally:
        first.release()
    assert running_host(str(plugin_dir), state) is None
    record = json.loads(Path(lock_path(str(plugin_dir), state)).read_text())
    assert set(record) == {"pid", "how", "since", "plugin_dir"}
    assert record["plugin_dir"] == str(plugin_dir)


def test_the_lock_is_never_opened_through_a_planted_symlink_and_loss_is_noticed(tmp_path):
    plugin_dir, state = str(tmp_path / "dp"), tmp_path / "state"
    state.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    path = lock_path(plugin_dir, str(state))
    os.symlink(victim, path)
    try:
        HostLock(plugin_dir, str(state)).acquire({})
    except OSError as error:
        assert not isinstance(error, LockHeld)
    else:
        raise AssertionError("locked through a symlink")
    assert victim.read_text() == "precious\n"
    os.unlink(path)
    held = HostLock(plugin_dir, str(state))
    held.acquire({})
    try:
        assert held.still_held()
        os.unlink(path)  # a cleanup of the state directory
        assert not held.still_held()
        held.acquire({})  # taken again on the new file
        assert held.still_held() and running_host(plugin_dir, str(state)).pid == os.getpid()
    finally:
        held.release()


def test_an_older_host_holding_the_legacy_lock_is_refused(tmp_path):
    """Versions before the state-directory lock held <plugin_dir>/.device-plugin-host/
    host.cli.lock: a host of this version finds such a one and refuses to start beside it."""
    plugin_dir = tmp_path / "dp"
    legacy = Path(legacy_lock_path(str(plugin_dir)))
    legacy.parent.mkdir(parents=True)
    legacy.write_text(json.dumps({"pid": 4242, "how": "hand: old", "since": ""}))
    old = os.open(legacy, os.O_RDWR)
    fcntl.flock(old, fcntl.LOCK_EX)
    try:
        try:
            HostLock(str(plugin_dir), str(tmp_path / "state")).acquire({})
        except LockHeld as error:
            assert error.holder.pid == 4242
        else:
            raise AssertionError("started beside an older host")
        assert running_host(str(plugin_dir), str(tmp_path / "state")).pid == 4242
    finally:
        os.close(old)
    fresh = HostLock(str(plugin_dir), str(tmp_path / "state"))
    fresh.acquire({})
    fresh.release()


def test_a_third_run_exits_2_naming_the_first_and_discover_says_so(tmp_path, short_dir):
    root = tmp_path / "root"
    FakeTree(root).numa_nodes(1)
    config = tmp_path / "config.toml"
    config.write_text(f'[host]\nplugin_dir = "{short_dir}"\nmetrics_address = ""\n'
                      f'drain_file = "{tmp_path}/state/drained"\n' + USB)
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
            # The plugin directory wiped and made again under the running host (kubeadm
            # reset + join): the lock is not in it, so the second host is still refused.
            await sim.stop()
            shutil.rmtree(short_dir)
            os.mkdir(short_dir)
            sim = KubeletSimulator(short_dir)
            await sim.start()
            await sim.wait_for(lambda s: "example.com/a" in s.resources
                               and s.resources["example.com/a"].connected, timeout=30)
            # A newer host already waits to take over (the successor lock, host/cli/lock.py):
            # one more is refused, naming the holder.
            waiting = HostLock(short_dir, str(tmp_path / "state"))
            assert waiting.acquire_or_follow({}) is False and waiting.following
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
            # The lock file itself deleted (a cleanup of the state directory): the first
            # host notices its inode is gone and locks the new file, so a third is refused.
            state = str(tmp_path / "state")
            os.unlink(lock_path(short_dir, state))
            for _ in range(200):
                if running_host(short_dir, state) is not None:
                    break
                await asyncio.sleep(0.05)
            assert running_host(short_dir, state).pid == first.pid
            third = await asyncio.create_subprocess_exec(
                *args, env=_env(), cwd=str(REPO), stderr=asyncio.subprocess.PIPE)
            _, err = await asyncio.wait_for(third.communicate(), 30)
            assert third.returncode == 2 and f"PID {first.pid}" in err.decode(), err
            waiting.release()

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
    lock = HostLock(str(missing), str(tmp_path / "state"))
    lock.acquire({})
    lock.release()
    assert not missing.exists()


def test_hosts_started_before_the_plugin_dir_exists_are_one_host(tmp_path, short_dir):
    """A missing plugin directory at start (a node whose kubelet is not installed yet) must
    not leave two hosts unlocked: the lock is in the state directory, so the second host
    stops with exit 2 at once, and the first serves the directory when it appears."""
    root = tmp_path / "root"
    FakeTree(root).numa_nodes(1)
    plugin_dir = os.path.join(short_dir, "dp")
    config = tmp_path / "config.toml"
    config.write_text(f'[host]\nplugin_dir = "{plugin_dir}"\nmetrics_address = ""\n'
                      f'drain_file = "{tmp_path}/drained"\n' + USB)
    args = [sys.executable, "-m", "host", "run", "--config", str(config), "--host-root",
            str(root)]

    async def scenario():
        first = await asyncio.create_subprocess_exec(
            *args, env=_env(INVOCATION_ID="1"), cwd=str(REPO), stderr=asyncio.subprocess.PIPE)
        second = None
        try:
            for _ in range(300):
                if running_host(plugin_dir, str(tmp_path)) is not None:
                    break
                await asyncio.sleep(0.05)
            # (A newer host waiting to take over holds the successor lock: one more is
            # refused.)
            waiting = HostLock(plugin_dir, str(tmp_path))
            assert waiting.acquire_or_follow({}) is False
            second = await asyncio.create_subprocess_exec(
                *args, env=_env(INVOCATION_ID="2"), cwd=str(REPO),
                stderr=asyncio.subprocess.PIPE)
            _, err = await asyncio.wait_for(second.communicate(), 30)
            waiting.release()
            assert second.returncode == 2
            assert f"PID {first.pid}" in err.decode() and "Traceback" not in err.decode(), err
            async with KubeletSimulator(plugin_dir) as sim:  # creates the directory
                await sim.wait_for(lambda s: "example.com/a" in s.resources
                                   and s.resources["example.com/a"].connected, timeout=20)
            assert first.returncode is None
            first.terminate()
            await asyncio.wait_for(first.communicate(), 20)
            assert first.returncode == 0
        finally:
            for h in (first, second):
                if h is not None and h.returncode is None:
                    h.kill()
                    await h.wait()

    asyncio.run(scenario())
