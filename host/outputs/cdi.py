"""The CDI stage: each device-plugin resource's spec on disk before its devices go out.

``stage`` runs before the outputs: it writes the resource's spec and returns the devices as
they may be advertised. A device whose CDI name the spec on disk does not hold cannot be
used by a runtime, so it is Unhealthy with the reason (unless ``cdi_fallback`` lets Allocate
hand out its device nodes instead). Specs deleted or not written (a full disk) are noticed
by a watch on the directory and a retry with backoff, and written again; a repaired spec
re-syncs its resource. Big writes (``write``) run in one worker thread, in the order asked.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Callable, Iterable, List, Optional, Sequence, Tuple, TypeVar

from host.core.cdi import FILE_PREFIX, CdiWriter
from host.core.inotify import DirectoryWatch
from host.core.model import Device, Health, ResourceConfig
from host.core.tasks import Background

log = logging.getLogger("host.app")  # the lines operators know
T = TypeVar("T")
#: The retry of a missing spec: 1 s, doubling, at most 30 s.
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 30.0


class CdiStage:
    """Owns the spec writer, its thread, the directory watch and the retry timer.

    ``served``: the resources whose specs must be on disk now; ``devices_of``: a resource's
    devices by name; ``resync``: a resource whose spec was repaired, to sync again."""

    def __init__(self, directory: str, background: Background,
                 served: Callable[[], Sequence[ResourceConfig]],
                 devices_of: Callable[[str], Sequence[Device]],
                 resync: Callable[[ResourceConfig], None]) -> None:
        self.writer = CdiWriter(directory)
        self._background = background
        self._served = served
        self._devices_of = devices_of
        self._resync = resync
        self.watch: Optional[DirectoryWatch] = None
        self._backoff = RETRY_FIRST_S
        self._thread: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._check: Optional[asyncio.Task] = None
        self._check_again = False

    @property
    def stopped(self) -> bool:
        return self._background.closed

    # -- the stage ----------------------------------------------------------------------------
    def stage(self, resource: ResourceConfig, devices: List[Device]) -> List[Device]:
        """Write the resource's spec; the devices as they may be advertised."""
        if not resource.cdi:
            return devices
        self.writer.update(resource.name, devices)
        if resource.cdi_fallback:
            return devices
        broken = self.writer.unresolvable(resource.name, devices)
        if not broken:
            return devices
        return [d.with_health(Health.UNHEALTHY, broken[d.id])
                if d.id in broken and d.healthy else d for d in devices]

    async def write(self, resources: Iterable[ResourceConfig]) -> None:
        """Write these resources' specs in the worker thread: JSON and fsync of thousands of
        devices must not stall the loop (and every ListAndWatch stream with it). ``stage``
        then finds each spec current for the very device list it is handed (one stat)."""
        items = [(r.name, self._devices_of(r.name)) for r in resources if r.cdi]
        if items:
            await self._in_thread(lambda: self._write_now(items))

    def _write_now(self, items: List[Tuple[str, Sequence[Device]]]) -> None:
        for name, devices in items:
            self.writer.update(name, devices)

    async def _in_thread(self, fn: Callable[[], T]) -> Optional[T]:
        """Run ``fn`` in the writer's one thread; None (not run) once stopped."""
        if self.stopped:
            return None
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="cdi-writer")
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn)

    def forget(self, name: str) -> None:
        """The resource's spec goes (it left the config, or no longer wants CDI)."""
        self.writer.remove(name)

    # -- repair ---------------------------------------------------------------------------------
    async def check(self) -> None:
        """Write again every spec that should be on disk and is not (a failed write, a file
        deleted by hand); cheap when all are there (one stat each, in the writer's thread)."""
        if self.stopped:
            return
        wanted = [r for r in self._served() if r.cdi]
        if wanted:
            changed = await self._in_thread(
                lambda: [r for r in wanted if self.writer.retry(r.name)])
            for resource in changed or ():
                if self.stopped:
                    return
                self._resync(resource)
        self.arm_retry()

    def schedule_check(self) -> None:
        """``check`` from a timer or a directory event: one owned task at a time, and one more
        pass when asked again while it runs (a burst of events is one check, not one each)."""
        if self._check is not None and not self._check.done():
            self._check_again = True
            return

        async def run() -> None:
            while True:
                self._check_again = False
                await self.check()
                if not self._check_again:
                    return

        self._check = self._background.spawn(run(), "cdi check")

    def arm_retry(self) -> None:
        """While a spec is missing, retry with backoff besides the rescans: freeing space
        elsewhere on the filesystem sends no event."""
        self._background.cancel("cdi retry")
        if not self.writer.problems or self.stopped:
            self._backoff = RETRY_FIRST_S
            return
        self._background.later("cdi retry", self._backoff, self.schedule_check)
        self._backoff = min(self._backoff * 2, RETRY_MAX_S)

    def start_watch(self, resources: Sequence[ResourceConfig]) -> None:
        """Notice at once when someone deletes one of our spec files (once some resource has
        ``cdi``; a later call after a reload starts it then)."""
        if self.watch is not None or not any(r.cdi for r in resources):
            return

        def changed(names: Optional[List[str]]) -> None:
            if names is None or any(n.startswith(FILE_PREFIX) for n in names):
                self.schedule_check()

        try:
            self.watch = DirectoryWatch(self.writer.directory, changed)
            self.watch.start()
        except OSError as error:
            log.warning("cannot watch the CDI directory %s: %s; specs are checked at every "
                        "rescan", self.writer.directory, error)
            self.watch = None

    def close_watch(self) -> None:
        if self.watch is not None:
            self.watch.close()

    def close(self) -> None:
        """Waits for a write in progress; none starts after it. Specs stay on disk: pods
        still hold their devices (CdiWriter)."""
        self.close_watch()
        self.writer.close()
        if self._thread is not None:
            self._thread.shutdown(wait=False)
