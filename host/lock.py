"""One host per plugin directory.

Two hosts on one kubelet plugin directory (a DaemonSet rolled out on a node that also has the
Debian package running, or a second `run` by hand) each see the other's sockets as stale and
re-register over each other: the kubelet's allocatable flaps to 0. So `run` takes an exclusive
flock first and a second process stops with exit 2, naming the holder's PID and how it was
started. The lock is a file in a subdirectory of the plugin directory: the directory both
installations share by definition (the DaemonSet mounts it), while the kubelet's start-up
cleanup deletes only files directly in it (1.33+: only sockets), never a subdirectory's.

The lock file is never deleted: unlinking a lock file while another process may have it open
lets two processes hold "the" lock on two different inodes. Its contents (JSON: pid, how,
since) are only a description; the flock is the truth.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from typing import Dict, Mapping, NamedTuple, Optional

LOCK_DIR = ".device-plugin-host"
LOCK_FILE = "host.lock"


def lock_path(plugin_dir: str) -> str:
    return os.path.join(plugin_dir, LOCK_DIR, LOCK_FILE)


class Holder(NamedTuple):
    """Who holds the lock, as it described itself."""

    pid: Optional[int]
    how: str
    since: str

    def describe(self) -> str:
        pid = f"PID {self.pid}" if self.pid is not None else "an unknown PID"
        since = f", since {self.since}" if self.since else ""
        return f"{pid}, started by {self.how}{since}"


class LockHeld(Exception):
    """Another host holds the plugin directory; ``str()`` is the operator's line."""

    def __init__(self, plugin_dir: str, holder: Holder) -> None:
        super().__init__(
            f"another device-plugin-host already serves {plugin_dir} ({holder.describe()}); "
            "two hosts on one plugin directory re-register over each other and the kubelet's "
            f"allocatable drops to 0: stop that one first{_stop_hint(holder.how)}")
        self.plugin_dir = plugin_dir
        self.holder = holder


def started_by(environ: Mapping[str, str] = os.environ, proc: str = "/proc") -> str:
    """How this process was started, in an operator's words."""
    if environ.get("INVOCATION_ID"):  # set by systemd for every unit it starts
        unit = _systemd_unit(proc)
        return f"systemd unit {unit}" if unit else "a systemd unit"
    if environ.get("KUBERNETES_SERVICE_HOST"):  # set in every pod's containers
        pod = environ.get("POD_NAME") or environ.get("HOSTNAME") or "?"
        namespace = environ.get("POD_NAMESPACE") or _pod_namespace()
        where = f"{namespace}/{pod}" if namespace else pod
        return f"Kubernetes pod {where} (DaemonSet)"
    try:
        with open(os.path.join(proc, "self", "cmdline"), "rb") as handle:
            argv = [part.decode("utf-8", "replace") for part in handle.read().split(b"\0") if part]
    except OSError:
        argv = []
    return "hand: " + " ".join(argv)[:200] if argv else "hand"


def _systemd_unit(proc: str) -> Optional[str]:
    """The unit from our cgroup path (``0::/system.slice/device-plugin-host.service``)."""
    try:
        with open(os.path.join(proc, "self", "cgroup"), encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    for line in lines:
        for part in reversed(line.rpartition(":")[2].split("/")):
            if part.endswith((".service", ".scope")):
                return part
    return None


def _pod_namespace() -> Optional[str]:
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace",
                  encoding="utf-8") as handle:
            return handle.read().strip() or None
    except OSError:
        return None


def _stop_hint(how: str) -> str:
    if how.startswith("systemd unit "):
        return f" (systemctl stop {how[len('systemd unit '):]})"
    if how.startswith("Kubernetes pod"):
        return " (remove the DaemonSet from this node, or stop the systemd unit, not both)"
    return ""


class HostLock:
    """The exclusive lock on a plugin directory, held while the process runs."""

    def __init__(self, plugin_dir: str) -> None:
        self.plugin_dir = plugin_dir
        self.path = lock_path(plugin_dir)
        self._fd: Optional[int] = None

    def acquire(self, environ: Mapping[str, str] = os.environ) -> None:
        """Take the lock or raise LockHeld; OSError when the directory cannot hold one
        (missing, read-only, a file). The plugin directory itself is never created here:
        it is the kubelet's, and serving reports its problems."""
        try:
            os.mkdir(os.path.dirname(self.path), 0o700)
        except FileExistsError:
            pass
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise LockHeld(self.plugin_dir, read_holder_file(self.path)) from None
            raise
        record: Dict[str, object] = {
            "pid": os.getpid(), "how": started_by(environ),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        data = (json.dumps(record, sort_keys=True) + "\n").encode("utf-8")
        # Overwrite in place, then cut: never an empty file for a reader to find.
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays (see above)
            self._fd = None


def read_holder_file(path: str, wait_s: float = 0.5) -> Holder:
    """The lock file's record. Called by someone who just found the lock taken: the holder
    takes the flock first and writes its record right after, so a record without a PID is
    read again for up to ``wait_s`` before it is reported as unknown."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(path, encoding="utf-8", errors="replace") as handle:
                record = json.loads(handle.read() or "{}")
        except (OSError, ValueError):
            record = {}
        if not isinstance(record, dict):
            record = {}
        pid = record.get("pid")
        if isinstance(pid, int) or time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    return Holder(pid=pid if isinstance(pid, int) else None,
                  how=str(record.get("how") or "an unknown way"),
                  since=str(record.get("since") or ""))


def running_host(plugin_dir: str) -> Optional[Holder]:
    """The host holding ``plugin_dir``, if one does (for check-config and discover)."""
    path = lock_path(plugin_dir)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return read_holder_file(path)
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
