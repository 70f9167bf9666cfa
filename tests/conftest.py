"""Shared fixtures: short temp dirs (unix socket paths cap at 107 bytes) and an async runner."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from typing import Iterator

import pytest


@pytest.fixture
def short_dir() -> Iterator[str]:
    """A short /tmp directory for plugin sockets; pytest's tmp_path can be too long."""
    path = tempfile.mkdtemp(prefix="dph", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def run():
    """Run a coroutine to completion on a fresh event loop (no pytest-asyncio needed)."""

    def runner(coro, timeout: float = 60.0):
        async def bounded():
            return await asyncio.wait_for(coro, timeout)

        return asyncio.run(bounded())

    return runner
