"""Link state changes from rtnetlink (RTMGRP_LINK) on the event loop.

``ip link set ... up/down`` and a cable pulled change a netdev's flags and operstate without
any uevent (only link add/remove have one), so drivers that watch ``net`` would see
a PF going down only at the safety rescan. The kernel announces every link change as
RTM_NEWLINK/RTM_DELLINK to the RTMGRP_LINK multicast group; this source listens there and
emits ``"net"`` when a link appears, vanishes, or its up/running/lower-up flags or operstate
change (a rescan is the truth; the message only triggers it).

Why a raw ``AF_NETLINK`` socket and not pyroute2: we need one multicast group and three
fields of one message type; the socket is non-blocking, so its fd goes straight to
``loop.add_reader`` (no thread, no polling, nothing to wake an idle host), and parsing the
fixed ``nlmsghdr``/``ifinfomsg`` headers plus two attributes is a few lines of ``struct``.
pyroute2 would add a large dependency (and its own socket/thread machinery) for that.
Layouts: include/uapi/linux/netlink.h, rtnetlink.h, if_link.h.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import struct
from typing import Callable, Dict, Optional, Tuple

log = logging.getLogger(__name__)

NETLINK_ROUTE = 0
RTMGRP_LINK = 0x1
RTM_NEWLINK = 16
RTM_DELLINK = 17
NLMSG_ERROR = 2
NLMSG_OVERRUN = 4
IFLA_IFNAME = 3
IFLA_OPERSTATE = 16
IFF_UP = 0x1
IFF_RUNNING = 0x40
IFF_LOWER_UP = 0x10000
_WATCHED_FLAGS = IFF_UP | IFF_RUNNING | IFF_LOWER_UP

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_IFINFOMSG = struct.Struct("=BxHiII")  # family, pad, type, index, flags, change
_RTATTR = struct.Struct("=HH")  # len, type
_RECV_BYTES = 65536
_RCVBUF = 1024 * 1024

LinkState = Tuple[int, int]  # (flags & watched, operstate)


def _align(n: int) -> int:
    return (n + 3) & ~3


def parse_links(data: bytes) -> list:
    """(message type, ifindex, name, flags, operstate) for each link message in ``data``;
    ``None`` entries for an overrun/error message (events may be lost)."""
    out: list = []
    offset = 0
    while offset + _NLMSGHDR.size <= len(data):
        length, kind, _flags, _seq, _pid = _NLMSGHDR.unpack_from(data, offset)
        if length < _NLMSGHDR.size or offset + length > len(data):
            break
        body = offset + _NLMSGHDR.size
        if kind in (RTM_NEWLINK, RTM_DELLINK) and length >= _NLMSGHDR.size + _IFINFOMSG.size:
            _family, _type, index, flags, _change = _IFINFOMSG.unpack_from(data, body)
            name, operstate = "", -1
            attr = body + _IFINFOMSG.size
            end = offset + length
            while attr + _RTATTR.size <= end:
                alen, atype = _RTATTR.unpack_from(data, attr)
                if alen < _RTATTR.size:
                    break
                value = data[attr + _RTATTR.size : attr + alen]
                if atype == IFLA_IFNAME:
                    name = value.split(b"\0", 1)[0].decode("utf-8", "replace")
                elif atype == IFLA_OPERSTATE and value:
                    operstate = value[0]
                attr += _align(alen)
            out.append((kind, index, name, flags, operstate))
        elif kind in (NLMSG_ERROR, NLMSG_OVERRUN):
            out.append(None)
        offset += _align(length)
    return out


class LinkSource:
    """An EventSource (see host.triggers.uevents) of ``"net"`` events for link state changes."""

    def __init__(self) -> None:
        self._sock: Optional[socket.socket] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._known: Dict[int, LinkState] = {}

    def start(self, emit: Callable[[str], None]) -> None:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK
                             | socket.SOCK_CLOEXEC, NETLINK_ROUTE)
        try:
            try:  # a burst (many VFs' links flapping) must not overflow the queue
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RCVBUF)
            except OSError:
                pass
            sock.bind((0, RTMGRP_LINK))
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._readable, emit)
        log.info("watching rtnetlink link changes (RTMGRP_LINK)")

    def _readable(self, emit: Callable[[str], None]) -> None:
        sock = self._sock
        if sock is None:
            return
        changed = False
        while True:
            try:
                data = sock.recv(_RECV_BYTES)
            except BlockingIOError:
                break
            except InterruptedError:
                continue
            except OSError as error:
                if error.errno == errno.ENOBUFS:  # the queue overflowed: changes were lost
                    log.warning("rtnetlink: %s; rescanning network devices", error)
                    self._known.clear()
                    changed = True
                    continue
                log.warning("rtnetlink: %s", error)
                break
            if not data:
                break
            for message in parse_links(data):
                if message is None:
                    changed = True
                    continue
                changed |= self._note(*message)
        if changed:
            emit("net")

    def _note(self, kind: int, index: int, name: str, flags: int, operstate: int) -> bool:
        """Whether this message changes what a scan would see (a new, gone or flipped link);
        RTM_NEWLINK also comes for MTU, address and other changes a health scan ignores."""
        if kind == RTM_DELLINK:
            self._known.pop(index, None)
            log.debug("rtnetlink: link %s (%d) removed", name, index)
            return True
        state = (flags & _WATCHED_FLAGS, operstate)
        before = self._known.get(index)
        self._known[index] = state
        if before == state:
            return False
        log.debug("rtnetlink: link %s (%d) flags %#x operstate %d", name, index, flags,
                  operstate)
        return True

    def close(self) -> None:
        if self._sock is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        self._loop = None
