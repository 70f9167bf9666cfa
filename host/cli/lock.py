"""One host per plugin directory.

Two hosts on one kubelet plugin directory (a DaemonSet rolled out on a node that also has the
Debian package running, or a second `run` by hand) each see the other's sockets as stale and
re-register over each other: the kubelet's allocatable flaps to 0. So `run` takes an exclusive
flock first and a second process stops with exit 2, naming the holder's PID and how it was
started.

The lock file lives in the host's state directory (the drain file's directory,
``/var/lib/device-plugin-host`` by default; the DaemonSet mounts it from the node, as the
Debian package's service uses it), named after the plugin directory it guards
(``host-<path>-<crc>.lock``). Not in the plugin directory: the kubelet and operators wipe and
re-create that directory (``kubeadm reset``, a re-mounted kubelet root), which dropped the lock
with it and let a second host start beside the first, and a file held open in it pins the
deleted directory's inode, which hid its deletion from the host's own watch. Versions before
this one locked ``<plugin_dir>/.device-plugin-host/host.lock``; a host still running such a
version is found there at start (``legacy_lock_path``) and refused the same way, but the old
file is only probed, never held.

An upgrade hands the directory over instead of refusing (``HostLock.acquire_or_follow``): a
new host that finds the lock held takes the *successor* lock beside it
(``host-<path>-<crc>.lock.next``) and serves and registers beside the old one: device plugin
resources on sockets of its own (the kubelet's new Register replaces the old endpoint), DRA
drivers with registration sockets of its own (the kubelet keeps both and calls the newer).
Once everything is registered it marks its record ``"state": "ready"`` (``announce_ready``).
The holder sees that (``successor``), drains (stops taking calls, deregisters, removes only its
own sockets: CDI specs, ResourceSlices, the DRA checkpoint, node labels and device-info files
are what the successor serves now) and releases the lock; the successor then takes it
(``take_over``) and drops the successor lock. A third host finds both held and exits 2, as
before. A successor that dies before it is ready drops its flock with its process: the holder
sees no successor and keeps serving.

The file is opened without following a symlink, created 0600, and must be a regular file of
ours. It is never deleted: unlinking a lock file while another process may have it open lets
two processes hold "the" lock on two different inodes. The holder checks now and then that
the path still names the inode it locked (``still_held``). Its contents (JSON: pid, how,
since, plugin_dir) are only a description; the flock is the truth.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import time
import zlib
from typing import Dict, Mapping, NamedTuple, Optional, Tuple

LOCK_DIR = ".device-plugin-host"  # the legacy location, in the plugin directory
SUCCESSOR_SUFFIX = ".next"
LOCK_FILE = "host.cli.lock"
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._")


def state_dir_of(drain_file: str) -> str:
    """The host's state directory: where the drain marks (and the host lock) live."""
    return os.path.dirname(drain_file) or "."


def lock_path(plugin_dir: str, state_dir: str) -> str:
    """The lock guarding ``plugin_dir``, in the state directory: a readable name with a
    CRC-32 of the whole path (two plugin directories never share one lock)."""
    path = os.path.abspath(plugin_dir)
    readable = "".join(c if c in _NAME_CHARS else "-" for c in path.strip("/"))[-80:]
    digest = f"{zlib.crc32(os.fsencode(path)):08x}"
    return os.path.join(state_dir, f"host-{readable or 'root'}-{digest}.lock")


def legacy_lock_path(plugin_dir: str) -> str:
    """Where versions before the state-directory lock kept it."""
    return os.path.join(plugin_dir, LOCK_DIR, LOCK_FILE)


class Holder(NamedTuple):
    """Who holds the lock, as it described itself."""

    pid: Optional[int]
    how: str
    since: str
    state: str = ""  # a successor's: "starting", then "ready"

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

    def __init__(self, plugin_dir: str, state_dir: str) -> None:
        self.plugin_dir = plugin_dir
        self.state_dir = state_dir
        self.path = lock_path(plugin_dir, state_dir)
        self.successor_path = self.path + SUCCESSOR_SUFFIX
        self._fd: Optional[int] = None
        self._inode: Optional[Tuple[int, int]] = None
        self._next_fd: Optional[int] = None  # the successor lock, while we wait for the lock
        self._record: Dict[str, object] = {}
        self.predecessor: Optional[Holder] = None  # whom we follow, as a successor

    @property
    def following(self) -> bool:
        """Whether this host is a successor still waiting for the holder to hand over."""
        return self._next_fd is not None

    def acquire_or_follow(self, environ: Mapping[str, str] = os.environ) -> bool:
        """Take the lock (True), or, when another host holds it, the successor lock (False:
        serve beside it, ``announce_ready`` once registered, then ``take_over``). Raises
        LockHeld when the successor lock is held too (a third host) or when an older
        version holds the legacy lock (it knows no hand-over); OSError as ``acquire``."""
        try:
            self.acquire(environ)
            return True
        except LockHeld as held:
            if _held_by_another(legacy_lock_path(self.plugin_dir)) is not None:
                raise
            holder = held.holder
        fd = _open_lock_file(self.successor_path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise LockHeld(self.plugin_dir, holder) from None
            raise
        self._next_fd = fd
        self.predecessor = holder
        self._record = _record(environ, self.plugin_dir)
        self._write(fd, {**self._record, "state": "starting"})
        return False

    def announce_ready(self) -> None:
        """As a successor: everything is served and registered; the holder may drain."""
        if self._next_fd is not None:
            self._write(self._next_fd, {**self._record, "state": "ready"})

    def take_over(self) -> bool:
        """As a successor: take the lock if the holder released it (non-blocking); True once
        this host holds it (the successor lock is dropped then)."""
        if self._next_fd is None:
            return self.held
        fd = _open_lock_file(self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._write(fd, self._record)
        st = os.fstat(fd)
        self._fd, self._inode = fd, (st.st_dev, st.st_ino)
        next_fd, self._next_fd = self._next_fd, None
        os.ftruncate(next_fd, 0)  # no stale "ready" for the next holder to read
        os.close(next_fd)
        return True

    def successor(self) -> Optional[Holder]:
        """As the holder: the host waiting to take over (with its ``state``), if one is."""
        return _held_by_another(self.successor_path)

    @staticmethod
    def _write(fd: int, record: Mapping[str, object]) -> None:
        data = (json.dumps(dict(record), sort_keys=True) + "\n").encode("utf-8")
        # Overwrite in place, then cut: never an empty file for a reader to find.
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))

    def acquire(self, environ: Mapping[str, str] = os.environ) -> None:
        """Take the lock or raise LockHeld (also when an older version holds the legacy lock
        in the plugin directory); OSError when the state directory cannot hold one
        (read-only, a file, a lock path that is not a regular file of ours). The state
        directory is created 0700 when missing; the plugin directory is never touched."""
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        fd = _open_lock_file(self.path)
        try:
            st = os.fstat(fd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise LockHeld(self.plugin_dir, read_holder_file(self.path)) from None
            raise
        legacy = _held_by_another(legacy_lock_path(self.plugin_dir))
        if legacy is not None:
            os.close(fd)  # an older version serves this directory: it keeps it
            raise LockHeld(self.plugin_dir, legacy)
        self._record = _record(environ, self.plugin_dir)
        self._write(fd, self._record)
        self.release()  # a lock taken again (still_held said it was lost): the old fd goes
        self._fd = fd
        self._inode = (st.st_dev, st.st_ino)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def still_held(self) -> bool:
        """Whether the lock path still names the file this process locked (someone may have
        deleted or replaced it: then a second host could lock the new file)."""
        if self._fd is None:
            return False
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._inode

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays (see above)
            self._fd = None
            self._inode = None
        if self._next_fd is not None:
            os.close(self._next_fd)
            self._next_fd = None


def _record(environ: Mapping[str, str], plugin_dir: str) -> Dict[str, object]:
    return {"pid": os.getpid(), "how": started_by(environ),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "plugin_dir": os.path.abspath(plugin_dir)}


def _open_lock_file(path: str) -> int:
    """A lock file opened for writing without following a symlink, created 0600; OSError
    when it is not a regular file of ours."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise OSError(errno.EPERM, f"{path} is not a regular file owned by us")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_holder_file(path: str, wait_s: float = 0.5) -> Holder:
    """The lock file's record. Called by someone who just found the lock taken: the holder
    takes the flock first and writes its record right after, so a record without a PID is
    read again for up to ``wait_s`` before it is reported as unknown."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, encoding="utf-8", errors="replace") as handle:
                record = json.loads(handle.read(65536) or "{}")
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
                  since=str(record.get("since") or ""), state=str(record.get("state") or ""))


def _held_by_another(path: str) -> Optional[Holder]:
    """The holder of the lock file at ``path`` when some process holds it; None when nobody
    does or there is no such file. Opened read-only without following a symlink, and only
    probed: a shared flock taken and dropped at once."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
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


def running_host(plugin_dir: str, state_dir: str) -> Optional[Holder]:
    """The host holding ``plugin_dir``, if one does (for check-config and discover)."""
    return (_held_by_another(lock_path(plugin_dir, state_dir))
            or _held_by_another(legacy_lock_path(plugin_dir)))
