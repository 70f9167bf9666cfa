"""The operators' drain marks (``device-plugin-host drain``): the drain file, watched."""

from __future__ import annotations

import logging
import os
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from host.core.drains import DrainError, read_drains
from host.core.inotify import DirectoryWatch

log = logging.getLogger("host.app")  # the lines operators know


class DrainWatch:
    """Reads ``path`` at start and at every change of it. ``current``: the marks applied
    now; ``apply``: apply new marks, returning the resources whose devices changed;
    ``resync``: sync one of those."""

    def __init__(self, path: Callable[[], str],
                 current: Callable[[], Dict[Tuple[str, str], str]],
                 apply: Callable[[Dict[Tuple[str, str], str]], Iterable[str]],
                 resync: Callable[[str], None]) -> None:
        self._path = path
        self._current = current
        self._apply = apply
        self._resync = resync
        self.watch: Optional[DirectoryWatch] = None

    def start(self) -> None:
        path = self._path()
        self.read()
        directory = os.path.dirname(path)
        try:  # watching the directory itself, not a busy ancestor such as /var/lib or /tmp
            os.makedirs(directory, mode=0o700, exist_ok=True)
        except OSError as error:
            log.debug("cannot create %s (%s); watching for it", directory, error)
        name = os.path.basename(path)

        def changed(names: Optional[List[str]]) -> None:
            if names is None or name in names:
                self.read()

        try:
            self.watch = DirectoryWatch(directory, changed)
            self.watch.start()
        except OSError as error:
            log.warning("cannot watch the drain file %s: %s", path, error)
            self.watch = None

    def read(self) -> None:
        """Apply the file's marks now; an unreadable file keeps the marks applied before."""
        current = self._current()
        try:
            drains = read_drains(self._path())
        except DrainError as error:
            log.error("%s; keeping the %d marks applied before", error, len(current))
            return
        for (name, device), reason in drains.items():
            if (name, device) not in current:
                log.warning("resource %s: device %s drained by an operator: %s", name,
                            device, reason)
        for name in self._apply(drains):
            self._resync(name)

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
