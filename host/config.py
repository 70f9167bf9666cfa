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

import dataclasses
import json
import logging
import math
import os
import posixpath
import re
import stat
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from host.cdi import kind_error
from host.driver import Driver, SelectorError
from host.model import ResourceConfig
from host.overlap import Overlap
from host.resource_name import resource_name_error
from host.socket_names import GRPC_MAX_SOCKET_PATH, MAX_SOCKET_NAME, longest_socket_path

try:
    import tomllib
except ImportError:  # pragma: no cover - Python < 3.11
    import tomli as tomllib  # type: ignore[no-redef]

log = logging.getLogger(__name__)

DEFAULT_CONFIG_PATH = "/etc/device-plugin-host/config.toml"

#: The key used for problems with the file as a whole (missing, unreadable, not UTF-8).
FILE_KEY = "(file)"

# sun_path is 108 bytes including the terminating NUL that gRPC and the kubelet rely on.
_MAX_SOCKET_PATH = 107
_KUBELET_SOCKET = "kubelet.sock"

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+\Z")
_TOML_POSITION = re.compile(r"\s*\((?:at line (\d+), column (\d+)|at end of document)\)\s*\Z")


class ConfigError(Exception):
    """One problem in a config file; ``str()`` is the line the CLI prints."""

    def __init__(self, file: str, key: str, reason: str) -> None:
        super().__init__(f"{file}: {key}: {reason}")
        self.file = file
        self.key = key
        self.reason = reason


@dataclass(frozen=True)
class HostSettings:
    """How the host process runs. Values are stored as validated: paths normalised, enums in
    lowercase, times as float seconds, so consumers never re-check them."""

    plugin_dir: str = "/var/lib/kubelet/device-plugins"
    host_root: str = "/"
    pod_resources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"
    log_level: str = "info"  # debug|info|warning|error
    log_format: str = "plain"  # plain|json
    allocate_timeout_s: float = 5.0  # driver allocate/preferred hooks
    discover_timeout_s: float = 30.0  # one driver scan
    register_timeout_s: float = 20.0  # Register covers the kubelet's 10 s dial-back + options
    liveness_grace_s: float = 300.0  # /healthz fails after a resource this long unregistered
    rescan_interval_s: float = 300.0  # safety rescan; 0 disables
    vanished_grace_s: float = 300.0  # how long a device gone from sysfs is still Unhealthy
    drain_file: str = "/var/lib/device-plugin-host/drained"  # operator's Unhealthy marks
    cdi_dir: str = "/var/run/cdi"  # where CDI specs go for resources with cdi = true
    metrics_address: str = "127.0.0.1:9400"  # Prometheus endpoint; "" disables it
    # Node labels through NFD's local source (host/nfd.py); "" disables the feature file.
    nfd_features_file: str = "/etc/kubernetes/node-feature-discovery/features.d/device-plugin-host"
    # DRA (resources with api = "dra") and plugin-watcher registration:
    # This node's name; by default the NODE_NAME environment variable (the downward API).
    node_name: str = dataclasses.field(
        default_factory=lambda: os.environ.get("NODE_NAME", "").strip())
    kubeconfig: Optional[str] = None  # API access; None means the in-cluster service account
    plugins_registry_dir: str = "/var/lib/kubelet/plugins_registry"
    dra_plugins_dir: str = "/var/lib/kubelet/plugins"
    dra_state_dir: str = "/var/lib/device-plugin-host/dra"  # the prepared-claims checkpoint


@dataclass(frozen=True)
class Config:
    """What the host serves and how.

    ``is_default`` is True when the resources are the drivers' built-in defaults (no config
    file, or one without ``[[resource]]``); those register only once they have a device.
    """

    path: Optional[str]
    host: HostSettings
    resources: Tuple[ResourceConfig, ...]
    is_default: bool

    def with_overrides(
        self, *, plugin_dir: Optional[str] = None, host_root: Optional[str] = None
    ) -> Config:
        """Apply command-line flags, which win over the file; checked like the file's values
        so a bad flag fails the same way (file ``command line``, key ``--plugin-dir``)."""
        changes: Dict[str, Any] = {}
        for field_name, value in (("plugin_dir", plugin_dir), ("host_root", host_root)):
            if value is not None:
                flag = "--" + field_name.replace("_", "-")
                changes[field_name] = _check_host_value("command line", flag, field_name, value)
        if not changes:
            return self
        return dataclasses.replace(self, host=dataclasses.replace(self.host, **changes))


# -- [host] ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Range:
    """Bounds for a seconds value. The upper bounds only exist to catch unit mistakes
    (milliseconds written as seconds) and to stay below threading.TIMEOUT_MAX."""

    minimum: float
    exclusive: bool  # minimum itself is not allowed
    maximum: float
    zero_disables: bool = False


_HOST_NUMBERS: Mapping[str, _Range] = {
    "allocate_timeout_s": _Range(0, True, 300),
    "discover_timeout_s": _Range(0, True, 3600),
    "register_timeout_s": _Range(0, True, 300),
    # While the kubelet is up; 0 disables the check (host/liveness.py).
    "liveness_grace_s": _Range(1, False, 86400, zero_disables=True),
    # A rescan more often than every second would be a busy loop over sysfs.
    "rescan_interval_s": _Range(1, False, 86400, zero_disables=True),
    "vanished_grace_s": _Range(0, False, 7 * 86400),
}
_HOST_PATHS = ("plugin_dir", "host_root", "pod_resources_socket", "drain_file", "cdi_dir",
               "kubeconfig", "plugins_registry_dir", "dra_plugins_dir", "dra_state_dir")
_HOST_ENUMS: Mapping[str, Tuple[str, ...]] = {
    "log_level": ("debug", "info", "warning", "error"),
    "log_format": ("plain", "json"),
}
_HOST_KEYS = tuple(field.name for field in dataclasses.fields(HostSettings))
_TOP_KEYS = ("host", "resource")
_RESOURCE_KEYS = (
    "name", "driver", "selectors", "settings", "replicas", "replica_policy", "health_interval_s",
    "cdi", "cdi_fallback", "shared_with", "api", "dra_driver_name", "registration",
)
_APIS = ("device-plugin", "dra")
_REGISTRATIONS = ("kubelet", "plugin-watcher")
_REPLICA_POLICIES = ("pack", "spread")
_MAX_REPLICAS = 1024
#: Each resource is a gRPC server, a socket and a kubelet registration; more than this is a
#: generated file gone wrong (10,000 took a 23 s reload), not a node. See README.
MAX_RESOURCES = 256
#: 256 resources with long selector lists are well under 1 MiB; a bigger file is a mistake
#: (a log or an image at the path), and must not be read into memory whole.
MAX_CONFIG_BYTES = 4 * 2**20


def _check_host_value(file: str, key: str, field_name: str, value: object) -> object:
    """One [host] value, checked and normalised; ``key`` is how the error names it."""
    if field_name == "kubeconfig" and value == "":
        return None  # the in-cluster service account, the same as leaving it out
    if field_name in _HOST_PATHS:
        return _check_path(file, key, field_name, value)
    if field_name in _HOST_ENUMS:
        return _check_enum(file, key, _HOST_ENUMS[field_name], value)
    if field_name == "nfd_features_file" and value == "":
        return value  # off
    if field_name == "nfd_features_file":
        path = _check_path(file, key, field_name, value)
        if str(value).endswith("/"):
            raise ConfigError(file, key, f"must name a file, got {_show(value)}")
        return path
    if field_name == "node_name":
        return _check_node_name(file, key, value)
    if field_name == "metrics_address":
        if not isinstance(value, str):
            raise ConfigError(file, key, f"must be a string like \"127.0.0.1:9400\", got "
                                         f"{_typed(value)}")
        from host.metrics import parse_address  # prometheus_client only when needed

        try:
            parse_address(value)
        except ValueError as error:
            raise ConfigError(file, key, str(error)) from None
        return value
    return _check_seconds(file, key, _HOST_NUMBERS[field_name], value)


def _check_node_name(file: str, key: str, value: object) -> str:
    if not isinstance(value, str):
        raise ConfigError(file, key, f"must be a string (the Node's name), got {_typed(value)}")
    if not value.strip():
        return os.environ.get("NODE_NAME", "").strip()
    problem = dns_subdomain_error(value)
    if problem:
        raise ConfigError(file, key, f"{_show(value)} is not a valid node name: {problem}")
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


def _check_path(file: str, key: str, field_name: str, value: object) -> str:
    if not isinstance(value, str):
        raise ConfigError(file, key, f"must be an absolute path (a string), got {_typed(value)}")
    if "\0" in value:
        raise ConfigError(file, key, "must not contain a NUL character")
    if not value.startswith("/"):
        raise ConfigError(file, key, f"must be an absolute path, got {_show(value)}")
    if ".." in value.split("/"):
        # The host root is a trust boundary: paths must not climb out of where they point.
        raise ConfigError(file, key, f"must not contain '..' segments, got {_show(value)}")
    path = posixpath.normpath(value)
    size = len(path.encode("utf-8"))
    if field_name == "pod_resources_socket" and size > _MAX_SOCKET_PATH:
        raise ConfigError(
            file, key, f"is {size} bytes; a unix socket path can be at most {_MAX_SOCKET_PATH}"
        )
    if field_name == "plugin_dir" and os.path.lexists(path) and not os.path.isdir(path):
        # A missing directory is waited for (the kubelet creates it); a file in its place
        # is the operator's mistake and never becomes a directory by itself (issue 11.8).
        raise ConfigError(file, key, f"{path} exists and is not a directory")
    if field_name == "plugin_dir" and longest_socket_path(path) > GRPC_MAX_SOCKET_PATH:
        # Checked against the longest socket name the host creates (issue 10.3), not only
        # kubelet.sock: grpcio binds at most 105 bytes, and a resource that cannot bind
        # would otherwise retry forever.
        raise ConfigError(
            file,
            key,
            f"is {size} bytes; with the host's socket names of up to {MAX_SOCKET_NAME} bytes"
            f" (next to {_KUBELET_SOCKET}) its socket paths would be"
            f" {longest_socket_path(path)} bytes, over grpc's {GRPC_MAX_SOCKET_PATH}-byte"
            f" unix socket path limit; use a directory of at most"
            f" {GRPC_MAX_SOCKET_PATH - 1 - MAX_SOCKET_NAME} bytes",
        )
    return path


def _check_enum(file: str, key: str, allowed: Tuple[str, ...], value: object) -> str:
    choices = ", ".join(f'"{choice}"' for choice in allowed)
    if not isinstance(value, str):
        raise ConfigError(file, key, f"must be one of {choices}, got {_typed(value)}")
    lowered = value.strip().lower()
    if lowered not in allowed:
        raise ConfigError(
            file, key, f"must be one of {choices}, got {_show(value)}{_hint(lowered, allowed)}"
        )
    return lowered


def _check_seconds(file: str, key: str, bounds: _Range, value: object) -> float:
    floor = f"{'>' if bounds.exclusive else '>='} {bounds.minimum:g}"
    wanted = f"0 (disabled) or a number {floor}" if bounds.zero_disables else f"a number {floor}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(file, key, f"must be {wanted}, got {_typed(value)}")
    try:
        number = float(value)
    except OverflowError:  # TOML integers are unbounded in tomllib
        number = math.inf if value > 0 else -math.inf
    if bounds.zero_disables and number == 0:
        return 0.0
    too_low = number <= bounds.minimum if bounds.exclusive else number < bounds.minimum
    if math.isnan(number) or too_low:
        raise ConfigError(file, key, f"must be {wanted}, got {_show(value)}")
    if not number <= bounds.maximum:  # also catches inf
        raise ConfigError(
            file, key, f"must be at most {bounds.maximum:g} (seconds), got {_show(value)}"
        )
    return number


def _parse_host(file: str, table: object) -> HostSettings:
    if not isinstance(table, dict):
        raise ConfigError(file, "host", f"must be a table ([host]), got {_typed(table)}")
    values: Dict[str, Any] = {}
    for key, value in table.items():
        dotted = f"host.{_key(key)}"
        if key not in _HOST_KEYS:
            raise ConfigError(file, dotted, _unknown_key(key, _HOST_KEYS))
        values[key] = _check_host_value(file, dotted, key, value)
    return HostSettings(**values)


# -- [[resource]] ----------------------------------------------------------------------------


def _parse_resource(
    file: str, index: int, entry: object, drivers: Mapping[str, Driver]
) -> ResourceConfig:
    where = f"resource[{index}]"
    if not isinstance(entry, dict):
        raise ConfigError(file, where, f"must be a table ([[resource]]), got {_typed(entry)}")

    if "name" not in entry:
        raise ConfigError(
            file, f"{where}.name", 'missing; every [[resource]] needs name = "vendor.example/thing"'
        )
    name = entry["name"]
    if not isinstance(name, str):
        raise ConfigError(file, f"{where}.name", f"must be a string, got {_typed(name)}")
    problem = resource_name_error(name)
    if problem is not None:
        raise ConfigError(
            file, f"{where}.name", f"{_show(name)} is not a valid resource name: {problem}"
        )
    where = f"{where} ({name})"

    known = ", ".join(sorted(drivers)) or "none are installed"
    if "driver" not in entry:
        raise ConfigError(file, f"{where}.driver", f"missing; known drivers: {known}")
    driver_name = entry["driver"]
    if not isinstance(driver_name, str):
        raise ConfigError(file, f"{where}.driver", f"must be a string, got {_typed(driver_name)}")
    driver = drivers.get(driver_name)
    if driver is None:
        raise ConfigError(
            file,
            f"{where}.driver",
            f"unknown driver {_show(driver_name)}{_hint(driver_name, list(drivers))};"
            f" known drivers: {known}",
        )

    for key in entry:
        if key not in _RESOURCE_KEYS:
            raise ConfigError(file, f"{where}.{_key(key)}", _unknown_resource_key(key, driver))

    tables: Dict[str, Dict[str, object]] = {}
    for part, check in (
        ("selectors", driver.check_selectors),
        ("settings", driver.check_settings),
    ):
        table = entry.get(part, {})
        if not isinstance(table, dict):
            raise ConfigError(
                file, f"{where}.{part}", f"must be a table ([resource.{part}]), got {_typed(table)}"
            )
        try:
            check(table)
        except SelectorError as error:
            # A key of the table is quoted like TOML would; a driver's own path (such as
            # "pre_start[0]") is shown as the driver wrote it.
            inner = _key(error.key) if error.key in table else error.key
            key = f"{where}.{part}" + (f".{inner}" if inner else "")
            raise ConfigError(file, key, error.reason) from None
        except Exception as error:
            # A driver bug must still end in one clear line, not a traceback at start-up.
            raise ConfigError(
                file,
                f"{where}.{part}",
                f"driver {driver_name!r} failed to check them: {type(error).__name__}: {error}",
            ) from error
        tables[part] = dict(table)
    return ResourceConfig(
        name=name,
        driver=driver_name,
        selectors=tables["selectors"],
        settings=tables["settings"],
        **_sharing_and_health(file, where, entry),
    )


def _sharing_and_health(file: str, where: str, entry: Mapping[str, object]) -> Dict[str, Any]:
    """The host-level resource keys: replicas, replica_policy, health_interval_s."""
    out: Dict[str, Any] = {}
    if "replicas" in entry:
        value = entry["replicas"]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(file, f"{where}.replicas", f"must be an integer, got {_typed(value)}")
        if not 1 <= value <= _MAX_REPLICAS:
            raise ConfigError(file, f"{where}.replicas",
                              f"must be between 1 and {_MAX_REPLICAS}, got {value}")
        out["replicas"] = value
    if "replica_policy" in entry:
        out["replica_policy"] = _check_enum(
            file, f"{where}.replica_policy", _REPLICA_POLICIES, entry["replica_policy"]
        )
        if "replicas" not in entry:
            raise ConfigError(file, f"{where}.replica_policy",
                              "only means something with replicas = N (N > 1)")
    for flag in ("cdi", "cdi_fallback"):
        if flag in entry:
            if not isinstance(entry[flag], bool):
                raise ConfigError(file, f"{where}.{flag}",
                                  f"must be true or false, got {_typed(entry[flag])}")
            out[flag] = entry[flag]
    if out.get("cdi"):
        problem = kind_error(str(entry.get("name", "")))
        if problem:
            raise ConfigError(file, f"{where}.cdi", f"the resource name cannot be a CDI kind: "
                                                     f"{problem}")
    if "shared_with" in entry:
        out["shared_with"] = _check_shared_with(file, where, entry)
    out.update(_api_keys(file, where, entry))
    if "health_interval_s" in entry:
        out["health_interval_s"] = _check_seconds(
            file, f"{where}.health_interval_s", _Range(0.1, False, 86400, zero_disables=True),
            entry["health_interval_s"],
        )
    return out


def _check_shared_with(file: str, where: str, entry: Mapping[str, object]) -> Tuple[str, ...]:
    """``shared_with = ["other/name", ...]``: resources that may advertise the same devices.
    That the names are configured is checked once every resource is known."""
    key = f"{where}.shared_with"
    value = entry["shared_with"]
    if not isinstance(value, list):
        raise ConfigError(file, key, f"must be an array of resource names, got {_typed(value)}")
    names: List[str] = []
    for position, item in enumerate(value):
        if not isinstance(item, str):
            raise ConfigError(file, f"{key}[{position}]",
                              f"must be a resource name (a string), got {_typed(item)}")
        problem = resource_name_error(item)
        if problem is not None:
            raise ConfigError(file, f"{key}[{position}]",
                              f"{_show(item)} is not a valid resource name: {problem}")
        if item == entry.get("name"):
            raise ConfigError(file, f"{key}[{position}]", "names the resource itself")
        if item not in names:
            names.append(item)
    return tuple(names)


def _check_shared_names(file: str, resources: Sequence[ResourceConfig]) -> None:
    known = {r.name for r in resources}
    for index, resource in enumerate(resources):
        for position, other in enumerate(resource.shared_with):
            if other not in known:
                raise ConfigError(
                    file, f"resource[{index}] ({resource.name}).shared_with[{position}]",
                    f"{_show(other)} is not a configured resource{_hint(other, sorted(known))}")


def overlap_error(config: Config, overlap: Overlap) -> ConfigError:
    """A device claimed by two resources, as one config error naming both and the ids."""
    index = {r.name: i for i, r in enumerate(config.resources)}
    file = config.path or "built-in defaults"
    first = f"resource[{index.get(overlap.first, '?')}] ({overlap.first})"
    second = f"resource[{index.get(overlap.second, '?')}] ({overlap.second})"
    return ConfigError(
        file, f"{second}.selectors",
        f"claims {overlap.describe()} that {first} also claims: two pods could be given one "
        f"device; narrow the selectors, or set shared_with = [\"{overlap.first}\"] if the "
        "two resources are meant to share them")
def _api_keys(file: str, where: str, entry: Mapping[str, object]) -> Dict[str, Any]:
    """api, dra_driver_name, registration: which kubelet API serves the resource, and how."""
    out: Dict[str, Any] = {}
    api = "device-plugin"
    if "api" in entry:
        api = out["api"] = _check_enum(file, f"{where}.api", _APIS, entry["api"])
    if "registration" in entry:
        out["registration"] = _check_enum(file, f"{where}.registration", _REGISTRATIONS,
                                          entry["registration"])
        if api == "dra":
            raise ConfigError(file, f"{where}.registration",
                              'only for api = "device-plugin"; a DRA driver always registers '
                              "through the plugin watcher")
    if "dra_driver_name" in entry:
        value = entry["dra_driver_name"]
        if api != "dra":
            raise ConfigError(file, f"{where}.dra_driver_name", 'only means something with '
                                                                'api = "dra"')
        if not isinstance(value, str):
            raise ConfigError(file, f"{where}.dra_driver_name",
                              f"must be a string like \"gpu.example.com\", got {_typed(value)}")
        problem = dns_subdomain_error(value)
        if problem is None and len(value) > 63:
            problem = f"is {len(value)} characters; a DRA driver name has at most 63"
        if problem is not None:
            raise ConfigError(file, f"{where}.dra_driver_name",
                              f"{_show(value)} is not a DNS subdomain: {problem}")
        out["dra_driver_name"] = value
    if api == "dra":
        for key in ("replicas", "replica_policy"):
            if key in entry:
                raise ConfigError(file, f"{where}.{key}",
                                  'not supported with api = "dra" (a DRA device is allocated '
                                  "whole; sharing is the claim's business)")
    return out


def _unknown_resource_key(key: str, driver: Driver) -> str:
    """Point a selector or setting written at the wrong level to the table it belongs in."""
    for part in ("selectors", "settings"):
        if key in getattr(driver, part[:-1] + "_types", {}):
            return f"unknown key; it belongs under [resource.{part}] (driver {driver.name!r})"
    return _unknown_key(key, _RESOURCE_KEYS)


# -- entry points ----------------------------------------------------------------------------


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
    return ".".join(_key(p[1:-1]) if len(p) > 1 and p[0] == p[-1] and p[0] in "\"'" else p
                    for p in parts)


def _parse_config(text: str, file: str, drivers: Mapping[str, Driver]) -> Config:
    if text.startswith("\ufeff"):
        text = text[1:]  # a byte-order mark from a Windows editor is harmless; TOML rejects it
    try:
        document = tomllib.loads(text)
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
            raise ConfigError(file, _key(key), _unknown_key(key, _TOP_KEYS))
    host = _parse_host(file, document.get("host", {}))

    if "resource" not in document:
        defaults = default_config(drivers)
        return Config(path=file, host=host, resources=defaults.resources, is_default=True)
    entries = document["resource"]
    if not isinstance(entries, list):
        raise ConfigError(
            file, "resource", f"must be an array of tables ([[resource]]), got {_typed(entries)}"
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
        resource = _parse_resource(file, index, entry, drivers)
        if resource.name in first_index:
            raise ConfigError(
                file,
                f"resource[{index}] ({resource.name}).name",
                f"duplicate: resource[{first_index[resource.name]}] already has this name;"
                " each resource name gets one kubelet registration",
            )
        first_index[resource.name] = index
        resources.append(resource)
    _check_shared_names(file, resources)
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


def default_config(drivers: Mapping[str, Driver]) -> Config:
    """Every driver's default resources, with default host settings.

    A driver whose defaults are broken (an exception, a bad name, a name another driver took,
    selectors it rejects itself) loses those resources with a logged reason; it must not stop
    the host from serving every other kind of device.
    """
    resources: List[ResourceConfig] = []
    owner: Dict[str, str] = {}
    for driver_name in sorted(drivers):
        driver = drivers[driver_name]
        try:
            offered: Sequence[ResourceConfig] = tuple(driver.default_resources())
        except Exception:
            log.exception("driver %r: default_resources() failed; it serves nothing", driver_name)
            continue
        for resource in offered:
            problem = _default_resource_problem(driver, resource, owner)
            if problem is not None:
                log.warning("driver %r: default resource skipped: %s", driver_name, problem)
                continue
            # Defaults register only once they have a device (a node without AMD GPUs does not
            # advertise amd.com/gpu = 0); the host enforces it rather than trusting each driver.
            resources.append(
                dataclasses.replace(resource, driver=driver_name, register_when_empty=False)
            )
            owner[resource.name] = driver_name
    return Config(path=None, host=HostSettings(), resources=tuple(resources), is_default=True)


def _default_resource_problem(
    driver: Driver, resource: object, owner: Mapping[str, str]
) -> Optional[str]:
    if not isinstance(resource, ResourceConfig):
        return f"not a ResourceConfig: {resource!r}"
    problem = resource_name_error(resource.name)
    if problem is not None:
        return f"{resource.name!r} is not a valid resource name: {problem}"
    if resource.name in owner:
        return f"{resource.name!r} is already served by driver {owner[resource.name]!r}"
    try:
        driver.check_selectors(resource.selectors)
        driver.check_settings(resource.settings)
    except Exception as error:
        return f"{resource.name!r} fails the driver's own checks: {error}"
    return None


# -- message helpers -------------------------------------------------------------------------


def _key(key: str) -> str:
    """A key as TOML would write it, so odd keys in messages are unambiguous."""
    return key if _BARE_KEY.match(key) else json.dumps(key)


def _hint(word: str, choices: Sequence[str]) -> str:
    import difflib  # only for a misspelt value

    close = difflib.get_close_matches(word, list(choices), n=1)
    return f' (did you mean "{close[0]}"?)' if close else ""


def _unknown_key(key: str, known: Sequence[str]) -> str:
    import difflib  # only for a misspelt value

    close = difflib.get_close_matches(key, list(known), n=1)
    if close:
        return f'unknown key (did you mean "{close[0]}"?)'
    return "unknown key; known keys: " + ", ".join(known)


def _show(value: object) -> str:
    """A value the way the user wrote it in TOML, cut short so the error stays one line."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = json.dumps(value, ensure_ascii=False)
    elif isinstance(value, (int, float)):
        text = repr(value)
    else:
        text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _typed(value: object) -> str:
    """A value with its TOML type, for messages where the type is the problem."""
    kinds = ((bool, "a boolean"), (str, "a string"), (int, "an integer"), (float, "a float"))
    for kind, words in kinds:
        if isinstance(value, kind):
            return f"{words} ({_show(value)})"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return f"a {type(value).__name__} ({value})"
