"""Creating files as root in directories others may write: never through a planted symlink.

Every file the host creates goes through here. A new file is opened with
``O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC`` under a random name in the target's own
directory: a symlink (or anything else) planted at that name makes the open fail instead of
writing through it, and the name cannot be predicted. Its mode is set with ``fchmod`` on the
open descriptor, so the umask never widens (or narrows) it. A whole-file write then renames
the temp file over the target: ``rename`` replaces a symlink at the target's name, never
what it points to, and a reader sees the old file or the new one, never half of one.

Durability is the caller's choice: ``durable=True`` flushes the data before the rename and the
directory after it (state that must survive a power cut: CDI specs, the DRA checkpoint, drain
marks, the record of files to clean up); without it the rename alone keeps readers from seeing
half a file (outputs rebuilt at every start).

Directories: the host's own state directory must be ours and closed to others
(``private_dir_problem``); shared system directories we must write into (the CDI, NFD and
device-info directories) are written as above, with one warning when others may write them
(``warn_if_shared``).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from typing import Optional, Set, Tuple, Union

log = logging.getLogger(__name__)

CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_ATTEMPTS = 100
_warned: Set[str] = set()


def create_temp(directory: str, prefix: str, mode: int) -> Tuple[int, str]:
    """A new, empty, exclusively created file with a random name in ``directory``, with
    exactly ``mode``; returns (fd, path). Never opens anything that already exists."""
    for _ in range(_ATTEMPTS):
        path = os.path.join(directory, f"{prefix}{os.urandom(6).hex()}.tmp")
        try:
            fd = os.open(path, CREATE_FLAGS, mode & 0o777)
        except FileExistsError:
            continue  # planted, or a collision: another random name
        try:
            os.fchmod(fd, mode)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        return fd, path
    raise FileExistsError(errno.EEXIST, f"no free temporary name in {directory}", directory)


def write_atomic(path: str, data: Union[str, bytes], *, mode: int, durable: bool = False,
                 prefix: str = ".dph-", make_dirs: bool = False) -> None:
    """Replace ``path`` with ``data`` (text is UTF-8), mode exactly ``mode``. Raises OSError
    (disk full, read-only mount) with the previous file left as it was. ``durable`` flushes the
    data before the rename and the directory after it. ``make_dirs`` creates missing parent
    directories (0755) first."""
    directory = os.path.dirname(path) or "."
    if make_dirs:
        os.makedirs(directory, mode=0o755, exist_ok=True)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    fd, temp = create_temp(directory, prefix, mode)
    try:
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise
    if durable:
        fsync_directory(directory)


def remove_file(path: str) -> None:
    """Remove a file; one that is already gone is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def fsync_directory(directory: str) -> None:
    """The rename itself survives a power cut only once the directory is on disk."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def open_lock_file(path: str, mode: int = 0o600) -> int:
    """Open (creating it if needed) a lock file without following a symlink at its name; the
    file must be a regular file of ours. Raises OSError naming the path otherwise."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "it is a symlink; refusing to follow it", path) from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "it is not a regular file", path)
        if info.st_uid != os.geteuid():
            raise OSError(errno.EPERM, f"it is owned by uid {info.st_uid}, not by us", path)
        if stat.S_IMODE(info.st_mode) != mode:
            os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_private_dir(directory: str) -> None:
    """Create ``directory`` (and missing parents) as 0700 when it does not exist."""
    if not os.path.isdir(directory):
        os.makedirs(directory, mode=0o700, exist_ok=True)


def private_dir_problem(directory: str) -> Optional[str]:
    """Why ``directory`` cannot hold the host's state, or None: it must be a real directory
    (not a symlink), owned by us, and writable by nobody else."""
    try:
        info = os.lstat(directory)
    except FileNotFoundError:
        return None  # created 0700 by whoever needs it first
    except OSError as error:
        return f"the state directory {directory} cannot be checked: {error.strerror or error}"
    if stat.S_ISLNK(info.st_mode):
        target = os.path.realpath(directory)
        info = os.stat(directory)
        where = f"{directory} (a symlink to {target})"
    else:
        where = directory
    if not stat.S_ISDIR(info.st_mode):
        return f"the state directory {where} is not a directory"
    if info.st_uid != os.geteuid():
        return (f"the state directory {where} is owned by uid {info.st_uid}, not by this "
                f"process (uid {os.geteuid()}); refusing to keep state there")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"the state directory {where} is writable by others (mode "
                f"{stat.S_IMODE(info.st_mode):04o}); refusing to keep state there "
                f"(chmod go-w {directory})")
    return None


def warn_if_shared(directory: str, what: str) -> None:
    """One warning per directory when others may write where we must (the CDI, NFD or
    device-info directory): we still write there, never through a planted file."""
    if directory in _warned:
        return
    try:
        info = os.stat(directory)
    except OSError:
        return
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        _warned.add(directory)
        log.warning("%s %s is writable by others (mode %04o): files are created there without "
                    "following symlinks, but anyone who can write it can remove or replace "
                    "them; chmod go-w %s", what, directory, stat.S_IMODE(info.st_mode),
                    directory)
