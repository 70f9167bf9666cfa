"""Command line: run, discover, check-config, demo, capture."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from host import __version__
from host.config import DEFAULT_CONFIG_PATH, Config, ConfigError, load_config
from host.drain import read_drains, update_drains
from host.driver import Driver
from host.hostfs import HostFS
from host.inotify import DirectoryWatch
from host.inventory import Inventory
from host.isolation import DriverCalls
from host.logs import setup_logging
from host.model import Device
from host.plugins import DriverRegistry, load_drivers
from host.protocol import POD_RESOURCES_SOCKET
from host.systemd import Notifier

if TYPE_CHECKING:
    from host.app import HostApp

log = logging.getLogger("host")

EXIT_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="device-plugin-host",
        description="Serve every kind of node device to the kubelet from one process.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="serve and register every configured resource")
    _config_flags(run)
    run.add_argument("--plugin-dir", help="kubelet device-plugin directory")

    discover = sub.add_parser("discover", help="print what would be advertised, then exit")
    _config_flags(discover)
    discover.add_argument("--json", action="store_true", help="a JSON array, one object a device")

    check = sub.add_parser("check-config", help="validate a config file (exit 2 when invalid)")
    check.add_argument("file")

    demo = sub.add_parser("demo", help="run the real host against a sample tree and simulator")
    demo.add_argument("--keep", action="store_true", help="keep the temporary directory")

    drain = sub.add_parser("drain", help="mark a device Unhealthy by hand (for draining)")
    drain.add_argument("resource", nargs="?")
    drain.add_argument("device", nargs="?")
    drain.add_argument("--reason", default="drained by an operator")
    drain.add_argument("--config", help=f"TOML config (default {DEFAULT_CONFIG_PATH})")
    drain.add_argument("--list", action="store_true", help="print the current marks")
    undrain = sub.add_parser("undrain", help="remove a device's drain mark")
    undrain.add_argument("resource")
    undrain.add_argument("device")
    undrain.add_argument("--config", help=f"TOML config (default {DEFAULT_CONFIG_PATH})")

    pods = sub.add_parser("pods", help="which pod holds which device (kubelet PodResources API)")
    pods.add_argument("--socket", default=POD_RESOURCES_SOCKET,
                      help=f"the kubelet's pod-resources socket (default {POD_RESOURCES_SOCKET})")
    pods.add_argument("--resource", help="only this resource name (or a pattern: 'nvidia.com/*')")
    pods.add_argument("--json", action="store_true", help="a JSON array, one object a row")

    capture = sub.add_parser("capture", help="write this machine's device tree as a .tree file")
    capture.add_argument("--host-root", default="/")
    capture.add_argument("--output", "-o", default="-")
    return parser


def _config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help=f"TOML config (default {DEFAULT_CONFIG_PATH} if present)")
    parser.add_argument("--host-root", help="read sysfs at DIR/sys and devices at DIR/dev")


def _load(args: argparse.Namespace, registry: DriverRegistry) -> Config:
    config = load_config(args.config, registry.with_unavailable())
    return config.with_overrides(
        plugin_dir=getattr(args, "plugin_dir", None), host_root=getattr(args, "host_root", None)
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    quiet = args.command in ("discover", "check-config", "demo", "capture")
    setup_logging("warning" if quiet else "info")
    if args.command == "demo":
        from host.demo import run_demo

        return run_demo(keep=args.keep)
    if args.command == "capture":
        return _capture(args)
    if args.command == "pods":
        from host.podresources import pods_main

        return pods_main(args.socket, args.resource, args.json)
    registry = load_drivers()
    try:
        if args.command == "check-config":
            config = load_config(args.file, registry.with_unavailable())
            print(f"{args.file}: valid: {len(config.resources)} resources "
                  f"({', '.join(r.name for r in config.resources) or 'none'})")
            return 0
        config = _load(args, registry)
    except ConfigError as error:
        print(f"device-plugin-host: invalid configuration: {error}", file=sys.stderr)
        return EXIT_CONFIG
    if args.command == "discover":
        return _discover(config, registry, as_json=args.json)
    if args.command in ("drain", "undrain"):
        return _drain(args, config)
    setup_logging(config.host.log_level, config.host.log_format, native_stderr=True)
    return _run(config, registry, args.config)


# -- run -------------------------------------------------------------------------------------
def _drain(args: argparse.Namespace, config: Config) -> int:
    path = config.host.drain_file
    if args.command == "drain" and (args.list or not args.resource):
        for (resource, device), reason in sorted(read_drains(path).items()):
            print(f"{resource}\t{device}\t{reason}")
        return 0
    if not args.device:
        print("device-plugin-host drain: give RESOURCE and DEVICE (or --list)", file=sys.stderr)
        return EXIT_CONFIG
    reason = args.reason if args.command == "drain" else None
    update_drains(path, (args.resource, args.device), reason)
    verb = "drained" if reason else "undrained"
    print(f"{verb} {args.resource} {args.device} ({path}); a running host applies it at once")
    return 0


class _ConfigReloader:
    """Reload on SIGHUP or when the config file changes (a ConfigMap update swaps its
    ``..data`` link); an invalid new file is rejected and the running set stays."""

    def __init__(self, app: HostApp, path: Optional[str], registry: DriverRegistry,
                 overrides: Dict[str, Optional[str]]) -> None:
        self.app = app
        self.path = path
        self.registry = registry
        self.overrides = overrides
        self._digest = self._read_digest()
        self._watch: Optional[DirectoryWatch] = None
        self._pending: Optional[asyncio.TimerHandle] = None

    def _read_digest(self) -> Optional[bytes]:
        if not self.path:
            return None
        try:
            with open(self.path, "rb") as handle:
                return hashlib.sha256(handle.read()).digest()
        except OSError:
            return None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, lambda: self.schedule(force=True))
        if self.path:
            name = os.path.basename(self.path)

            def changed(names: Optional[List[str]]) -> None:
                if names is None or name in names or "..data" in names:
                    self.schedule()

            self._watch = DirectoryWatch(os.path.dirname(os.path.abspath(self.path)), changed)
            self._watch.start()

    def schedule(self, force: bool = False) -> None:
        """Debounced: editors and ConfigMap updates write in several steps."""
        if self._pending is not None:
            self._pending.cancel()
        self._pending = asyncio.get_running_loop().call_later(
            0.05, lambda: asyncio.ensure_future(self.reload(force)))

    async def reload(self, force: bool) -> None:
        self._pending = None
        digest = self._read_digest()
        if not force and digest == self._digest:
            return
        self._digest = digest
        try:
            config = load_config(self.path, self.registry.with_unavailable())
            config = config.with_overrides(**self.overrides)
        except ConfigError as error:
            log.error("reload rejected, still serving the previous configuration: %s", error)
            return
        log.info("reloading the configuration from %s", self.path or "built-in defaults")
        await self.app.reload(config)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
        if self._pending is not None:
            self._pending.cancel()


async def _announce_ready(app: HostApp, notifier: Notifier, config: Config) -> None:
    """READY=1 once every resource is registered, but never held hostage by a kubelet that
    is not there yet: boot ordering (cloud-init running kubeadm join after
    multi-user.target) would otherwise deadlock. Without a kubelet, serving is ready."""
    if app.ready.is_set():
        return  # on_ready already sent it
    kubelet = os.path.join(config.host.plugin_dir, "kubelet.sock")
    if not os.path.exists(kubelet):
        notifier.ready(f"serving {len(app.served())} resources; waiting for the kubelet at "
                       f"{kubelet}")
        return
    try:
        await asyncio.wait_for(app.ready.wait(), config.host.register_timeout_s)
    except asyncio.TimeoutError:
        pending = [name for name, ep in app.registrar.endpoints.items() if not ep.registered]
        notifier.ready(f"serving; registration pending for {', '.join(pending)}")


def _run(config: Config, registry: DriverRegistry, config_path: Optional[str]) -> int:
    from host.app import HostApp

    drivers = registry.with_unavailable()
    if config_path is None and os.path.lexists(DEFAULT_CONFIG_PATH):
        config_path = DEFAULT_CONFIG_PATH

    async def serve() -> None:
        app = HostApp(config, drivers)
        reloader = _ConfigReloader(app, config_path, registry, {
            "plugin_dir": config.host.plugin_dir, "host_root": config.host.host_root})
        notifier = Notifier()
        app.on_ready.append(lambda: notifier.ready(
            f"serving {len(app.served())} resources, all registered"))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        log.info("device-plugin-host %s: plugin dir %s, host root %s, %d resources configured",
                 __version__, config.host.plugin_dir, config.host.host_root,
                 len(config.resources))
        try:
            notifier.start_watchdog()
            await app.metrics.start(config.host.metrics_address)
            await app.start()
            reloader.start()
            announce = loop.create_task(_announce_ready(app, notifier, config))
            await stop.wait()
            announce.cancel()
            log.info("stopping: removing our sockets")
            notifier.stopping()
        finally:
            notifier.stop_watchdog()
            reloader.close()
            await app.stop()
            await app.metrics.stop()

    asyncio.run(serve())
    logging.shutdown()
    if DriverCalls.stuck_threads():
        # A driver call that never returned: Python would wait for its thread forever.
        sys.stderr.flush()
        os._exit(0)
    return 0


# -- discover --------------------------------------------------------------------------------
def _discover(config: Config, registry: DriverRegistry, *, as_json: bool) -> int:
    drivers = registry.with_unavailable()
    inventory = asyncio.run(_scan_once(config, drivers))
    rows: List[Dict[str, Any]] = []
    for resource in config.resources:
        for device in inventory.devices.get(resource.name, []):
            rows.append(device_record(resource.name, resource.driver, device))
    if as_json:
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print_table(rows)
    if not rows:
        kinds = ", ".join(sorted(registry.drivers)) or "none"
        print(
            f"nothing to serve: the drivers ({kinds}) found no devices under "
            f"{config.host.host_root} for the {len(config.resources)} configured resources",
            file=sys.stderr,
        )
    return 0


async def _scan_once(config: Config, drivers: Dict[str, Driver]) -> Inventory:
    calls = DriverCalls()
    inventory = Inventory(
        HostFS(config.host.host_root), drivers, config.resources, calls,
        discover_timeout_s=config.host.discover_timeout_s, vanished_grace_s=0,
    )
    try:
        await inventory.scan()
    finally:
        calls.shutdown()
    return inventory


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


def _print_table(rows: List[Dict[str, Any]]) -> None:
    headers = ("RESOURCE", "ID", "HEALTH", "NUMA", "DEVICE NODES", "DETAILS")
    table = []
    for row in rows:
        attrs = row["attributes"]
        details = " ".join(
            f"{k}={attrs[k]}" for k in ("vendor", "device", "kernel_driver", "model") if k in attrs
        )
        if row["health"] != "Healthy" and row["health_reason"]:
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
    from host.testing.tree import capture_tree

    globs = ("/dev/nvidia*", "/dev/nvidia-caps/*", "/dev/kfd", "/dev/dri/*",
             "/dev/dri/by-path/*", "/dev/infiniband/*", "/dev/vfio/*",
             "/dev/bus/usb/*/*", "/dev/dfl-*", "/dev/xclmgmt*", "/dev/ttyUSB*", "/dev/ttyACM*",
             "/dev/hidraw*", "/dev/video*", "/dev/accel/*")
    lines = capture_tree(args.host_root, globs)
    if args.output == "-":
        for line in lines:
            print(line)
    else:
        with open(args.output, "w", encoding="utf-8") as out:
            for line in lines:
                out.write(line + "\n")
    return 0
