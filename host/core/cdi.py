"""CDI (Container Device Interface) spec files for resources that ask for them.

The kubelet copies the names Allocate returns into the CRI request; the runtime resolves them
against spec files in /etc/cdi and /var/run/cdi. So the spec must exist before a pod asks,
follow every device change, and go away with the host. Files are written to a temp name in
the same directory and renamed, so a runtime never reads half a file, and each declares the
*lowest* cdiVersion its fields need: a runtime whose CDI library predates the declared
version rejects the whole file.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from typing import Any, Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

from host.core import fileio
from host.core.model import Device

log = logging.getLogger(__name__)

_VENDOR_CLASS = re.compile(r"[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?\Z")
_NAME_BAD = re.compile(r"[^A-Za-z0-9_.:-]")
FILE_PREFIX = "device-plugin-host_"


def cdi_kind(resource: str) -> Tuple[str, str]:
    """(vendor, class) for a resource name, e.g. ("nvidia.com", "gpu")."""
    vendor, _, klass = resource.partition("/")
    return vendor, klass


def kind_error(resource: str) -> Optional[str]:
    """Why a resource name cannot be a CDI kind, or None (CDI wants a letter first)."""
    vendor, klass = cdi_kind(resource)
    for part, what in ((vendor, "vendor (the domain)"), (klass, "class (after '/')")):
        if not _VENDOR_CLASS.match(part):
            return (f"the CDI {what} {part!r} must start with a letter, end with a letter or "
                    "digit and contain only letters, digits, '_', '-' and '.'")
    return None


def device_name(device_id: str) -> str:
    """A CDI device name for an id: letters, digits and ``_.:-``, alphanumeric at both ends."""
    name = _NAME_BAD.sub("_", device_id)
    if not name[:1].isalnum():
        name = "d" + name
    if not name[-1:].isalnum():
        name = name + "0"
    return name


def qualified_names(resource: str, devices: Sequence[Device]) -> List[str]:
    vendor, klass = cdi_kind(resource)
    return [f"{vendor}/{klass}={device_name(d.id)}" for d in devices]


def build_spec(resource: str, devices: Sequence[Device]) -> Optional[Dict[str, Any]]:
    """The spec for a resource's devices; None when there is nothing to describe (a spec
    with no device is invalid, so the file is removed instead)."""
    vendor, klass = cdi_kind(resource)
    version = (0, 3, 0)
    entries = []
    for device in devices:
        edits: Dict[str, Any] = {}
        nodes = []
        for node in device.device_nodes:
            entry: Dict[str, Any] = {"path": node.container_path, "permissions": node.permissions}
            if node.host_path != node.container_path:
                entry["hostPath"] = node.host_path
                version = max(version, (0, 5, 0))
            nodes.append(entry)
        if nodes:
            edits["deviceNodes"] = nodes
        if device.mounts:
            edits["mounts"] = [
                {"hostPath": m.host_path, "containerPath": m.container_path,
                 "options": ["ro", "nosuid", "nodev", "bind"] if m.read_only
                 else ["rw", "nosuid", "nodev", "bind"]}
                for m in device.mounts
            ]
        if not edits:
            # Every CDI device needs non-empty containerEdits; env is joined per container by
            # the host (PCIDEVICE_*=a,b), so it stays in the Allocate response, except here
            # where a device has nothing else to say.
            edits["env"] = [f"{k}={v}" for k, v in sorted(device.env.items())] or [
                f"DEVICE_PLUGIN_HOST_DEVICE={device.id}"]
        name = device_name(device.id)
        if name[0].isdigit():
            version = max(version, (0, 5, 0))
        entries.append({"name": name, "containerEdits": edits})
    if not entries:
        return None
    if "." in klass:
        version = max(version, (0, 6, 0))
    return {
        "cdiVersion": ".".join(map(str, version)),
        "kind": f"{vendor}/{klass}",
        "devices": entries,
    }


class CdiWriter:
    """Keeps one spec file per resource in ``directory`` in step with its devices.

    A spec that should be on disk but is not (the write failed: disk full, read-only mount;
    someone deleted the file, truncated it or replaced it with other content) is remembered
    in ``problems`` and written again by ``retry``, which the host calls on every rescan and
    on every change event in the directory. ``retry`` compares the file's identity (inode,
    size, times) with what the last write left, and reads it only when that differs. Which
    device names the file on disk really holds is tracked too, so the host can tell which
    devices a runtime could resolve until the spec is repaired.

    The host writes specs from a worker thread (JSON and fsync stay off the event loop) and
    reads the state on the loop: one lock keeps them consistent, and once ``close`` (stop)
    has run nothing is written again, whichever thread asks.

    Specs outlive the process: pods hold devices across a host's stop, restart or upgrade,
    and a container restarting in one of them resolves its CDI names from the file. A spec
    is removed only when its resource has no device left (past the vanished grace) or the
    resource leaves the config; a restart replaces each file in place (write and rename),
    so it is never absent.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._written: Dict[str, str] = {}  # resource -> file path
        self._wanted: Dict[str, str] = {}  # resource -> JSON text that should be on disk
        self._on_disk: Dict[str, FrozenSet[str]] = {}  # resource -> device names in the file
        self._wanted_names: Dict[str, FrozenSet[str]] = {}
        # resource -> (inode, size, mtime, ctime) of the file as our last write (or a check
        # that found our text in it) left it; anything else on disk gets read and compared.
        self._stamp: Dict[str, Tuple[int, int, int, int]] = {}
        self.problems: Dict[str, str] = {}  # resource -> why its spec is not (fully) on disk
        self._lock = threading.RLock()
        self.closed = False
        # The device list each spec was last built from: the host hands the same list object
        # until the devices change, so a second update for it costs no JSON at all.
        self._built_from: Dict[str, Sequence[Device]] = {}

    def path_for(self, resource: str) -> str:
        vendor, klass = cdi_kind(resource)
        return os.path.join(self.directory, f"{FILE_PREFIX}{vendor}-{klass}.json")

    def update(self, resource: str, devices: Sequence[Device]) -> bool:
        """Write (or remove) the resource's spec; False when it could not be written (disk
        full, read-only mount): the previous file stays, the error is logged once and the
        write is retried by ``retry``."""
        with self._lock:
            if self.closed:
                return True
            if self._built_from.get(resource) is devices and resource not in self.problems \
                    and resource in self._wanted and os.path.exists(self.path_for(resource)):
                return True
            written = self._update(resource, devices)
            self._built_from[resource] = devices
            return written

    def _update(self, resource: str, devices: Sequence[Device]) -> bool:
        spec = build_spec(resource, devices)
        if spec is None:
            self.remove(resource)
            return True
        text = json.dumps(spec, indent=2, sort_keys=True) + "\n"
        if self._wanted.get(resource) == text and resource not in self.problems and \
                os.path.exists(self.path_for(resource)):
            return True
        self._wanted[resource] = text
        self._stamp.pop(resource, None)  # the file on disk is checked against the new text
        self._wanted_names[resource] = frozenset(d["name"] for d in spec["devices"])
        return self._write(resource)

    def retry(self, resource: str) -> bool:
        """Make sure the spec that should be on disk is there; cheap when it is (one stat).
        True when the state of the resource's spec changed (written now, or found missing)."""
        with self._lock:
            if self.closed:
                return False
            return self._retry(resource)

    def _retry(self, resource: str) -> bool:
        if resource not in self._wanted:
            return False
        path = self.path_for(resource)
        damage = self._damage(resource, path)  # also what a runtime can resolve meanwhile
        if resource not in self.problems:
            if damage is None:
                return False
            log.warning("resource %s: CDI spec %s %s; writing it again", resource, path,
                        damage)
            self.problems[resource] = f"CDI spec {path} {damage}"
        before = self.problems.get(resource)
        self._write(resource)
        return self.problems.get(resource) != before

    def _damage(self, resource: str, path: str) -> Optional[str]:
        """How the file on disk differs from what we wrote, or None when it holds our text.
        Sets ``_on_disk`` to the device names the file really holds."""
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            self._on_disk.pop(resource, None)
            self._stamp.pop(resource, None)
            return "was deleted"
        except OSError as error:
            self._on_disk.pop(resource, None)
            return f"cannot be checked: {error.strerror or error}"
        stamp = (stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
        if self._stamp.get(resource) == stamp:
            return None
        wanted = self._wanted[resource].encode("utf-8")
        data = b""
        if stat.st_size == len(wanted):
            try:
                data = _read_bounded(path, len(wanted) + 1)
            except OSError as error:
                self._on_disk.pop(resource, None)
                return f"cannot be read: {error.strerror or error}"
            if data == wanted:
                self._stamp[resource] = stamp
                return None
        elif stat.st_size and stat.st_size <= 2 * len(wanted) + 4096:
            try:
                data = _read_bounded(path, stat.st_size + 1)
            except OSError:
                data = b""
        self._stamp.pop(resource, None)
        self._on_disk[resource] = _names_in(data, resource)
        if stat.st_size == 0:
            return "was truncated to 0 bytes"
        return "was changed by someone else (it is not the spec this host wrote)"

    def resolvable(self, resource: str, names: Iterable[str]) -> bool:
        """Whether every one of these CDI device names is in the spec file on disk."""
        if resource not in self.problems:
            return True
        on_disk = self._on_disk.get(resource, frozenset())
        return all(name in on_disk for name in names)

    def unresolvable(self, resource: str, devices: Sequence[Device]) -> Dict[str, str]:
        """device id -> reason, for the devices whose CDI name a runtime cannot resolve now."""
        problem = self.problems.get(resource)
        if problem is None:
            return {}
        on_disk = self._on_disk.get(resource, frozenset())
        return {d.id: problem for d in devices if device_name(d.id) not in on_disk}

    def _write(self, resource: str) -> bool:
        path = self.path_for(resource)
        text = self._wanted[resource]
        try:
            os.makedirs(self.directory, mode=0o755, exist_ok=True)
            fileio.warn_if_shared(self.directory, "the CDI directory")
            # 0644: container runtimes (and `cdi list`) read it.
            fileio.write_atomic(path, text, mode=0o644, durable=True)
        except OSError as error:
            if not os.path.exists(path):
                self._on_disk.pop(resource, None)
            reason = (f"CDI spec {path} could not be written: "
                      f"{error.strerror or error}")
            if self.problems.get(resource) != reason:
                log.error("resource %s: cannot write CDI spec %s: %s; the previous spec (if "
                          "any) stays, retried at every rescan", resource, path, error)
            self.problems[resource] = reason
            return False
        if resource in self.problems:
            log.info("resource %s: CDI spec %s written", resource, path)
            del self.problems[resource]
        self._written[resource] = path
        self._on_disk[resource] = self._wanted_names[resource]
        try:
            stat = os.stat(path)
            self._stamp[resource] = (stat.st_ino, stat.st_size, stat.st_mtime_ns,
                                     stat.st_ctime_ns)
        except OSError:
            self._stamp.pop(resource, None)  # the next check reads and compares the text
        return True

    def remove(self, resource: str) -> None:
        with self._lock:
            self._remove(resource)

    def _remove(self, resource: str) -> None:
        self._built_from.pop(resource, None)
        path = self._written.pop(resource, None) or self.path_for(resource)
        self._wanted.pop(resource, None)
        self._wanted_names.pop(resource, None)
        self._on_disk.pop(resource, None)
        self._stamp.pop(resource, None)
        self.problems.pop(resource, None)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as error:
            log.error("resource %s: cannot remove CDI spec %s: %s", resource, path, error)

    def close(self) -> None:
        """Stop writing (the host stopped); every spec stays on disk for the pods that hold
        its devices. Waits for a write in progress."""
        with self._lock:
            self.closed = True


def _read_bounded(path: str, limit: int) -> bytes:
    """At most ``limit`` bytes of a file, without following a symlink planted at its name."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        chunks = []
        while limit > 0:
            chunk = os.read(fd, min(limit, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            limit -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _names_in(data: bytes, resource: str) -> FrozenSet[str]:
    """The device names a spec file for ``resource`` declares (none when it is not one)."""
    try:
        spec = json.loads(data.decode("utf-8"))
    except ValueError:
        return frozenset()
    vendor, klass = cdi_kind(resource)
    if not isinstance(spec, dict) or spec.get("kind") != f"{vendor}/{klass}" or \
            not isinstance(spec.get("devices"), list):
        return frozenset()
    return frozenset(d["name"] for d in spec["devices"]
                     if isinstance(d, dict) and isinstance(d.get("name"), str))
