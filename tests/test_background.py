"""The host owns its background work: nothing it started writes a file after stop() returns.

Each test holds a driver's discover in its worker thread across stop(), lets it return
afterwards, and checks that the CDI directory stays as stop() left it (specs stay on disk for
the pods holding their devices, unchanged): a rescan, a reload or the first scan still running
when stop() returned must not write a spec after the host stopped.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

from device_plugin_host_testing.drivers import MemoryDriver, make_devices
from device_plugin_host_testing.harness import make_config, running_host
from host.app import HostApp
from host.cli.reload import ConfigReloader
from host.config import load_config
from host.config.plugins import DriverRegistry
from host.core.hostfs import HostFS
from host.core.model import Device, ResourceConfig
from host.core.tasks import Background

RESOURCE = "example.com/gpu"


class GatedDriver(MemoryDriver):
    """discover() blocks while ``hang`` is set and tells the loop when it has entered and
    when it has returned (events, not sleeps)."""

    def __init__(self, devices: Dict[str, List[Device]]) -> None:
        super().__init__("m", devices)
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    @property
    def loop(self) -> Optional[asyncio.AbstractEventLoop]:
        return self._loop

    @loop.setter
    def loop(self, loop: asyncio.AbstractEventLoop) -> None:
        # The events are made here, in the test's running loop: Python 3.9 binds an
        # asyncio.Event to the loop current at construction, and there is none before.
        self._loop = loop
        self.entered = asyncio.Event()
        self.returned = asyncio.Event()

    def discover(self, host: HostFS, resources: Sequence[ResourceConfig]
                 ) -> Mapping[str, Sequence[Device]]:
        held = self.hang.is_set()
        if held and self.loop is not None:
            self.loop.call_soon_threadsafe(self.entered.set)
        try:
            return super().discover(host, resources)
        finally:
            if held and self.loop is not None:
                self.loop.call_soon_threadsafe(self.returned.set)


def _specs(cdi_dir: Path) -> Dict[str, bytes]:
    """Every file in the CDI directory with its contents."""
    if not cdi_dir.exists():
        return {}
    return {name: (cdi_dir / name).read_bytes() for name in sorted(os.listdir(cdi_dir))}


def _setup(tmp_path: Path, short_dir: str, driver: GatedDriver):
    cdi_dir = tmp_path / "cdi"
    config = make_config(short_dir, [ResourceConfig(RESOURCE, "m", cdi=True)],
                         cdi_dir=str(cdi_dir), rescan_interval_s=0,
                         discover_timeout_s=30)
    return cdi_dir, config


async def _release_and_settle(driver: GatedDriver) -> None:
    """Let the held discover return, then let whatever still awaited it run to its end."""
    driver.release.set()
    await asyncio.wait_for(driver.returned.wait(), 10)
    for _ in range(50):  # the thread's result reaches the loop in a few callbacks
        await asyncio.sleep(0)


def test_a_rescan_held_in_discover_across_stop_writes_no_cdi_spec(tmp_path, short_dir, run):
    driver = GatedDriver({RESOURCE: make_devices("g", 2)})
    cdi_dir, config = _setup(tmp_path, short_dir, driver)

    async def scenario() -> None:
        driver.loop = asyncio.get_running_loop()
        async with running_host(config, {"m": driver}) as app:
            before = _specs(cdi_dir)
            assert len(before) == 1
            driver.hang.set()
            driver.devices[RESOURCE] = make_devices("g", 3)
            app.request_rescan()
            await asyncio.wait_for(driver.entered.wait(), 10)
        assert _specs(cdi_dir) == before  # kept by stop(): pods may hold the devices
        assert not app.background.tasks() and not app.background.timer_keys()
        await _release_and_settle(driver)
        assert _specs(cdi_dir) == before  # the rescan's 3 devices were never written

    run(scenario())


def test_stop_during_the_first_scan_serves_and_writes_nothing(tmp_path, short_dir, run):
    driver = GatedDriver({RESOURCE: make_devices("g", 2)})
    cdi_dir, config = _setup(tmp_path, short_dir, driver)

    async def scenario() -> None:
        driver.loop = asyncio.get_running_loop()
        driver.hang.set()
        app = HostApp(config, {"m": driver}, events=None)
        start = asyncio.get_running_loop().create_task(app.start())
        await asyncio.wait_for(driver.entered.wait(), 10)
        await app.stop()
        await _release_and_settle(driver)
        await asyncio.wait_for(start, 10)
        assert not cdi_dir.exists() or os.listdir(cdi_dir) == []
        assert app.served() == []
        assert os.listdir(short_dir) == []  # no socket either
        assert not app.background.tasks() and not app.background.timer_keys()

    run(scenario())


def test_a_reload_held_in_discover_across_stop_writes_no_cdi_spec(tmp_path, short_dir, run):
    """The reloader's task belongs to the host: stop() ends it even where the caller never
    closes the reloader."""
    driver = GatedDriver({RESOURCE: make_devices("g", 2),
                          "example.com/other": make_devices("o", 1)})
    cdi_dir = tmp_path / "cdi"
    host = (f'[host]\nplugin_dir = "{short_dir}"\ncdi_dir = "{cdi_dir}"\n'
            f'drain_file = "{tmp_path / "drain" / "drained"}"\nnfd_features_file = ""\n'
            'rescan_interval_s = 0\n')
    one = f'[[resource]]\nname = "{RESOURCE}"\ndriver = "m"\ncdi = true\n'
    two = one + '[[resource]]\nname = "example.com/other"\ndriver = "m"\ncdi = true\n'
    path = tmp_path / "config.toml"
    path.write_text(host + one)
    registry = DriverRegistry()
    registry.drivers["m"] = driver
    registry.sources["m"] = "test"
    config = load_config(str(path), registry.with_unavailable())

    async def scenario() -> None:
        driver.loop = asyncio.get_running_loop()
        async with running_host(config, {"m": driver}) as app:
            assert len(os.listdir(cdi_dir)) == 1
            reloader = ConfigReloader(app, str(path), registry, {}, quiet_s=0.01)
            path.write_text(host + two)
            driver.hang.set()
            reloader.schedule(force=True)  # the trial scan is held in discover
            await asyncio.wait_for(driver.entered.wait(), 10)
            driver.hang.clear()
            driver.release.set()  # the trial scan returns; the reload's own rescan follows
            await asyncio.wait_for(driver.returned.wait(), 10)
            driver.returned.clear()
            driver.entered.clear()
            driver.release.clear()
            driver.hang.set()
            await asyncio.wait_for(driver.entered.wait(), 10)
            before = _specs(cdi_dir)
        assert _specs(cdi_dir) == before
        await _release_and_settle(driver)
        assert _specs(cdi_dir) == before

    run(scenario())


def test_background_cancels_and_awaits_tasks_and_timers(run):
    async def scenario() -> None:
        owner = Background("test")
        fired: List[str] = []
        finished = threading.Event()

        async def work() -> None:
            try:
                await asyncio.Event().wait()
            finally:
                finished.set()

        owner.later("t", 60, fired.append, "t")
        owner.later("t", 60, fired.append, "t2")  # replaces the first
        assert owner.timer_keys() == ["t"]
        task = owner.spawn(work(), "work")
        assert task is not None
        await asyncio.sleep(0)
        await owner.aclose()
        assert finished.is_set() and task.done() and not owner.tasks()
        assert owner.timer_keys() == [] and fired == []
        coro = work()
        assert owner.spawn(coro, "late") is None  # closed: nothing new starts
        owner.later("u", 0, fired.append, "u")
        assert owner.timer_keys() == []

    run(scenario())
