"""pytest fixtures of the test kit, for our suite and third-party driver packages alike.

Import them into a ``conftest.py``::

    from device_plugin_host_testing.fixtures import run, short_dir
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from typing import Iterator

import pytest


@pytest.fixture
def short_dir() -> Iterator[str]:
    """A short /tmp directory for plugin sockets: unix socket paths stop at 107 bytes, which
    pytest's tmp_path can exceed."""
    path = tempfile.mkdtemp(prefix="dph", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def run():
    """Run a coroutine on a fresh event loop (no pytest-asyncio needed), bounded so a hang
    fails instead of blocking the suite."""

    def runner(coro, timeout: float = 60.0):
        async def bounded():
            return await asyncio.wait_for(coro, timeout)

        return asyncio.run(bounded())

    return runner
