"""The [host] table: how the host process runs, and the Config that carries it.

Values are checked and normalised once, here, so the rest of the host reads them as they are.
A command-line flag is checked the same way as the file's value (``Config.with_overrides``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

from host.config.errors import ConfigError, show, toml_key, typed, unknown_key
from host.config.values import Range, check_enum, check_node_name, check_path, check_seconds
from host.core.model import ResourceConfig
from host.kubelet.socket_names import POD_RESOURCES_SOCKET

RESTART = "device_plugin_host.restart"  # field metadata: takes effect at the next start


def _restart(default: Any) -> Any:
    return dataclasses.field(default=default, metadata={RESTART: True})


@dataclass(frozen=True)
class HostSettings:
    """How the host process runs. Values are stored as validated: paths normalised, enums in
    lowercase, times as float seconds, so consumers never re-check them. A setting made with
    ``_restart`` is read once at start: a reload that changes it is told so and applies the
    rest (``restart_only``); every other one follows a reload."""

    plugin_dir: str = _restart("/var/lib/kubelet/device-plugins")
    host_root: str = _restart("/")
    pod_resources_socket: str = _restart(POD_RESOURCES_SOCKET)
    log_level: str = _restart("info")  # debug|info|warning|error
    log_format: str = _restart("plain")  # plain|json
    allocate_timeout_s: float = _restart(5.0)  # driver allocate/preferred hooks
    discover_timeout_s: float = 30.0  # one driver scan
    # Register covers the kubelet's 10 s dial-back + options
    register_timeout_s: float = _restart(20.0)
    liveness_grace_s: float = 300.0  # /healthz fails after a resource this long unregistered
    rescan_interval_s: float = 300.0  # safety rescan; 0 disables
    vanished_grace_s: float = 300.0  # how long a device gone from sysfs is still Unhealthy
    # The operator's Unhealthy marks
    drain_file: str = _restart("/var/lib/device-plugin-host/drained")
    cdi_dir: str = _restart("/var/run/cdi")  # where CDI specs go for resources with cdi = true
    metrics_address: str = _restart("127.0.0.1:9400")  # Prometheus endpoint; "" disables it
    # Node labels through NFD's local source (host/outputs/nfd.py); "" disables the feature file.
    nfd_features_file: str = _restart(
        "/etc/kubernetes/node-feature-discovery/features.d/device-plugin-host")
    # DRA (resources with api = "dra") and plugin-watcher registration:
    # This node's name; by default the NODE_NAME environment variable (the downward API).
    node_name: str = dataclasses.field(
        default_factory=lambda: os.environ.get("NODE_NAME", "").strip(),
        metadata={RESTART: True})
    # API access; None means the in-cluster service account
    kubeconfig: Optional[str] = _restart(None)
    plugins_registry_dir: str = _restart("/var/lib/kubelet/plugins_registry")
    dra_plugins_dir: str = _restart("/var/lib/kubelet/plugins")
    # The prepared-claims checkpoint
    dra_state_dir: str = _restart("/var/lib/device-plugin-host/dra")
    # Unhealthy DRA devices: "omit" (left out of the slice; safe on every version) or "taint"
    # (published with a NoSchedule or NoExecute taint, docs/dra.md; needs the DRADeviceTaints
    # gate, on by default from 1.36; where the server drops the taint the host falls back to
    # leaving devices out).
    dra_unhealthy: str = "omit"
    # Device metadata (KEP-5304, docs/dra.md): "off", or the metadata API version of the JSON
    # file of each prepared request's device attributes, mounted into its containers by CDI.
    dra_device_metadata: str = "off"
    # Installed driver packages the host must not load (a broken third-party driver, a kind
    # of device this node must not advertise); resources naming one are a config error.
    disabled_drivers: Tuple[str, ...] = _restart(())


def restart_only(old: HostSettings, new: HostSettings) -> List[str]:
    """The settings read once at start whose value differs between ``old`` and ``new``."""
    return [f.name for f in dataclasses.fields(HostSettings)
            if f.metadata.get(RESTART) and getattr(old, f.name) != getattr(new, f.name)]


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
                changes[field_name] = check_host_value("command line", flag, field_name, value)
        if not changes:
            return self
        return dataclasses.replace(self, host=dataclasses.replace(self.host, **changes))


_HOST_NUMBERS: Mapping[str, Range] = {
    "allocate_timeout_s": Range(0, True, 300),
    "discover_timeout_s": Range(0, True, 3600),
    "register_timeout_s": Range(0, True, 300),
    # While the kubelet is up; 0 disables the check (host/kubelet/liveness.py).
    "liveness_grace_s": Range(1, False, 86400, zero_disables=True),
    # A rescan more often than every second would be a busy loop over sysfs.
    "rescan_interval_s": Range(1, False, 86400, zero_disables=True),
    "vanished_grace_s": Range(0, False, 7 * 86400),
}


_HOST_PATHS = ("plugin_dir", "host_root", "pod_resources_socket", "drain_file", "cdi_dir",
               "kubeconfig", "plugins_registry_dir", "dra_plugins_dir", "dra_state_dir")


_HOST_ENUMS: Mapping[str, Tuple[str, ...]] = {
    "log_level": ("debug", "info", "warning", "error"),
    "log_format": ("plain", "json"),
    "dra_unhealthy": ("omit", "taint"),
    "dra_device_metadata": ("off", "v1alpha1"),
}


HOST_KEYS = tuple(field.name for field in dataclasses.fields(HostSettings))


def check_host_value(file: str, key: str, field_name: str, value: object) -> object:
    """One [host] value, checked and normalised; ``key`` is how the error names it."""
    if field_name == "kubeconfig" and value == "":
        return None  # the in-cluster service account, the same as leaving it out
    if field_name in _HOST_PATHS:
        return check_path(file, key, field_name, value)
    if field_name in _HOST_ENUMS:
        return check_enum(file, key, _HOST_ENUMS[field_name], value)
    if field_name == "nfd_features_file" and value == "":
        return value  # off
    if field_name == "nfd_features_file":
        path = check_path(file, key, field_name, value)
        if str(value).endswith("/"):
            raise ConfigError(file, key, f"must name a file, got {show(value)}")
        if os.path.isdir(str(path)):  # NFD's docs name the directory; a rename onto it fails
            example = show(str(path).rstrip("/") + "/device-plugin-host")
            raise ConfigError(file, key, f"{show(value)} is a directory: name the file NFD"
                                         f" reads in it, such as {example}")
        return path
    if field_name == "node_name":
        return check_node_name(file, key, value)
    if field_name == "disabled_drivers":
        return check_driver_names(file, key, value)
    if field_name == "metrics_address":
        if not isinstance(value, str):
            raise ConfigError(file, key, f"must be a string like \"127.0.0.1:9400\", got "
                                         f"{typed(value)}")
        from host.metrics.http import parse_address  # not the metrics themselves

        try:
            parse_address(value)
        except ValueError as error:
            raise ConfigError(file, key, str(error)) from None
        return value
    return check_seconds(file, key, _HOST_NUMBERS[field_name], value)


def check_driver_names(file: str, key: str, value: object) -> Tuple[str, ...]:
    """``disabled_drivers = ["name", ...]``: driver names as their packages register them
    (entry point names). A name that is not installed is allowed: one file serves many
    nodes, and blocking a package before it is installed is what an operator may want."""
    if not isinstance(value, list):
        raise ConfigError(file, key, f"must be an array of driver names, got {typed(value)}")
    names: List[str] = []
    for position, item in enumerate(value):
        where = f"{key}[{position}]"
        if not isinstance(item, str):
            raise ConfigError(file, where, f"must be a driver name (a string), got {typed(item)}")
        if not item.strip() or item != item.strip() or any(c.isspace() for c in item):
            raise ConfigError(file, where, f"{show(item)} is not a driver name (no spaces)")
        if item in names:
            raise ConfigError(file, where, f"{show(item)} is listed twice")
        names.append(item)
    return tuple(names)


def parse_host(file: str, table: object) -> HostSettings:
    if not isinstance(table, dict):
        raise ConfigError(file, "host", f"must be a table ([host]), got {typed(table)}")
    values: Dict[str, Any] = {}
    for key, value in table.items():
        dotted = f"host.{toml_key(key)}"
        if key not in HOST_KEYS:
            raise ConfigError(file, dotted, unknown_key(key, HOST_KEYS))
        values[key] = check_host_value(file, dotted, key, value)
    return HostSettings(**values)
