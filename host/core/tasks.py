"""One owner for an object's background work: its tasks and its timers.

The host starts work that outlives the call that started it: rescans, reload passes, the
safety rescan, vanished-device expiry, health checks, the event scheduler's coalescing timer,
CDI retries, the NFD file's deferred write, the device-info reconciler. None of it may run
after stop() returned (a rescan still running then would rewrite a CDI spec after the files
were removed).

Here every such piece of work is registered in one place. ``aclose()`` stops new work from
being started, cancels every timer and task, and returns only once the tasks have finished
(their cancellation included), so the caller can remove its files knowing nothing writes them
again. A task's failure is logged, never "Task exception was never retrieved".
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Coroutine, Dict, Hashable, List, Optional, Set

log = logging.getLogger(__name__)


async def cancel_and_wait(task: Optional[asyncio.Task[Any]]) -> None:
    """Cancel ``task`` (None: nothing) and return once it has finished; its cancellation is
    the expected end, not an error."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


class Background:
    """The tasks and timers of one owner (the host); nothing starts once it is closed."""

    def __init__(self, label: str = "host") -> None:
        self.label = label
        self.closed = False
        self._tasks: Set[asyncio.Task] = set()
        self._timers: Dict[Hashable, asyncio.TimerHandle] = {}
        self._closers: List[Callable[[], Awaitable[None]]] = []

    # -- tasks --------------------------------------------------------------------------
    def spawn(self, coro: Coroutine[Any, Any, Any], name: str,
              on_error: Optional[Callable[[BaseException], None]] = None,
              ) -> Optional[asyncio.Task]:
        """Run ``coro`` as an owned task; None (and the coroutine closed) once closed."""
        if self.closed:
            coro.close()
            return None
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)

        def done(task: asyncio.Task) -> None:
            self._tasks.discard(task)
            if task.cancelled():
                return
            error = task.exception()
            if error is None:
                return
            if on_error is not None:
                on_error(error)
            else:
                log.error("%s: %s failed: %s: %s", self.label, task.get_name(),
                          type(error).__name__, error, exc_info=error)

        task.add_done_callback(done)
        return task

    def tasks(self) -> List[asyncio.Task]:
        return list(self._tasks)

    # -- timers -------------------------------------------------------------------------
    def later(self, key: Hashable, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        """(Re)arm the timer ``key``: one timer per key, the earlier one cancelled."""
        self.cancel(key)
        if self.closed:
            return

        def fire() -> None:
            self._timers.pop(key, None)
            fn(*args)

        self._timers[key] = asyncio.get_running_loop().call_later(delay, fire)

    def cancel(self, key: Hashable) -> None:
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()

    def armed(self, key: Hashable) -> bool:
        return key in self._timers

    def timer_keys(self) -> List[Hashable]:
        return list(self._timers)

    # -- components with their own tasks ---------------------------------------------------
    def own(self, closer: Callable[[], Awaitable[None]]) -> None:
        """A component that keeps its own tasks (a registrar, the DRA front end): closed, and
        awaited, by ``aclose`` after the host's own tasks, in the reverse order of owning."""
        self._closers.append(closer)

    # -- shutdown -----------------------------------------------------------------------
    async def aclose(self) -> None:
        """Cancel every timer and task and wait until the tasks have ended."""
        self.closed = True
        for key in list(self._timers):
            self.cancel(key)
        # A task cancelled here may start another as it unwinds (a rescan's callback): loop
        # until none is left, each round awaiting the cancelled ones.
        while self._tasks:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._tasks.difference_update(tasks)
        closers, self._closers = self._closers, []
        for closer in reversed(closers):
            await closer()
