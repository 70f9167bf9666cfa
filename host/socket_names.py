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
#: The kubelet's PodResources socket (host.protocol re-exports it; config reads it from here,
#: without loading the protocol modules).
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
