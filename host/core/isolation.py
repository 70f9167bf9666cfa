"""Driver code runs off the event loop, in the driver's own small thread pool, under a timeout.

One pool per driver means a driver that hangs can exhaust only its own workers: other drivers'
scans and allocations, and the gRPC servers on the loop, keep going. A timed-out call cannot be
killed (Python threads cannot be), so it is counted as hung until it returns; callers use
``hung()`` to avoid piling more work onto a stuck driver, and ``on_unhung`` to resume.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from typing import Any, Callable, Dict, Optional, Sequence, TypeVar

from host.core.model import ContainerAllocation, Device, ResourceConfig

T = TypeVar("T")

WORKERS_PER_DRIVER = 4
#: A driver's pre_start is bounded inside the kubelet's 30 s PreStartContainer deadline; the
#: DRA side, which runs it while preparing a claim, uses the same bound.
PRE_START_TIMEOUT_S = 28.0


class DriverCallError(Exception):
    """A driver call failed or timed out; the message names the driver and the operation."""

    def __init__(self, driver: str, operation: str, reason: str, *, timed_out: bool = False):
        super().__init__(f"driver {driver!r} {operation}: {reason}")
        self.driver = driver
        self.operation = operation
        self.reason = reason
        self.timed_out = timed_out


class DriverCalls:
    def __init__(self) -> None:
        self._pools: Dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        self._hung: Dict[str, int] = {}
        self.on_unhung: Optional[Callable[[str], None]] = None

    def _pool(self, driver: str) -> concurrent.futures.ThreadPoolExecutor:
        pool = self._pools.get(driver)
        if pool is None:
            pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=WORKERS_PER_DRIVER, thread_name_prefix=f"driver-{driver}"
            )
            self._pools[driver] = pool
        return pool

    def hung(self, driver: str) -> int:
        """How many calls into this driver timed out and have not returned yet."""
        return self._hung.get(driver, 0)

    async def call(
        self, driver: str, operation: str, timeout: float, fn: Callable[..., T], *args: Any
    ) -> T:
        loop = asyncio.get_running_loop()
        work = self._pool(driver).submit(functools.partial(fn, *args))
        waiter = asyncio.wrap_future(work, loop=loop)
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except asyncio.TimeoutError:
            self._hung[driver] = self._hung.get(driver, 0) + 1
            work.add_done_callback(
                lambda _: _call_soon(loop, self._returned_late, driver)
            )
            raise DriverCallError(
                driver, operation, f"no answer within {timeout:g} s", timed_out=True
            ) from None
        except asyncio.CancelledError:
            raise
        except Exception as error:
            reason = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            raise DriverCallError(driver, operation, reason) from error

    def _returned_late(self, driver: str) -> None:
        self._hung[driver] = max(0, self._hung.get(driver, 0) - 1)
        if self._hung[driver] == 0 and self.on_unhung is not None:
            self.on_unhung(driver)

    def shutdown(self) -> None:
        """Stop accepting work; a hung driver thread is abandoned, not joined."""
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self._pools.clear()

    @staticmethod
    def stuck_threads() -> int:
        """Driver threads still alive (a hung call); the CLI exits without joining them."""
        return sum(
            1 for t in threading.enumerate() if t.name.startswith("driver-") and t.is_alive()
        )


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    if not loop.is_closed():
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closing
            pass


class DriverResultError(DriverCallError):
    """A driver hook answered with something it must not return."""

    def __init__(self, driver: str, operation: str, reason: str) -> None:
        super().__init__(driver, operation, reason)
        self.args = (f"driver {driver!r} {operation} {reason}",)


async def driver_allocate(calls: DriverCalls, driver: Any, resource: ResourceConfig,
                          devices: Sequence[Device], merged: ContainerAllocation,
                          timeout_s: float) -> ContainerAllocation:
    """The driver's ``allocate`` over the host's merge of ``devices``, in the driver's pool
    under ``timeout_s``: the step both the device plugin's Allocate and a DRA prepare take.
    Raises DriverCallError (DriverResultError when it returns no ContainerAllocation)."""
    result = await calls.call(driver.name, "allocate", timeout_s,
                              driver.allocate, resource, devices, merged)
    if not isinstance(result, ContainerAllocation):
        raise DriverResultError(driver.name, "allocate",
                                f"returned {type(result).__name__}, not ContainerAllocation")
    return result


async def driver_pre_start(calls: DriverCalls, driver: Any, resource: ResourceConfig,
                           devices: Sequence[Device]) -> None:
    """The driver's ``pre_start`` for ``devices``, under PRE_START_TIMEOUT_S. Raises
    DriverCallError."""
    await calls.call(driver.name, "pre_start", PRE_START_TIMEOUT_S,
                     driver.pre_start, resource, devices)
