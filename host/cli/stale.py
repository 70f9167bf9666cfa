"""What an earlier run of the host left behind, removed when a new one starts.

A host killed with SIGKILL (or an OOM kill, a power cut) leaves its unix sockets in the
plugin directory, and a host restarted with a resource removed from its config would never
again touch that resource's CDI spec or SR-IOV device-info files. At start, the host that
holds the host lock (so no other host of ours is running beside it) removes:

* sockets in the plugin directory named like ours (``host.kubelet.socket_names.SOCKET_NAME``) on
  which nothing accepts a connection (a live server, whoever runs it, is never touched);
* per-resource CDI specs of ours (``<FILE_PREFIX><vendor>-<class>.json`` whose ``kind``
  names that same resource) for resources the config no longer serves with ``cdi``; specs of
  DRA claims carry the claim's uid in their name and are left to the DRA checkpoint;
* device-info files of resources that no longer write them. Those files carry no mark of
  ours (the SR-IOV network device plugin writes the same names into the same directory), so
  the host records which (directory, resource) pairs it wrote for in its state directory
  (``device-info-resources.json``) and removes only the files of recorded pairs.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from typing import Iterable, List, Optional, Sequence, Set, Tuple

from host.config.settings import Config
from host.core import fileio
from host.core.cdi import FILE_PREFIX, CdiWriter
from host.core.model import ResourceConfig
from host.kubelet.socket_names import SOCKET_NAME
from host.kubelet.socket_probe import accepts
from host.outputs import devinfo

log = logging.getLogger(__name__)

DEVICE_INFO_RECORD = "device-info-resources.json"
_MAX_SPEC_BYTES = 16 * 2**20  # read to learn a spec's kind; a bigger file is not ours


def state_dir(config: Config) -> str:
    """Where the host keeps its own state: the drain file's directory."""
    return os.path.dirname(os.path.abspath(config.host.drain_file))


def stale_sockets(plugin_dir: str) -> List[str]:
    """Paths of sockets named like ours in ``plugin_dir`` that nothing serves."""
    try:
        names = os.listdir(plugin_dir)
    except OSError:
        return []
    out = []
    for name in sorted(names):
        if not SOCKET_NAME.match(name):
            continue
        path = os.path.join(plugin_dir, name)
        try:
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                continue
        except OSError:
            continue
        if accepts(path) is not None:  # refused: its server is gone
            out.append(path)
    return out


def _spec_kind(path: str) -> Optional[str]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MAX_SPEC_BYTES:
            return None
        data = b""
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            data += chunk
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        spec = json.loads(data)
    except ValueError:
        return None
    kind = spec.get("kind") if isinstance(spec, dict) else None
    return kind if isinstance(kind, str) else None


def stale_cdi_specs(cdi_dir: str, served: Set[str]) -> List[str]:
    """Paths of our per-resource CDI specs in ``cdi_dir`` whose resource is not in ``served``."""
    try:
        names = os.listdir(cdi_dir)
    except OSError:
        return []
    writer = CdiWriter(cdi_dir)
    out = []
    for name in sorted(names):
        if not (name.startswith(FILE_PREFIX) and name.endswith(".json")):
            continue
        path = os.path.join(cdi_dir, name)
        kind = _spec_kind(path)
        if kind is None or "/" not in kind or kind in served:
            continue
        if writer.path_for(kind) == path:  # exactly the name we give that resource's spec
            out.append(path)
    return out


Pair = Tuple[str, str]  # (device-info directory, resource)


def _read_record(path: str) -> Set[Pair]:
    try:
        with open(path, encoding="utf-8") as handle:
            entries = json.load(handle)
    except (OSError, ValueError):
        return set()
    if not isinstance(entries, list):
        return set()
    return {(e[0], e[1]) for e in entries
            if isinstance(e, list) and len(e) == 2 and all(isinstance(x, str) for x in e)}


def device_info_pairs(resources: Iterable[ResourceConfig]) -> Set[Pair]:
    return {(os.path.abspath(devinfo.directory_of(r)), r.name)
            for r in resources if devinfo.enabled(r)}


def remove_stale_device_info(directory: str, resources: Sequence[ResourceConfig]) -> List[str]:
    """Remove the files of recorded (directory, resource) pairs the config no longer has;
    the record then holds exactly the current pairs. Returns the paths removed."""
    path = os.path.join(directory, DEVICE_INFO_RECORD)
    recorded = _read_record(path)
    current = device_info_pairs(resources)
    removed = []
    for info_dir, resource in sorted(recorded - current):
        for device_id in devinfo.owned(info_dir, resource):
            if devinfo.remove(info_dir, resource, device_id):
                removed.append(os.path.join(info_dir, devinfo.file_name(resource, device_id)))
    if recorded != current and (recorded or current):
        fileio.make_private_dir(directory)
        fileio.write_atomic(path, json.dumps(sorted(map(list, current))) + "\n", mode=0o600,
                            durable=True)
    return removed


def remove_stale(config: Config) -> List[str]:
    """Everything an earlier run of ours left that this config does not serve. Only for the
    host that holds the host lock. Returns the paths removed; each is logged."""
    removed: List[str] = []
    for path in stale_sockets(config.host.plugin_dir):
        try:
            os.unlink(path)
        except OSError as error:
            log.warning("cannot remove the stale socket %s: %s", path, error.strerror or error)
            continue
        removed.append(path)
    served = {r.name for r in config.resources if r.cdi}
    for path in stale_cdi_specs(config.host.cdi_dir, served):
        try:
            os.unlink(path)
        except OSError as error:
            log.warning("cannot remove the stale CDI spec %s: %s", path, error.strerror or error)
            continue
        removed.append(path)
    try:
        removed.extend(remove_stale_device_info(state_dir(config), config.resources))
    except OSError as error:
        log.warning("cannot update the record of device-info files in %s: %s",
                    state_dir(config), error.strerror or error)
    for path in removed:
        log.info("removed %s, left by an earlier run for something no longer served", path)
    return removed
