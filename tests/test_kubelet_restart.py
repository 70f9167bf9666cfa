"""Kubelet restarts as the real kubelet does them: a Register in flight when it
stops, its dead socket left behind for an outage, every socket wiped at start. Every resource
must be back within 100 ms of the new kubelet.sock, with one or two Register calls each."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.core import short_dir as short_dir_for_floor
from device_plugin_host_testing.drivers import MemoryDriver, make_devices
from device_plugin_host_testing.harness import kubelet_and_host, make_config
from host.core.model import ResourceConfig
from host.sim.kubelet import KubeletSimulator

REPO = Path(__file__).resolve().parents[1]
NAMES = [f"example.com/r{i:02d}" for i in range(24)]
BACK_WITHIN_S = 0.100


def _all_live(sim):
    return all(sim.resources[n].connected and sim.resources[n].live for n in NAMES)


async def _floor_ms() -> float:
    """The same restart for 24 minimal plugins (benchmarks.floors) told the kubelet is back:
    what a fresh server, a Register with dial-back and a first snapshot cost here, now."""
    from benchmarks.floors import MinimalPlugin, kubelet_channel
    from host.kubelet.protocol.convert import framed_device, snapshot_payload

    with short_dir_for_floor() as plugin_dir:
        sim = KubeletSimulator(plugin_dir)
        await sim.start()
        devices = make_devices("f", 2)
        payload = snapshot_payload(framed_device(d) for d in devices)
        plugins = [MinimalPlugin(plugin_dir, n, i, payload) for i, n in enumerate(NAMES)]
        channel = kubelet_channel(plugin_dir)
        try:
            await asyncio.gather(*(p.register(channel) for p in plugins))
            await sim.wait_for(_all_live, what="floor registered")
            await sim.restart(outage_s=0.0, unlink=False)
            await channel.close()
            channel = kubelet_channel(plugin_dir)
            await asyncio.gather(*(p.register(channel) for p in plugins))
            await sim.wait_for(_all_live, what="floor back")
            assert sim.started_at is not None
            return (max(sim.resources[n].live_at for n in NAMES) - sim.started_at) * 1000
        finally:
            await asyncio.gather(*(p.stop() for p in plugins))
            await channel.close()
            await sim.stop()


def _restart_with_register_in_flight(short_dir, run, outage_s: float, unlink: bool):
    driver = MemoryDriver("m", {n: make_devices(f"d{i}-", 2) for i, n in enumerate(NAMES)})
    config = make_config(short_dir, [ResourceConfig(n, "m") for n in NAMES])

    async def body():
        async with kubelet_and_host(config, {"m": driver}) as (sim, app):
            before = dict(sim.register_calls)
            made_before = {n: app.device_plugin.registrar.endpoints[n].registrations for n in NAMES}
            # A slow kubelet and a socket wiped under one resource: that resource serves anew
            # and registers, and its Register is still in flight when the kubelet stops.
            sim.register_delay_s = 30.0
            victim = app.device_plugin.registrar.endpoints[NAMES[0]]
            os.unlink(victim.socket_path)
            await sim.wait_for(lambda k: k.registers_in_flight >= 1, what="a Register in flight")
            sim.register_delay_s = 0.0
            await sim.restart(outage_s=outage_s, unlink=unlink)
            await sim.wait_for(_all_live, timeout=15, what="every resource back")
            slowest = max(sim.resources[n].live_at for n in NAMES) - sim.started_at
            attempts = {n: sim.register_calls[n] - before.get(n, 0) for n in NAMES}
            endpoints = app.device_plugin.registrar.endpoints
            made = {n: endpoints[n].registrations - made_before[n] for n in NAMES}
            return slowest, attempts, made, sim.describe()

    slowest, attempts, made, state = run(body(), timeout=60)
    floor = run(_floor_ms(), timeout=60) / 1000
    # 100 ms is the promise; on a machine so loaded that 24 hand-written minimal plugins
    # need more than half of that, allow twice their time (measured just now).
    limit = max(BACK_WITHIN_S, 2 * floor)
    print(f"slowest resource back after {slowest * 1000:.1f} ms (floor {floor * 1000:.1f} ms);"
          f" attempts {attempts}")
    assert slowest < limit, f"slowest resource back after {slowest * 1000:.0f} ms; {state}"
    # One Register per resource for the new kubelet; the victim also had its failed one.
    assert attempts[NAMES[0]] <= 2, attempts
    assert all(count == 1 for name, count in attempts.items() if name != NAMES[0]), attempts
    # ... and no Register the kubelet never saw (against its dead socket, or failing fast).
    assert made[NAMES[0]] <= 2 and all(
        count == 1 for name, count in made.items() if name != NAMES[0]), made


@pytest.mark.alone
def test_all_back_within_100ms_after_2s_outage_with_a_register_in_flight(short_dir, run):
    _restart_with_register_in_flight(short_dir, run, outage_s=2.0, unlink=False)


@pytest.mark.alone
def test_all_back_within_100ms_after_2s_outage_with_the_socket_gone(short_dir, run):
    _restart_with_register_in_flight(short_dir, run, outage_s=2.0, unlink=True)


# -- 10.3: the socket path limit ----------------------------------------------------------------
def test_a_plugin_dir_too_long_for_the_host_socket_names_is_refused_at_start(tmp_path):
    """A 58-byte plugin dir passed the old check (dir + "/kubelet.sock" <= 107) although the
    host's own socket paths then reached grpc's limit and never bound: exit 2 with the numbers."""
    from host.kubelet.socket_names import GRPC_MAX_SOCKET_PATH, MAX_SOCKET_NAME

    plugin_dir = "/" + "p" * 57
    config = tmp_path / "c.toml"
    config.write_text(f'[host]\nplugin_dir = "{plugin_dir}"\n')
    for args in (("check-config", str(config)), ("run", "--config", str(config))):
        done = subprocess.run([sys.executable, "-m", "host", *args], capture_output=True,
                              text=True, timeout=60, cwd=REPO, env=dict(os.environ,
                              PYTHONPATH=str(REPO)))
        assert done.returncode == 2, (args, done.stderr)
        assert "Traceback" not in done.stderr
        longest = 58 + 1 + MAX_SOCKET_NAME
        for number in ("58 bytes", f"{longest} bytes", f"{GRPC_MAX_SOCKET_PATH}-byte"):
            assert number in done.stderr, (number, done.stderr)
    assert not os.path.exists(plugin_dir)


def test_the_longest_socket_name_bounds_every_name_the_host_makes():
    from host.kubelet.socket_names import MAX_SOCKET_NAME, socket_file_name

    names = [socket_file_name("example.com/" + "x" * 200, "f" * 14, g)
             for g in (1, 999_999, 10**9 + 7)]
    assert max(len(n) for n in names) <= MAX_SOCKET_NAME
    assert len(set(names)) == 3


# -- 11.3: only the kubelet's own stream ending means re-registering ----------------------------
def test_another_client_closing_a_listandwatch_stream_never_reregisters(short_dir, run):
    import grpc

    from host.kubelet.protocol import api, api_grpc

    name = NAMES[0]
    driver = MemoryDriver("m", {name: make_devices("d", 2)})
    config = make_config(short_dir, [ResourceConfig(name, "m")])

    async def body():
        async with kubelet_and_host(config, {"m": driver}) as (sim, app):
            endpoint = app.device_plugin.registrar.endpoints[name]
            generation, calls = endpoint.generation, sim.register_calls[name]
            ended = asyncio.Event()
            hook = endpoint.service.on_stream_end

            def observed(tag, stream):
                hook(tag, stream)
                ended.set()

            endpoint.service.on_stream_end = observed
            async with grpc.aio.insecure_channel("unix:" + endpoint.socket_path) as channel:
                call = api_grpc.DevicePluginStub(channel).ListAndWatch(api.Empty())
                first = await call.read()
                assert len(first.devices) == 2
                call.cancel()
                await asyncio.wait_for(ended.wait(), 5)
            assert endpoint.registered_with is not None
            await asyncio.sleep(0)  # let a (wrongly) poked reconcile run, if there were one
            assert endpoint.generation == generation and sim.register_calls[name] == calls
            assert sim.resources[name].connected and sim.resources[name].allocatable == 2
            # The kubelet's own stream ending still does: it comes back on its own.
            await sim.resources[name].current.close()
            await sim.wait_for(lambda k: k.register_calls[name] == calls + 1
                               and k.resources[name].connected and k.resources[name].live,
                               what="re-registered after the kubelet's stream ended")

    run(body())


def test_a_kubelet_outage_is_one_line_however_many_resources_and_each_outage_is_told(
        short_dir, run, caplog):
    import logging

    driver = MemoryDriver("m", {n: make_devices(f"d{i}-", 1) for i, n in enumerate(NAMES)})
    config = make_config(short_dir, [ResourceConfig(n, "m") for n in NAMES])
    caplog.set_level(logging.DEBUG, logger="host.kubelet.registration")

    def down_lines():
        return [r for r in caplog.records if "does not accept connections" in r.getMessage()
                and r.levelno >= logging.WARNING]

    async def body():
        async with kubelet_and_host(config, {"m": driver}) as (sim, _app):
            for outage in range(2):
                await sim.stop(unlink=False)
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 5
                while len(down_lines()) < outage + 1 and loop.time() < deadline:
                    await asyncio.sleep(0.02)  # a log line has no event to wait on
                await sim.start()
                await sim.wait_for(_all_live, timeout=10, what="back")

    run(body(), timeout=60)
    assert len(down_lines()) == 2, [r.getMessage() for r in down_lines()]
    back = [r for r in caplog.records if "a kubelet is back" in r.getMessage()]
    assert len(back) == 2
    failed = [r for r in caplog.records if "Register failed" in r.getMessage()
              and r.levelno >= logging.WARNING]
    assert failed == [], [r.getMessage() for r in failed]  # no Register against a dead socket
