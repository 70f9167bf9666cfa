"""Live reload of the config file: only a complete, valid file ever changes what is served.

Reloads come from SIGHUP and from the file changing (a ConfigMap update swaps its ``..data``
link; an editor truncates, writes and renames). Both arrive as bursts of events, and in the
middle of one the file can be empty or half written, which would parse as "no resources:
serve the built-in defaults" and unregister everything the operator configured. So:

* events are debounced: the file is read once it has been quiet for ``QUIET_S``, and read
  again if it changed while being read;
* a file that is empty (nothing but whitespace and comments) is rejected unless it was empty
  at start: an operator who wants the built-in defaults back restarts the host;
* parsing and validation run in a worker thread (a 10,000-line file must not stall the
  loop), then a trial scan checks for devices two resources claim;
* a rejection is logged once per file content, as ``file: key: reason``, and the previous
  configuration keeps serving.

The reloader's one task and its quiet-period timer belong to the host's owner of background
work (``HostApp.background``, host/core/tasks.py): ``HostApp.stop()`` cancels and awaits a reload in
progress before it removes any file, even where the caller never closes the reloader. Nothing
it starts is left unawaited, and no exception escapes into "Task exception was never
retrieved".
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import stat
import time
from typing import TYPE_CHECKING, Callable, List, Mapping, Optional, Tuple

from host.config import FILE_KEY, MAX_CONFIG_BYTES, Config, ConfigError, load_config, overlap_error
from host.config.plugins import DriverRegistry
from host.core.inotify import DirectoryWatch

if TYPE_CHECKING:
    from host.app import HostApp

log = logging.getLogger("host")

#: How long the file must be left alone before it is read (an editor's or kubelet's burst).
QUIET_S = 0.25
_TIMER = "config reload quiet period"


def is_empty(data: bytes) -> bool:
    """Nothing but whitespace and comments: TOML for "no settings at all"."""
    text = data.decode("utf-8", errors="replace").lstrip("\ufeff")
    return all(not line.strip() or line.lstrip().startswith("#") for line in text.splitlines())


class ConfigReloader:
    """Reload on SIGHUP or when the config file changes; an invalid, empty or half-written
    new file is rejected and the running set stays."""

    def __init__(self, app: HostApp, path: Optional[str], registry: DriverRegistry,
                 overrides: Mapping[str, Optional[str]], quiet_s: float = QUIET_S) -> None:
        self.app = app
        self.path = path
        self.registry = registry
        self.overrides = overrides
        self.quiet_s = quiet_s
        data = self._read()
        # The bytes themselves, compared whole: exact, and a config is a few kB (4 MB at
        # most, host/config/__init__.py). No digest, so OpenSSL's digests are never loaded.
        self._applied = data
        self._empty_at_start = data is not None and is_empty(data)
        self._rejected: Optional[Tuple[Optional[bytes], str]] = None
        self._watch: Optional[DirectoryWatch] = None
        self._timer = False  # the quiet period is running (its timer is app.background's)
        self._task: Optional[asyncio.Task] = None
        self._again = False
        self._force = False
        self.reloads = 0  # applied reloads, for tests and logs
        self.rejections = 0
        # Told "applied", "rejected" or "unchanged" after each reload that read a settled file.
        self.on_outcome: Optional[Callable[[str], None]] = None
        self._idle = asyncio.Event()  # no quiet period running and no reload in progress
        self._idle.set()

    def _read(self) -> Optional[bytes]:
        if not self.path:
            return None
        try:  # never block the loop on a FIFO, nor read a huge file whole (load_config says)
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
            with open(fd, "rb") as handle:
                if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                    return None
                return handle.read(MAX_CONFIG_BYTES + 1)
        except OSError:
            return None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, lambda: self.schedule(force=True))
        if self.path:
            name = os.path.basename(self.path)

            def changed(names: Optional[List[str]]) -> None:
                if names is None or name in names or "..data" in names:
                    self.schedule()

            self._watch = DirectoryWatch(os.path.dirname(os.path.abspath(self.path)), changed)
            self._watch.start()

    def schedule(self, force: bool = False) -> None:
        """(Re)start the quiet period; the reload runs once events stop for ``quiet_s``."""
        self._force = self._force or force
        self._idle.clear()
        if self.app.background.closed:
            return
        self._timer = True
        self.app.background.later(_TIMER, self.quiet_s, self._fire)

    def _fire(self) -> None:
        self._timer = False
        if self._task is not None and not self._task.done():
            self._again = True  # one more pass once the running one has finished
            return
        self._task = self.app.background.spawn(self._run(), "config reload")
        if self._task is None:
            self._idle.set()  # the host has stopped: nothing more will be applied

    async def _run(self) -> None:
        while True:
            self._again = False
            force, self._force = self._force, False
            try:
                await self.reload(force)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # a bug must not kill reloading for good
                log.debug("reload failed", exc_info=True)
                log.error("reload failed, still serving the previous configuration: %s: %s",
                          type(error).__name__, error)
            if not self._again:
                if not self._timer:
                    self._idle.set()
                return

    async def wait_idle(self) -> None:
        """Until every change seen so far has been applied or rejected (for tests)."""
        await self._idle.wait()

    async def reload(self, force: bool = False) -> None:
        """Read, check and apply the file once. Public for tests; normally driven by events."""
        data, settled = self._read_settled()
        if not settled:
            self.schedule(force)  # still being written: wait for the next quiet period
            return
        if not force and data == self._applied:
            self._tell("unchanged")
            return
        try:
            config = await self._check(data)
        except ConfigError as error:
            self.rejections += 1
            if force or self._rejected != (data, str(error)):
                log.error("reload rejected, still serving the previous configuration: %s",
                          error)
            self._rejected = (data, str(error))
            self._tell("rejected")
            return
        self._rejected = None
        self._applied = data
        log.info("reloading the configuration from %s", self.path or "built-in defaults")
        await self.app.reload(config)
        self.reloads += 1
        self._tell("applied")

    def _tell(self, outcome: str) -> None:
        if self.on_outcome is not None:
            self.on_outcome(outcome)

    def _read_settled(self) -> Tuple[Optional[bytes], bool]:
        """The file's bytes, and whether they are final: not modified within the quiet period
        and not replaced or changed while being read."""
        if not self.path:
            return None, True
        before = _stat(self.path)
        data = self._read()
        after = _stat(self.path)
        if before != after:
            return data, False
        if after is not None and 0 <= time.time() - after[3] / 1e9 < self.quiet_s:
            return data, False  # written a moment ago: more may follow
        return data, True

    async def _check(self, data: Optional[bytes]) -> Config:
        path = self.path
        if path is not None and data is not None and is_empty(data) and not self._empty_at_start:
            raise ConfigError(
                path, FILE_KEY,
                "is empty (truncated, or still being written?); an empty file means the "
                "built-in defaults, which would stop every configured resource: not applied "
                "(restart the host to serve the built-in defaults)")
        loop = asyncio.get_running_loop()
        if self.registry.has_pending:
            # The host's own drivers that no resource used at start: the new file may name
            # one (or be the defaults of all). Imported off the loop, known to the host
            # before the file is checked against them.
            await loop.run_in_executor(None, self.registry.load_pending)
            self.app.adopt_drivers(self.registry.with_unavailable())
        # Parsing and driver validation of a large file take long: off the loop.
        config = await loop.run_in_executor(None, self._load)
        if not config.is_default:
            overlaps = await self.app.overlaps_in(config)
            if overlaps:
                raise overlap_error(config, overlaps[0])
        if not self.app.dra.started and any(r.api == "dra" for r in config.resources):
            # The first DRA resource (a new one, or one moving from the device plugin API):
            # the DRA side is built now; where it cannot work, the file is rejected.
            from host.dra.startup import DraStartError

            try:
                await self.app.start_dra_live(config)
            except DraStartError as error:
                raise ConfigError(self.path or "built-in defaults", FILE_KEY,
                                  str(error)) from None
        return config

    def _load(self) -> Config:
        config = load_config(self.path, self.registry.with_unavailable())
        return config.with_overrides(**self.overrides)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
        self.app.background.cancel(_TIMER)
        self._timer = False
        if self._task is not None:
            self._task.cancel()

    async def aclose(self) -> None:
        """close(), then wait for a running reload to end (its cancellation included)."""
        self.close()
        if self._task is not None:
            try:
                await self._task
            except asyncio.CancelledError:
                pass


def _stat(path: str) -> Optional[Tuple[int, int, int, int]]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
