"""sd_notify over a real datagram socket, with the real host process."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

from host.cli.systemd import Notifier
from host.sim import fake_gpu
from host.sim.kubelet import KubeletSimulator
from host.sim.tree import FakeTree

REPO = Path(__file__).resolve().parents[1]


def _listener(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.setblocking(False)
    return sock


def _private_config(tmp_path) -> str:
    """Drain marks under tmp_path: a test's host must not create /var/lib/device-plugin-host."""
    config = tmp_path / "private.toml"
    config.write_text(f'[host]\ndrain_file = "{tmp_path / "state" / "drained"}"\n')
    return str(config)


def test_notifier_is_silent_outside_systemd():
    assert Notifier({}).send("READY=1") is False


def test_watchdog_interval_is_read_from_the_environment():
    assert Notifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "30000000"}).watchdog_s == 30.0
    assert Notifier({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}).watchdog_s is None


def test_host_sends_ready_after_every_resource_registered_then_stopping(tmp_path, short_dir):
    tree = FakeTree(tmp_path / "root")
    tree.numa_nodes(1)
    fake_gpu.add_nvidia_control_nodes(tree)
    fake_gpu.add_nvidia_gpu(tree, "0000:18:00.0", minor=0, numa_node=0)
    notify_path = os.path.join(short_dir, "notify")
    plugin_dir = os.path.join(short_dir, "dp")
    os.mkdir(plugin_dir)
    listener = _listener(notify_path)

    async def receive(loop) -> str:
        return (await loop.sock_recv(listener, 4096)).decode()

    async def scenario():
        loop = asyncio.get_running_loop()
        sim = KubeletSimulator(plugin_dir)
        await sim.start()
        env = dict(os.environ, PYTHONPATH=str(REPO), NOTIFY_SOCKET=notify_path,
                   WATCHDOG_USEC="400000", WATCHDOG_PID="")
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "host", "run", "--plugin-dir", plugin_dir, "--host-root",
            str(tmp_path / "root"), "--config", str(_private_config(tmp_path)), env=env,
            stderr=asyncio.subprocess.PIPE)
        try:
            messages = []
            while not any("READY=1" in m for m in messages):
                messages.append(await asyncio.wait_for(receive(loop), 20))
            assert sim.resources["nvidia.com/gpu"].registrations >= 1
            assert any("WATCHDOG=1" in m for m in messages)
            pings = 0
            while pings < 2:  # keeps pinging at half the interval
                if "WATCHDOG=1" in await asyncio.wait_for(receive(loop), 2):
                    pings += 1
            process.send_signal(signal.SIGTERM)
            while True:
                if "STOPPING=1" in await asyncio.wait_for(receive(loop), 10):
                    break
            await asyncio.wait_for(process.wait(), 15)
            assert process.returncode == 0
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            await sim.stop()
            listener.close()

    asyncio.run(scenario())


def test_ready_without_a_kubelet_does_not_hold_up_boot(tmp_path, short_dir):
    """No kubelet yet (a node before kubeadm join): READY comes once the sockets serve."""
    tree = FakeTree(tmp_path / "root")
    tree.numa_nodes(1)
    fake_gpu.add_nvidia_control_nodes(tree)
    fake_gpu.add_nvidia_gpu(tree, "0000:18:00.0", minor=0, numa_node=0)
    notify_path = os.path.join(short_dir, "notify")
    plugin_dir = os.path.join(short_dir, "dp")
    os.mkdir(plugin_dir)
    listener = _listener(notify_path)

    async def scenario():
        loop = asyncio.get_running_loop()
        env = dict(os.environ, PYTHONPATH=str(REPO), NOTIFY_SOCKET=notify_path)
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "host", "run", "--plugin-dir", plugin_dir, "--host-root",
            str(tmp_path / "root"), "--config", str(_private_config(tmp_path)), env=env,
            stderr=asyncio.subprocess.PIPE)
        try:
            message = (await asyncio.wait_for(loop.sock_recv(listener, 4096), 20)).decode()
            assert "READY=1" in message and "waiting for the kubelet" in message
            assert [n for n in os.listdir(plugin_dir) if n.startswith("dph-")]
            process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(process.wait(), 15)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            listener.close()

    asyncio.run(scenario())
