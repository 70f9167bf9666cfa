"""Live reload against real files, a real inotify watch and the kubelet simulator: only a
complete, valid file changes what is served."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import AsyncIterator, List, Optional, Tuple

import pytest

from host.app import HostApp
from host.cli.reload import ConfigReloader, is_empty
from host.config import load_config
from host.config.plugins import load_drivers
from host.sim.kubelet import KubeletSimulator
from host.sim.tree import FakeTree

A = '[[resource]]\nname = "example.com/a"\ndriver = "usb"\n'
B = '[[resource]]\nname = "example.com/b"\ndriver = "usb"\n'


@contextlib.asynccontextmanager
async def reloading_host(
    config_file: Path, root: Path, plugin_dir: str, first: Optional[List[str]] = None
) -> AsyncIterator[Tuple[KubeletSimulator, HostApp, ConfigReloader, List[str]]]:
    """The real host with the real reloader on ``config_file``; yields the messages of every
    unhandled task exception the loop reports (there must be none). ``first``: the drivers
    loaded at start, as `run` loads those its file names (the others stay pending)."""
    registry = load_drivers(first=first)
    overrides = {"plugin_dir": plugin_dir, "host_root": str(root)}
    config = load_config(str(config_file), registry.with_unavailable()).with_overrides(
        **overrides)
    loop_errors: List[str] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: loop_errors.append(context["message"]))
    sim = KubeletSimulator(plugin_dir)
    await sim.start()
    app = HostApp(config, registry.with_unavailable(), events=None)
    reloader = ConfigReloader(app, str(config_file), registry, overrides)
    outcomes: asyncio.Queue = asyncio.Queue()
    reloader.on_outcome = outcomes.put_nowait
    reloader.outcomes = outcomes  # type: ignore[attr-defined]
    try:
        await app.start()
        reloader.start()
        yield sim, app, reloader, loop_errors
    finally:
        await reloader.aclose()
        await app.stop()
        await sim.stop()
        loop.set_exception_handler(None)


@pytest.fixture
def root(tmp_path) -> Path:
    FakeTree(tmp_path / "root").numa_nodes(1)
    return tmp_path / "root"


async def _outcome(reloader: ConfigReloader) -> str:
    return await asyncio.wait_for(reloader.outcomes.get(), 10)  # type: ignore[attr-defined]


def _rejections(caplog) -> List[str]:
    return [r.getMessage() for r in caplog.records if "reload rejected" in r.getMessage()]


def test_an_emptied_file_is_rejected_once_and_a_good_file_then_applies(
        tmp_path, root, short_dir, run, caplog):
    config = tmp_path / "config.toml"
    config.write_text(A + B)

    async def scenario():
        async with reloading_host(config, root, short_dir) as (sim, app, reloader, errors):
            await sim.wait_for(lambda s: s.resources["example.com/a"].connected
                               and s.resources["example.com/b"].connected)
            with caplog.at_level(logging.INFO, logger="host"):
                config.write_text("")  # truncated, as a failed `kubectl cp` or editor leaves it
                assert await _outcome(reloader) == "rejected"
                os.utime(config)  # more events for the same empty file: no second log line
                assert await _outcome(reloader) == "rejected"
                reloader.schedule()
                assert await _outcome(reloader) == "rejected"
            assert sorted(app.served()) == ["example.com/a", "example.com/b"]
            assert sim.resources["example.com/a"].connected
            rejected = _rejections(caplog)
            assert len(rejected) == 1, rejected
            assert f"{config}: (file): is empty" in rejected[0]
            assert "built-in defaults" in rejected[0]
            config.write_text(A)
            assert await _outcome(reloader) == "applied"
            await sim.wait_for(lambda s: not s.resources["example.com/b"].connected,
                               what="b removed by the good file")
            assert app.served() == ["example.com/a"] and reloader.reloads == 1
            assert errors == []

    run(scenario())


def test_a_file_empty_at_start_may_be_empty_again(tmp_path, root, short_dir, run):
    config = tmp_path / "config.toml"
    config.write_text("# nothing yet: the built-in defaults\n")

    async def scenario():
        async with reloading_host(config, root, short_dir) as (sim, _app, reloader, _errors):
            config.write_text(A)
            await sim.wait_for(lambda s: "example.com/a" in s.resources
                               and s.resources["example.com/a"].connected)
            config.write_text("\n")
            await sim.wait_for(lambda s: not s.resources["example.com/a"].connected,
                               what="back to the defaults")
            assert reloader.rejections == 0

    run(scenario())


def test_a_burst_of_partial_writes_is_one_reload_of_the_final_file(
        tmp_path, root, short_dir, run, caplog):
    config = tmp_path / "config.toml"
    config.write_text(A)
    whole = A + B

    async def scenario():
        async with reloading_host(config, root, short_dir) as (sim, _app, reloader, _errors):
            await sim.wait_for(lambda s: s.resources["example.com/a"].connected)
            with caplog.at_level(logging.INFO, logger="host"):
                # An editor writing in pieces: each piece alone is empty or invalid TOML.
                with open(config, "w") as out:
                    for cut in (0, len(A) + 5, len(A) + 30, len(whole)):
                        out.seek(0)
                        out.truncate()
                        out.write(whole[:cut])
                        out.flush()
                        await asyncio.sleep(0.02)  # the writer's pace, not a wait for the host
                await sim.wait_for(lambda s: "example.com/b" in s.resources
                                   and s.resources["example.com/b"].connected)
                await asyncio.wait_for(reloader.wait_idle(), 5)
            assert reloader.reloads == 1
            assert _rejections(caplog) == []

    run(scenario())


def test_a_configmap_data_swap_is_one_reload(tmp_path, root, short_dir, run):
    """The kubelet's AtomicWriter: files in a timestamped dir, ``..data`` a symlink to it,
    the visible name a symlink through ``..data``; an update renames a new ``..data`` over
    the old one (kubernetes pkg/volume/util/atomic_writer.go)."""
    mount = tmp_path / "configmap"
    mount.mkdir()
    first = mount / "..2026_12_02_06_00_00.000000001"
    first.mkdir()
    (first / "config.toml").write_text(A)
    os.symlink(first.name, mount / "..data")
    os.symlink("..data/config.toml", mount / "config.toml")
    config = mount / "config.toml"

    async def scenario():
        async with reloading_host(config, root, short_dir) as (sim, _app, reloader, _errors):
            await sim.wait_for(lambda s: s.resources["example.com/a"].connected)
            second = mount / "..2026_12_02_06_01_00.000000002"
            second.mkdir()
            (second / "config.toml").write_text(A + B)
            os.symlink(second.name, mount / "..data_tmp")
            os.rename(mount / "..data_tmp", mount / "..data")
            for old in first.iterdir():
                old.unlink()
            first.rmdir()
            await sim.wait_for(lambda s: "example.com/b" in s.resources
                               and s.resources["example.com/b"].connected)
            await asyncio.wait_for(reloader.wait_idle(), 5)
            assert reloader.reloads == 1 and reloader.rejections == 0

    run(scenario())


def test_deeply_nested_toml_on_reload_is_a_rejection_and_reloading_keeps_working(
        tmp_path, root, short_dir, run, caplog):
    config = tmp_path / "config.toml"
    config.write_text(A)

    async def scenario():
        async with reloading_host(config, root, short_dir) as (sim, _app, reloader, errors):
            await sim.wait_for(lambda s: s.resources["example.com/a"].connected)
            with caplog.at_level(logging.INFO, logger="host"):
                config.write_text(A + "x = " + "[" * 5000 + "]" * 5000 + "\n")
                assert await _outcome(reloader) == "rejected"
            rejected = _rejections(caplog)
            assert len(rejected) == 1 and "nested" in rejected[0], rejected
            assert "Traceback" not in caplog.text
            config.write_text(A + B)
            await sim.wait_for(lambda s: "example.com/b" in s.resources
                               and s.resources["example.com/b"].connected)
            assert errors == []

    run(scenario())


def test_is_empty():
    assert is_empty(b"") and is_empty(b"\n  \n# comment\n   # indented\n")
    assert is_empty("\ufeff# bom\n".encode())
    assert not is_empty(b"[host]\n") and not is_empty(b"# x\nresource = []\n")


def test_a_reload_that_makes_two_resources_claim_one_gpu_is_rejected(
        tmp_path, short_dir, run, caplog):
    from host.sim import fake_gpu

    root = tmp_path / "root"
    tree = FakeTree(root)
    tree.numa_nodes(1)
    fake_gpu.add_nvidia_control_nodes(tree)
    fake_gpu.add_nvidia_gpu(tree, "0000:18:00.0", minor=0, numa_node=0)
    gpu = ('[[resource]]\nname = "{}"\ndriver = "gpu"\n[resource.selectors]\n'
           'vendor = "0x10de"\n')
    config = tmp_path / "config.toml"
    config.write_text(gpu.format("nvidia.com/gpu"))

    async def scenario():
        async with reloading_host(config, root, short_dir) as (sim, app, reloader, _errors):
            await sim.wait_for(lambda s: s.resources["nvidia.com/gpu"].allocatable == 1)
            with caplog.at_level(logging.INFO, logger="host"):
                config.write_text(gpu.format("nvidia.com/gpu") + gpu.format("example.com/gpu"))
                assert await _outcome(reloader) == "rejected"
            rejected = _rejections(caplog)
            assert len(rejected) == 1
            assert "resource[1] (example.com/gpu).selectors" in rejected[0]
            assert "0000:18:00.0" in rejected[0]
            assert app.served() == ["nvidia.com/gpu"]

    run(scenario())


def test_a_reload_naming_a_driver_not_loaded_at_start_loads_and_serves_it(
        tmp_path, short_dir, run):
    """`run` imports only the drivers its file names, and the host's own others only when a
    reload needs them."""
    from host.sim import fake_gpu

    root = tmp_path / "root"
    tree = FakeTree(root)
    tree.numa_nodes(1)
    fake_gpu.add_nvidia_control_nodes(tree)
    fake_gpu.add_nvidia_gpu(tree, "0000:18:00.0", minor=0, numa_node=0)
    gpu = '[[resource]]\nname = "nvidia.com/gpu"\ndriver = "gpu"\n'
    config = tmp_path / "config.toml"
    config.write_text(gpu)

    async def scenario():
        async with reloading_host(config, root, short_dir, first=["gpu"]) as (
                sim, app, reloader, errors):
            await sim.wait_for(lambda s: s.resources["nvidia.com/gpu"].allocatable == 1)
            assert "usb" not in app.drivers and reloader.registry.has_pending
            config.write_text(gpu + A)
            assert await _outcome(reloader) == "applied"
            await sim.wait_for(lambda s: s.resources["example.com/a"].connected)
            assert sorted(app.served()) == ["example.com/a", "nvidia.com/gpu"]
            assert {"usb", "sriov", "rdma"} <= set(app.drivers)
            assert not reloader.registry.has_pending
            assert sim.resources["nvidia.com/gpu"].registrations == 1  # untouched
            assert errors == []

    run(scenario())
