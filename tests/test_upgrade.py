"""Upgrades with no gap: two hosts overlap and hand the node over (host/cli/lock.py), DRA drivers
with per-instance sockets, a DRA checkpoint the two share, against kubelet stand-ins that keep
using the old plugin until the new one registers and fail calls during the switch as the real
kubelet does (an Allocate on a connection it closed, a prepare on a deregistered instance)."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
from pathlib import Path

import pytest

from benchmarks import upgrade
from host.cli.lock import HostLock, LockHeld, running_host
from host.dra import naming
from host.dra.checkpoint import Checkpoint, PreparedClaim, PreparedDevice
from host.kubelet import socket_names
from host.kubelet.plugin_watcher import remove_dead_instances
from host.kubelet.socket_names import instance_id
from host.sim.apiserver import kube_api

__all__ = ["kube_api"]


# -- the whole upgrade ---------------------------------------------------------------------------


@pytest.fixture
def short_tmp():
    directory = tempfile.mkdtemp(prefix="dpu", dir="/tmp")  # unix socket paths stay short
    yield directory
    import shutil

    shutil.rmtree(directory, ignore_errors=True)


def _run(coro):
    return asyncio.run(coro)


def test_a_hand_over_keeps_claims_preparable_and_devices_allocatable(tmp_path, short_tmp,
                                                                    kube_api):
    """Kubelet 1.37 (clients by name and socket path): neither side has any gap. Against
    the real API server where KUBEBUILDER_ASSETS is set."""
    outcome = _run(upgrade.scenario(str(tmp_path), short_tmp, kube_api, mode="handover",
                                    kubelet_version=(1, 37)))
    assert outcome.old_exit == 0  # the old host drained and exited by itself
    assert outcome.prepares > 5 and outcome.prepare_failures == []
    assert outcome.dra_gap_s == 0.0
    assert outcome.allocations > 20 and outcome.allocate_failures == []
    assert outcome.dp_gap_s == 0.0
    # prepared by the old host, its CDI spec kept through the hand-over, unprepared (and
    # the spec removed) by the new one
    assert outcome.held_claim_unprepared


def test_a_hand_over_on_a_1_36_kubelet_costs_one_re_registration(tmp_path, short_tmp):
    """1.36 closes the new host's stream when the old host's ends (it looks the client up by
    name); the new host registers again at once. DRA has no gap."""
    from host.sim.apiserver import ApiServerStandIn

    with ApiServerStandIn() as api:
        outcome = _run(upgrade.scenario(str(tmp_path), short_tmp, api, mode="handover",
                                        kubelet_version=(1, 36)))
    assert outcome.old_exit == 0
    assert outcome.prepare_failures == [] and outcome.dra_gap_s == 0.0
    assert outcome.dp_gap_s < 0.2, outcome.dp_gap_s
    # only pods admitted during that re-registration fail, the way the kubelet fails them
    assert all("no healthy devices present" in f or "connection" in f.lower()
               or f.startswith("CancelledError") for f in outcome.allocate_failures), \
        outcome.allocate_failures
    assert outcome.allocations > 20


def test_daemonset_pods_hand_over_and_the_old_one_waits_for_its_deletion(tmp_path, short_tmp):
    """As DaemonSet pods (sockets named after POD_UID): the old pod, handed over, must not
    exit (its container would be restarted and take the node back); it goes at SIGTERM."""
    from host.sim.apiserver import ApiServerStandIn

    with ApiServerStandIn() as api:
        outcome = _run(upgrade.scenario(str(tmp_path), short_tmp, api, mode="handover",
                                        kubelet_version=(1, 37), pods=True))
    assert outcome.old_waited and outcome.old_exit == 0
    assert outcome.prepare_failures == [] and outcome.allocate_failures == []
    assert outcome.dp_gap_s == 0.0 and outcome.dra_gap_s == 0.0


def test_stop_then_start_is_the_gap_the_hand_over_removes(tmp_path, short_tmp):
    """The floor, measured the same way: the scenario does see a gap when there is one."""
    from host.sim.apiserver import ApiServerStandIn

    with ApiServerStandIn() as api:
        outcome = _run(upgrade.scenario(str(tmp_path), short_tmp, api, mode="restart",
                                        kubelet_version=(1, 37)))
    assert outcome.dp_gap_s > 0.05 and outcome.dra_gap_s > 0.05
    assert outcome.allocate_failures and outcome.prepare_failures


# -- the pieces ------------------------------------------------------------------------------------


def test_the_lock_hands_over_to_one_successor_and_refuses_a_third(tmp_path):
    plugin_dir, state = str(tmp_path / "dp"), str(tmp_path / "state")
    old, new, third = (HostLock(plugin_dir, state) for _ in range(3))
    assert old.acquire_or_follow({"INVOCATION_ID": "1"}) is True
    try:
        assert new.acquire_or_follow({}) is False and new.following
        assert new.predecessor is not None and new.predecessor.pid == os.getpid()
        with pytest.raises(LockHeld):
            third.acquire_or_follow({})
        assert old.successor().state == "starting"
        assert new.take_over() is False  # the holder has not let go
        new.announce_ready()
        assert old.successor().state == "ready"
        old.release()
        assert new.take_over() is True and new.held and not new.following
        assert old.successor() is None  # no stale "ready" for the next holder
        assert running_host(plugin_dir, state).pid == os.getpid()
    finally:
        for lock in (old, new, third):
            lock.release()


def test_instance_ids_come_from_the_pod_or_the_systemd_start():
    assert instance_id({"POD_UID": "0f3c-11ee", "INVOCATION_ID": "abc"}) == "0f3c-11ee"
    assert instance_id({"INVOCATION_ID": "4a1b2c"}) == "4a1b2c"
    assert instance_id({}) == ""
    assert instance_id({"POD_UID": "../../etc"}) == ""  # never part of a path


def test_registration_socket_names_fit_a_unix_socket_path():
    driver = naming.driver_name("nvidia.com/gpu", None, "gpu")
    uid = "6b1e0c8a-73f5-4b44-9c5e-2f1a9a0d5e11"
    assert socket_names.registration_socket_file("/r", driver) == f"{driver}-reg.sock"
    assert socket_names.registration_socket_file("/r", driver, uid) == f"{driver}-{uid}-reg.sock"
    deep = "/var/lib/kubelet/" + "x" * 20
    name = socket_names.registration_socket_file(deep, driver, uid)
    assert len(os.path.join(deep, name)) <= socket_names.UNIX_PATH_MAX
    assert uid not in name and name.endswith("-reg.sock")
    assert name != socket_names.registration_socket_file(deep, driver, uid[:-1] + "2")
    assert socket_names.service_socket_file("dra", uid) == f"dra-{uid}.sock"
    assert socket_names.is_instance_socket(f"dra-{uid}.sock", "dra")
    assert socket_names.is_instance_socket("dra.sock", "dra")
    assert not socket_names.is_instance_socket("dra-x.y.sock", "dra")


def test_sockets_of_dead_instances_go_and_live_ones_stay(short_tmp):
    registry = os.path.join(short_tmp, "reg")
    service = os.path.join(short_tmp, "plug", "d.example.com")
    os.makedirs(registry)
    os.makedirs(service)
    live = socket.socket(socket.AF_UNIX)
    live.bind(os.path.join(registry, "d.example.com-live1-reg.sock"))
    live.listen()
    for path in (os.path.join(registry, "d.example.com-dead1-reg.sock"),
                 os.path.join(service, "dra-dead1.sock"),
                 os.path.join(registry, "other.example.com-reg.sock")):
        dead = socket.socket(socket.AF_UNIX)
        dead.bind(path)
        dead.close()
    try:
        removed = remove_dead_instances(registry, "d.example.com", service, "dra",
                                        keep=(os.path.join(service, "dra-me.sock"),))
    finally:
        live.close()
    assert sorted(os.path.basename(p) for p in removed) == [
        "d.example.com-dead1-reg.sock", "dra-dead1.sock"]
    assert sorted(os.listdir(registry)) == ["d.example.com-live1-reg.sock",
                                            "other.example.com-reg.sock"]


def _claim(uid: str) -> PreparedClaim:
    device = PreparedDevice(("gpu",), "pool", "gpu0", ("k/c=1",), "example.com/gpu", "gpu0")
    return PreparedClaim(uid=uid, namespace="default", name=uid, devices=(device,))


def test_two_hosts_share_the_checkpoint_one_call_at_a_time(tmp_path):
    """Each call runs under the node-wide flock and sees what the other host wrote."""
    state = str(tmp_path / "state")
    old, new = Checkpoint(state), Checkpoint(state)

    async def scenario():
        async with old.shared():
            old.put(_claim("a"))
            # the other host waits for the lock while this call runs
            waiting = asyncio.ensure_future(_enter(new))
            await asyncio.sleep(0.2)
            assert not waiting.done()
        await asyncio.wait_for(waiting, 5)
        assert set(new.claims) == {"a"}  # read again under the lock
        async with new.shared():
            new.remove("a")
            new.put(_claim("b"))
        async with old.shared():
            assert set(old.claims) == {"b"}

    async def _enter(checkpoint: Checkpoint) -> None:
        async with checkpoint.shared():
            pass

    try:
        asyncio.run(scenario())
    finally:
        old.close()
        new.close()
    assert Path(state, "serialize.lock").stat().st_mode & 0o777 == 0o600


def test_a_handed_over_host_leaves_the_successors_files(short_tmp, tmp_path):
    """hand_over=True removes only the host's own sockets; the node labels (and device-info
    files, CDI specs) are the successor's now. A plain stop removes the labels."""
    from device_plugin_host_testing.drivers import MemoryDriver, make_devices
    from device_plugin_host_testing.harness import make_config
    from host.app import HostApp
    from host.core.model import ResourceConfig

    labels = tmp_path / "features.d" / "device-plugin-host"
    labels.parent.mkdir()
    resource = ResourceConfig(name="example.com/nic", driver="memory")
    config = make_config(os.path.join(short_tmp, "dp"), [resource],
                         nfd_features_file=str(labels), rescan_interval_s=0)
    os.makedirs(config.host.plugin_dir)

    async def one(hand_over: bool) -> bool:
        app = HostApp(config, {"memory": MemoryDriver(
            devices={resource.name: make_devices("nic", 2)})}, events=None)
        await app.start()
        assert "example.com/nic.count=2" in labels.read_text()
        endpoint = app.endpoint(resource.name)
        for _ in range(500):  # served (no kubelet here: nothing registers)
            if endpoint is not None and endpoint.socket_name and endpoint.server is not None:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        sockets = [n for n in os.listdir(config.host.plugin_dir) if n.endswith(".sock")]
        await app.stop(hand_over=hand_over)
        assert sockets and not [n for n in os.listdir(config.host.plugin_dir)
                                if n in sockets]  # its own sockets go either way
        return labels.exists()

    assert asyncio.run(one(hand_over=True)) is True
    assert asyncio.run(one(hand_over=False)) is False
