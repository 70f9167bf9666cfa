"""The TOML config file, validated completely before anything starts.

A DaemonSet that starts with a typo keeps crash-looping or, worse, serves the wrong devices, so
every mistake is found here and reported as one line naming the file, the key and the reason
(the CLI prints ``str(error)`` and exits 2). Selector and setting values are checked by the
driver that will use them, because only it knows what they mean.

A file without any ``[[resource]]`` serves the drivers' built-in defaults: the shipped
config.toml is entirely comments, and a ConfigMap that only tunes ``[host]`` (another kubelet
root, debug logging) should not have to restate every default resource. An explicit
``resource = []`` asks for nothing to be served, which is never what a device plugin is for,
so it is an error.
"""

from __future__ import annotations

import os
import re
import stat
from typing import Any, Dict, List, Mapping, Optional, Tuple

from host.config.defaults import default_config
from host.config.errors import FILE_KEY, ConfigError, show, toml_key, typed, unknown_key
from host.config.limits import MAX_CONFIG_BYTES, MAX_RESOURCES, overlap_error
from host.config.resources import check_shared_names, parse_resource
from host.config.settings import Config, HostSettings, parse_host
from host.core.driver import Driver
from host.core.model import ResourceConfig

try:
    import tomllib
except ImportError:  # pragma: no cover - Python < 3.11
    import tomli as tomllib  # type: ignore[no-redef]

# The last text parsed and its document. A start reads the file ahead of loading the drivers
# (host/config/plugins.py: which drivers it disables, which it uses) and again to validate it; the
# second read reuses the first parse. Documents are only read, never changed.
_LAST_PARSE: Tuple[str, Dict[str, Any]] = ("", {})


def parse_toml(text: str) -> Dict[str, Any]:
    """``tomllib.loads``, once for the same text (raises its TOMLDecodeError)."""
    global _LAST_PARSE
    last_text, document = _LAST_PARSE
    if text != last_text or not text:
        document = tomllib.loads(text)
        _LAST_PARSE = (text, document)
    return document


__all__ = [
    "CONFIG_VERSION", "DEFAULT_CONFIG_PATH", "FILE_KEY", "MAX_CONFIG_BYTES", "MAX_RESOURCES",
    "Config", "ConfigError", "HostSettings", "default_config", "load_config", "overlap_error",
    "parse_config", "show", "typed", "unknown_key",
]


DEFAULT_CONFIG_PATH = "/etc/device-plugin-host/config.toml"


_TOML_POSITION = re.compile(r"\s*\((?:at line (\d+), column (\d+)|at end of document)\)\s*\Z")


_TOP_KEYS = ("version", "host", "resource")
#: The config format this host reads; ``version`` is optional, and any other value is refused
#: (a file written for a later format must not be half understood).
CONFIG_VERSION = 1


def parse_config(text: str, file: str, drivers: Mapping[str, Driver]) -> Config:
    """Parse and validate config text; ``file`` names it in errors. Raises ConfigError."""
    try:
        return _parse_config(text, file, drivers)
    except RecursionError:
        # tomllib recurses once per nesting level: thousands of "[" end here, not in a
        # traceback (and a restart loop under systemd).
        raise ConfigError(file, _deepest(text), "invalid TOML: arrays or tables nested too "
                          "deeply to parse") from None


def _deepest(text: str) -> str:
    """Where nesting first gets absurd (the 100th open bracket), as "line L, column C"."""
    depth = 0
    line, column = 1, 0
    for char in text:
        column += 1
        if char == "\n":
            line, column = line + 1, 0
        elif char in "[{":
            depth += 1
            if depth >= 100:
                return f"line {line}, column {column}"
        elif char in "]}":
            depth = max(0, depth - 1)
    return "TOML syntax"


def _duplicate_key(text: str, number: int) -> Optional[str]:
    """The dotted key on line ``number`` that tomllib refused to overwrite, with the table
    it is in ("host.log_level", "resource[1].selectors.vendor"); None if it cannot tell."""
    lines = text.splitlines()
    if not 1 <= number <= len(lines):
        return None
    arrays: Dict[str, int] = {}
    table = ""

    def qualified(name: str) -> str:
        head, dot, rest = name.partition(".")
        if head in arrays:
            return f"{head}[{arrays[head] - 1}]{dot}{rest}"
        return name

    for line in lines[: number - 1]:
        stripped = line.strip()
        if stripped.startswith("[["):
            name = _dotted(stripped[2:].split("]]", 1)[0])
            arrays[name] = arrays.get(name, 0) + 1
            table = qualified(name)
        elif stripped.startswith("["):
            table = qualified(_dotted(stripped[1:].split("]", 1)[0]))
    here = lines[number - 1].strip()
    if here.startswith("["):
        return qualified(_dotted(here.strip("[]")))
    if "=" not in here:
        return None
    key = _dotted(here.split("=", 1)[0])
    return f"{table}.{key}" if table else key


def _dotted(key: str) -> str:
    """A TOML key as written (``a . "b c"``) in our messages' form (``a."b c"``)."""
    parts = [part.strip() for part in key.split(".")]
    return ".".join(toml_key(p[1:-1]) if len(p) > 1 and p[0] == p[-1] and p[0] in "\"'" else p
                    for p in parts)


def _parse_config(text: str, file: str, drivers: Mapping[str, Driver]) -> Config:
    if text.startswith("\ufeff"):
        text = text[1:]  # a byte-order mark from a Windows editor is harmless; TOML rejects it
    try:
        document = parse_toml(text)
    except tomllib.TOMLDecodeError as error:
        message = str(error)
        match = _TOML_POSITION.search(message)
        if match is None:
            raise ConfigError(file, "TOML syntax", message) from None
        position = f"line {match[1]}, column {match[2]}" if match[1] else "end of file"
        if message.startswith("Cannot overwrite a value") and match[1]:
            key = _duplicate_key(text, int(match[1]))
            if key:
                raise ConfigError(file, key, f"set twice (again at {position}); each key may "
                                             "appear once in its table") from None
        raise ConfigError(file, position, f"invalid TOML: {message[: match.start()]}") from None

    for key in document:
        if key not in _TOP_KEYS:
            raise ConfigError(file, toml_key(key), unknown_key(key, _TOP_KEYS))
    if "version" in document:
        version = document["version"]
        if isinstance(version, bool) or not isinstance(version, int) or \
                version != CONFIG_VERSION:
            raise ConfigError(file, "version", f"must be {CONFIG_VERSION} (the only config format "
                                               f"this host reads), got {show(version)}")
    host = parse_host(file, document.get("host", {}))
    if host.disabled_drivers:
        drivers = {n: d for n, d in drivers.items() if n not in host.disabled_drivers}

    if "resource" not in document:
        defaults = default_config(drivers)
        return Config(path=file, host=host, resources=defaults.resources, is_default=True)
    entries = document["resource"]
    if not isinstance(entries, list):
        raise ConfigError(
            file, "resource", f"must be an array of tables ([[resource]]), got {typed(entries)}"
        )
    if not entries:
        raise ConfigError(
            file,
            "resource",
            "no resources: an empty list serves nothing; remove the key to serve the"
            " built-in defaults",
        )

    if len(entries) > MAX_RESOURCES:
        raise ConfigError(
            file, "resource",
            f"{len(entries)} resources; at most {MAX_RESOURCES} are supported (each one is a "
            "gRPC server, a socket and a kubelet registration)")
    resources: List[ResourceConfig] = []
    first_index: Dict[str, int] = {}
    for index, entry in enumerate(entries):
        resource = parse_resource(file, index, entry, drivers, host.disabled_drivers)
        if resource.name in first_index:
            raise ConfigError(
                file,
                f"resource[{index}] ({resource.name}).name",
                f"duplicate: resource[{first_index[resource.name]}] already has this name;"
                " each resource name gets one kubelet registration",
            )
        first_index[resource.name] = index
        resources.append(resource)
    check_shared_names(file, resources)
    return Config(path=file, host=host, resources=tuple(resources), is_default=False)


def load_config(
    path: Optional[str],
    drivers: Mapping[str, Driver],
    *,
    default_path: str = DEFAULT_CONFIG_PATH,
) -> Config:
    """Read and validate the config file.

    With no path, ``default_path`` is used when anything is there (a dangling ConfigMap link
    included, which then fails loudly) and the built-in defaults otherwise. A path given
    explicitly must exist: silently serving defaults because of a typo in --config would hide
    the operator's whole configuration.
    """
    if path is None:
        if not os.path.lexists(default_path):
            return default_config(drivers)
        path = default_path
    try:
        # O_NONBLOCK: a FIFO at the path must not hang start-up waiting for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        with open(fd, "rb") as stream:
            mode = os.fstat(stream.fileno()).st_mode
            if stat.S_ISDIR(mode):
                raise IsADirectoryError
            if not stat.S_ISREG(mode):
                raise ConfigError(path, FILE_KEY, "is not a regular file (a device, FIFO or "
                                                  "socket); give the path of a TOML file")
            data = stream.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise ConfigError(path, FILE_KEY, f"is larger than {MAX_CONFIG_BYTES // 2**20} MiB;"
                                              " no config file needs that much")
    except FileNotFoundError:
        raise ConfigError(path, FILE_KEY, "does not exist") from None
    except IsADirectoryError:
        raise ConfigError(path, FILE_KEY, "is a directory, not a config file") from None
    except OSError as error:
        raise ConfigError(path, FILE_KEY, f"cannot read: {error.strerror or error}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        before = data[: error.start]
        line = before.count(b"\n") + 1
        column = error.start - (before.rfind(b"\n") + 1) + 1
        raise ConfigError(
            path,
            f"line {line}, column {column}",
            f"not UTF-8 (byte 0x{data[error.start]:02x}); TOML files must be UTF-8",
        ) from None
    return parse_config(text, path, drivers)
