"""Checks for one config value of a common kind: paths, enums, seconds, DNS names.

Shared by the [host] table and [[resource]] entries; each returns the value normalised
(paths without '.' segments, enums lowercased, seconds as float) so consumers never re-check.
"""

from __future__ import annotations

import math
import os
import posixpath
import re
from typing import NamedTuple, Optional, Tuple

from host.config.errors import ConfigError, hint, show, typed
from host.kubelet.socket_names import (
    GRPC_MAX_SOCKET_PATH,
    KUBELET_SOCKET,
    MAX_SOCKET_NAME,
    MAX_SOCKET_PATH,
    longest_socket_path,
)


class Range(NamedTuple):
    """Bounds for a seconds value. The upper bounds only exist to catch unit mistakes
    (milliseconds written as seconds) and to stay below threading.TIMEOUT_MAX."""

    minimum: float
    exclusive: bool  # minimum itself is not allowed
    maximum: float
    zero_disables: bool = False


def check_enum(file: str, key: str, allowed: Tuple[str, ...], value: object) -> str:
    choices = ", ".join(f'"{choice}"' for choice in allowed)
    if not isinstance(value, str):
        raise ConfigError(file, key, f"must be one of {choices}, got {typed(value)}")
    lowered = value.strip().lower()
    if lowered not in allowed:
        raise ConfigError(
            file, key, f"must be one of {choices}, got {show(value)}{hint(lowered, allowed)}"
        )
    return lowered


def check_seconds(file: str, key: str, bounds: Range, value: object) -> float:
    floor = f"{'>' if bounds.exclusive else '>='} {bounds.minimum:g}"
    wanted = f"0 (disabled) or a number {floor}" if bounds.zero_disables else f"a number {floor}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(file, key, f"must be {wanted}, got {typed(value)}")
    try:
        number = float(value)
    except OverflowError:  # TOML integers are unbounded in tomllib
        number = math.inf if value > 0 else -math.inf
    if bounds.zero_disables and number == 0:
        return 0.0
    too_low = number <= bounds.minimum if bounds.exclusive else number < bounds.minimum
    if math.isnan(number) or too_low:
        raise ConfigError(file, key, f"must be {wanted}, got {show(value)}")
    if not number <= bounds.maximum:  # also catches inf
        raise ConfigError(
            file, key, f"must be at most {bounds.maximum:g} (seconds), got {show(value)}"
        )
    return number


def check_path(file: str, key: str, field_name: str, value: object) -> str:
    if not isinstance(value, str):
        raise ConfigError(file, key, f"must be an absolute path (a string), got {typed(value)}")
    if "\0" in value:
        raise ConfigError(file, key, "must not contain a NUL character")
    if not value.startswith("/"):
        raise ConfigError(file, key, f"must be an absolute path, got {show(value)}")
    if ".." in value.split("/"):
        # The host root is a trust boundary: paths must not climb out of where they point.
        raise ConfigError(file, key, f"must not contain '..' segments, got {show(value)}")
    path = posixpath.normpath(value)
    size = len(path.encode("utf-8"))
    if field_name == "pod_resources_socket" and size > MAX_SOCKET_PATH:
        raise ConfigError(
            file, key, f"is {size} bytes; a unix socket path can be at most {MAX_SOCKET_PATH}"
        )
    if field_name == "plugin_dir" and os.path.lexists(path) and not os.path.isdir(path):
        # A missing directory is waited for (the kubelet creates it); a file in its place
        # is the operator's mistake and never becomes a directory by itself.
        raise ConfigError(file, key, f"{path} exists and is not a directory")
    if field_name == "plugin_dir" and longest_socket_path(path) > GRPC_MAX_SOCKET_PATH:
        # Checked against the longest socket name the host creates, not only
        # kubelet.sock: grpcio binds at most 105 bytes, and a resource that cannot bind
        # would otherwise retry forever.
        raise ConfigError(
            file,
            key,
            f"is {size} bytes; with the host's socket names of up to {MAX_SOCKET_NAME} bytes"
            f" (next to {KUBELET_SOCKET}) its socket paths would be"
            f" {longest_socket_path(path)} bytes, over grpc's {GRPC_MAX_SOCKET_PATH}-byte"
            f" unix socket path limit; use a directory of at most"
            f" {GRPC_MAX_SOCKET_PATH - 1 - MAX_SOCKET_NAME} bytes",
        )
    return path


def check_node_name(file: str, key: str, value: object) -> str:
    if not isinstance(value, str):
        raise ConfigError(file, key, f"must be a string (the Node's name), got {typed(value)}")
    if not value.strip():
        return os.environ.get("NODE_NAME", "").strip()
    problem = dns_subdomain_error(value)
    if problem:
        raise ConfigError(file, key, f"{show(value)} is not a valid node name: {problem}")
    return value


def dns_subdomain_error(value: str) -> Optional[str]:
    """Why ``value`` is not a DNS subdomain (RFC 1123, as Kubernetes names are), or None."""
    if not value:
        return "must not be empty"
    if len(value) > 253:
        return f"is {len(value)} characters; at most 253"
    if not _DNS_SUBDOMAIN.match(value):
        return ("must be lowercase letters, digits, '-' and '.', starting and ending with a "
                "letter or digit")
    return None


_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"


_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*\Z")
