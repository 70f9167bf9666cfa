"""Linux inotify on the asyncio loop, through ctypes: file-system events without polling.

The host must notice within milliseconds that the kubelet wiped its socket or created a new
kubelet.sock. inotify's file descriptor goes to ``loop.add_reader``; nothing wakes up unless
the kernel reports an event, so an idle host costs no CPU.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import struct
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = getattr(os, "O_CLOEXEC", 0o2000000)

_EVENT = struct.Struct("iIII")

log = logging.getLogger(__name__)

_libc = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        try:  # glibc's soname: find_library would run ``ldconfig -p`` in a subprocess
            _libc = ctypes.CDLL("libc.so.6", use_errno=True)
        except OSError:  # musl and others
            from ctypes.util import find_library

            _libc = ctypes.CDLL(find_library("c") or "libc.so.6", use_errno=True)
        _libc.inotify_init1.argtypes = [ctypes.c_int]
        _libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        _libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
    return _libc


class Event(NamedTuple):
    wd: int
    mask: int
    name: str


class Inotify:
    """One inotify instance; ``callback`` gets each batch of events on the loop thread."""

    def __init__(self, callback: Callable[[List[Event]], None]) -> None:
        fd = _lib().inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self.fd = fd
        self._callback = callback
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.fd, self._on_readable)

    def add_watch(self, path: str, mask: int) -> int:
        wd = _lib().inotify_add_watch(self.fd, os.fsencode(path), mask)
        if wd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_add_watch {path}: {os.strerror(err)}", path)
        return wd

    def remove_watch(self, wd: int) -> None:
        _lib().inotify_rm_watch(self.fd, wd)  # EINVAL when already gone: fine

    def _on_readable(self) -> None:
        events: List[Event] = []
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            except OSError as error:
                if error.errno == errno.EINTR:
                    continue
                raise
            offset = 0
            while offset + _EVENT.size <= len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
                offset += _EVENT.size
                raw = data[offset : offset + length]
                offset += length
                events.append(Event(wd, mask, os.fsdecode(raw.rstrip(b"\0"))))
        if events:
            self._callback(events)

    def close(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.fd)
            self._loop = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class DirectoryWatch:
    """Watch one directory's entries, surviving the directory's deletion and re-creation.

    While the directory is missing, the nearest existing ancestor is watched for the next path
    component to appear, so a host started before the kubelet (or whose plugin dir was deleted)
    picks the directory up the moment it exists. While it is there, its parent is watched for
    the directory's own name too: a directory deleted while some process keeps a file in it
    open sends no IN_DELETE_SELF (the open file pins the inode), so only the parent's
    IN_DELETE / IN_CREATE tells that the path now names another directory; the watch then
    moves to the directory the path names (compared by st_dev and st_ino).
    ``on_change(names)`` gets the entry names that changed; ``None`` means "re-check
    everything": the directory itself appeared, vanished or was replaced, or the kernel's event
    queue overflowed (``IN_Q_OVERFLOW``: events were lost, so any entry may have changed
    unseen). Writes in place (``IN_MODIFY``: a file truncated or rewritten without being
    re-created) are reported like any other entry change.
    """

    ENTRY_MASK = (IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_ATTRIB
                  | IN_CLOSE_WRITE | IN_MODIFY)
    SELF_MASK = IN_DELETE_SELF | IN_MOVE_SELF
    PARENT_MASK = IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | SELF_MASK

    def __init__(self, path: str, on_change: Callable[[Optional[List[str]]], None]) -> None:
        self.path = os.path.abspath(path)
        self._on_change = on_change
        self._inotify = Inotify(self._on_events)
        self._watches: Dict[int, str] = {}
        self._parent = os.path.dirname(self.path)
        self._name = os.path.basename(self.path)
        self._identity: Optional[Tuple[int, int]] = None  # (st_dev, st_ino) being watched
        self.present = False
        self.overflows = 0  # IN_Q_OVERFLOW events seen: each one became a full re-check

    def start(self) -> None:
        self._inotify.start()
        self._arm()

    def close(self) -> None:
        self._inotify.close()
        self._watches.clear()

    def _arm(self) -> None:
        """(Re)place the watches for the current state of the path."""
        for wd in list(self._watches):
            self._inotify.remove_watch(wd)
        self._watches.clear()
        self._identity = None
        try:
            wd = self._inotify.add_watch(self.path, self.ENTRY_MASK | self.SELF_MASK | IN_ONLYDIR)
            self._watches[wd] = self.path
            self.present = True
            self._identity = _identity(self.path)
            if self._parent != self.path:
                try:
                    wd = self._inotify.add_watch(self._parent, self.PARENT_MASK | IN_ONLYDIR)
                    self._watches[wd] = self._parent
                except OSError:
                    pass  # the directory's own events still come; only replacement is missed
            return
        except OSError:
            self.present = False
        ancestor = os.path.dirname(self.path)
        while True:
            try:
                wd = self._inotify.add_watch(
                    ancestor, IN_CREATE | IN_MOVED_TO | self.SELF_MASK | IN_ONLYDIR
                )
                self._watches[wd] = ancestor
                break
            except OSError:
                if ancestor == "/":
                    raise
                ancestor = os.path.dirname(ancestor)
        # The path may have appeared between the failed watch and the ancestor's watch.
        if os.path.isdir(self.path):
            self._arm()

    def _on_events(self, events: List[Event]) -> None:
        names: List[str] = []
        rearm = False
        overflow = False
        for event in events:
            if event.mask & IN_Q_OVERFLOW:  # wd is -1: it belongs to no watch, but to all
                overflow = True
                continue
            watched = self._watches.get(event.wd)
            if watched is None:
                continue
            if watched == self.path:
                if event.mask & (self.SELF_MASK | IN_IGNORED):
                    rearm = True
                elif event.name:
                    names.append(event.name)
            elif self.present and watched == self._parent and event.name:
                # The parent, for our directory's name: deleted, renamed or made anew.
                if event.name == self._name and _identity(self.path) != self._identity:
                    rearm = True
            else:
                rearm = True  # something appeared along the path, or the ancestor went away
        was_present = self.present
        if overflow:
            self.overflows += 1
            log.warning("inotify: the event queue for %s overflowed (events were lost); "
                        "re-checking everything it watches", self.path)
            rearm = True  # the directory itself may have gone and come back unseen
        if rearm:
            self._arm()
        if overflow or (rearm and (self.present or was_present)):
            self._on_change(None)
        elif names:
            self._on_change(names)


def _identity(path: str) -> Optional[Tuple[int, int]]:
    """(st_dev, st_ino) of the directory at ``path`` now; None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino
