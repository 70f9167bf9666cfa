"""Loading drivers: entry points one at a time, each hook implementation called on its own.

pluggy's ``load_setuptools_entrypoints`` stops at the first package that fails to import, and a
broadcast hook call stops at the first implementation that raises. Here each entry point is
loaded, registered and asked for its drivers inside its own guard, so a broken third-party
package is logged with its distribution name and version and every other driver still loads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, distributions
from typing import Any, Dict, List, Optional, Tuple

import pluggy

from host import hookspecs
from host.driver import Driver, UnavailableDriver

log = logging.getLogger(__name__)

def _entry_points(group: str) -> List[Tuple[EntryPoint, Optional[str]]]:
    """Entry points of a group with "distribution version" for each; walks distributions
    itself because Python 3.9's EntryPoint does not know its distribution."""
    found = []
    for dist in distributions():
        try:
            label = f"{dist.metadata['Name']} {dist.version}"
        except Exception:  # broken metadata must not stop the walk
            label = None
        for entry_point in dist.entry_points:
            if entry_point.group == group:
                found.append((entry_point, label))
    return found


@dataclass(frozen=True)
class LoadFailure:
    """A package or driver that could not be loaded, for logs, ``discover`` and metrics."""

    source: str  # "entry point NAME (dist VERSION)"
    reason: str
    driver: Optional[str] = None  # the driver (or entry point) name config files would use


@dataclass
class DriverRegistry:
    drivers: Dict[str, Driver] = field(default_factory=dict)
    sources: Dict[str, str] = field(default_factory=dict)
    failures: List[LoadFailure] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.manager = pluggy.PluginManager(hookspecs.PROJECT)
        self.manager.add_hookspecs(hookspecs)

    # -- loading ---------------------------------------------------------------------------
    def load_entry_points(self, group: str = hookspecs.ENTRY_POINT_GROUP) -> None:
        seen = set()
        for entry_point, dist in sorted(_entry_points(group), key=lambda pair: pair[0].name):
            key = (entry_point.name, entry_point.value)
            if key in seen:  # the same distribution visible twice on sys.path
                continue
            seen.add(key)
            source = f"entry point {entry_point.name} ({dist or entry_point.value})"
            try:
                plugin = entry_point.load()
            except BaseException as error:
                if isinstance(error, KeyboardInterrupt):
                    raise
                self._fail(source, f"import failed: {type(error).__name__}: {error}",
                           entry_point.name)
                continue
            self.add_plugin(plugin, entry_point.name, source)

    def add_plugin(self, plugin: Any, name: str, source: Optional[str] = None) -> None:
        """Register one plugin object (a module or an object with the hook) and collect its
        drivers. Used for entry points and for in-process plugins in tests."""
        source = source or f"plugin {name}"
        try:
            self.manager.register(plugin, name=name)
            self.manager.check_pending()
        except Exception as error:
            if self.manager.is_registered(plugin):
                self.manager.unregister(plugin)
            self._fail(source, f"not a valid driver plugin: {error}", name)
            return
        impls = [
            impl for impl in self.manager.hook.device_plugin_host_drivers.get_hookimpls()
            if impl.plugin is plugin
        ]
        if not impls:
            self._fail(source, "implements no device_plugin_host_drivers hook", name)
            return
        for impl in impls:
            try:
                drivers = list(impl.function() or ())
            except Exception as error:
                self._fail(source, f"device_plugin_host_drivers raised "
                                   f"{type(error).__name__}: {error}", name)
                continue
            for driver in drivers:
                self._add_driver(driver, source)

    def _add_driver(self, driver: Any, source: str) -> None:
        name = getattr(driver, "name", None)
        if not isinstance(name, str) or not name:
            self._fail(source, f"driver object {driver!r:.60} has no name")
            return
        if not callable(getattr(driver, "discover", None)):
            self._fail(source, "driver has no discover()", name)
            return
        if name in self.drivers:
            self._fail(source, f"driver name {name!r} is already provided by "
                               f"{self.sources[name]}", name)
            return
        self.drivers[name] = driver
        self.sources[name] = source

    def _fail(self, source: str, reason: str, driver: Optional[str] = None) -> None:
        self.failures.append(LoadFailure(source, reason, driver))
        log.error("%s: %s; other drivers keep loading", source, reason)


    def with_unavailable(self) -> Dict[str, Driver]:
        """Loaded drivers plus stand-ins for those that failed, so a config naming a broken
        driver still starts: that resource reports the failure, the others serve."""
        drivers: Dict[str, Driver] = {}
        for failure in self.failures:
            if failure.driver and failure.driver not in self.drivers:
                drivers[failure.driver] = UnavailableDriver(failure.driver, failure.reason)
        drivers.update(self.drivers)
        return drivers


def load_drivers() -> DriverRegistry:
    registry = DriverRegistry()
    registry.load_entry_points()
    return registry
