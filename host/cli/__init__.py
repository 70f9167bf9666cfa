"""Command line: argument parsing and the small commands (check-config, drain, pods, capture).

``run`` lives in host/cli/serve.py and ``discover`` in host/cli/discovery.py; this module parses,
loads the config the same way for every command, and turns every operator-caused error into
one line and an exit code (host/cli/exit.py), never a traceback. Every command's and flag's
definition (their help texts are the operator's reference) is in one ``_parser``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import traceback
from typing import TYPE_CHECKING, Callable, Dict, Optional, Sequence

from host import __version__
from host.cli.discovery import config_source, discover, scan_once
from host.cli.exit import EXIT_CONFIG, CommandError
from host.cli.lock import running_host, state_dir_of
from host.cli.logs import setup_logging
from host.cli.reload import is_empty
from host.cli.serve import run
from host.config import DEFAULT_CONFIG_PATH, Config, ConfigError, load_config, overlap_error
from host.config.plugins import DriverRegistry, configured_drivers, disabled_in_config, load_drivers
from host.core.drains import (
    DEFAULT_REASON,
    DrainError,
    clean_reason,
    key_error,
    read_drains,
    update_drains,
)
from host.kubelet.socket_names import POD_RESOURCES_SOCKET
from host.memory import collect_again

if TYPE_CHECKING:
    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]

log = logging.getLogger("host")

_DEBUG_HELP = "show the Python traceback when a command fails (for bug reports)"
_DRAIN_CONFIG_HELP = (f"TOML config whose drain_file holds the marks (default "
                      f"{DEFAULT_CONFIG_PATH} if present)")


class _Formatter(argparse.HelpFormatter):
    """argparse's own formatter, told the terminal width: by itself it asks
    shutil.get_terminal_size, and the daemon does not import shutil (with bz2 and lzma).
    Same rule: $COLUMNS, else the terminal's,
    else 80, less 2."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: Optional[int] = None) -> None:
        if width is None:
            try:
                width = int(os.environ["COLUMNS"])
            except (KeyError, ValueError):
                stdout = sys.__stdout__
                try:
                    width = os.get_terminal_size(stdout.fileno()).columns if stdout else 80
                except (AttributeError, ValueError, OSError):
                    width = 80
            width -= 2
        super().__init__(prog, indent_increment, max_help_position, width)


#: The commands, in the order ``--help`` lists them.
COMMANDS = ("run", "discover", "check-config", "demo", "drain", "undrain", "pods", "capture")


def _parser(only: Optional[str] = None) -> argparse.ArgumentParser:
    """The whole command line, or with ``only`` just that command's part: a command
    line that names its command needs no other (``_command_of`` says when that is safe)."""
    parser = argparse.ArgumentParser(
        prog="device-plugin-host",
        description="Serve every kind of node device to the kubelet from one process.",
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    # Accepted after the command too (`capture --debug`); SUPPRESS keeps the top-level value.
    common = argparse.ArgumentParser(add_help=False, formatter_class=_Formatter)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help=_DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="what to do; `device-plugin-host COMMAND --help` for more")
    for name in COMMANDS:
        if only is None or only == name:
            _COMMAND_FLAGS[name](sub, common)
    return parser


def _command_of(argv: Sequence[str]) -> Optional[str]:
    """The command ``argv`` names, when only that command's parser is needed to parse it:
    the first word that is not an option, with no option before it but ``--debug`` (the
    top-level ``--help`` and ``--version`` need every command)."""
    for word in argv:
        if word == "--debug":
            continue
        return word if word in COMMANDS else None
    return None


def _add(sub: Subcommands, common: argparse.ArgumentParser, name: str, *,
         help: str) -> argparse.ArgumentParser:
    return sub.add_parser(
        name, parents=[common], help=help, description=help[0].upper() + help[1:] + ".",
        formatter_class=_Formatter)


def _run_flags(sub: Subcommands, common: argparse.ArgumentParser) -> None:
    run = _add(sub, common, "run", help="serve and register every configured resource")
    _config_flags(run)
    run.add_argument("--plugin-dir", metavar="DIR",
                     help="the kubelet's device-plugin directory, where kubelet.sock is and our"
                          " sockets go (default: plugin_dir in [host], "
                          "/var/lib/kubelet/device-plugins)")


def _discover_flags(sub: Subcommands, common: argparse.ArgumentParser) -> None:
    discover = _add(sub, common, "discover", help="print what would be advertised, then exit")
    _config_flags(discover)
    discover.add_argument("--json", action="store_true", help="a JSON array, one object a device")


def _check_flags(sub: Subcommands, common: argparse.ArgumentParser) -> None:
    check = _add(sub, common, "check-config", help="validate a config file (exit 2 when invalid)")
    check.add_argument("file", help="the TOML file to check (nothing is served or changed)")
    check.add_argument("--host-root", metavar="DIR",
                       help="scan the devices under DIR (default: the [host] host_root, the "
                            "live host) for devices two resources claim")


def _demo_flags(sub: Subcommands, common: argparse.ArgumentParser) -> None:
    demo = _add(sub, common, "demo", help="run the real host against a sample tree and simulator")
    demo.add_argument("--keep", action="store_true", help="keep the temporary directory")


def _drain_flags(sub: Subcommands, common: argparse.ArgumentParser) -> None:
    drain = _add(sub, common, "drain", help="mark a device Unhealthy by hand (for draining)")
    drain.add_argument("resource", nargs="?", help="the resource name, e.g. nvidia.com/gpu")
    drain.add_argument("device", nargs="?",
                       help="the device id as discover shows it (its replicas go with it)")
    drain.add_argument("--reason", default=DEFAULT_REASON,
                       help="why, shown as the device's health reason (default: %(default)s)")
    drain.add_argument("--config", help=_DRAIN_CONFIG_HELP)
    drain.add_argument("--list", action="store_true", help="print the current marks")


def _undrain_flags(sub: Subcommands, common: argparse.ArgumentParser) -> None:
    undrain = _add(sub, common, "undrain", help="remove a device's drain mark")
    undrain.add_argument("resource", help="the resource name of the mark")
    undrain.add_argument("device", help="the device id of the mark")
    undrain.add_argument("--config", help=_DRAIN_CONFIG_HELP)


def _pods_flags(sub: Subcommands, common: argparse.ArgumentParser) -> None:
    pods = _add(sub, common, "pods", help="which pod holds which device (kubelet PodResources API)")
    pods.add_argument("--socket", default=POD_RESOURCES_SOCKET,
                      help=f"the kubelet's pod-resources socket (default {POD_RESOURCES_SOCKET})")
    pods.add_argument("--resource", help="only this resource name (or a pattern: 'nvidia.com/*')")
    pods.add_argument("--json", action="store_true", help="a JSON array, one object a row")
    pods.add_argument("--claims", action="store_true",
                      help="the DRA claims this host prepared (from its checkpoint) instead")
    pods.add_argument("--dra-state-dir", default="/var/lib/device-plugin-host/dra",
                      help="where the host keeps its prepared-claims checkpoint")


def _capture_flags(sub: Subcommands, common: argparse.ArgumentParser) -> None:
    capture = _add(sub, common, "capture", help="write this machine's device tree as a .tree file")
    capture.add_argument("--host-root", default="/", metavar="DIR",
                         help="capture the tree under DIR instead of this machine's / "
                              "(DIR/sys, DIR/dev)")
    capture.add_argument("--output", "-o", default="-", metavar="FILE",
                         help="write to FILE (atomically) instead of standard output")


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


_COMMAND_FLAGS: Dict[str, Callable[[Subcommands, argparse.ArgumentParser], None]] = {
    "run": _run_flags, "discover": _discover_flags, "check-config": _check_flags,
    "demo": _demo_flags, "drain": _drain_flags, "undrain": _undrain_flags,
    "pods": _pods_flags, "capture": _capture_flags,
}


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
    words = sys.argv[1:] if argv is None else list(argv)
    args = _parser(_command_of(words)).parse_args(words)
    if args.command != "run":
        collect_again()  # off only for the daemon's start (host/memory.py)
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
        from host.cli.demo import run_demo

        return run_demo(keep=args.keep)
    if args.command == "capture":
        return _capture(args)
    if args.command == "pods":
        from host.kubelet.podresources import pods_main

        if args.claims:
            return _claims(args)
        code = pods_main(args.socket, args.resource, args.json)
        if not args.json and os.path.isdir(args.dra_state_dir):
            _claims(args, quiet=True)
            _apis(args)
        return code
    # [host] disabled_drivers: those packages are never imported (host/config/plugins.py).
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
            if not _check_dra_node(config):
                return EXIT_CONFIG
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
        return discover(config, registry, as_json=args.json)
    if args.command in ("drain", "undrain"):
        return _drain(args, config)
    setup_logging(config.host.log_level, config.host.log_format, native_stderr=True)
    for line in registry.disabled_lines():  # loading ran before logging was set up
        log.info("%s", line)
    return run(config, registry, args.config)


def _note_running_host(config: Config) -> None:
    """check-config and discover say when a host already serves the plugin directory: its
    view is what the kubelet sees, and `run` would refuse to start beside it."""
    holder = running_host(config.host.plugin_dir, state_dir_of(config.host.drain_file))
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


def _check_dra_node(config: Config) -> bool:
    """check-config's word on the node name DRA resources need: which case exits 2 at
    ``run`` (a name that is no Node name) and which is waited for (a Node not registered
    yet). False when ``run`` would exit 2 here."""
    from host.config.values import dns_subdomain_error

    if not any(r.api == "dra" for r in config.resources):
        return True
    name = config.host.node_name
    if not name:
        print("DRA: no node name here ([host] node_name / NODE_NAME): `run` exits 2 (a "
              "configuration error) unless its environment sets NODE_NAME")
        return True
    problem = dns_subdomain_error(name)
    if problem:
        print(f"device-plugin-host: invalid configuration: node name {name!r} (NODE_NAME) is "
              f"not a valid Node name: {problem}", file=sys.stderr)
        return False
    print(f"DRA: node {name}: if its Node is not registered yet, `run` waits for it (a "
          "warning once, a note on /healthz) and serves the device plugin resources meanwhile; "
          "not an error")
    return True


def _check_overlaps(config: Config, registry: DriverRegistry) -> None:
    """A device two configured resources claim is a config error; only a scan shows it."""
    if config.is_default:
        return
    inventory, _ = asyncio.run(scan_once(config, registry.with_unavailable(), warn=False))
    if inventory.overlaps:
        raise overlap_error(config, inventory.overlaps[0])


def _apis(args: argparse.Namespace) -> None:
    """Which API serves each resource, as the running host last wrote it (moves included)."""
    import fnmatch

    from host.migration import STATE_FILE

    try:
        with open(os.path.join(args.dra_state_dir, STATE_FILE), encoding="utf-8") as handle:
            serving = json.load(handle).get("resources") or {}
    except (OSError, ValueError, AttributeError):
        return
    rows = [(name, str(api)) for name, api in sorted(serving.items())
            if not args.resource or fnmatch.fnmatchcase(name, args.resource)]
    if rows:
        print("\nserved through:")
        width = max(len(name) for name, _ in rows)
        for name, api in rows:
            print(f"  {name:<{width}}  {api}")


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
            for (resource, device), why in sorted(read_drains(path).items()):
                print(f"{resource}\t{device}\t{why}")
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
              f"{config_source(config, short=True)}; the mark matters once it is served",
              file=sys.stderr)
    verb = "drained" if reason else "undrained"
    shown = f": {marks[(args.resource, args.device)]}" if reason else ""
    print(f"{verb} {args.resource} {args.device}{shown} ({path}); a running host applies it "
          "at once")
    return 0


# -- discover --------------------------------------------------------------------------------


# -- capture ---------------------------------------------------------------------------------
def _capture(args: argparse.Namespace) -> int:
    from host.cli.capture import capture_tree, driver_dev_globs

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
    from host.core.fileio import write_atomic

    try:
        write_atomic(os.path.abspath(args.output), "".join(line + "\n" for line in lines),
                     mode=0o644, prefix=".capture.")
    except OSError as error:
        raise CommandError(f"cannot write {args.output}: {error.strerror or error}") from None
    return 0
