"""Run the real host in-process against a plugin dir, for tests, benchmarks and the demo."""

from __future__ import annotations

import contextlib
from typing import AsyncIterator, Dict, Sequence, Union

from host.app import HostApp
from host.config import Config, HostSettings
from host.driver import Driver
from host.model import ResourceConfig
from host.watch import EventSource


def make_config(plugin_dir: str, resources: Sequence[ResourceConfig], **host: object) -> Config:
    settings = HostSettings(plugin_dir=plugin_dir, **host)  # type: ignore[arg-type]
    return Config(path=None, host=settings, resources=tuple(resources), is_default=False)


@contextlib.asynccontextmanager
async def running_host(
    config: Config, drivers: Dict[str, Driver], events: Union[str, EventSource, None] = None
) -> AsyncIterator[HostApp]:
    """The real host; device events only where a test passes a source (or "udev")."""
    app = HostApp(config, drivers, events=events)
    await app.start()
    try:
        yield app
    finally:
        await app.stop()
