"""Plain-socket checks of the plugin directory, for reasons grpc would not give.

grpc's bind only says "Failed to bind" (and prints the reason on stderr), and a connect to a
dead kubelet's left-over socket costs a whole Register attempt. A plain bind, connect or stat
first gets the kernel's own reason in one line.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from typing import Optional


class PluginDirError(OSError):
    """Our socket cannot be created in the plugin directory (read-only, full, not a directory,
    no permission): an operator's problem, told in one line with the OS reason, and retried."""


def bind_problem(path: str) -> Optional[str]:
    """Bind a plain unix socket at ``path`` first (then remove it): the kernel's own reason
    (EROFS, ENOSPC, EACCES, ENOTDIR) comes back as a clean error, where grpc's bind would only
    say "Failed to bind" and print the reason on stderr."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.bind(path)
    except OSError as error:
        return os.strerror(error.errno) if error.errno else str(error)
    finally:
        probe.close()
    try:
        os.unlink(path)
    except OSError as error:
        return os.strerror(error.errno) if error.errno else str(error)
    return None


def accepts(path: str) -> Optional[str]:
    """None if something accepts connections on ``path``; else the OS reason. Non-blocking:
    a unix socket connect either succeeds, is refused, or (backlog full) says EAGAIN."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
    try:
        sock.connect(path)
    except BlockingIOError:
        return None  # alive, only busy
    except OSError as error:
        return os.strerror(error.errno) if error.errno else str(error)
    finally:
        sock.close()
    return None


def dir_problem(path: str) -> str:
    """Why ``path`` cannot hold our sockets as a directory ("" when it is one)."""
    try:
        st = os.stat(path)
    except OSError as error:
        return f"{os.strerror(error.errno) if error.errno else error}"
    if not stat.S_ISDIR(st.st_mode):
        kind = "regular file" if stat.S_ISREG(st.st_mode) else "non-directory"
        return f"{os.strerror(errno.ENOTDIR)} (it is a {kind})"
    return ""
