"""CDI specs: valid by the spec rules, lowest cdiVersion, following devices, gone on stop."""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
from pathlib import Path
from typing import List

import pytest

from device_plugin_host_testing.drivers import MemoryDriver, make_devices
from device_plugin_host_testing.harness import kubelet_and_host, make_config, running_host
from host.core.cdi import CdiWriter, build_spec, device_name, kind_error
from host.core.inotify import DirectoryWatch
from host.core.model import Device, DeviceNode, Health, Mount, ResourceConfig
from host.sim.kubelet import KubeletSimulator

_VENDOR = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*[A-Za-z0-9]\Z")
_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?\Z")
_VERSIONS = ["0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0"]


def check_spec_rules(spec: dict) -> None:
    """The CDI rules as a runtime's CDI library applies them."""
    assert set(spec) <= {"cdiVersion", "kind", "devices", "containerEdits", "annotations"}
    assert spec["cdiVersion"] in _VERSIONS
    version = tuple(int(p) for p in spec["cdiVersion"].split("."))
    vendor, klass = spec["kind"].split("/")
    assert _VENDOR.match(vendor) and _VENDOR.match(klass)
    if "." in klass:
        assert version >= (0, 6, 0)
    assert spec["devices"], "a spec needs at least one device"
    names = [d["name"] for d in spec["devices"]]
    assert len(names) == len(set(names))
    for device in spec["devices"]:
        assert set(device) <= {"name", "containerEdits", "annotations"}
        assert _NAME.match(device["name"])
        if device["name"][0].isdigit():
            assert version >= (0, 5, 0)
        edits = device["containerEdits"]
        assert edits and set(edits) <= {"env", "deviceNodes", "mounts", "hooks"}
        for node in edits.get("deviceNodes", []):
            assert node["path"].startswith("/")
            assert set(node.get("permissions", "")) <= set("rwm")
            if "hostPath" in node:
                assert version >= (0, 5, 0)
        for mount in edits.get("mounts", []):
            assert mount["hostPath"] and mount["containerPath"]
        for env in edits.get("env", []):
            assert "=" in env and env.split("=", 1)[0]


def test_lowest_version_for_the_fields_used():
    plain = build_spec("vendor.com/gpu", [Device(id="gpu0",
                                                 device_nodes=(DeviceNode("/dev/vgpu0"),))])
    assert plain["cdiVersion"] == "0.3.0"
    check_spec_rules(plain)
    digit = build_spec("vendor.com/gpu", [Device(id="0000:18:00.0",
                                                 device_nodes=(DeviceNode("/dev/x"),))])
    assert digit["cdiVersion"] == "0.5.0"  # digit-first device name
    moved = build_spec("vendor.com/gpu", [Device(id="g", device_nodes=(
        DeviceNode("/dev/nvidia3", "/dev/nvidia0"),))])
    assert moved["cdiVersion"] == "0.5.0"  # hostPath differs
    dotted = build_spec("vendor.com/a.b", [Device(id="g", mounts=(Mount("/a", "/b"),))])
    assert dotted["cdiVersion"] == "0.6.0"
    for spec in (digit, moved, dotted):
        check_spec_rules(spec)
    assert build_spec("vendor.com/gpu", []) is None


def test_names_and_kinds():
    assert device_name("0000:18:00.0") == "0000:18:00.0"
    assert device_name("g0::1") == "g0::1"
    assert device_name("-weird id/") == "d-weird_id_0"
    assert kind_error("nvidia.com/gpu") is None
    assert "start with a letter" in kind_error("3com.com/nic")
    assert "start with a letter" in kind_error("example.com/1gpu")


def test_writer_is_atomic_follows_changes_and_survives_a_full_disk(tmp_path):
    writer = CdiWriter(str(tmp_path / "cdi"))
    devices = make_devices("g", 2)
    assert writer.update("example.com/gpu", devices)
    path = writer.path_for("example.com/gpu")
    spec = json.loads(Path(path).read_text())
    check_spec_rules(spec)
    assert [d["name"] for d in spec["devices"]] == ["g0", "g1"]
    assert writer.update("example.com/gpu", devices[:1])
    assert [d["name"] for d in json.loads(Path(path).read_text())["devices"]] == ["g0"]
    assert [n for n in os.listdir(tmp_path / "cdi") if n.endswith(".tmp")] == []
    writer.remove("example.com/gpu")
    assert not os.path.exists(path)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
def test_disk_full_keeps_the_previous_spec(tmp_path):
    writer = CdiWriter(str(tmp_path))
    assert writer.update("example.com/gpu", make_devices("g", 1))
    path = writer.path_for("example.com/gpu")
    before = Path(path).read_text()
    os.chmod(tmp_path, 0o500)  # stands in for ENOSPC/EROFS: the temp file cannot be made
    try:
        if os.geteuid() == 0:
            pytest.skip("root ignores directory permissions; covered by the read-only case")
        assert writer.update("example.com/gpu", make_devices("g", 2)) is False
        assert Path(path).read_text() == before
    finally:
        os.chmod(tmp_path, 0o700)


def test_cdi_write_failure_is_logged_and_allocation_still_works(tmp_path, short_dir, run):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the CDI directory should be")
    driver = MemoryDriver("m", {"example.com/gpu": make_devices("g", 2)})
    resource = ResourceConfig("example.com/gpu", "m", cdi=True)
    config = make_config(short_dir, [resource], cdi_dir=str(blocker / "cdi"))

    async def scenario():
        async with kubelet_and_host(config, {"m": driver}) as (sim, _app):
            await sim.wait_for(lambda s: "example.com/gpu" in s.resources
                               and s.resources["example.com/gpu"].allocatable == 2)
            result = await sim.allocate("example.com/gpu", 1)
            assert [d.host_path for d in result.response.devices] == ["/dev/g0"]

    run(scenario())


def test_allocate_returns_cdi_names_and_specs_outlive_stop_and_restart(
        tmp_path, short_dir, run):
    """Pods keep their devices across a host's stop, restart or upgrade: a container that
    restarts in one resolves its CDI names from the spec, so stop() leaves every spec as it
    was and a restart replaces each in place (never absent, even for a moment)."""
    devices = make_devices("g", 3)
    devices[2] = devices[2].with_health(Health.UNHEALTHY, "x")
    driver = MemoryDriver("m", {"example.com/gpu": devices,
                                "example.com/nic": make_devices("n", 1)})
    cdi_dir = tmp_path / "cdi"
    resources = [ResourceConfig("example.com/gpu", "m", cdi=True, cdi_fallback=False),
                 ResourceConfig("example.com/nic", "m", cdi=True)]
    config = make_config(short_dir, resources, cdi_dir=str(cdi_dir))

    async def scenario():
        sim = KubeletSimulator(short_dir)
        await sim.start()
        try:
            async with running_host(config, {"m": driver}) as app:
                await sim.wait_for(lambda s: len(s.resources) == 2
                                   and all(r.snapshots for r in s.resources.values()))
                files = sorted(os.listdir(cdi_dir))
                assert files == ["device-plugin-host_example.com-gpu.json",
                                 "device-plugin-host_example.com-nic.json"]
                for name in files:
                    check_spec_rules(json.loads((cdi_dir / name).read_text()))
                gpu = await sim.allocate("example.com/gpu", 2)
                assert list(gpu.response.cdi_devices) and not gpu.response.devices
                assert [c.name for c in gpu.response.cdi_devices] == \
                    [f"example.com/gpu={i}" for i in gpu.device_ids]
                assert gpu.response.envs["VISIBLE"]  # env stays in the response
                nic = await sim.allocate("example.com/nic", 1)
                assert [c.name for c in nic.response.cdi_devices] == ["example.com/nic=n0"]
                assert [d.host_path for d in nic.response.devices] == ["/dev/n0"]  # fallback
                # A new device: the spec follows before the kubelet can ask for it.
                driver.devices["example.com/gpu"] = make_devices("g", 4)
                await app.rescan()
                spec = json.loads((cdi_dir / files[0]).read_text())
                assert [d["name"] for d in spec["devices"]] == ["g0", "g1", "g2", "g3"]
                kept = {name: (cdi_dir / name).read_bytes() for name in files}
            # Stopped: every spec stays, byte for byte (pods still hold g0.., n0).
            assert {name: (cdi_dir / name).read_bytes() for name in os.listdir(cdi_dir)} == kept
            missing: List[str] = []
            watching = threading.Event()
            done = threading.Event()

            def watch() -> None:  # as a runtime resolving names during the restart would
                watching.set()
                while not done.is_set():
                    missing.extend(name for name in files if not (cdi_dir / name).exists())

            watcher = threading.Thread(target=watch)
            watcher.start()
            watching.wait(5)
            try:
                async with running_host(config, {"m": driver}) as again:
                    await sim.wait_for(lambda s: all(
                        s.resources[n].connected and s.resources[n].live
                        and s.resources[n].endpoint == again.endpoint(n).socket_name
                        for n in again.served()), what="registered by the restarted host")
            finally:
                done.set()
                watcher.join(10)
            assert missing == []
            # Gone for good (no device left past the grace): only then is the spec removed.
            driver.devices["example.com/nic"] = []
            gone = make_config(short_dir, resources, cdi_dir=str(cdi_dir), vanished_grace_s=0)
            async with running_host(gone, {"m": driver}) as last:
                await sim.wait_for(lambda s: s.resources["example.com/gpu"].endpoint
                                   == last.endpoint("example.com/gpu").socket_name
                                   and s.resources["example.com/gpu"].live)
            assert sorted(os.listdir(cdi_dir)) == [files[0]]
        finally:
            await sim.stop()

    run(scenario())


@pytest.fixture
def full_cdi_dir(tmp_path):
    """A real 16 KiB tmpfs filled up: writes into it fail with ENOSPC, as on a full disk.
    Yields (directory, free) where ``free()`` deletes the filler."""
    import subprocess

    mount_point = tmp_path / "cdi"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    filler = mount_point / "filler"
    try:
        try:
            with open(filler, "wb") as out:
                while True:
                    out.write(b"\0" * 512)
                    out.flush()
        except OSError:
            pass  # full now

        def free() -> None:
            filler.unlink()

        yield mount_point, free
    finally:
        subprocess.run(["umount", str(mount_point)], capture_output=True)


def test_spec_missing_after_a_full_disk_is_retried_and_devices_are_unhealthy_meanwhile(
        full_cdi_dir, short_dir, run):
    cdi_dir, free = full_cdi_dir
    driver = MemoryDriver("m", {"example.com/gpu": make_devices("g", 2)})
    resource = ResourceConfig("example.com/gpu", "m", cdi=True, cdi_fallback=False)
    config = make_config(short_dir, [resource], cdi_dir=str(cdi_dir))
    spec = cdi_dir / "device-plugin-host_example.com-gpu.json"

    async def scenario():
        async with kubelet_and_host(config, {"m": driver}) as (sim, app):
            state = sim.resources["example.com/gpu"]
            await sim.wait_for(lambda s: s.resources["example.com/gpu"].capacity == 2)
            # No spec on disk: a CDI name no runtime can resolve is never handed out.
            assert not spec.exists()
            assert state.allocatable == 0
            assert {d.health for d in state.devices.values()} == {"Unhealthy"}
            snapshot = app.device_plugin.snapshots["example.com/gpu"]
            reasons = {d.health_reason for d in snapshot.devices}
            assert len(reasons) == 1 and "No space left on device" in reasons.pop()
            with pytest.raises(Exception, match="unhealthy"):
                await sim.allocate("example.com/gpu", 1)
            await app.rescan()  # still full: still Unhealthy
            assert not spec.exists() and state.allocatable == 0
            free()
            await app.rescan()  # nothing about the devices changed; the spec is retried
            assert spec.exists()
            check_spec_rules(json.loads(spec.read_text()))
            await sim.wait_for(lambda s: s.resources["example.com/gpu"].allocatable == 2,
                               timeout=3, what="healthy once the spec is written")
            result = await sim.allocate("example.com/gpu", 1)
            assert [c.name for c in result.response.cdi_devices] == \
                [f"example.com/gpu={i}" for i in result.device_ids]
            # Deleted by hand: written again (the directory watch sees it at once).
            rewritten = asyncio.Event()
            watch = DirectoryWatch(str(cdi_dir), lambda names: spec.exists() and rewritten.set())
            watch.start()
            try:
                spec.unlink()
                await asyncio.wait_for(rewritten.wait(), 3)
            finally:
                watch.close()
            check_spec_rules(json.loads(spec.read_text()))
            assert state.allocatable == 2

    run(scenario())


def test_spec_missing_with_fallback_hands_out_device_nodes_without_cdi_names(
        full_cdi_dir, short_dir, run):
    cdi_dir, free = full_cdi_dir
    driver = MemoryDriver("m", {"example.com/gpu": make_devices("g", 2)})
    resource = ResourceConfig("example.com/gpu", "m", cdi=True, cdi_fallback=True)
    config = make_config(short_dir, [resource], cdi_dir=str(cdi_dir))

    async def scenario():
        async with kubelet_and_host(config, {"m": driver}) as (sim, app):
            await sim.wait_for(lambda s: s.resources["example.com/gpu"].allocatable == 2)
            result = await sim.allocate("example.com/gpu", 1, pod="a")
            assert [d.host_path for d in result.response.devices] == ["/dev/g0"]
            assert list(result.response.cdi_devices) == []  # none a runtime cannot resolve
            free()
            await app.rescan()
            result = await sim.allocate("example.com/gpu", 1, pod="b")
            assert [c.name for c in result.response.cdi_devices] == ["example.com/gpu=g1"]

    run(scenario())
