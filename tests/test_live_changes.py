"""Health that recovers, operator drains, replicas and live reload, end to end over gRPC."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from device_plugin_host_testing.drivers import MemoryDriver, make_devices
from device_plugin_host_testing.harness import kubelet_and_host, make_config, running_host
from host.core.drains import read_drains, update_drains
from host.core.model import Device, DeviceNode, ResourceConfig
from host.sim.kubelet import KubeletSimulator
from host.sim.tree import FakeTree

REPO = Path(__file__).resolve().parents[1]

AER_FATAL = "Undefined 0\nDLP 0\nSDES 0\nTLP 0\nTOTAL_ERR_FATAL {n}\n"
AER_NONFATAL = "Undefined 0\nTLP 0\nTOTAL_ERR_NONFATAL {n}\n"


def _pci_devices(tree: FakeTree, count: int):
    devices = []
    for i in range(count):
        address = f"0000:{0x18 + i:02x}:00.0"
        path = tree.pci_function(address, vendor=0x1234, device=0x1, pci_class=0x120000,
                                 numa_node=0)
        tree.attr(f"{path}/aer_dev_fatal", AER_FATAL.format(n=1))  # an old error from boot
        tree.attr(f"{path}/aer_dev_nonfatal", AER_NONFATAL.format(n=0))
        devices.append(Device(id=address, numa_nodes=(0,),
                              device_nodes=(DeviceNode(f"/dev/acc{i}"),),
                              attributes={"pci_address": address}))
    return devices


@pytest.mark.alone
def test_aer_errors_rising_flip_health_and_it_recovers(tmp_path, short_dir, run):
    tree = FakeTree(tmp_path / "root")
    tree.numa_nodes(1)
    devices = _pci_devices(tree, 2)
    driver = MemoryDriver("acc", {"example.com/acc": devices})
    # The Unhealthy state lasts one check interval (no new errors at the next check heals
    # it), and ListAndWatch sends the latest snapshot: at 0.1 s a loop starved by a loaded CI
    # machine sent the healed one first (the kubelet never saw the flip). 0.25 s leaves room.
    resource = ResourceConfig("example.com/acc", "acc", health_interval_s=0.25)
    config = make_config(short_dir, [resource], host_root=str(tmp_path / "root"))

    async def scenario():
        async with kubelet_and_host(config, {"acc": driver}) as (sim, _app):
            await sim.wait_for(lambda s: "example.com/acc" in s.resources
                               and s.resources["example.com/acc"].allocatable == 2)
            # Three more health checks (scans) handled: old errors alone are not a problem.
            await driver.scanned(driver.scans + 4)
            assert sim.resources["example.com/acc"].allocatable == 2
            tree.attr("/sys/bus/pci/devices/0000:19:00.0/aer_dev_nonfatal",
                      AER_NONFATAL.format(n=3))
            await sim.wait_for(lambda s: s.resources["example.com/acc"].allocatable == 1,
                               timeout=3, what="AER rise seen")
            assert sim.resources["example.com/acc"].devices["0000:19:00.0"].health == \
                "Unhealthy"
            # No new errors at the next check: healthy again.
            await sim.wait_for(lambda s: s.resources["example.com/acc"].allocatable == 2,
                               timeout=3, what="recovered after the errors stopped")

    run(scenario())


def test_operator_drain_file_marks_a_device_unhealthy_at_once(short_dir, run):
    driver = MemoryDriver("m", {"example.com/x": make_devices("x", 3)})
    config = make_config(short_dir, [ResourceConfig("example.com/x", "m")])
    drain_file = config.host.drain_file

    async def scenario():
        async with kubelet_and_host(config, {"m": driver}) as (sim, _app):
            await sim.wait_for(lambda s: "example.com/x" in s.resources
                               and s.resources["example.com/x"].allocatable == 3)
            update_drains(drain_file, ("example.com/x", "x1"), "replacing the fan")
            await sim.wait_for(lambda s: s.resources["example.com/x"].allocatable == 2,
                               timeout=2, what="drain applied")
            assert sim.resources["example.com/x"].devices["x1"].health == "Unhealthy"
            update_drains(drain_file, ("example.com/x", "x1"), None)
            await sim.wait_for(lambda s: s.resources["example.com/x"].allocatable == 3,
                               timeout=2, what="undrained")
            if os.path.exists(drain_file):
                os.unlink(drain_file)

    run(scenario())


def test_drain_command_line(tmp_path):
    config = tmp_path / "c.toml"
    drain_file = tmp_path / "state" / "drained"
    config.write_text(f'[host]\ndrain_file = "{drain_file}"\n')
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "host", *args, "--config", str(config)],
                              capture_output=True, text=True, env=env, cwd=REPO, timeout=60)

    assert cli("drain", "nvidia.com/gpu", "0000:18:00.0", "--reason", "bad ECC").returncode == 0
    assert read_drains(str(drain_file)) == {("nvidia.com/gpu", "0000:18:00.0"): "bad ECC"}
    listed = cli("drain", "--list")
    assert "0000:18:00.0\tbad ECC" in listed.stdout
    assert cli("undrain", "nvidia.com/gpu", "0000:18:00.0").returncode == 0
    assert read_drains(str(drain_file)) == {}
    assert (os.stat(drain_file).st_mode & 0o777) == 0o600


@pytest.mark.parametrize("policy", ["pack", "spread"])
def test_replicas_share_devices_by_policy(short_dir, run, policy):
    driver = MemoryDriver("m", {"example.com/gpu": make_devices("g", 2, (0, 1))})
    resource = ResourceConfig("example.com/gpu", "m", replicas=4, replica_policy=policy)
    config = make_config(short_dir, [resource])

    async def scenario():
        sim = KubeletSimulator(short_dir, topology_policy="none")
        await sim.start()
        try:
            async with running_host(config, {"m": driver}):
                await sim.wait_for(lambda s: "example.com/gpu" in s.resources
                                   and s.resources["example.com/gpu"].capacity == 8)
                ids = sorted(sim.resources["example.com/gpu"].devices)
                assert ids[:4] == ["g0::0", "g0::1", "g0::2", "g0::3"]
                first = await sim.allocate("example.com/gpu", 1, pod="a")
                second = await sim.allocate("example.com/gpu", 1, pod="b")
                underlying = {i.split("::")[0] for i in first.device_ids + second.device_ids}
                if policy == "pack":
                    assert len(underlying) == 1  # both on the same GPU
                else:
                    assert len(underlying) == 2  # one on each GPU
                # Allocation data of a replica is its device's.
                nodes = [d.host_path for d in first.response.devices]
                assert nodes in (["/dev/g0"], ["/dev/g1"])
        finally:
            await sim.stop()

    run(scenario())


def test_reload_keeps_unchanged_streams_adds_and_removes(short_dir, run, tmp_path):
    driver = MemoryDriver("m", {"example.com/keep": make_devices("k", 2),
                                "example.com/gone": make_devices("g", 1),
                                "example.com/new": make_devices("n", 3),
                                "example.com/grow": make_devices("w", 1)})
    first = make_config(short_dir, [ResourceConfig("example.com/keep", "m"),
                                    ResourceConfig("example.com/gone", "m"),
                                    ResourceConfig("example.com/grow", "m")])
    second = replace(first, resources=(
        ResourceConfig("example.com/keep", "m"),
        ResourceConfig("example.com/grow", "m", replicas=2),
        ResourceConfig("example.com/new", "m"),
    ))

    async def scenario():
        async with kubelet_and_host(first, {"m": driver}) as (sim, app):
            await sim.wait_for(lambda s: len(s.resources) == 3
                               and all(r.connected and r.snapshots
                                       for r in s.resources.values()))
            keep = sim.resources["example.com/keep"]
            keep_state = (keep.registrations, keep.endpoint, keep.snapshots)
            grow_registrations = sim.resources["example.com/grow"].registrations
            await app.reload(second)
            await sim.wait_for(lambda s: "example.com/new" in s.resources
                               and s.resources["example.com/new"].allocatable == 3
                               and s.resources["example.com/grow"].capacity == 2
                               and s.resources["example.com/grow"].options
                               .get_preferred_allocation_available
                               and not s.resources["example.com/gone"].connected,
                               timeout=3, what="reload applied")
            # Unchanged: same socket, same registration, same stream, no new message.
            assert (keep.registrations, keep.endpoint, keep.snapshots) == keep_state
            assert keep.connected
            # Changed replicas: a new snapshot, and one registration more, since replicas turn
            # GetPreferredAllocation on (a change of that option re-registers).
            assert sim.resources["example.com/grow"].registrations == grow_registrations + 1
            assert "example.com/gone" not in app.served()

    run(scenario())


def test_sighup_with_a_bad_file_keeps_serving_then_a_good_file_applies(tmp_path, short_dir):
    root = tmp_path / "root"
    FakeTree(root).numa_nodes(1)
    config = tmp_path / "config.toml"
    usb_a = '[[resource]]\nname = "example.com/a"\ndriver = "usb"\n'
    usb_b = '[[resource]]\nname = "example.com/b"\ndriver = "usb"\n'
    config.write_text(usb_a)

    async def scenario():
        sim = KubeletSimulator(short_dir)
        await sim.start()
        env = dict(os.environ, PYTHONPATH=str(REPO))
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "host", "run", "--config", str(config), "--plugin-dir",
            short_dir, "--host-root", str(root), env=env, cwd=str(REPO),
            stderr=asyncio.subprocess.PIPE)
        try:
            await sim.wait_for(lambda s: "example.com/a" in s.resources
                               and s.resources["example.com/a"].connected, timeout=20)
            registrations = sim.resources["example.com/a"].registrations
            config.write_text('[[resource]]\nname = "Bad/Name"\ndriver = "usb"\n')
            process.send_signal(signal.SIGHUP)
            await asyncio.sleep(0.5)
            assert sim.resources["example.com/a"].connected
            assert sim.resources["example.com/a"].registrations == registrations
            config.write_text(usb_a + usb_b)  # the file watch picks this up, no signal needed
            await sim.wait_for(lambda s: "example.com/b" in s.resources
                               and s.resources["example.com/b"].connected, timeout=5,
                               what="the new resource after the file changed")
            assert sim.resources["example.com/a"].registrations == registrations
            process.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(process.communicate(), 15)
            assert process.returncode == 0
            assert b"reload rejected" in err and b"Bad/Name" in err
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            await sim.stop()

    asyncio.run(scenario())


def test_aer_counters_of_functions_gone_are_pruned(tmp_path, short_dir, run):
    """AerTracker kept the counters of every function ever seen (its ``forget`` was never
    called): a function gone from the resource, or a resource no longer checked, drops them."""
    from host.core.hostfs import HostFS
    from host.core.isolation import DriverCalls
    from host.inventory import Inventory

    tree = FakeTree(tmp_path / "root")
    devices = _pci_devices(tree, 2)
    driver = MemoryDriver("m", {"example.com/acc": devices})
    resource = ResourceConfig("example.com/acc", "m", health_interval_s=1)

    async def scenario():
        calls = DriverCalls()
        inventory = Inventory(HostFS(str(tree.root)), {"m": driver}, [resource], calls,
                              discover_timeout_s=5, vanished_grace_s=0)
        try:
            await inventory.scan()
            assert inventory._aer.tracked() == {("example.com/acc", d.id) for d in devices}
            driver.devices["example.com/acc"] = devices[:1]  # one function gone
            await inventory.scan()
            assert inventory._aer.tracked() == {("example.com/acc", devices[0].id)}
            inventory.set_resources([replace(resource, health_interval_s=0)])
            await inventory.scan()  # no longer checked: nothing kept
            assert inventory._aer.tracked() == set()
            inventory.set_resources([resource])
            await inventory.scan()
            inventory.set_resources([ResourceConfig("example.com/other", "m")])
            assert inventory._aer.tracked() == set()  # the resource is gone
        finally:
            calls.shutdown()

    run(scenario())


def test_a_reload_applies_live_settings_and_names_each_restart_only_one(short_dir, run, caplog):
    """Settings read once at start (marked on HostSettings) are named in one warning each when
    a reload changes them; the others take effect at once (the inventory's scan timeout and
    vanished grace here), and nothing else is reported."""
    import dataclasses
    import logging

    from host.config.settings import RESTART, HostSettings

    resource = ResourceConfig(name="example.com/x", driver="memory")
    config = make_config(short_dir, [resource])
    driver = MemoryDriver("memory", {"example.com/x": make_devices("x", 2)})
    restart = {f.name for f in dataclasses.fields(HostSettings)
               if f.metadata.get(RESTART)}
    assert {"log_level", "allocate_timeout_s", "register_timeout_s", "plugin_dir"} <= restart
    assert not {"discover_timeout_s", "vanished_grace_s", "rescan_interval_s",
                "liveness_grace_s", "dra_unhealthy", "dra_device_metadata"} & restart

    async def scenario():
        async with kubelet_and_host(config, {"memory": driver}) as (_sim, app):
            changed = replace(config, host=replace(
                config.host, log_level="debug", allocate_timeout_s=9.0,
                discover_timeout_s=7.0, vanished_grace_s=11.0))
            with caplog.at_level(logging.WARNING, logger="host"):
                await app.reload(changed)
            assert (app.inventory.discover_timeout_s, app.inventory.vanished_grace_s) == (
                7.0, 11.0)
            return [r.getMessage() for r in caplog.records if "next restart" in r.getMessage()]

    warned = run(scenario())
    assert sorted(warned) == [
        "reload: [host] allocate_timeout_s changed; it takes effect at the next restart",
        "reload: [host] log_level changed; it takes effect at the next restart"]
