"""Whole-file writes that a reader (a container runtime, our next start) never sees half done.

Write to a temp file in the same directory, fsync, rename over the target, fsync the
directory: after a crash the file is either the old one or the new one.
"""

from __future__ import annotations

import os

from host import fileio


def write_atomic(path: str, text: str, mode: int = 0o644) -> None:
    """Raises OSError (disk full, read-only mount); the previous file then stays. Created
    without following symlinks, with exactly ``mode`` (host/fileio.py)."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o755, exist_ok=True)
    fileio.write_atomic(path, text, mode, fsync=True)


def remove_file(path: str) -> None:
    """Remove a file; one that is already gone is fine (unprepare is retried)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
