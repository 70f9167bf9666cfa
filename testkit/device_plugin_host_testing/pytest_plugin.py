"""The test kit as a pytest plugin, for our suite and third-party driver packages alike.

Installing the kit (device-plugin-host-testing, or device-plugin-host[testing]) registers this
module with pytest (the ``pytest11`` entry point in testkit/pyproject.toml), so a driver
package's tests get these fixtures with no ``conftest.py``:

* ``short_dir``: a short /tmp directory for unix sockets (paths stop at 107 bytes, which
  pytest's ``tmp_path`` can exceed), removed afterwards;
* ``run``: runs one coroutine on a fresh event loop, bounded by a timeout;
* ``fake_tree``: an empty :class:`~host.sim.tree.FakeTree` (a fake ``/sys`` + ``/dev``
  host root) under ``tmp_path``;
* ``aio``: one event loop for the whole test (``aio.run(coro)``), for tests whose objects must
  outlive one coroutine, such as a running kubelet;
* ``kubelet``: a :class:`~host.sim.kubelet.KubeletSimulator` already serving
  ``kubelet.sock`` in ``short_dir`` on ``aio``'s loop, stopped after the test; its options
  from ``@pytest.mark.kubelet(...)``.

Fixtures live here and not in a ``conftest.py`` so that one definition serves every suite.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Coroutine, Iterator, TypeVar

import pytest

from host.process import configure_process

# The kit runs the host inside the test process, so, like the program's own entry points, it
# applies the program's grpc settings before grpc is first imported (the imports below load
# it). pytest loads this plugin before any conftest.py, which was too late: the suite forked
# `ip` with grpc's fork handlers armed, and a grpcio 1.80 child died in them (SIGABRT).
configure_process()

from device_plugin_host_testing.fixtures import run, short_dir  # noqa: E402
from host.sim.kubelet import KubeletSimulator  # noqa: E402
from host.sim.tree import FakeTree  # noqa: E402

__all__ = ["Aio", "aio", "fake_tree", "kubelet", "run", "short_dir"]

T = TypeVar("T")


class Aio:
    """One event loop for a test. ``asyncio.run`` closes its loop after each coroutine, and
    gRPC servers (the kubelet simulator) die with their loop; this loop lives until teardown,
    which cancels what is left and closes it the way ``asyncio.run`` does."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        """Run ``coro`` to completion on the test's loop; a hang fails after ``timeout``."""
        bounded: Awaitable[T] = asyncio.wait_for(coro, timeout)
        return self.loop.run_until_complete(bounded)

    def close(self) -> None:
        loop = self.loop
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()


@pytest.fixture
def aio() -> Iterator[Aio]:
    """An event loop that lasts the whole test: ``aio.run(coro)``."""
    runner = Aio()
    try:
        yield runner
    finally:
        runner.close()


@pytest.fixture
def fake_tree(tmp_path: Any) -> FakeTree:
    """An empty fake host root (``/sys``, ``/dev``) for a driver's ``discover``: build the
    layout with the tree's methods or the ``host.sim.fake_*`` and
    ``device_plugin_host_testing.fake_*`` builders."""
    return FakeTree(tmp_path / "root")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "kubelet(**options): KubeletSimulator options for the kubelet fixture "
        "(topology_policy, numa_nodes, kubelet_version, ...)")


@pytest.fixture
def kubelet(request: pytest.FixtureRequest, aio: Aio, short_dir: str
            ) -> Iterator[KubeletSimulator]:
    """A kubelet simulator serving ``<short_dir>/kubelet.sock`` on ``aio``'s loop: point the
    host's ``plugin_dir`` at ``kubelet.plugin_dir`` and drive it with ``aio.run``. Options
    come from ``@pytest.mark.kubelet(topology_policy="single-numa-node", ...)``."""
    marker = request.node.get_closest_marker("kubelet")
    sim = KubeletSimulator(short_dir, **(marker.kwargs if marker else {}))
    aio.run(sim.start())
    try:
        yield sim
    finally:
        aio.run(sim.stop())
