"""Whole-file writes that a reader (a container runtime, our next start) never sees half done.

Write to a temp file in the same directory, fsync, rename over the target, fsync the
directory: after a crash the file is either the old one or the new one.
"""

from __future__ import annotations

import os
import tempfile


def write_atomic(path: str, text: str, mode: int = 0o644) -> None:
    """Raises OSError (disk full, read-only mount); the previous file then stays."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o755, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=directory, prefix=".dph-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temp, mode)
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def remove_file(path: str) -> None:
    """Remove a file; one that is already gone is fine (unprepare is retried)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
