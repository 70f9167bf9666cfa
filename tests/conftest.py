"""Shared fixtures come from the test kit's pytest plugin
(testkit/device_plugin_host_testing/pytest_plugin.py, registered by the ``pytest11`` entry point in
pyproject.toml), the same one third-party driver authors get by installing the host: ``short_dir``,
``run``, ``fake_tree``, ``aio``, ``kubelet``. The plugin also applies the program's grpc settings
(host.process) before grpc is imported.

What this file adds is about the cost of the suite on a small machine, not about any test:

* Temporary files go to a RAM-backed tmpfs when the machine has one with room. The suite
  builds thousands of fake sysfs trees (every symlink and attribute file of a real layout);
  on an ext4 ``/tmp`` mounted with ``discard`` their creation and removal cost more system
  time than all the tests' own work (measured: 17.6 s of system time against 1.6 s on tmpfs
  for three driver test files). A real ``/sys`` lives in memory too. An explicit ``TMPDIR``
  or ``--basetemp`` wins. Unix sockets keep their short ``/tmp`` paths (``short_dir``).
* The ~170 child interpreters (``python -m host ...``) read their bytecode from one cache
  made for this run: with PYTHONDONTWRITEBYTECODE=1 (set on this machine) each child
  compiled all ~100 modules of the program again, as no installed host ever does. The cache
  lives outside the checkout (PYTHONPYCACHEPREFIX) and is removed when the run ends.
* The suite runs on every CPU (pytest-xdist, ``-n auto`` in pyproject.toml): most tests wait
  on sockets, child processes and timers. A test that holds the host to a time bound is
  marked ``alone``; while it runs no other test does (a writer-preferring lock over two
  ``flock`` files), so the other worker's load can never be what it measures.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Optional

import pytest

_TMPFS = "/dev/shm"
_NODE_SUITE = Path(__file__).resolve().parent / "node"
# The suite keeps every passing test's directory until the session ends (~250 MB at most);
# a tmpfs with less room than this is left alone.
_TMPFS_MIN_FREE = 1 << 30


def _tmpfs_with_room(path: str = _TMPFS) -> Optional[str]:
    """``path`` if it is a writable tmpfs mount point with room for the suite's files."""
    try:
        with open("/proc/self/mounts", encoding="utf-8") as mounts:
            kinds = {fields[1]: fields[2] for fields in (line.split() for line in mounts)
                     if len(fields) > 2}
        stat = os.statvfs(path)
    except OSError:
        return None
    if kinds.get(path) != "tmpfs" or not os.access(path, os.W_OK | os.X_OK):
        return None
    return path if stat.f_bavail * stat.f_frsize >= _TMPFS_MIN_FREE else None


# The directory of the two lock files every worker shares, made by the controller.
_LOCKS_ENV = "DPH_TEST_LOCKS"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "node: the whole-node suite (tests/node: a real kubelet and containerd, as "
        "root); collected only by `-m node`")
    config.addinivalue_line(
        "markers", "alone: holds the host to a time bound; when the suite runs in parallel, "
        "no other test runs beside it")
    if getattr(config, "workerinput", None) is not None:
        return  # a pytest-xdist worker inherits what its controller set up
    if "TMPDIR" not in os.environ and config.option.basetemp is None:
        tmpfs = _tmpfs_with_room()
        if tmpfs is not None:
            os.environ["TMPDIR"] = tmpfs  # children too (demo, benchmarks' own temp dirs)
            tempfile.tempdir = tmpfs
    if "PYTHONPYCACHEPREFIX" not in os.environ:
        cache = tempfile.mkdtemp(prefix="dph-pycache-")
        os.environ["PYTHONPYCACHEPREFIX"] = cache
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # the children fill the cache
        config.add_cleanup(lambda: shutil.rmtree(cache, ignore_errors=True))
    if _LOCKS_ENV not in os.environ:
        locks = tempfile.mkdtemp(prefix="dph-locks-")
        os.environ[_LOCKS_ENV] = locks
        config.add_cleanup(lambda: shutil.rmtree(locks, ignore_errors=True))


def _node_run(config: pytest.Config) -> bool:
    """``-m node`` (or an expression selecting it): the whole-node suite, tests/node."""
    words = re.findall(r"[\w-]+", config.getoption("markexpr", "") or "")
    return any(w == "node" and (i == 0 or words[i - 1] != "not") for i, w in enumerate(words))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> Optional[bool]:
    """tests/node runs a real kubelet and container runtime as root: only ``-m node``
    collects it, never the default run."""
    if collection_path == _NODE_SUITE and not _node_run(config):
        return True
    return None


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per CPU this process may run on (xdist itself counts physical
    cores, and a cgroup or taskset may allow fewer than the machine has); none for the
    whole-node suite, whose one node is the machine's."""
    if _node_run(config):
        return 0
    return max(1, len(os.sched_getaffinity(0)))


@contextlib.contextmanager
def _turn(directory: str, alone: bool) -> Iterator[None]:
    """Shared for an ordinary test, exclusive for an ``alone`` one. A test that wants the
    room alone first takes the turnstile, so no new test enters while it waits for those
    inside to finish (without it, two workers starting tests back to back could keep an
    exclusive waiter out for the whole run)."""
    with open(os.path.join(directory, "turnstile"), "a") as turnstile, \
            open(os.path.join(directory, "room"), "a") as room:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def _alone_when_timed(request: pytest.FixtureRequest) -> Iterator[None]:
    alone = request.node.get_closest_marker("alone") is not None
    directory = os.environ.get(_LOCKS_ENV)
    parallel = directory is not None and getattr(request.config, "workerinput", None) is not None
    with _turn(directory, alone) if parallel and directory else contextlib.nullcontext():
        if not alone:
            yield
            return
        # The process has run hundreds of tests by now: a full collection of everything they
        # left in its heap, landing inside the measured window, took longer than the bound
        # itself. Collected now and set aside for the test (as `run` freezes what its start
        # built, host/cli/serve.py), so only the test's own objects are ever traversed.
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()
