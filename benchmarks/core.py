"""What every benchmark family shares: the Figure record, the run context, statistics.

A family is a function that returns Figures for the keys it was asked for. Families are listed
in ``benchmarks.__main__.FAMILIES`` with the keys they can produce, so a new family (the udev
event latencies of a later issue) slots in by adding a module and one line there.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable, Dict, Iterator, List, Optional, Sequence, Set

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Figure:
    """One measured key. ``floor`` is the same measurement of the least the machine can do
    (None when nothing comparable exists); ``notes`` are extra facts for the human table."""

    key: str
    value: float
    unit: str
    floor: Optional[float] = None
    notes: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not (isinstance(self.value, (int, float)) and math.isfinite(self.value)):
            raise ValueError(f"{self.key}: value {self.value!r} is not a finite number")
        if self.floor is not None and not math.isfinite(self.floor):
            raise ValueError(f"{self.key}: floor {self.floor!r} is not a finite number")

    @property
    def ratio(self) -> Optional[float]:
        if self.floor is None or self.floor <= 0:
            return None
        return self.value / self.floor

    def as_json(self) -> Dict[str, object]:
        """The contract scripts rely on: exactly these four fields."""
        ratio = self.ratio
        return {
            "value": round(self.value, 4),
            "unit": self.unit,
            "floor": None if self.floor is None else round(self.floor, 4),
            "ratio": None if ratio is None else round(ratio, 3),
        }


class Skipped(Exception):
    """A family that cannot measure on this machine (not root, no real kubelet, no podman or
    image): its keys are reported as skipped with this reason, neither figures nor missing."""


@dataclass
class Context:
    """How big a run is and which keys it wants."""

    quick: bool = False
    prefixes: Sequence[str] = ()
    tiny: bool = False  # the smoke test's size: shapes only, numbers meaningless
    progress: Callable[[str], None] = lambda message: None

    def wants(self, key: str) -> bool:
        return not self.prefixes or any(key.startswith(p) for p in self.prefixes)

    def pick(self, full: int, quick: int, tiny: int) -> int:
        """A repetition count for this run's size."""
        return tiny if self.tiny else quick if self.quick else full


#: The idle window of a tiny run (the smoke test's size: shapes only, numbers meaningless).
TINY_IDLE_S = 0.2


def stderr_progress(message: str) -> None:
    print(f"  .. {message}", file=sys.stderr, flush=True)


# -- statistics ------------------------------------------------------------------------------
def median(samples: Sequence[float]) -> float:
    ordered = sorted(samples)
    if not ordered:
        raise ValueError("no samples")
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def percentile(samples: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile: a value that was actually observed (p99 of 50 is the max)."""
    ordered = sorted(samples)
    if not ordered:
        raise ValueError("no samples")
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def summary(samples: Sequence[float], unit: str) -> str:
    return (f"n={len(samples)} min={min(samples):.3g} median={median(samples):.3g} "
            f"p99={percentile(samples, 99):.3g} max={max(samples):.3g} {unit}")


# -- environment -----------------------------------------------------------------------------
@contextlib.contextmanager
def short_dir(prefix: str = "dphb") -> Iterator[str]:
    """A directory under /tmp short enough for unix socket paths (107 bytes)."""
    path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def memory_tmp() -> Optional[str]:
    """tmpfs for generated sysfs trees when there is one: sysfs lives in memory too, and tens
    of thousands of small files on a VM's ext4 take a minute to create instead of seconds."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None


#: Where child interpreters keep their bytecode during a run (see ``bytecode_cache``).
_PYCACHE: Optional[str] = None
#: Inherited caches this process has filled already.
_FILLED: Set[str] = set()


@contextlib.contextmanager
def bytecode_cache() -> Iterator[str]:
    """A bytecode cache for the child interpreters of one run, removed afterwards.

    An installed host has its .pyc files (pip compiles at install); a checkout run with
    PYTHONDONTWRITEBYTECODE=1 would compile ~100 modules on every start instead, and the
    start-up and memory figures would measure the compiler. The cache lives outside the
    checkout (PYTHONPYCACHEPREFIX) so a run leaves nothing behind. It is filled before the
    first child starts, as pip does at install: a child that compiles keeps the compiler's
    memory in its RSS and its time in its start-up.
    """
    global _PYCACHE
    previous = _PYCACHE
    # A cache the caller made for its own children (the test suite's, tests/conftest.py) is
    # used as it is and left to its owner: filling a new one cost the suite ~1 s a family.
    inherited = os.environ.get("PYTHONPYCACHEPREFIX")
    path = inherited or tempfile.mkdtemp(prefix="dphb-pycache-")
    _PYCACHE = path
    try:
        if path not in _FILLED:  # a second run in this process finds every file current
            subprocess.run(
                [sys.executable, "-m", "compileall", "-q", "-j", "0",
                 *(str(REPO / part) for part in ("host", "drivers", "benchmarks"))],
                env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                check=False)
            if inherited:
                _FILLED.add(path)
        yield path
    finally:
        _PYCACHE = previous
        if not inherited:
            shutil.rmtree(path, ignore_errors=True)


def child_env() -> Dict[str, str]:
    """The environment for child interpreters: this checkout first on the path, bytecode
    cached as on an installed node when a ``bytecode_cache`` is active."""
    env = dict(os.environ)
    parts = [str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.pop("PYTHONDEVMODE", None)
    if _PYCACHE is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = _PYCACHE
    return env


def now() -> float:
    return time.perf_counter()


class ChildFailed(RuntimeError):
    """A child process died or never got ready; the message ends with its stderr."""


@contextlib.asynccontextmanager
async def child_process(
    args: Sequence[str], *, wait_for_line: Optional[str] = "ready", timeout: float = 60.0
) -> AsyncIterator[asyncio.subprocess.Process]:
    """A child interpreter (``python -m ...``), yielded once it printed ``wait_for_line``;
    SIGTERM and a wait on the way out, SIGKILL when it does not stop."""
    with tempfile.TemporaryFile() as errors:
        process = await asyncio.create_subprocess_exec(
            sys.executable, *args, cwd=str(REPO), env=child_env(),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=errors,
        )

        def failure(what: str) -> ChildFailed:
            errors.seek(0)
            tail = errors.read().decode(errors="replace")[-2000:]
            return ChildFailed(f"{' '.join(args[:3])}: {what}; stderr:\n{tail}")

        try:
            if wait_for_line is not None:
                await _read_until(process, wait_for_line, timeout, failure)
            yield process
            if process.returncode is not None:
                raise failure(f"exited early with {process.returncode}")
        finally:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(process.wait(), 15)
                except asyncio.TimeoutError:
                    process.kill()
                    await process.wait()


async def _read_until(process: asyncio.subprocess.Process, line: str, timeout: float,
                      failure: Callable[[str], ChildFailed]) -> None:
    assert process.stdout is not None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise failure(f"no {line!r} within {timeout:g} s")
        try:
            raw = await asyncio.wait_for(process.stdout.readline(), remaining)
        except asyncio.TimeoutError:
            continue
        if not raw:
            await process.wait()
            raise failure(f"exited with {process.returncode} before {line!r}")
        if raw.decode(errors="replace").strip() == line:
            return
