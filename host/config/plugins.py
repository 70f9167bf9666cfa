"""Loading drivers: entry points one at a time, each hook implementation called on its own.

pluggy's ``load_setuptools_entrypoints`` stops at the first package that fails to import, and a
broadcast hook call stops at the first implementation that raises. Here each entry point is
loaded, registered and asked for its drivers inside its own guard, so a broken third-party
package is logged with its distribution name and version and every other driver still loads.

Entry points are read from entry_points.txt (zipped eggs included); configured drivers load
first; disabled drivers are never imported; every failure is reported.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import stat
import sys
from typing import Any, Dict, FrozenSet, Iterable, List, NamedTuple, Optional, Tuple, cast

import pluggy

from host.core import hookspecs
from host.core.capabilities import Capabilities
from host.core.driver import Driver, UnavailableDriver

log = logging.getLogger(__name__)

# The entry-point value syntax of the packaging spec (and importlib.metadata's EntryPoint).
_VALUE = re.compile(r"(?P<module>[\w.]+)\s*(:\s*(?P<attr>[\w.]+)\s*)?((?P<extras>\[.*\])\s*)?$")
_METADATA_DIRS = (".dist-info", ".egg-info")
#: The distribution the built-in drivers come with (pyproject.toml's name).
OWN_DISTRIBUTION = "device-plugin-host"


class EntryPoint(NamedTuple):
    """One ``name = module:attr`` line of a distribution's entry_points.txt."""

    name: str
    value: str
    group: str

    def load(self) -> Any:
        match = _VALUE.match(self.value)
        if match is None:
            raise ValueError(f"malformed entry point value {self.value!r}")
        target: Any = importlib.import_module(match.group("module"))
        for attr in filter(None, (match.group("attr") or "").split(".")):
            target = getattr(target, attr)
        return target


def _entry_points(group: str) -> List[Tuple[EntryPoint, Optional[str]]]:
    """Entry points of a group with "distribution version" for each.

    Reads only each distribution's entry_points.txt, and the name and version header lines
    of those that declare ``group``, never every installed distribution's METADATA. The search
    is importlib.metadata's own: the *.dist-info and
    *.egg-info directories of every sys.path entry, in order; zipped path entries go through
    importlib.metadata itself.
    """
    header = f"[{group}]"
    found: List[Tuple[EntryPoint, Optional[str]]] = []
    seen = set()  # a distribution on sys.path twice: the first one wins, as in importlib
    for base in sys.path:
        directory = base or "."
        try:
            names = sorted(os.listdir(directory))
        except NotADirectoryError:
            found.extend(_zipped_entry_points(base, group))
            continue
        except OSError:
            continue
        for name in names:
            if not name.endswith(_METADATA_DIRS):
                continue
            project = re.sub(r"[-_.]+", "_", name.rsplit(".", 1)[0].split("-", 1)[0]).lower()
            if project in seen:
                continue
            seen.add(project)
            meta = os.path.join(directory, name)
            text = _read(os.path.join(meta, "entry_points.txt"))
            if text is None or header not in text:
                continue
            label = _label(meta)
            found.extend((EntryPoint(ep_name, value, group), label)
                         for ep_name, value in _section(text, group))
    return found


def _own_package(label: Optional[str]) -> bool:
    """Whether an entry point's "Name Version" label is this distribution's."""
    return label is not None and label.split(" ", 1)[0] == OWN_DISTRIBUTION


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except (OSError, UnicodeDecodeError):
        return None


def _section(text: str, group: str) -> Iterable[Tuple[str, str]]:
    """``name = value`` pairs of one ``[group]`` section (INI syntax, as setuptools writes)."""
    inside = False
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            inside = line[1:-1].strip() == group
            continue
        if inside:
            name, sep, value = line.partition("=")
            if sep and name.strip() and value.strip():
                yield name.strip(), value.strip()


def _label(meta: str) -> Optional[str]:
    """"Name Version" from the metadata file's header lines; broken metadata gives None."""
    text = _read(os.path.join(meta, "METADATA" if meta.endswith(".dist-info") else "PKG-INFO"))
    if text is None:
        return None
    fields: Dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the headers end at the first blank line; the description follows
        key, sep, value = line.partition(":")
        if sep and key in ("Name", "Version"):
            fields.setdefault(key, value.strip())
    if "Name" not in fields or "Version" not in fields:
        return None
    return f"{fields['Name']} {fields['Version']}"


def _zipped_entry_points(path: str, group: str) -> List[Tuple[EntryPoint, Optional[str]]]:
    """A zip file on sys.path (rare on a node): importlib.metadata reads inside it."""
    from importlib.metadata import distributions

    found = []
    try:
        for dist in distributions(path=[path]):
            for entry_point in dist.entry_points:
                if entry_point.group == group:
                    try:
                        label: Optional[str] = f"{dist.metadata['Name']} {dist.version}"
                    except Exception:
                        label = None
                    found.append((EntryPoint(entry_point.name, entry_point.value, group),
                                  label))
    except Exception as error:  # an unreadable archive must not stop the others
        log.debug("entry points in %s: %s", path, error)
    return found


class LoadFailure(NamedTuple):
    """A package or driver that could not be loaded, for logs, ``discover`` and metrics."""

    source: str  # "entry point NAME (dist VERSION)"
    reason: str
    driver: Optional[str] = None  # the driver (or entry point) name config files would use


#: The reason a disabled package's resources report, and what discover/check-config print.
DISABLED_REASON = "disabled by [host] disabled_drivers"


class DriverRegistry:
    # A plain class, like the records of this module (NamedTuples): nothing compares registries.
    def __init__(self) -> None:
        self.drivers: Dict[str, Driver] = {}
        self.sources: Dict[str, str] = {}
        self.failures: List[LoadFailure] = []
        #: Entry points skipped, never imported, because ``[host] disabled_drivers`` names
        #: them: entry-point name -> source.
        self.disabled: Dict[str, str] = {}
        self.manager = pluggy.PluginManager(hookspecs.PROJECT)
        self.manager.add_hookspecs(hookspecs)
        self._pending: List[Tuple[EntryPoint, Optional[str]]] = []
        self._blocked: FrozenSet[str] = frozenset()  # [host] disabled_drivers

    # -- loading ---------------------------------------------------------------------------
    def load_entry_points(self, group: str = hookspecs.ENTRY_POINT_GROUP,
                          first: Optional[Iterable[str]] = None,
                          disabled: Iterable[str] = ()) -> None:
        """Load the group's entry points. With ``first`` (the driver names a config file
        uses), only the entry points of those names load now, when they provide every one of
        them; the others wait for ``load_pending`` (a driver package's import is the biggest
        part of a start beyond grpc's own). A name no entry point of that name provides
        means a package whose drivers are named otherwise: everything loads.

        Entry points ``disabled`` names (``[host] disabled_drivers``: entry-point names, the
        driver names of the built-ins and of most packages) are never imported, now or
        pending, so a package that breaks or slows the host on import can be switched off
        without uninstalling it. The config loader refuses a resource of a disabled driver
        and serves none of its defaults."""
        self._blocked = frozenset(disabled)
        seen = set()
        found = []
        for entry_point, dist in sorted(_entry_points(group), key=lambda pair: pair[0].name):
            key = (entry_point.name, entry_point.value)
            if key in seen:  # the same distribution visible twice on sys.path
                continue
            seen.add(key)
            if entry_point.name in self._blocked:
                source = f"entry point {entry_point.name} ({dist or entry_point.value})"
                self.disabled[entry_point.name] = source
                log.info("%s: %s; not imported", source, DISABLED_REASON)
                continue
            found.append((entry_point, dist))
        if first is None:
            self._pending = []
            self._load(found)
            return
        wanted = set(first)
        self._pending = [pair for pair in found if pair[0].name not in wanted]
        self._load([pair for pair in found if pair[0].name in wanted])
        if not wanted <= set(self.with_unavailable()):
            self.load_pending()

    def load_pending(self, *, other_packages_only: bool = False) -> bool:
        """Load the entry points ``load_entry_points(first=...)`` left; True when any were.

        ``other_packages_only``: leave this distribution's own drivers pending. They are
        installed and tested with the host, so importing one that no resource uses only to
        see that it imports tells an operator nothing; another
        package's driver is loaded, so a broken install is in the log and the metrics at
        start. A reload loads the rest when it runs (host/cli/reload.py)."""
        if other_packages_only:
            load = [pair for pair in self._pending if not _own_package(pair[1])]
            self._pending = [pair for pair in self._pending if _own_package(pair[1])]
        else:
            load, self._pending = self._pending, []
        self._load(load)
        return bool(load)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def _load(self, entry_points: List[Tuple[EntryPoint, Optional[str]]]) -> None:
        for entry_point, dist in entry_points:
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
                # pluggy types a hook's result as object; list() of a non-iterable raises
                # TypeError, reported below like any other failure of the hook.
                drivers = list(cast(Iterable[object], impl.function() or ()))
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
        log.debug("driver %s from %s: %s", name, source, Capabilities.of(driver))

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

    def disabled_lines(self) -> List[str]:
        """One line per disabled package, for discover and check-config."""
        return [f"driver {name}: {source} is {DISABLED_REASON} (not loaded)"
                for name, source in sorted(self.disabled.items())]


def load_drivers(first: Optional[Iterable[str]] = None,
                 disabled: Iterable[str] = ()) -> DriverRegistry:
    registry = DriverRegistry()
    registry.load_entry_points(first=first, disabled=disabled)
    return registry


#: Larger files are refused by the config loader anyway (host/config/__init__.py MAX_CONFIG_BYTES).
_MAX_PRE_READ = 4 * 2**20 + 1


def _parsed(data: bytes) -> Any:
    """The file's TOML, parsed once for these reads and the config loader's (host/config/__init__.py
    parse_toml); raises ValueError (TOMLDecodeError, UnicodeError) for a bad file."""
    from host.config import parse_toml

    return parse_toml(data.decode("utf-8"))


def disabled_in_config(path: Optional[str], default_path: str) -> Tuple[str, ...]:
    """``[host] disabled_drivers`` of a config file, read before any driver is imported
    (the config loader needs the drivers to check selectors, so it runs after loading).

    Only a well-formed list of strings counts; anything else (no file, a FIFO, bad TOML, a
    wrong type) gives () here, and the config loader then rejects the file with the key and
    the reason. Opened like the loader opens it: non-blocking, a regular file only.
    """
    if path is None:
        if not os.path.lexists(default_path):
            return ()
        path = default_path
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return ()
    try:
        with open(fd, "rb") as stream:
            if not stat.S_ISREG(os.fstat(stream.fileno()).st_mode):
                return ()
            data = stream.read(_MAX_PRE_READ)
        if len(data) >= _MAX_PRE_READ:
            return ()
        document = _parsed(data)
    except (OSError, ValueError, RecursionError):  # TOMLDecodeError and UnicodeError too
        return ()
    host = document.get("host")
    names = host.get("disabled_drivers") if isinstance(host, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return ()
    return tuple(names)


def configured_drivers(path: Optional[str]) -> Optional[List[str]]:
    """The driver names a config file's resources use, read ahead of its validation so that
    only those drivers load before serving; None (load every driver) for a file that does
    not say, cannot be read or parsed (load_config then reports it), or has no resources
    (the drivers' defaults are served)."""
    if path is None:
        return None
    from host.config import MAX_CONFIG_BYTES

    try:  # as load_config reads it: a FIFO must not hang, a huge file is not read whole
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        with open(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                return None
            raw = handle.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            return None
        data = _parsed(raw)
    except Exception:  # load_config reports whatever is wrong with the file
        return None
    resources = data.get("resource") if isinstance(data, dict) else None
    if not isinstance(resources, list) or not resources:
        return None
    names = [r.get("driver") for r in resources if isinstance(r, dict)]
    if len(names) != len(resources) or not all(isinstance(n, str) and n for n in names):
        return None
    return sorted({n for n in names if isinstance(n, str)})  # all are, as checked above
