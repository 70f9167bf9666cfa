"""One [[resource]] entry: name, driver, the driver's selectors and settings, and the host's
own keys (replicas, CDI, sharing, health checks, which kubelet API serves it).

The driver checks its selectors and settings (only it knows what they mean); a driver that
raises while checking still ends in one config error line, never a traceback.
"""

from __future__ import annotations

from typing import Any, Collection, Dict, List, Mapping, Sequence, Tuple

from host.config.errors import ConfigError, hint, show, toml_key, typed, unknown_key
from host.config.limits import MAX_REPLICAS
from host.config.values import Range, check_enum, check_seconds, dns_subdomain_error
from host.core.capabilities import config_checks
from host.core.cdi import kind_error
from host.core.driver import Driver, SelectorError
from host.core.model import ResourceConfig
from host.core.resource_name import resource_name_error

RESOURCE_KEYS = (
    "name", "driver", "selectors", "settings", "replicas", "replica_policy", "health_interval_s",
    "cdi", "cdi_fallback", "shared_with", "api", "dra_driver_name", "registration",
)


_APIS = ("device-plugin", "dra")


_REGISTRATIONS = ("kubelet", "plugin-watcher")


_REPLICA_POLICIES = ("pack", "spread")


def parse_resource(
    file: str, index: int, entry: object, drivers: Mapping[str, Driver],
    disabled: Collection[str] = (),
) -> ResourceConfig:
    where = f"resource[{index}]"
    if not isinstance(entry, dict):
        raise ConfigError(file, where, f"must be a table ([[resource]]), got {typed(entry)}")

    if "name" not in entry:
        raise ConfigError(
            file, f"{where}.name", 'missing; every [[resource]] needs name = "vendor.example/thing"'
        )
    name = entry["name"]
    if not isinstance(name, str):
        raise ConfigError(file, f"{where}.name", f"must be a string, got {typed(name)}")
    problem = resource_name_error(name)
    if problem is not None:
        raise ConfigError(
            file, f"{where}.name", f"{show(name)} is not a valid resource name: {problem}"
        )
    where = f"{where} ({name})"

    known = ", ".join(sorted(drivers)) or "none are installed"
    if "driver" not in entry:
        raise ConfigError(file, f"{where}.driver", f"missing; known drivers: {known}")
    driver_name = entry["driver"]
    if not isinstance(driver_name, str):
        raise ConfigError(file, f"{where}.driver", f"must be a string, got {typed(driver_name)}")
    if driver_name in disabled:
        raise ConfigError(file, f"{where}.driver",
                          f"driver {show(driver_name)} is disabled by host.disabled_drivers; "
                          "remove the resource or the driver from that list")
    driver = drivers.get(driver_name)
    if driver is None:
        raise ConfigError(
            file,
            f"{where}.driver",
            f"unknown driver {show(driver_name)}{hint(driver_name, list(drivers))};"
            f" known drivers: {known}",
        )

    for key in entry:
        if key not in RESOURCE_KEYS:
            raise ConfigError(file, f"{where}.{toml_key(key)}", _unknown_resource_key(key, driver))

    tables: Dict[str, Dict[str, object]] = {}
    check_selectors, check_settings = config_checks(driver)
    for part, check in (("selectors", check_selectors), ("settings", check_settings)):
        table = entry.get(part, {})
        if not isinstance(table, dict):
            raise ConfigError(
                file, f"{where}.{part}", f"must be a table ([resource.{part}]), got {typed(table)}"
            )
        try:
            check(table)
        except SelectorError as error:
            # A key of the table is quoted like TOML would; a driver's own path (such as
            # "pre_start[0]") is shown as the driver wrote it.
            inner = toml_key(error.key) if error.key in table else error.key
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
            raise ConfigError(file, f"{where}.replicas", f"must be an integer, got {typed(value)}")
        if not 1 <= value <= MAX_REPLICAS:
            raise ConfigError(file, f"{where}.replicas",
                              f"must be between 1 and {MAX_REPLICAS}, got {value}")
        out["replicas"] = value
    if "replica_policy" in entry:
        out["replica_policy"] = check_enum(
            file, f"{where}.replica_policy", _REPLICA_POLICIES, entry["replica_policy"]
        )
        if "replicas" not in entry:
            raise ConfigError(file, f"{where}.replica_policy",
                              "only means something with replicas = N (N > 1)")
    for flag in ("cdi", "cdi_fallback"):
        if flag in entry:
            if not isinstance(entry[flag], bool):
                raise ConfigError(file, f"{where}.{flag}",
                                  f"must be true or false, got {typed(entry[flag])}")
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
        out["health_interval_s"] = check_seconds(
            file, f"{where}.health_interval_s", Range(0.1, False, 86400, zero_disables=True),
            entry["health_interval_s"],
        )
    return out


def _check_shared_with(file: str, where: str, entry: Mapping[str, object]) -> Tuple[str, ...]:
    """``shared_with = ["other/name", ...]``: resources that may advertise the same devices.
    That the names are configured is checked once every resource is known."""
    key = f"{where}.shared_with"
    value = entry["shared_with"]
    if not isinstance(value, list):
        raise ConfigError(file, key, f"must be an array of resource names, got {typed(value)}")
    names: List[str] = []
    for position, item in enumerate(value):
        if not isinstance(item, str):
            raise ConfigError(file, f"{key}[{position}]",
                              f"must be a resource name (a string), got {typed(item)}")
        problem = resource_name_error(item)
        if problem is not None:
            raise ConfigError(file, f"{key}[{position}]",
                              f"{show(item)} is not a valid resource name: {problem}")
        if item == entry.get("name"):
            raise ConfigError(file, f"{key}[{position}]", "names the resource itself")
        if item not in names:
            names.append(item)
    return tuple(names)


def check_shared_names(file: str, resources: Sequence[ResourceConfig]) -> None:
    known = {r.name for r in resources}
    for index, resource in enumerate(resources):
        for position, other in enumerate(resource.shared_with):
            if other not in known:
                raise ConfigError(
                    file, f"resource[{index}] ({resource.name}).shared_with[{position}]",
                    f"{show(other)} is not a configured resource{hint(other, sorted(known))}")


def _api_keys(file: str, where: str, entry: Mapping[str, object]) -> Dict[str, Any]:
    """api, dra_driver_name, registration: which kubelet API serves the resource, and how."""
    out: Dict[str, Any] = {}
    api = "device-plugin"
    if "api" in entry:
        api = out["api"] = check_enum(file, f"{where}.api", _APIS, entry["api"])
    if "registration" in entry:
        out["registration"] = check_enum(file, f"{where}.registration", _REGISTRATIONS,
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
                              f"must be a string like \"gpu.example.com\", got {typed(value)}")
        problem = dns_subdomain_error(value)
        if problem is None and len(value) > 63:
            problem = f"is {len(value)} characters; a DRA driver name has at most 63"
        if problem is not None:
            raise ConfigError(file, f"{where}.dra_driver_name",
                              f"{show(value)} is not a DNS subdomain: {problem}")
        out["dra_driver_name"] = value
    if api == "dra" and "replica_policy" in entry:
        raise ConfigError(file, f"{where}.replica_policy",
                          'not supported with api = "dra" (the scheduler picks which shared '
                          "device a claim gets; replicas = N shares each device N ways)")
    return out


def _unknown_resource_key(key: str, driver: Driver) -> str:
    """Point a selector or setting written at the wrong level to the table it belongs in."""
    for part in ("selectors", "settings"):
        if key in getattr(driver, part[:-1] + "_types", {}):
            return f"unknown key; it belongs under [resource.{part}] (driver {driver.name!r})"
    return unknown_key(key, RESOURCE_KEYS)
