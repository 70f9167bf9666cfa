"""The names of the host's unix sockets, and the longest one it can ever create.

grpcio refuses to bind unix socket paths of 106 and 107 bytes, although sun_path
holds 107 plus the NUL. Every name is bounded (readable prefix cut, fixed-size hash, token and
generation field), so config validation can check ``plugin_dir`` once, at start, against the
longest path the host will bind, instead of a resource that never binds and retries forever.
"""

from __future__ import annotations

import os
import re
import zlib
from typing import Mapping, Optional

#: The kubelet's registration socket, in its device plugin directory.
KUBELET_SOCKET = "kubelet.sock"
#: The kubelet's PodResources socket (host.kubelet.protocol re-exports it; config reads it from
# here, : without loading the protocol modules).
POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
#: sun_path is 108 bytes including the terminating NUL that gRPC and the kubelet rely on.
MAX_SOCKET_PATH = 107
#: The longest unix socket path grpcio binds (bytes).
GRPC_MAX_SOCKET_PATH = 105
READABLE_MAX = 20
TOKEN_MAX = 10  # pid (pid_max <= 2**22: at most 6 hex digits) + 4 random hex digits
GENERATION_WRAP = 1_000_000  # the generation field is 6 digits; old sockets never live that long
DIGEST_LEN = 8  # hex digits of the resource name's CRC-32, for uniqueness past the readable cut


def socket_file_name(resource: str, token: str, generation: int) -> str:
    """A bare, unique, short socket file name: readable prefix, hash for uniqueness."""
    # CRC-32, not a truncated sha1: as unlikely to collide for the names of one config (32 bits
    # either way, and no adversary picks them), and hashlib would load OpenSSL's digests.
    digest = f"{zlib.crc32(resource.encode()):0{DIGEST_LEN}x}"
    readable = re.sub(r"[^A-Za-z0-9]+", "-", resource).strip("-")[:READABLE_MAX]
    return _file_name(readable, digest, token, generation)


def _file_name(readable: str, digest: str, token: str, generation: int) -> str:
    return f"dph-{readable}-{digest}-{token[:TOKEN_MAX]}-{generation % GENERATION_WRAP:06d}.sock"


#: Every name socket_file_name can return, and nothing another plugin would likely pick.
SOCKET_NAME = re.compile(rf"dph-[A-Za-z0-9-]{{0,{READABLE_MAX}}}-[0-9a-f]{{{DIGEST_LEN}}}"
                         rf"-[0-9a-f]{{1,{TOKEN_MAX}}}-[0-9]{{6}}\.sock\Z")

#: The longest name socket_file_name can return.
MAX_SOCKET_NAME = len(_file_name("x" * READABLE_MAX, "0" * DIGEST_LEN, "f" * TOKEN_MAX,
                                 GENERATION_WRAP - 1))


def longest_socket_path(plugin_dir: str) -> int:
    """Bytes of the longest socket path the host binds in ``plugin_dir``."""
    return len(plugin_dir.rstrip("/").encode("utf-8")) + 1 + MAX_SOCKET_NAME


_INSTANCE = re.compile(r"[A-Za-z0-9][-A-Za-z0-9]{0,63}\Z")
INSTANCE_ENV = ("POD_UID", "INVOCATION_ID")


def instance_id(environ: Optional[Mapping[str, str]] = None) -> str:
    """This process's instance id: the pod's UID (the DaemonSet passes ``POD_UID`` through the
    downward API), else systemd's ``INVOCATION_ID`` (unique per start of the unit), else ""
    (run by hand: one instance, fixed socket names). A value that is not 1-64 characters of
    [A-Za-z0-9-] is ignored, since it becomes part of socket file names. Plugin-watcher
    sockets (DRA drivers) are named after it, so an old and a new host can be registered at
    once during an upgrade (host.dra.naming)."""
    env = os.environ if environ is None else environ
    for key in INSTANCE_ENV:
        value = (env.get(key) or "").strip()
        if value and _INSTANCE.match(value):
            return value
    return ""


# -- per-instance socket names (rolling updates) ----------------------------------------------
#
# Since kubelet 1.33 the DRA plugin manager keeps every registered endpoint of a driver and
# calls the newest connected one (cm/dra/plugin/dra_plugin_manager.go ``get``), so an old and a
# new instance of a driver may overlap during an upgrade. Each instance then needs its own
# registration socket (deleting a shared one deregisters the other instance) and its own
# service socket. The names follow k8s.io/dynamic-resource-allocation's ``RollingUpdate``:
# ``<driver>-<uid>-reg.sock`` (shortened while the path is too long for AF_UNIX) and
# ``dra-<uid>.sock`` in the driver's plugin directory. An empty instance id keeps the fixed
# names (``<driver>-reg.sock``, ``dra.sock``) of a single instance.

UNIX_PATH_MAX = 108


def _b64(data: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")


def registration_socket_file(registry_dir: str, plugin_name: str, instance: str = "") -> str:
    """The registration socket's base name for ``plugin_name`` (a DRA driver or a resource
    name, "/" mapped to "_"; never starting with ".", which the plugin watcher ignores).

    Without an instance: ``<name>-reg.sock``. With one, the first that fits in a unix socket
    path under ``registry_dir``: ``<name>-<instance>-reg.sock``,
    ``<name>-<base64(sha256(instance))[:8 bytes]>-reg.sock``,
    ``dra-<base64(sha256(name NUL instance))[:16 bytes]>-reg.sock``."""
    name = plugin_name.replace("/", "_")
    name = name if not name.startswith(".") else "_" + name[1:]
    if not instance:
        return name + "-reg.sock"
    import hashlib  # only with an instance id: the single-instance path loads no digests

    uid_hash = hashlib.sha256(instance.encode()).digest()
    both_hash = hashlib.sha256(f"{name}\0{instance}".encode()).digest()
    candidates = [f"{name}-{instance}-reg.sock", f"{name}-{_b64(uid_hash[:8])}-reg.sock",
                  f"dra-{_b64(both_hash[:16])}-reg.sock"]
    for candidate in candidates:
        if len(os.path.join(registry_dir, candidate).encode()) <= UNIX_PATH_MAX:
            return candidate
    return candidates[-1]


def service_socket_file(stem: str, instance: str = "") -> str:
    """``dra.sock`` / ``dra-<instance>.sock`` (``stem`` "dra"; "device-plugin" for a device
    plugin registered through the plugin watcher)."""
    return f"{stem}-{instance}.sock" if instance else f"{stem}.sock"


def is_instance_socket(file_name: str, stem: str) -> bool:
    """Whether ``file_name`` is a service socket of some instance of ours (``<stem>.sock`` or
    ``<stem>-<id>.sock``)."""
    if file_name == f"{stem}.sock":
        return True
    head, tail = f"{stem}-", ".sock"
    return (file_name.startswith(head) and file_name.endswith(tail)
            and bool(_INSTANCE.match(file_name[len(head):-len(tail)])))
