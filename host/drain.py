"""Devices an operator marked Unhealthy by hand, for draining a node or a bad card.

The mark lives in a small text file (``drain_file`` in config), one line per device:
``<resource> <device-id> <reason...>``. ``device-plugin-host drain`` edits it atomically and the
running host watches it with inotify, so a mark takes effect in milliseconds and survives
restarts. An id names a device; its replicas (``<id>::<k>``) are drained with it.
"""

from __future__ import annotations

import fcntl
import os
from typing import Dict, Optional, Tuple

DrainKey = Tuple[str, str]  # (resource, device id)


def read_drains(path: str) -> Dict[DrainKey, str]:
    """The marks in the file; a missing file means none. Malformed lines are skipped."""
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except FileNotFoundError:
        return {}
    marks: Dict[DrainKey, str] = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(None, 2)
        if len(parts) < 2:
            continue
        marks[(parts[0], parts[1])] = parts[2] if len(parts) == 3 else "drained by an operator"
    return marks


def update_drains(path: str, key: DrainKey, reason: Optional[str]) -> Dict[DrainKey, str]:
    """Add (reason given) or remove (None) one mark, under a lock, replacing the file
    atomically so the watching host never reads half a file."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o700, exist_ok=True)
    with open(os.path.join(directory, ".drain.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        marks = read_drains(path)
        if reason is None:
            marks.pop(key, None)
        else:
            marks[key] = " ".join(reason.split()) or "drained by an operator"
        import tempfile  # random, shutil and compressors: only when writing

        fd, temp = tempfile.mkstemp(dir=directory, prefix=".drain.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write("# resource device-id reason (managed by device-plugin-host drain)\n")
                for (resource, device), text in sorted(marks.items()):
                    out.write(f"{resource} {device} {text}\n")
            os.chmod(temp, 0o600)
            os.replace(temp, path)
        except BaseException:
            if os.path.exists(temp):
                os.unlink(temp)
            raise
    return marks
