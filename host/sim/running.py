"""The real host running in-process, as ``demo`` runs it and the test kit's harness does."""

from __future__ import annotations

import contextlib
from typing import AsyncIterator, Dict, Union

from host.app import HostApp
from host.config import Config
from host.core.driver import Driver
from host.triggers.uevents import EventSource


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
