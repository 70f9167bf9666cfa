"""Devices an operator marked Unhealthy by hand, for draining a node or a bad card.

The marks live in a small file (``drain_file`` in config), one JSON object a line:
``{"resource": "...", "device": "...", "reason": "..."}``. JSON, because a line format split
on whitespace cannot carry every reason an operator types and breaks on the first odd
character; files written by older versions (``<resource> <device-id> <reason...>``) are still
read, and rewritten as JSON lines on the next change. ``device-plugin-host drain`` edits the
file under a lock and replaces it atomically (fsync, rename), and the running host watches it
with inotify, so a mark takes effect in milliseconds and survives restarts and power loss.
An id names a device; its replicas (``<id>::<k>``) are drained with it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
from typing import Dict, List, Optional, Tuple

from host.core import fileio

# The same bounds the inventory puts on ids that drivers report.
from host.core.model import BAD_ID, MAX_ID_LENGTH
from host.core.resource_name import resource_name_error

log = logging.getLogger(__name__)

DrainKey = Tuple[str, str]  # (resource, device id)

DEFAULT_REASON = "drained by an operator"
MAX_REASON_LENGTH = 1024
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class DrainError(Exception):
    """The marks cannot be read or changed; ``str()`` is one line for the operator."""


class NoSuchMark(DrainError):
    """``undrain`` of a device that carries no mark."""


def key_error(resource: str, device: str) -> Optional[str]:
    """Why (resource, device) can never name an advertised device, or None. A mark that can
    never match would silently do nothing, which is worse than refusing it."""
    problem = resource_name_error(resource)
    if problem is not None:
        return f"{json.dumps(resource)} is not a valid resource name: {problem}"
    if not device:
        return "the device id is empty"
    if len(device) > MAX_ID_LENGTH:
        return f"the device id is {len(device)} characters; ids are at most {MAX_ID_LENGTH}"
    if BAD_ID.search(device):
        return (f"the device id {json.dumps(device)} contains whitespace or control characters;"
                " no device id does")
    try:
        device.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes in argv: the kubelet's ids are UTF-8
        return f"the device id {json.dumps(device)} is not valid UTF-8"
    return None


def clean_reason(reason: str) -> str:
    """One printable line: the reason ends up in logs, metrics and the kubelet's view."""
    text = " ".join(_CONTROL.sub(" ", reason).split())
    if len(text) > MAX_REASON_LENGTH:
        raise DrainError(f"the reason is {len(text)} characters; at most {MAX_REASON_LENGTH}")
    return text or DEFAULT_REASON


def read_drains(path: str) -> Dict[DrainKey, str]:
    """The marks in the file; a missing file means none. A line that is not a mark is
    skipped with a warning (one bad line must not undrain every other device); a file that
    cannot be read at all raises DrainError, so the caller keeps the marks it had."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        return {}
    except OSError as error:
        raise DrainError(f"cannot read the drain marks {path}: {_reason(error)}") from None
    text = data.decode("utf-8", errors="replace")
    marks: Dict[DrainKey, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        mark = _parse_json_line(line) if line.startswith("{") else _parse_legacy_line(line)
        if mark is None:
            log.warning("%s:%d: not a drain mark, skipped: %.80s", path, number, line)
            continue
        marks[mark[0]] = mark[1]
    return marks


def _parse_json_line(line: str) -> Optional[Tuple[DrainKey, str]]:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    resource, device = record.get("resource"), record.get("device")
    reason = record.get("reason", DEFAULT_REASON)
    if not (isinstance(resource, str) and isinstance(device, str) and isinstance(reason, str)):
        return None
    return (resource, device), reason or DEFAULT_REASON


def _parse_legacy_line(line: str) -> Optional[Tuple[DrainKey, str]]:
    """``<resource> <device-id> <reason...>``, as versions before JSON lines wrote it."""
    parts = line.split(None, 2)
    if len(parts) < 2:
        return None
    return (parts[0], parts[1]), parts[2] if len(parts) == 3 else DEFAULT_REASON


def update_drains(path: str, key: DrainKey, reason: Optional[str], *,
                  missing_ok: bool = True) -> Dict[DrainKey, str]:
    """Add (reason given) or remove (None) one mark, under a lock, replacing the file
    atomically so the watching host never reads half a file. Removing a mark that is not
    there raises NoSuchMark unless ``missing_ok``. Every OS failure (a full disk, a
    read-only or missing state directory) is a DrainError naming the path and the reason,
    and leaves the previous file as it was."""
    directory = os.path.dirname(path) or "."
    try:
        fileio.make_private_dir(directory)
        problem = fileio.private_dir_problem(directory)
        if problem is not None:
            raise DrainError(f"cannot write the drain marks: {problem}")
        lock = fileio.open_lock_file(os.path.join(directory, ".drain.lock"))
    except FileExistsError:  # makedirs' answer for a file where the directory should be
        raise DrainError(f"cannot write the drain marks in {directory}: it exists and is not a "
                         "directory") from None
    except OSError as error:
        raise DrainError(f"cannot write the drain marks in {directory}: "
                         f"{_reason(error)}") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        marks = read_drains(path)
        if reason is None:
            if key not in marks and not missing_ok:
                raise NoSuchMark(f"{key[0]} {key[1]} has no drain mark (in {path})")
            marks.pop(key, None)
        else:
            marks[key] = clean_reason(reason)
        _write_atomically(path, directory, _encode(marks))
    finally:
        os.close(lock)
    return marks


def _encode(marks: Dict[DrainKey, str]) -> bytes:
    lines: List[str] = [
        # ASCII escapes: any string, lone surrogates from odd argv bytes included, survives.
        json.dumps({"resource": resource, "device": device, "reason": reason}, sort_keys=True)
        for (resource, device), reason in sorted(marks.items())
    ]
    return "".join(line + "\n" for line in lines).encode("utf-8")


def _write_atomically(path: str, directory: str, data: bytes) -> None:
    try:
        fileio.write_atomic(path, data, mode=0o600, durable=True, prefix=".drain.")
    except OSError as error:
        raise DrainError(f"cannot write the drain marks {path}: {_reason(error)}") from None


def _reason(error: OSError) -> str:
    if error.errno == errno.ENOSPC:
        return "No space left on device (free space in the state directory, then retry)"
    if error.errno == errno.EROFS:
        return "Read-only file system (drain_file must be on a writable file system)"
    return error.strerror or str(error)
