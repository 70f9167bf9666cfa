"""Link state reaches the kubelet through rtnetlink: ``ip link set down/up``
has no uevent, so without RTMGRP_LINK a PF going down waits for the 300 s safety rescan.

Real kernel, real veth pair in a network namespace this test makes (and deletes), the real
host in that namespace (``ip netns exec``) and the kubelet simulator here: unix sockets live
in the file system, so they cross namespaces. The PF's state the driver reads comes from the
fake sysfs tree (the veth only makes the kernel send the notification a real PF would).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from host.sim.fake_net import sriov_pf
from host.sim.kubelet import KubeletSimulator
from host.sim.tree import FakeTree

REPO = Path(__file__).resolve().parents[1]
RESOURCE = "example.com/vf"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2"
)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@pytest.fixture
def netns():
    name = f"dph-{uuid.uuid4().hex[:8]}"
    _ip("netns", "add", name)
    try:
        _ip("-n", name, "link", "add", "dphA", "type", "veth", "peer", "name", "dphB")
        _ip("-n", name, "link", "set", "dphA", "up")
        _ip("-n", name, "link", "set", "dphB", "up")
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
    assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                      text=True, timeout=20).stdout


def test_link_down_and_up_reach_the_kubelet_in_milliseconds(netns, tmp_path, short_dir, run):
    tree = FakeTree(tmp_path / "root")
    tree.numa_nodes(1)
    pf = sriov_pf(tree, "0000:3b:00.0", numvfs=2, ifname="ens1f0", iommu_group=30,
                  vf_iommu_group=100, numa_node=0)
    operstate = f"{pf.path}/net/ens1f0/operstate"
    config = tmp_path / "config.toml"
    config.write_text(
        f'[host]\nplugin_dir = "{short_dir}"\nhost_root = "{tree.root}"\n'
        f'drain_file = "{tmp_path}/state/drained"\ncdi_dir = "{tmp_path}/cdi"\n'
        f'metrics_address = ""\n'
        f'[[resource]]\nname = "{RESOURCE}"\ndriver = "sriov"\n'
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    timings = {}

    async def body():
        sim = KubeletSimulator(short_dir)
        await sim.start()
        host = await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", netns, sys.executable, "-m", "host", "run",
            "--config", str(config), env=env, cwd=str(REPO),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        try:
            await sim.wait_for(lambda k: k.resources[RESOURCE].allocatable == 2, timeout=30,
                               what="both VFs healthy")
            for state, wanted in (("down", 0), ("up", 2)):
                tree.attr(operstate, state)  # what sysfs says once the link changed
                started = time.monotonic()
                await asyncio.to_thread(_ip, "-n", netns, "link", "set", "dphA", state)
                await sim.wait_for(lambda k, w=wanted: k.resources[RESOURCE].allocatable == w,
                                   timeout=5, what=f"link {state} seen by the kubelet")
                timings[state] = (time.monotonic() - started) * 1000
        finally:
            host.terminate()
            _, err = await asyncio.wait_for(host.communicate(), 20)
            await sim.stop()
        return err.decode()

    stderr = run(body(), timeout=90)
    assert "rtnetlink" in stderr, stderr
    assert stderr.count("link of PF ens1f0 is down") == 1, stderr
    print(f"link change to kubelet: down {timings['down']:.1f} ms, up {timings['up']:.1f} ms")
