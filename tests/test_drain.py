"""The drain marks file: any valid name round-trips, old files are still read, bad keys and
failing state directories are refused with one line."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from host.core.drains import (
    DrainError,
    NoSuchMark,
    clean_reason,
    key_error,
    read_drains,
    update_drains,
)
from host.core.resource_name import resource_name_error

_LOWER = "abcdefghijklmnopqrstuvwxyz0123456789"
_ANY = _LOWER + "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _edged(inner: str, edge: str, longest: int) -> st.SearchStrategy[str]:
    """``[edge]([inner]{0,longest}[edge])?``: built from parts, as st.from_regex spent
    three quarters of this test's time (5 of 7 s under cProfile) in its regex machinery."""
    return st.one_of(st.sampled_from(edge), st.builds(
        lambda first, middle, last: first + middle + last,
        st.sampled_from(edge), st.text(inner, max_size=longest), st.sampled_from(edge)))


# [a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?(\.[a-z0-9]{1,6}){0,2}/
#   [A-Za-z0-9]([A-Za-z0-9._-]{0,30}[A-Za-z0-9])?
_NAMES = st.builds(
    lambda label, dots, name: f"{label}{''.join('.' + d for d in dots)}/{name}",
    _edged(_LOWER + "-", _LOWER, 8),
    st.lists(st.text(_LOWER, min_size=1, max_size=6), max_size=2),
    _edged(_ANY + "._-", _ANY, 30),
).filter(lambda name: resource_name_error(name) is None)
_IDS = st.text(min_size=1, max_size=256).filter(lambda d: key_error("example.com/x", d) is None)


@settings(max_examples=200, deadline=None)
@given(marks=st.dictionaries(st.tuples(_NAMES, _IDS), st.text(max_size=200), max_size=6))
def test_every_valid_name_and_any_reason_round_trip(marks):
    with tempfile.TemporaryDirectory() as state:
        path = os.path.join(state, "drained")
        for key, reason in marks.items():
            update_drains(path, key, reason)
        assert read_drains(path) == {key: clean_reason(reason) for key, reason in marks.items()}
        if marks:
            with open(path, encoding="ascii") as handle:  # JSON lines, one object a line
                records = [json.loads(line) for line in handle]
            assert {(r["resource"], r["device"]) for r in records} == set(marks)


def test_the_file_is_json_lines(tmp_path):
    path = str(tmp_path / "drained")
    update_drains(path, ("nvidia.com/gpu", "0000:18:00.0"), "bad ECC\nsee ticket #12\t\x1b[31m")
    with open(path, encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"resource": "nvidia.com/gpu", "device": "0000:18:00.0",
         "reason": "bad ECC see ticket #12 [31m"}]


def test_a_file_in_the_old_format_is_read_and_rewritten_as_json_lines(tmp_path):
    path = tmp_path / "drained"
    path.write_text("# resource device-id reason (managed by device-plugin-host drain)\n"
                    "nvidia.com/gpu 0000:18:00.0 bad ECC on row 3\n"
                    "example.com/x x1\n")
    assert read_drains(str(path)) == {("nvidia.com/gpu", "0000:18:00.0"): "bad ECC on row 3",
                                      ("example.com/x", "x1"): "drained by an operator"}
    update_drains(str(path), ("example.com/x", "x2"), "fan")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert {(r["resource"], r["device"], r["reason"]) for r in records} == {
        ("nvidia.com/gpu", "0000:18:00.0", "bad ECC on row 3"),
        ("example.com/x", "x1", "drained by an operator"), ("example.com/x", "x2", "fan")}


def test_a_bad_line_is_skipped_and_the_other_marks_stay(tmp_path, caplog):
    path = tmp_path / "drained"
    path.write_text('{"resource": "example.com/x", "device": "x1", "reason": "r"}\n'
                    '{"resource": "example.com/x", "device": 7}\n{not json\n[]\nlonely\n')
    assert read_drains(str(path)) == {("example.com/x", "x1"): "r"}
    assert sum("not a drain mark" in r.getMessage() for r in caplog.records) == 4


@pytest.mark.parametrize(("resource", "device", "words"), [
    ("Example.com/GPU", "x", "not a valid resource name"),
    ("nvidia.com/gpu\nevil.com/x", "x", "not a valid resource name"),
    ("gpu", "x", "not a valid resource name"),
    ("nvidia.com/gpu", "", "empty"),
    ("nvidia.com/gpu", "a b", "whitespace or control"),
    ("nvidia.com/gpu", "a\tb", "whitespace or control"),
    ("nvidia.com/gpu", "a\x1bb", "whitespace or control"),
    ("nvidia.com/gpu", "a\u2028b", "whitespace or control"),
    ("nvidia.com/gpu", "x" * 257, "at most 256"),
    ("nvidia.com/gpu", "bad\udcffbyte", "not valid UTF-8"),
])
def test_keys_that_can_never_match_a_device_are_refused(resource, device, words):
    problem = key_error(resource, device)
    assert problem is not None and words in problem


def test_removing_a_mark_that_is_not_there(tmp_path):
    path = str(tmp_path / "drained")
    update_drains(path, ("example.com/x", "x1"), "r")
    with pytest.raises(NoSuchMark, match=r"example\.com/x x2 has no drain mark"):
        update_drains(path, ("example.com/x", "x2"), None, missing_ok=False)
    assert update_drains(path, ("example.com/x", "x2"), None) == {("example.com/x", "x1"): "r"}


def test_unreadable_marks_raise_instead_of_reading_as_none(tmp_path):
    (tmp_path / "drained").mkdir()
    with pytest.raises(DrainError, match="cannot read the drain marks"):
        read_drains(str(tmp_path / "drained"))


def test_a_state_directory_that_is_a_file(tmp_path):
    (tmp_path / "state").write_text("")
    with pytest.raises(DrainError, match=r"marks in .*state: it exists and is not a directory"):
        update_drains(str(tmp_path / "state" / "drained"), ("example.com/x", "x1"), "r")
    assert os.listdir(tmp_path) == ["state"]


def test_a_drain_racing_admission_fails_no_pod_and_applies_from_the_next_snapshot(
        tmp_path, short_dir, run):
    """The kubelet admits a pod from the last ListAndWatch snapshot it got; a device drained
    after that snapshot was sent is still allocated (it works: its device nodes are there),
    and refused once the kubelet had time to read the Unhealthy snapshot. A device whose
    nodes are gone is refused whatever the kubelet was told."""
    import asyncio
    from dataclasses import replace

    import grpc

    from device_plugin_host_testing.drivers import MemoryDriver, make_devices
    from device_plugin_host_testing.harness import kubelet_and_host, make_config
    from host.core.model import DeviceNode, ResourceConfig

    name = "example.com/gpu"
    nodes = tmp_path / "dev"
    nodes.mkdir()
    devices = []
    for device in make_devices("g", 3):
        (nodes / device.id).write_text("")
        devices.append(replace(device, device_nodes=(
            DeviceNode(str(nodes / device.id), f"/dev/{device.id}"),)))
    driver = MemoryDriver("m", {name: devices})
    config = make_config(short_dir, [ResourceConfig(name, "m")], rescan_interval_s=0)

    async def scenario() -> None:
        async with kubelet_and_host(config, {"m": driver}) as (sim, app):
            state = sim.resources[name]
            assert state.healthy == {"g0", "g1", "g2"}
            snapshots = state.snapshots
            # The operator's drain lands between the snapshot the kubelet admitted from and
            # its Allocate: the host updates its snapshot at once, the kubelet has not read it.
            update_drains(config.host.drain_file, (name, "g0"), "replacing the fan")
            app.drains.read()
            assert not app.device_plugin.snapshots[name].device("g0").healthy
            answer = await sim.call_allocate(name, [["g0"]])
            assert [d.host_path for d in answer.container_responses[0].devices] == \
                [str(nodes / "g0")]
            # The drain applies from the next snapshot on: once the kubelet has it (and the
            # message is no longer in flight), g0 is refused.
            await sim.wait_for(lambda s: s.resources[name].snapshots > snapshots
                               and "g0" in s.resources[name].unhealthy)
            await asyncio.sleep(1.1)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await sim.call_allocate(name, [["g0"]])
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "drained by an operator: replacing the fan" in refused.value.details()
            # Told Healthy, but its device node is gone: it cannot work, refused at once.
            os.unlink(nodes / "g1")
            update_drains(config.host.drain_file, (name, "g1"), "gone")
            app.drains.read()
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                await sim.call_allocate(name, [["g1"]])
            assert gone.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            # An unknown id is refused as before; a Healthy device is allocated as before.
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await sim.call_allocate(name, [["g9"]])
            assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            await sim.call_allocate(name, [["g2"]])

    run(scenario(), timeout=60)
