"""Command line: run, discover, check-config, demo, capture."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import logging
import os
import signal
import sys
import traceback
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from host import __version__
from host.config import DEFAULT_CONFIG_PATH, Config, ConfigError, load_config, overlap_error
from host.drain import (
    DEFAULT_REASON,
    DrainError,
    clean_reason,
    key_error,
    read_drains,
    update_drains,
)
from host.driver import Driver
from host.hostfs import HostFS
from host.inventory import Inventory
from host.isolation import DriverCalls
from host.lock import HostLock, LockHeld, running_host
from host.logs import setup_logging
from host.model import Device, Health, ResourceConfig
from host.plugins import DriverRegistry, configured_drivers, disabled_in_config, load_drivers
from host.protocol import POD_RESOURCES_SOCKET
from host.reload import ConfigReloader, is_empty
from host.socket_names import KUBELET_SOCKET
from host.systemd import Notifier

if TYPE_CHECKING:
    from host.app import HostApp

log = logging.getLogger("host")

EXIT_CONFIG = 2
_DEBUG_HELP = "show the Python traceback when a command fails (for bug reports)"
_DRAIN_CONFIG_HELP = (f"TOML config whose drain_file holds the marks (default "
                      f"{DEFAULT_CONFIG_PATH} if present)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="device-plugin-host",
        description="Serve every kind of node device to the kubelet from one process.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    # Accepted after the command too (`capture --debug`); SUPPRESS keeps the top-level value.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help=_DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="what to do; `device-plugin-host COMMAND --help` for more")

    def add(name: str, *, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], help=help, description=help[0].upper()
                              + help[1:] + ".")


    run = add("run", help="serve and register every configured resource")
    _config_flags(run)
    run.add_argument("--plugin-dir", metavar="DIR",
                     help="the kubelet's device-plugin directory, where kubelet.sock is and our"
                          " sockets go (default: plugin_dir in [host], "
                          "/var/lib/kubelet/device-plugins)")

    discover = add("discover", help="print what would be advertised, then exit")
    _config_flags(discover)
    discover.add_argument("--json", action="store_true", help="a JSON array, one object a device")

    check = add("check-config", help="validate a config file (exit 2 when invalid)")
    check.add_argument("file", help="the TOML file to check (nothing is served or changed)")
    check.add_argument("--host-root", metavar="DIR",
                       help="scan the devices under DIR (default: the [host] host_root, the "
                            "live host) for devices two resources claim")

    demo = add("demo", help="run the real host against a sample tree and simulator")
    demo.add_argument("--keep", action="store_true", help="keep the temporary directory")

    drain = add("drain", help="mark a device Unhealthy by hand (for draining)")
    drain.add_argument("resource", nargs="?", help="the resource name, e.g. nvidia.com/gpu")
    drain.add_argument("device", nargs="?",
                       help="the device id as discover shows it (its replicas go with it)")
    drain.add_argument("--reason", default=DEFAULT_REASON,
                       help="why, shown as the device's health reason (default: %(default)s)")
    drain.add_argument("--config", help=_DRAIN_CONFIG_HELP)
    drain.add_argument("--list", action="store_true", help="print the current marks")
    undrain = add("undrain", help="remove a device's drain mark")
    undrain.add_argument("resource", help="the resource name of the mark")
    undrain.add_argument("device", help="the device id of the mark")
    undrain.add_argument("--config", help=_DRAIN_CONFIG_HELP)

    pods = add("pods", help="which pod holds which device (kubelet PodResources API)")
    pods.add_argument("--socket", default=POD_RESOURCES_SOCKET,
                      help=f"the kubelet's pod-resources socket (default {POD_RESOURCES_SOCKET})")
    pods.add_argument("--resource", help="only this resource name (or a pattern: 'nvidia.com/*')")
    pods.add_argument("--json", action="store_true", help="a JSON array, one object a row")
    pods.add_argument("--claims", action="store_true",
                      help="the DRA claims this host prepared (from its checkpoint) instead")
    pods.add_argument("--dra-state-dir", default="/var/lib/device-plugin-host/dra",
                      help="where the host keeps its prepared-claims checkpoint")

    capture = add("capture", help="write this machine's device tree as a .tree file")
    capture.add_argument("--host-root", default="/", metavar="DIR",
                         help="capture the tree under DIR instead of this machine's / "
                              "(DIR/sys, DIR/dev)")
    capture.add_argument("--output", "-o", default="-", metavar="FILE",
                         help="write to FILE (atomically) instead of standard output")
    return parser


def _config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE",
                        help=f"TOML config (default {DEFAULT_CONFIG_PATH} if present, else the "
                             "built-in defaults)")
    parser.add_argument("--host-root", metavar="DIR",
                        help="read sysfs at DIR/sys and devices at DIR/dev; the paths handed to "
                             "the kubelet stay host paths (default: host_root in [host], /)")


def _load(args: argparse.Namespace, registry: DriverRegistry) -> Config:
    config = load_config(args.config, registry.with_unavailable())
    return config.with_overrides(
        plugin_dir=getattr(args, "plugin_dir", None), host_root=getattr(args, "host_root", None)
    )


def host_root_problem(root: str) -> Optional[str]:
    """Why ``root`` cannot be a host root, or None. A mistyped --host-root would otherwise
    look like a machine without devices: every driver finds nothing under a missing tree."""
    if not os.path.lexists(root):
        return "does not exist"
    if not os.path.isdir(root):
        return "is not a directory"
    if not os.path.isdir(os.path.join(root, "sys")):
        return "has no sys/ directory: not a host's root (devices are read from DIR/sys)"
    return None


def _check_host_root(config: Config, *, from_flag: bool) -> None:
    root = config.host.host_root
    problem = host_root_problem(root)
    if problem is None:
        return
    if from_flag:
        raise ConfigError("command line", "--host-root", f"{root} {problem}")
    raise ConfigError(config.path or "built-in defaults", "host.host_root", f"{root} {problem}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Every operator-caused failure ends in one line on stderr and exit 1 (or 2 for a bad
    configuration or host root); a traceback only with ``--debug``."""
    args = _parser().parse_args(argv)
    try:
        code = _dispatch(args)
        sys.stdout.flush()  # a closed pipe shows up here when the output was buffered
        return code
    except BrokenPipeError:
        # The reader went away (`capture | head`): what it read is all it wanted.
        _discard_stdout()
        return 1
    except KeyboardInterrupt:
        return 130
    except CommandError as error:
        if args.debug:
            traceback.print_exc()
        print(f"device-plugin-host {args.command}: {error}", file=sys.stderr)
        return error.code
    except Exception as error:  # the last line of defence: one line for operators
        if args.debug:
            traceback.print_exc()
        else:
            print(f"device-plugin-host {args.command}: {describe_error(error)} "
                  "(--debug shows the traceback)", file=sys.stderr)
        return 1


class CommandError(Exception):
    """An operator-caused failure of a command: ``str()`` is the line to print."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def describe_error(error: BaseException) -> str:
    """One line for an unexpected error: an OS error's reason and path read like a shell's."""
    if isinstance(error, OSError) and error.strerror:
        where = f"{error.filename}: " if error.filename else ""
        return f"{where}{error.strerror}"
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _discard_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _dispatch(args: argparse.Namespace) -> int:
    quiet = args.command in ("discover", "check-config", "demo", "capture")
    setup_logging("warning" if quiet else "info")
    if args.command == "demo":
        from host.demo import run_demo

        return run_demo(keep=args.keep)
    if args.command == "capture":
        return _capture(args)
    if args.command == "pods":
        from host.podresources import pods_main

        if args.claims:
            return _claims(args)
        code = pods_main(args.socket, args.resource, args.json)
        if not args.json and os.path.isdir(args.dra_state_dir):
            _claims(args, quiet=True)
        return code
    # [host] disabled_drivers: those packages are never imported (host/plugins.py).
    config_file = args.file if args.command == "check-config" else args.config
    disabled = disabled_in_config(config_file, DEFAULT_CONFIG_PATH)
    if args.command == "run":  # the configured drivers first; the others once serving
        path = args.config or (DEFAULT_CONFIG_PATH if os.path.lexists(DEFAULT_CONFIG_PATH)
                               else None)
        registry = load_drivers(first=configured_drivers(path), disabled=disabled)
    else:
        registry = load_drivers(disabled=disabled)
    try:
        if args.command == "check-config":
            config = load_config(args.file, registry.with_unavailable())
            config = config.with_overrides(host_root=args.host_root)
            _check_overlaps(config, registry)
            print(f"{args.file}: valid: {_what_it_serves(args.file, config)}")
            for line in registry.disabled_lines():
                print(line)
            _note_running_host(config)
            return 0
        config = _load(args, registry)
        if args.command in ("discover", "run"):
            _check_host_root(config, from_flag=args.host_root is not None)
    except ConfigError as error:
        print(f"device-plugin-host: invalid configuration: {error}", file=sys.stderr)
        return EXIT_CONFIG
    if args.command == "discover":
        _note_running_host(config)
        for line in registry.disabled_lines():
            print(line, file=sys.stderr)
        return _discover(config, registry, as_json=args.json)
    if args.command in ("drain", "undrain"):
        return _drain(args, config)
    setup_logging(config.host.log_level, config.host.log_format, native_stderr=True)
    for line in registry.disabled_lines():  # loading ran before logging was set up
        log.info("%s", line)
    return _run(config, registry, args.config)


def _note_running_host(config: Config) -> None:
    """check-config and discover say when a host already serves the plugin directory: its
    view is what the kubelet sees, and `run` would refuse to start beside it."""
    holder = running_host(config.host.plugin_dir)
    if holder is not None:
        print(f"note: a device-plugin-host already serves {config.host.plugin_dir}: "
              f"{holder.describe()}", file=sys.stderr)


def _what_it_serves(path: str, config: Config) -> str:
    """check-config's summary; an empty file or one without [[resource]] is valid, but the
    operator must be told that it means the built-in defaults."""
    listed = ", ".join(r.name for r in config.resources) or "none"
    names = f"{len(config.resources)} resources ({listed})"
    if not config.is_default:
        return names
    try:
        with open(path, "rb") as handle:
            empty = is_empty(handle.read())
    except OSError:
        empty = False
    why = "the file is empty" if empty else "the file has no [[resource]]"
    return f"{why}, which means the built-in defaults: {names}"


def _check_overlaps(config: Config, registry: DriverRegistry) -> None:
    """A device two configured resources claim is a config error; only a scan shows it."""
    if config.is_default:
        return
    inventory, _ = asyncio.run(_scan_once(config, registry.with_unavailable(), warn=False))
    if inventory.overlaps:
        raise overlap_error(config, inventory.overlaps[0])


def _claims(args: argparse.Namespace, quiet: bool = False) -> int:
    """Prepared DRA claims; ``quiet``: the section after the PodResources table, if any."""
    from host.dra.claims_view import claim_rows, format_claims

    try:
        rows = claim_rows(args.dra_state_dir, args.resource)
    except (OSError, ValueError) as error:
        print(f"device-plugin-host pods: cannot read the DRA checkpoint in "
              f"{args.dra_state_dir}: {error}", file=sys.stderr)
        return 1
    if args.json and not quiet:
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    if rows:
        if quiet:
            print("\nprepared DRA claims:")
        for line in format_claims(rows):
            print(line)
    elif not quiet:
        print("no prepared DRA claims", file=sys.stderr)
    return 0


# -- run -------------------------------------------------------------------------------------
def _drain(args: argparse.Namespace, config: Config) -> int:
    path = config.host.drain_file
    try:
        if args.command == "drain" and (args.list or args.resource is None):
            for (resource, device), reason in sorted(read_drains(path).items()):
                print(f"{resource}\t{device}\t{reason}")
            return 0
        if args.device is None:
            raise CommandError("give RESOURCE and DEVICE (or --list)", EXIT_CONFIG)
        problem = key_error(args.resource, args.device)
        if problem is not None:
            raise CommandError(problem, EXIT_CONFIG)
        reason = args.reason if args.command == "drain" else None
        if reason is not None:
            try:
                reason = clean_reason(reason)
            except DrainError as error:  # a bad argument, like a bad name
                raise CommandError(f"--reason: {error}", EXIT_CONFIG) from None
        marks = update_drains(path, (args.resource, args.device), reason, missing_ok=False)
    except DrainError as error:
        raise CommandError(str(error)) from None
    if args.resource not in {r.name for r in config.resources}:  # a typo, or another config
        print(f"device-plugin-host {args.command}: note: {args.resource} is not among "
              f"{_config_source(config, short=True)}; the mark matters once it is served",
              file=sys.stderr)
    verb = "drained" if reason else "undrained"
    shown = f": {marks[(args.resource, args.device)]}" if reason else ""
    print(f"{verb} {args.resource} {args.device}{shown} ({path}); a running host applies it "
          "at once")
    return 0


async def _announce_ready(app: HostApp, notifier: Notifier, config: Config) -> None:
    """READY=1 once every resource is registered, but never held hostage by a kubelet that
    is not there yet: boot ordering (cloud-init running kubeadm join after
    multi-user.target) would otherwise deadlock. Without a kubelet, serving is ready."""
    if app.ready.is_set():
        return  # on_ready already sent it
    kubelet = os.path.join(config.host.plugin_dir, KUBELET_SOCKET)
    if not os.path.exists(kubelet):
        notifier.ready(f"serving {len(app.served())} resources; waiting for the kubelet at "
                       f"{kubelet}")
        return
    try:
        await asyncio.wait_for(app.ready.wait(), config.host.register_timeout_s)
    except asyncio.TimeoutError:
        pending = [name for name, ep in app.registrar.endpoints.items() if not ep.registered]
        notifier.ready(f"serving; registration pending for {', '.join(pending)}")


def _load_rest(registry: DriverRegistry, app: HostApp) -> None:
    if registry.load_pending():
        for name, driver in registry.with_unavailable().items():
            app.drivers.setdefault(name, driver)
            app.inventory.drivers.setdefault(name, driver)


def _run(config: Config, registry: DriverRegistry, config_path: Optional[str]) -> int:
    from host.app import HostApp

    drivers = registry.with_unavailable()
    if config_path is None and os.path.lexists(DEFAULT_CONFIG_PATH):
        config_path = DEFAULT_CONFIG_PATH

    async def serve() -> None:
        app = HostApp(config, drivers)
        reloader = ConfigReloader(app, config_path, registry, {
            "plugin_dir": config.host.plugin_dir, "host_root": config.host.host_root})
        notifier = Notifier()
        app.on_ready.append(lambda: notifier.ready(
            f"serving {len(app.served())} resources, all registered"))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        warned: List[OSError] = []

        def take_lock() -> None:
            """The plugin directory was missing or unwritable at start: lock it as soon as
            we could bind a socket there; another host that got there first stops us."""
            if lock.held or lost_lock:
                return
            try:
                lock.acquire()
            except LockHeld as error:
                lost_lock.append(error)
                stop.set()
            except OSError as error:
                if not warned:
                    warned.append(error)
                    log.warning("cannot lock %s (%s): a second host on this plugin directory "
                                "would not be stopped", lock.path, error.strerror or error)

        if not lock.held:
            app.registrar.link.on_dir_usable = take_lock
        log.info("device-plugin-host %s: plugin dir %s, host root %s, %d resources configured",
                 __version__, config.host.plugin_dir, config.host.host_root,
                 len(config.resources))
        try:
            notifier.start_watchdog()
            await app.metrics.start(config.host.metrics_address)
            await app.start()
            # Everything built so far lives as long as the process: keep it out of the cyclic
            # collector, whose full passes over ~80,000 objects (10,000 devices) took ~18 ms
            # and set ListAndWatch's p99. Here, at the process entry, not in HostApp.start:
            # a test or benchmark process starts hosts by the hundred.
            gc.freeze()
            reloader.on_outcome = lambda outcome: gc.freeze() if outcome == "applied" else None
            reloader.start()
            # The drivers no resource uses load once serving (a reload may name them; a broken
            # package is still reported): a moment after all are registered, or in 5 s.
            app.on_ready.append(lambda: loop.call_later(0.5, _load_rest, registry, app))
            loop.call_later(5.0, _load_rest, registry, app)
            announce = loop.create_task(_announce_ready(app, notifier, config))
            await stop.wait()
            announce.cancel()
            log.info("stopping: removing our sockets")
            notifier.stopping()
        finally:
            notifier.stop_watchdog()
            await reloader.aclose()
            await app.stop()
            await app.metrics.stop()

    lock = HostLock(config.host.plugin_dir)
    lost_lock: List[LockHeld] = []
    try:
        lock.acquire()
    except LockHeld as error:
        print(f"device-plugin-host: {error}", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as error:
        # A missing or read-only plugin dir: serving says so in one line and waits for it,
        # and the lock is taken the moment a socket of ours could be bound (take_lock).
        log.debug("cannot lock %s yet: %s", lock.path, error.strerror or error)
    try:
        asyncio.run(serve())
        if lost_lock:
            print(f"device-plugin-host: {lost_lock[0]}", file=sys.stderr)
            logging.shutdown()
            return EXIT_CONFIG
    except ConfigError as error:  # found only with a scan: devices two resources claim
        print(f"device-plugin-host: invalid configuration: {error}", file=sys.stderr)
        return EXIT_CONFIG
    except Exception as error:
        if type(error).__name__ != "DraStartError":  # host.dra loads only for DRA configs
            raise
        print(f"device-plugin-host: cannot serve DRA resources: {error}", file=sys.stderr)
        logging.shutdown()
        return EXIT_CONFIG
    finally:
        lock.release()
    logging.shutdown()
    if DriverCalls.stuck_threads():
        # A driver call that never returned: Python would wait for its thread forever.
        sys.stderr.flush()
        os._exit(0)
    return 0


# -- discover --------------------------------------------------------------------------------
def _discover(config: Config, registry: DriverRegistry, *, as_json: bool) -> int:
    drivers = registry.with_unavailable()
    inventory, empty = asyncio.run(_scan_once(config, drivers))
    rows: List[Dict[str, Any]] = []
    for resource in config.resources:
        for device in inventory.devices.get(resource.name, []):
            rows.append(device_record(resource.name, resource.driver, device))
            if resource.api == "dra":
                rows[-1]["dra"] = _dra_record(resource, device, config.host.node_name)
    summary = _resource_summary(config, inventory, empty)
    if as_json:
        # stdout stays the documented array of devices; what has none is told on stderr.
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
        for line in summary:
            print(line, file=sys.stderr)
    else:
        _print_table(rows)
        print()
        for line in summary:
            print(line)
    if not rows:
        kinds = ", ".join(sorted(registry.drivers)) or "none"
        print(
            f"nothing to serve: the drivers ({kinds}) found no devices under "
            f"{config.host.host_root} for {_config_source(config, short=True)}",
            file=sys.stderr,
        )
    return 0


def _config_source(config: Config, *, short: bool = False) -> str:
    """Where the resources come from, in words: a file, or the drivers' built-in defaults."""
    if not config.is_default:
        count = len(config.resources)
        return f"the {count} resource{'s' * (count != 1)} configured in {config.path}"
    if short:
        return "the built-in defaults"
    if config.path is None:
        return f"the built-in defaults (no config file at {DEFAULT_CONFIG_PATH})"
    return f"the built-in defaults ({config.path} has no [[resource]])"


def _resource_summary(config: Config, inventory: Inventory, empty: Dict[str, str]) -> List[str]:
    """One line per resource, devices or not: a resource that advertises nothing is exactly
    the one an operator runs discover for."""
    lines = [f"resources: {_config_source(config)}"]
    for resource in config.resources:
        devices = inventory.devices.get(resource.name, [])
        if devices:
            healthy = sum(1 for d in devices if d.healthy)
            word = "device" if len(devices) == 1 else "devices"
            lines.append(f"  {resource.name}: {len(devices)} {word} ({healthy} Healthy)")
            continue
        line = f"  {resource.name}: 0 devices: {empty.get(resource.name, 'reason unknown')}"
        if not resource.register_when_empty:
            line += " (a built-in default: registers once it has a device)"
        lines.append(line)
    return lines


async def _scan_once(config: Config, drivers: Dict[str, Driver],
                     warn: bool = True) -> Tuple[Inventory, Dict[str, str]]:
    """One scan, and for each resource that found nothing, why (while the pools exist)."""
    calls = DriverCalls()
    inventory = Inventory(
        HostFS(config.host.host_root), drivers, config.resources, calls,
        discover_timeout_s=config.host.discover_timeout_s, vanished_grace_s=0,
    )
    inventory.warn_overlaps = warn
    try:
        await inventory.scan()
        empty = {}
        for resource in config.resources:
            if not inventory.devices.get(resource.name):
                empty[resource.name] = await _why_empty(inventory, resource, config, calls)
    finally:
        calls.shutdown()
    return inventory, empty


async def _why_empty(inventory: Inventory, resource: ResourceConfig, config: Config,
                     calls: DriverCalls) -> str:
    """A driver failure, selectors that match nothing the driver sees, or a host without any
    such device. Selectors are told apart by asking the driver again without them."""
    status = inventory.status.get(resource.driver)
    if status is not None and status.last_error:
        return f"the driver failed: {status.last_error}"
    root = config.host.host_root
    if not resource.selectors:
        return f"the {resource.driver} driver found no devices under {root}"
    shown = ", ".join(f"{key}={json.dumps(value)}" for key, value in resource.selectors.items())
    driver = inventory.drivers[resource.driver]
    probe = dataclasses.replace(resource, selectors={})
    logging.disable(logging.WARNING)  # the scan above already said what the driver warns
    try:
        result = await calls.call(resource.driver, "discover", config.host.discover_timeout_s,
                                  driver.discover, inventory.host, [probe])
        seen: Optional[int] = len(list(result.get(resource.name, ())))
    except Exception:  # the answer is only a hint; the real scan already succeeded
        seen = None
    finally:
        logging.disable(logging.NOTSET)
    if seen:
        return (f"no match for its selectors ({shown}); the {resource.driver} driver sees "
                f"{seen} device{'s' * (seen != 1)} without them")
    if seen == 0:
        return f"the {resource.driver} driver found no devices under {root} (selectors: {shown})"
    return f"no match for its selectors ({shown})"


def device_record(resource: str, driver: str, device: Device) -> Dict[str, Any]:
    """The JSON shape of one advertised device; scripts rely on these keys."""
    return {
        "resource": resource,
        "id": device.id,
        "health": device.health.value,
        "health_reason": device.health_reason,
        "numa_nodes": list(device.numa_nodes),
        "device_nodes": [
            {"host_path": n.host_path, "container_path": n.container_path,
             "permissions": n.permissions}
            for n in device.device_nodes
        ],
        "mounts": [
            {"host_path": m.host_path, "container_path": m.container_path,
             "read_only": m.read_only}
            for m in device.mounts
        ],
        "env": dict(device.env),
        "annotations": dict(device.annotations),
        "cdi_devices": list(device.cdi_devices),
        "driver": driver,
        "attributes": dict(device.attributes),
    }


def _dra_record(resource: ResourceConfig, device: Device, node_name: str) -> Dict[str, Any]:
    """How a DRA resource's device appears in its ResourceSlice (names, attributes)."""
    from host.dra import naming, slices

    try:
        pool: Optional[str] = naming.pool_name(resource.name, node_name) if node_name else None
    except ValueError:
        pool = None
    return {
        "driver": naming.driver_name(resource.name, resource.dra_driver_name),
        "pool": pool,
        "device_name": naming.dra_device_name(device.id),
        "attributes": slices.device_attributes(device),
        "capacity": slices.device_capacity(device),
    }


def _print_table(rows: List[Dict[str, Any]]) -> None:
    headers = ("RESOURCE", "ID", "HEALTH", "NUMA", "DEVICE NODES", "DETAILS")
    table = []
    for row in rows:
        attrs = row["attributes"]
        details = " ".join(
            f"{k}={attrs[k]}" for k in ("vendor", "device", "kernel_driver", "model") if k in attrs
        )
        if "dra" in row:
            details = f"dra={row['dra']['device_name']} {details}".strip()
        if row["health"] != Health.HEALTHY.value and row["health_reason"]:
            details = f"({row['health_reason']}) {details}".strip()
        table.append((
            row["resource"], row["id"], row["health"],
            ",".join(str(n) for n in row["numa_nodes"]) or "-",
            ",".join(n["host_path"] for n in row["device_nodes"]) or "-",
            details,
        ))
    widths = [max([len(h)] + [len(r[i]) for r in table]) for i, h in enumerate(headers[:-1])]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)) + "  " + headers[-1])
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])


# -- capture ---------------------------------------------------------------------------------
def _capture(args: argparse.Namespace) -> int:
    from host.capture import capture_tree, driver_dev_globs

    # The /dev nodes each installed driver says it owns (its device_globs).
    globs = driver_dev_globs(load_drivers().drivers.values())
    problem = host_root_problem(args.host_root)
    if problem is not None:
        raise CommandError(f"--host-root {args.host_root} {problem}", EXIT_CONFIG)
    lines = capture_tree(args.host_root, globs)
    if args.output == "-":
        for line in lines:
            print(line)
        return 0
    # Written beside the target and renamed: a failed capture leaves no half file behind.
    directory = os.path.dirname(os.path.abspath(args.output))
    import tempfile  # random, shutil and compressors: only for capture

    try:
        fd, temp = tempfile.mkstemp(dir=directory, prefix=".capture.", suffix=".tmp")
    except OSError as error:
        raise CommandError(f"cannot write {args.output}: {error.strerror or error}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            for line in lines:
                out.write(line + "\n")
        os.chmod(temp, 0o644)
        os.replace(temp, args.output)
    except OSError as error:
        raise CommandError(f"cannot write {args.output}: {error.strerror or error}") from None
    finally:
        if os.path.lexists(temp):
            os.unlink(temp)
    return 0
