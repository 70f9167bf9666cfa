"""The host end to end: real gRPC over real unix sockets against the kubelet simulator."""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import stat
import tempfile
import threading

import grpc
import psutil
import pytest

from device_plugin_host_testing.drivers import (
    MemoryDriver,
    ReversePreferenceDriver,
    SlowAllocateDriver,
    make_devices,
)
from device_plugin_host_testing.harness import kubelet_and_host, running_host
from device_plugin_host_testing.harness import make_config as _make_config
from host.core.model import Device, Health, ResourceConfig
from host.kubelet.protocol import api
from host.sim.kubelet import KubeletSimulator
from host.sim.tree import FakeTree

_ROOT = []  # the fake machine, built once per process


def make_config(plugin_dir, resources, **host):
    """A config whose host root is a fake two-socket machine (NUMA nodes 0 and 1), built once
    per test process in a temp dir removed at exit (a fixed path outlived every run)."""
    if not _ROOT:
        _ROOT.append(tempfile.mkdtemp(prefix="dph-two-socket-"))
        atexit.register(shutil.rmtree, _ROOT[0], ignore_errors=True)
        FakeTree(_ROOT[0]).numa_nodes(2)
    return _make_config(plugin_dir, resources, host_root=_ROOT[0], **host)


def _resources(*specs):
    return [ResourceConfig(name=name, driver=driver) for name, driver in specs]


def _registered(sim, names, counts=None):
    def check(s):
        for name in names:
            state = s.resources.get(name)
            if state is None or not state.connected or state.snapshots == 0:
                return False
            if counts and len(state.devices) != counts[name]:
                return False
        return True

    return check


def test_registers_every_resource_on_its_own_socket(short_dir, run):
    gpus = MemoryDriver("gpus", {"example.com/gpu": make_devices("gpu", 4, (0, 1)),
                                 "example.com/vgpu": make_devices("vgpu", 2)})
    nics = MemoryDriver("nics", {"example.com/nic": make_devices("nic", 3)})
    resources = _resources(("example.com/gpu", "gpus"), ("example.com/vgpu", "gpus"),
                           ("example.com/nic", "nics"))

    async def scenario():
        sim = KubeletSimulator(short_dir)
        await sim.start()
        try:
            config = make_config(short_dir, resources)
            async with running_host(config, {"gpus": gpus, "nics": nics}) as app:
                names = [r.name for r in resources]
                await sim.wait_for(_registered(sim, names, {"example.com/gpu": 4,
                                                           "example.com/vgpu": 2,
                                                           "example.com/nic": 3}),
                                   what="three resources registered")
                endpoints = {sim.resources[n].endpoint for n in names}
                assert len(endpoints) == 3  # one socket per resource
                for endpoint in endpoints:
                    assert "/" not in endpoint
                    mode = os.stat(os.path.join(short_dir, endpoint)).st_mode
                    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
                state = sim.resources["example.com/gpu"]
                assert state.capacity == 4 and state.allocatable == 4
                assert state.options.get_preferred_allocation_available
                assert not state.options.pre_start_required
                topo = {d.ID: [n.ID for n in d.topology.nodes] for d in state.devices.values()}
                assert topo == {"gpu0": [0], "gpu1": [0], "gpu2": [1], "gpu3": [1]}
                # The kubelet holds the registrations before our Register calls return, so
                # the host turns ready a moment after the last one is seen there.
                await asyncio.wait_for(app.ready.wait(), 5)
            # Stopped: every socket of ours is gone.
            left = [n for n in os.listdir(short_dir) if n.startswith("dph-")]
            assert left == []
        finally:
            await sim.stop()

    run(scenario())


def test_unknown_numa_sends_no_topology(short_dir, run):
    driver = MemoryDriver("m", {"example.com/x": make_devices("x", 2, ())})

    async def scenario():
        config = make_config(short_dir, _resources(("example.com/x", "m")))
        async with kubelet_and_host(config, {"m": driver}) as (sim, _app):
            await sim.wait_for(_registered(sim, ["example.com/x"]))
            for device in sim.resources["example.com/x"].devices.values():
                assert not device.HasField("topology")

    run(scenario())


def test_list_and_watch_sends_full_snapshots_on_change(short_dir, run):
    driver = MemoryDriver("m", {"example.com/x": make_devices("x", 3)})

    async def scenario():
        config = make_config(short_dir, _resources(("example.com/x", "m")))
        async with kubelet_and_host(config, {"m": driver}) as (sim, app):
            await sim.wait_for(_registered(sim, ["example.com/x"], {"example.com/x": 3}))
            first = sim.resources["example.com/x"].snapshots
            # A rescan with nothing changed sends nothing.
            assert await app.rescan() == set()
            # One device turns unhealthy: a full snapshot with it Unhealthy.
            devices = make_devices("x", 3)
            devices[1] = devices[1].with_health(Health.UNHEALTHY, "test")
            driver.devices["example.com/x"] = devices
            await app.rescan()
            await sim.wait_for(lambda s: s.resources["example.com/x"].allocatable == 2,
                               what="x1 unhealthy")
            state = sim.resources["example.com/x"]
            assert state.capacity == 3 and state.snapshots == first + 1
            # A device added: the next snapshot lists all four.
            driver.devices["example.com/x"] = make_devices("x", 4)
            await app.rescan()
            await sim.wait_for(lambda s: s.resources["example.com/x"].allocatable == 4)
            assert state.connected

    run(scenario())


def test_allocate_good_unknown_and_unhealthy_ids(short_dir, run):
    devices = make_devices("x", 4)
    devices[3] = devices[3].with_health(Health.UNHEALTHY, "ECC errors")
    driver = MemoryDriver("m", {"example.com/x": devices})

    async def scenario():
        config = make_config(short_dir, _resources(("example.com/x", "m")))
        async with kubelet_and_host(config, {"m": driver}) as (sim, _app):
            await sim.wait_for(_registered(sim, ["example.com/x"]))
            response = await sim.call_allocate("example.com/x", [["x0", "x2"]])
            container = response.container_responses[0]
            assert [d.host_path for d in container.devices] == ["/dev/x0", "/dev/x2"]
            assert all(d.permissions == "rw" for d in container.devices)
            assert container.envs["VISIBLE"] == "x0,x2"  # joined in request order

            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await sim.call_allocate("example.com/x", [["x0", "nope"]])
            assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "unknown device id 'nope'" in unknown.value.details()

            with pytest.raises(grpc.aio.AioRpcError) as unhealthy:
                await sim.call_allocate("example.com/x", [["x3"]])
            assert unhealthy.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "Unhealthy: ECC errors" in unhealthy.value.details()

            with pytest.raises(grpc.aio.AioRpcError) as empty:
                await sim.call_allocate("example.com/x", [])
            assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            with pytest.raises(grpc.aio.AioRpcError) as twice:
                await sim.call_allocate("example.com/x", [["x1", "x1"]])
            assert "listed twice" in twice.value.details()

            # The server keeps serving after refusals.
            result = await sim.allocate("example.com/x", 2)
            assert len(result.device_ids) == 2 and "x3" not in result.device_ids

    run(scenario())


def test_preferred_allocation_packs_one_numa_node(short_dir, run):
    driver = MemoryDriver("m", {"example.com/gpu": make_devices("gpu", 8, (0, 1))})

    async def scenario():
        config = make_config(short_dir, _resources(("example.com/gpu", "m")))
        async with kubelet_and_host(config, {"m": driver}) as (sim, _app):
            await sim.wait_for(_registered(sim, ["example.com/gpu"]))
            everything = [f"gpu{i}" for i in range(8)]
            reply = await sim.call_preferred("example.com/gpu", everything, [], 4)
            assert sorted(reply.container_responses[0].deviceIDs) == \
                ["gpu0", "gpu1", "gpu2", "gpu3"]
            reply = await sim.call_preferred("example.com/gpu", everything, ["gpu5"], 3)
            picked = list(reply.container_responses[0].deviceIDs)
            assert "gpu5" in picked and len(picked) == 3
            assert all(int(p[3:]) >= 4 for p in picked)  # all on NUMA node 1
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await sim.call_preferred("example.com/gpu", everything, [], 0)
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # A pod asking for 4 through the kubelet's path gets 4 on one node.
            result = await sim.allocate("example.com/gpu", 4, pod="a")
            assert len(result.numa_nodes) == 1

    run(scenario())


def test_driver_preferred_policy_overrides_numa_compact(short_dir, run):
    driver = ReversePreferenceDriver("r", {"example.com/x": make_devices("x", 4)})

    async def scenario():
        config = make_config(short_dir, _resources(("example.com/x", "r")))
        async with kubelet_and_host(config, {"r": driver}) as (sim, _app):
            await sim.wait_for(_registered(sim, ["example.com/x"]))
            reply = await sim.call_preferred("example.com/x", ["x0", "x1", "x2", "x3"],
                                             [], 2)
            assert list(reply.container_responses[0].deviceIDs) == ["x3", "x2"]

    run(scenario())


def test_allocate_never_blocks_past_the_timeout(short_dir, run):
    driver = SlowAllocateDriver("slow", {"example.com/x": make_devices("x", 2)}, delay=2.0)

    async def scenario():
        config = make_config(short_dir, _resources(("example.com/x", "slow")),
                             allocate_timeout_s=0.2)
        async with kubelet_and_host(config, {"slow": driver}) as (sim, _app):
            await sim.wait_for(_registered(sim, ["example.com/x"]))
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(grpc.aio.AioRpcError) as slow:
                await sim.call_allocate("example.com/x", [["x0"]])
            assert loop.time() - started < 1.5
            assert slow.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "no answer within 0.2 s" in slow.value.details()

    run(scenario())


def test_pre_start_runs_only_where_the_driver_asks(short_dir, run):
    driver = MemoryDriver("m", {"example.com/p": make_devices("p", 2),
                                "example.com/q": make_devices("q", 2)})
    resources = [ResourceConfig("example.com/p", "m", settings={"pre_start": True}),
                 ResourceConfig("example.com/q", "m")]

    async def scenario():
        config = make_config(short_dir, resources)
        async with kubelet_and_host(config, {"m": driver}) as (sim, _app):
            await sim.wait_for(_registered(sim, ["example.com/p", "example.com/q"]))
            assert sim.resources["example.com/p"].options.pre_start_required
            assert not sim.resources["example.com/q"].options.pre_start_required
            await sim.allocate("example.com/p", 1)
            assert driver.pre_starts == [["p0"]]
            driver.fail = RuntimeError("bitstream load failed")
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await sim.call_pre_start("example.com/p", ["p1"])
            assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "bitstream load failed" in failed.value.details()

    run(scenario())


def test_kubelet_starting_after_the_host(short_dir, run):
    plugin_dir = os.path.join(short_dir, "dp")  # does not exist yet either
    driver = MemoryDriver("m", {"example.com/x": make_devices("x", 2)})

    async def scenario():
        config = make_config(plugin_dir, _resources(("example.com/x", "m")))
        async with running_host(config, {"m": driver}) as app:
            await asyncio.sleep(0.2)
            assert not app.ready.is_set()
            sim = KubeletSimulator(plugin_dir)
            await sim.start()  # creates the dir, then kubelet.sock
            try:
                await sim.wait_for(_registered(sim, ["example.com/x"], {"example.com/x": 2}),
                                   timeout=3)
                await asyncio.wait_for(app.ready.wait(), 1)
            finally:
                await sim.stop()

    run(scenario())


def test_kubelet_restart_loop_reregisters_everything_without_leaks(short_dir, run):
    names = [f"example.com/r{i}" for i in range(4)]
    driver = MemoryDriver("m", {n: make_devices(f"d{i}-", 2) for i, n in enumerate(names)})
    process = psutil.Process()

    async def scenario():
        config = make_config(short_dir, _resources(*[(n, "m") for n in names]))
        async with kubelet_and_host(config, {"m": driver}) as (sim, _app):
            await sim.wait_for(_registered(sim, names))
            for restart in range(50):
                before = {n: sim.resources[n].registrations for n in names}
                await sim.restart()
                await sim.wait_for(
                    lambda s, before=before: all(
                        s.resources[n].registrations > before[n] and s.resources[n].connected
                        and s.resources[n].snapshots > 0 for n in names),
                    timeout=5, what=f"re-registration after restart {restart}")
                if restart == 9:
                    baseline = (process.num_fds(), threading.active_count())
            after = (process.num_fds(), threading.active_count())
            assert after[0] <= baseline[0] + 4, (baseline, after)
            assert after[1] <= baseline[1] + 1, (baseline, after)
            sockets = [n for n in os.listdir(short_dir) if n.startswith("dph-")]
            assert len(sockets) == len(names)  # old generations cleaned up

    run(scenario(), timeout=120)


def test_failing_and_hanging_drivers_degrade_only_their_resources(short_dir, run):
    good = MemoryDriver("good", {"example.com/good": make_devices("g", 2)})
    bad = MemoryDriver("bad", {"example.com/bad": make_devices("b", 2)})
    stuck = MemoryDriver("stuck", {"example.com/stuck": make_devices("s", 2)})
    resources = _resources(("example.com/good", "good"), ("example.com/bad", "bad"),
                           ("example.com/stuck", "stuck"))
    names = [r.name for r in resources]

    async def scenario():
        config = make_config(short_dir, resources, discover_timeout_s=0.3)
        drivers = {"good": good, "bad": bad, "stuck": stuck}
        async with kubelet_and_host(config, drivers) as (sim, app):
            await sim.wait_for(_registered(sim, names))
            bad.fail = RuntimeError("sysfs exploded")
            stuck.hang.set()
            await app.rescan()
            await sim.wait_for(lambda s: s.resources["example.com/bad"].allocatable == 0
                               and s.resources["example.com/stuck"].allocatable == 0,
                               what="bad and stuck degraded")
            assert sim.resources["example.com/bad"].capacity == 2  # kept, Unhealthy
            assert "sysfs exploded" in app.inventory.status["bad"].last_error
            assert "no answer within" in app.inventory.status["stuck"].last_error
            # The good resource still allocates.
            result = await sim.allocate("example.com/good", 1)
            assert result.device_ids == ["g0"] or result.device_ids == ["g1"]
            # Recovery: the fault clears, the next scan restores health.
            bad.fail = None
            stuck.hang.clear()
            stuck.release.set()
            await app.rescan(["bad"])
            await sim.wait_for(lambda s: s.resources["example.com/bad"].allocatable == 2
                               and s.resources["example.com/stuck"].allocatable == 2,
                               timeout=5, what="recovered")

    run(scenario())


def test_vanished_device_reported_unhealthy_then_dropped(short_dir, run):
    driver = MemoryDriver("m", {"example.com/x": make_devices("x", 2)})

    async def scenario():
        config = make_config(short_dir, _resources(("example.com/x", "m")),
                             vanished_grace_s=0.5)
        async with kubelet_and_host(config, {"m": driver}) as (sim, app):
            await sim.wait_for(_registered(sim, ["example.com/x"], {"example.com/x": 2}))
            driver.devices["example.com/x"] = make_devices("x", 1)
            await app.rescan()
            await sim.wait_for(lambda s: s.resources["example.com/x"].allocatable == 1)
            assert sim.resources["example.com/x"].capacity == 2
            assert sim.resources["example.com/x"].devices["x1"].health == "Unhealthy"
            await sim.wait_for(lambda s: s.resources["example.com/x"].capacity == 1,
                               timeout=3, what="x1 dropped after its grace")

    run(scenario())


def test_plugin_dir_deleted_and_recreated(short_dir, run):
    plugin_dir = os.path.join(short_dir, "dp")
    driver = MemoryDriver("m", {"example.com/x": make_devices("x", 1)})

    async def scenario():
        sim = KubeletSimulator(plugin_dir)
        await sim.start()
        config = make_config(plugin_dir, _resources(("example.com/x", "m")))
        async with running_host(config, {"m": driver}):
            await sim.wait_for(_registered(sim, ["example.com/x"]))
            await sim.stop()
            import shutil

            shutil.rmtree(plugin_dir)
            await asyncio.sleep(0.1)
            before = sim.resources["example.com/x"].registrations
            await sim.start()
            try:
                await sim.wait_for(
                    lambda s: s.resources["example.com/x"].registrations > before
                    and s.resources["example.com/x"].connected, timeout=3)
            finally:
                await sim.stop()

    run(scenario())


def test_options_reply_is_instant_and_derived(short_dir, run):
    driver = MemoryDriver("m", {"example.com/x": make_devices("x", 1)})

    async def scenario():
        config = make_config(short_dir, _resources(("example.com/x", "m")))
        async with kubelet_and_host(config, {"m": driver}) as (sim, _app):
            await sim.wait_for(_registered(sim, ["example.com/x"]))
            options = await sim.call_options("example.com/x")
            # One device on one NUMA node: GetPreferredAllocation cannot change the kubelet's
            # pick, so it is not advertised (tests/test_preferred_option.py).
            assert options == api.DevicePluginOptions(
                pre_start_required=False, get_preferred_allocation_available=False)

    run(scenario())


def test_garbage_from_a_driver_never_reaches_the_kubelet(short_dir, run):
    garbage = [Device(id="ok0", numa_nodes=(0,)), Device(id="ok0"), Device(id="bad id"),
               Device(id=""), "not a device", Device(id="ghost", numa_nodes=(7,))]
    driver = MemoryDriver("m", {"example.com/x": garbage})

    async def scenario():
        config = make_config(short_dir, _resources(("example.com/x", "m")))
        async with kubelet_and_host(config, {"m": driver}) as (sim, _app):
            await sim.wait_for(_registered(sim, ["example.com/x"]))
            devices = sim.resources["example.com/x"].devices
            assert sorted(devices) == ["ghost", "ok0"]

    run(scenario())


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_serving_many_resources_at_once_leaves_the_process_umask_alone(short_dir, run):
    names = [f"example.com/u{i}" for i in range(16)]
    driver = MemoryDriver("m", {n: make_devices(f"d{i}-", 1) for i, n in enumerate(names)})
    before = _current_umask()

    async def scenario():
        config = make_config(short_dir, _resources(*[(n, "m") for n in names]))
        async with kubelet_and_host(config, {"m": driver}) as (sim, _app):
            await sim.wait_for(_registered(sim, names))
            await sim.restart()
            await sim.wait_for(lambda s: all(s.resources[n].registrations >= 2
                                             and s.resources[n].connected for n in names))

    run(scenario())
    assert _current_umask() == before


def test_a_configured_resource_with_no_devices_registers_with_an_empty_snapshot(short_dir, run):
    driver = MemoryDriver("m", {"example.com/empty": []})

    async def scenario():
        config = make_config(short_dir, _resources(("example.com/empty", "m")))
        async with kubelet_and_host(config, {"m": driver}) as (sim, app):
            state = sim.resources["example.com/empty"]
            assert state.connected and state.snapshots == 1 and state.capacity == 0
            driver.devices["example.com/empty"] = make_devices("late", 1)
            await app.rescan()
            await sim.wait_for(lambda s: s.resources["example.com/empty"].allocatable == 1)

    run(scenario())
