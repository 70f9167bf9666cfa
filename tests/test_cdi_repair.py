"""CDI specs broken behind the host's back are repaired, and lost inotify events are survived.

A spec truncated in place, or replaced by another valid spec, is compared with what the host
wrote and rewritten; until then the devices it no longer names are Unhealthy. A burst of
events past the kernel's queue (``IN_Q_OVERFLOW``) makes every watch re-check what it covers.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import pytest

from device_plugin_host_testing.drivers import MemoryDriver, make_devices
from device_plugin_host_testing.harness import kubelet_and_host, make_config
from host.core.cdi import CdiWriter
from host.core.drains import update_drains
from host.core.inotify import DirectoryWatch
from host.core.model import ResourceConfig

GPU = "example.com/gpu"
SPEC = "device-plugin-host_example.com-gpu.json"


def _config(short_dir: str, cdi_dir: Path, **host: object):
    resource = ResourceConfig(GPU, "m", cdi=True, cdi_fallback=False)
    # No safety rescan in the window: only the directory watch can repair anything.
    return make_config(short_dir, [resource], cdi_dir=str(cdi_dir), rescan_interval_s=3600.0,
                       **host)


async def _until(predicate, timeout: float = 3.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def _max_queued_events() -> int:
    with open("/proc/sys/fs/inotify/max_queued_events", encoding="ascii") as handle:
        return int(handle.read())


def _overflow(directory: Path) -> None:
    """More events than the kernel queues, into ``directory``, while the loop is blocked (the
    caller does not await): the queue overflows for real. chmod alternating between two files
    (identical consecutive events would be merged into one)."""
    files = [directory / ".burst-a", directory / ".burst-b"]
    for path in files:
        path.write_bytes(b"")
    for number in range(_max_queued_events() + 64):
        os.chmod(files[number % 2], 0o600 if number % 4 < 2 else 0o644)
    for path in files:
        path.unlink()


def test_a_spec_truncated_in_place_is_rewritten(short_dir, run, tmp_path):
    cdi_dir = tmp_path / "cdi"
    driver = MemoryDriver("m", {GPU: make_devices("g", 2)})

    async def scenario():
        async with kubelet_and_host(_config(short_dir, cdi_dir), {"m": driver}) as (sim, _app):
            spec = cdi_dir / SPEC
            wanted = spec.read_bytes()
            os.truncate(spec, 0)  # in place: the file stays, only IN_MODIFY is sent
            await _until(lambda: spec.read_bytes() == wanted, what="the spec rewritten")
            assert sim.resources[GPU].allocatable == 2

    run(scenario())


def test_a_spec_replaced_by_a_valid_one_without_our_devices_is_rewritten(short_dir, run,
                                                                        tmp_path):
    cdi_dir = tmp_path / "cdi"
    driver = MemoryDriver("m", {GPU: make_devices("g", 2)})

    async def scenario():
        async with kubelet_and_host(_config(short_dir, cdi_dir), {"m": driver}) as (sim, _app):
            spec = cdi_dir / SPEC
            wanted = spec.read_bytes()
            other = {"cdiVersion": "0.3.0", "kind": GPU, "devices": []}
            temporary = cdi_dir / ".someone-else.tmp"
            temporary.write_text(json.dumps(other))
            os.rename(temporary, spec)
            await _until(lambda: spec.read_bytes() == wanted, what="the spec rewritten")
            result = await sim.allocate(GPU, 1)
            assert [c.name for c in result.response.cdi_devices] == \
                [f"{GPU}={i}" for i in result.device_ids]

    run(scenario())


@pytest.fixture
def small_tmpfs(tmp_path):
    mount_point = tmp_path / "cdi"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], capture_output=True)


def _fill(directory: Path, name: str) -> None:
    try:
        with open(directory / name, "wb") as out:
            while True:
                out.write(b"\0" * 512)
                out.flush()
    except OSError:
        pass  # full now


def test_devices_a_damaged_spec_no_longer_names_are_unresolvable_until_it_is_repaired(
        small_tmpfs):
    devices = make_devices("g", 3)
    writer = CdiWriter(str(small_tmpfs))
    assert writer.update(GPU, devices)
    spec = small_tmpfs / SPEC
    wanted = spec.read_bytes()
    # Someone leaves a valid spec naming only g0, and the disk is full: no repair possible.
    partial = json.loads(wanted)
    partial["devices"] = partial["devices"][:1]
    spec.write_text(json.dumps(partial))
    _fill(small_tmpfs, "filler")
    assert writer.retry(GPU)  # the state changed: found damaged, the rewrite failed
    assert spec.read_bytes() != wanted
    broken = writer.unresolvable(GPU, devices)
    assert sorted(broken) == ["g1", "g2"]
    assert "No space left on device" in broken["g1"]
    assert writer.resolvable(GPU, ["g0"]) and not writer.resolvable(GPU, ["g1"])
    # Truncated to nothing: no device resolves.
    os.truncate(spec, 0)
    _fill(small_tmpfs, "filler2")
    writer.retry(GPU)
    assert sorted(writer.unresolvable(GPU, devices)) == ["g0", "g1", "g2"]
    (small_tmpfs / "filler").unlink()
    writer.retry(GPU)
    assert spec.read_bytes() == wanted
    assert writer.unresolvable(GPU, devices) == {} and not writer.problems


def test_an_untouched_spec_is_not_read_again(tmp_path, monkeypatch):
    writer = CdiWriter(str(tmp_path))
    writer.update(GPU, make_devices("g", 2))
    os.chmod(tmp_path / SPEC, 0o644)  # a change of ctime only: read once, found ours
    assert not writer.retry(GPU)
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda *a, **k: opened.append(a) or real_open(*a, **k))
    assert not writer.retry(GPU)
    assert opened == []  # one stat, no read, when nothing changed since the last check


def test_an_inotify_queue_overflow_reports_a_full_recheck(tmp_path, run):
    seen = []

    async def scenario():
        watch = DirectoryWatch(str(tmp_path), seen.append)
        watch.start()
        try:
            _overflow(tmp_path)
            await _until(lambda: None in seen, what="a re-check after the overflow")
            assert watch.overflows == 1
        finally:
            watch.close()

    run(scenario())


def test_a_spec_deleted_while_the_event_queue_overflows_is_restored(short_dir, run, tmp_path):
    cdi_dir = tmp_path / "cdi"
    driver = MemoryDriver("m", {GPU: make_devices("g", 2)})

    async def scenario():
        async with kubelet_and_host(_config(short_dir, cdi_dir), {"m": driver}) as (_sim, app):
            spec = cdi_dir / SPEC
            wanted = spec.read_bytes()
            assert app.cdi.watch is not None
            _overflow(cdi_dir)  # no await: the loop cannot drain the queue meanwhile
            spec.unlink()  # this event is lost: the queue is full
            await _until(lambda: spec.exists() and spec.read_bytes() == wanted,
                         what="the spec restored after the overflow")

    run(scenario())


def test_a_drain_mark_written_while_the_event_queue_overflows_is_applied(short_dir, run,
                                                                        tmp_path):
    cdi_dir = tmp_path / "cdi"
    driver = MemoryDriver("m", {GPU: make_devices("g", 2)})
    drain_file = tmp_path / "state" / "drained"

    async def scenario():
        config = _config(short_dir, cdi_dir, drain_file=str(drain_file))
        async with kubelet_and_host(config, {"m": driver}) as (sim, _app):
            _overflow(drain_file.parent)
            update_drains(str(drain_file), (GPU, "g1"), "bad fan")
            await sim.wait_for(lambda s: s.resources[GPU].devices["g1"].health == "Unhealthy",
                               timeout=3, what="the drain mark applied after the overflow")

    run(scenario())
