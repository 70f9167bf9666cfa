"""What a killed host, or one whose config lost a resource, left behind is removed at the
next start: dead sockets named like ours, our CDI specs and the device-info files of
resources no longer served. Live sockets, other plugins' files and DRA claim specs stay."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import uuid
from pathlib import Path

from device_plugin_host_testing.drivers import make_devices
from device_plugin_host_testing.harness import make_config
from host.cli.stale import DEVICE_INFO_RECORD, remove_stale, remove_stale_device_info
from host.core.cdi import CdiWriter
from host.core.model import ResourceConfig
from host.kubelet.socket_names import SOCKET_NAME, socket_file_name
from host.outputs import devinfo
from host.sim.tree import FakeTree

REPO = Path(__file__).resolve().parents[1]
SRIOV = {"device_info": True}


def _dead_socket(path: str) -> None:
    """A socket file whose server is gone, as a SIGKILL leaves it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(1)
    sock.close()  # the file stays


def test_every_socket_name_of_ours_matches_the_pattern_and_others_do_not():
    for resource in ("nvidia.com/gpu", "a/b", "x" * 60 + "/y", "intel.com/sriov_netdevice"):
        for generation in (1, 999_999, 1_000_001):
            assert SOCKET_NAME.match(socket_file_name(resource, "1a2b3c4d5e", generation))
    for other in ("kubelet.sock", "nvidia-gpu.sock", "dph-x.sock", "sriovNet.sock"):
        assert not SOCKET_NAME.match(other)


def test_dead_sockets_of_ours_go_and_live_or_foreign_ones_stay(short_dir, tmp_path):
    dead = os.path.join(short_dir, socket_file_name("example.com/gpu", "abc123", 3))
    _dead_socket(dead)
    live_path = os.path.join(short_dir, socket_file_name("example.com/gpu", "def456", 1))
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(live_path)
    live.listen(8)
    foreign = os.path.join(short_dir, "nvidia-gpu.sock")
    _dead_socket(foreign)
    regular = os.path.join(short_dir, socket_file_name("example.com/nic", "abc123", 4))
    Path(regular).write_text("not a socket\n")
    try:
        config = make_config(short_dir, [], cdi_dir=str(tmp_path / "cdi"))
        assert remove_stale(config) == [dead]
        assert not os.path.lexists(dead)
        assert os.path.exists(live_path) and os.path.exists(foreign) and os.path.exists(regular)
    finally:
        live.close()


def test_cdi_specs_of_resources_no_longer_served_go(short_dir, tmp_path):
    cdi_dir = tmp_path / "cdi"
    writer = CdiWriter(str(cdi_dir))
    for resource in ("example.com/gpu", "example.com/old", "example.com/plain"):
        writer.update(resource, make_devices("g", 2))
    claim = cdi_dir / f"device-plugin-host_{uuid.uuid4()}_example.com-old.json"
    claim.write_text(json.dumps({"cdiVersion": "0.3.0", "kind": "example.com/old",
                                 "devices": [{"name": "g0"}]}))
    foreign = cdi_dir / "nvidia.yaml"
    foreign.write_text("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\n")
    resources = [ResourceConfig("example.com/gpu", "m", cdi=True),
                 ResourceConfig("example.com/plain", "m")]  # still served, no longer cdi
    config = make_config(short_dir, resources, cdi_dir=str(cdi_dir))
    removed = remove_stale(config)
    assert sorted(removed) == sorted([writer.path_for("example.com/old"),
                                      writer.path_for("example.com/plain")])
    assert sorted(p.name for p in cdi_dir.iterdir()) == sorted(
        [Path(writer.path_for("example.com/gpu")).name, claim.name, foreign.name])


def test_device_info_files_of_resources_we_no_longer_serve_go(tmp_path):
    state = tmp_path / "state"
    info = tmp_path / "devinfo"
    old = ResourceConfig("intel.com/old", "sriov", settings={**SRIOV,
                                                             "device_info_dir": str(info)})
    kept = ResourceConfig("intel.com/sriov", "sriov", settings={**SRIOV,
                                                                "device_info_dir": str(info)})
    # A first run serves both: recorded.
    assert remove_stale_device_info(str(state), [old, kept]) == []
    for resource in ("intel.com/old", "intel.com/sriov", "openshift.io/other"):
        devinfo.write(str(info), resource, "0000:3b:01.2", devinfo.pci_info("0000:3b:01.2"))
    # The next run no longer has intel.com/old; openshift.io/other was never ours.
    removed = remove_stale_device_info(str(state), [kept])
    assert removed == [str(info / devinfo.file_name("intel.com/old", "0000:3b:01.2"))]
    assert sorted(p.name for p in info.iterdir()) == sorted(
        devinfo.file_name(r, "0000:3b:01.2") for r in ("intel.com/sriov", "openshift.io/other"))
    record = json.loads((state / DEVICE_INFO_RECORD).read_text())
    assert record == [[str(info), "intel.com/sriov"]]
    assert (state / DEVICE_INFO_RECORD).stat().st_mode & 0o777 == 0o600


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("INVOCATION_ID", "KUBERNETES_SERVICE_HOST", "POD_NAME", "POD_NAMESPACE")}
    env["PYTHONPATH"] = str(REPO)
    return env


def test_a_restart_after_kill_9_removes_what_the_killed_host_left(tmp_path, short_dir, run):
    root = tmp_path / "root"
    FakeTree(root).numa_nodes(1)
    cdi_dir = tmp_path / "cdi"
    config = tmp_path / "config.toml"
    config.write_text(f'[host]\nplugin_dir = "{short_dir}"\nmetrics_address = ""\n'
                      f'drain_file = "{tmp_path}/state/drained"\ncdi_dir = "{cdi_dir}"\n'
                      '[[resource]]\nname = "example.com/a"\ndriver = "usb"\n')
    args = [sys.executable, "-m", "host", "run", "--config", str(config), "--host-root",
            str(root)]
    removed_resource = CdiWriter(str(cdi_dir))
    removed_resource.update("example.com/removed", make_devices("r", 1))
    old_spec = removed_resource.path_for("example.com/removed")

    def ours():
        return {n for n in os.listdir(short_dir) if SOCKET_NAME.match(n)}

    async def until(predicate, what):
        for _ in range(400):
            if predicate():
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out: {what}")

    async def scenario():
        first = await asyncio.create_subprocess_exec(*args, env=_env(), cwd=str(REPO))
        try:
            await until(lambda: ours(), "the first host's socket")
        finally:
            first.send_signal(signal.SIGKILL)
            await first.wait()
        left = ours()
        assert left, "SIGKILL left no socket: nothing to test"
        second = await asyncio.create_subprocess_exec(*args, env=_env(), cwd=str(REPO))
        try:
            await until(lambda: ours() and not (ours() & left), "the stale sockets removed")
            assert not os.path.exists(old_spec)
        finally:
            second.terminate()
            await second.wait()

    run(scenario())
