"""Process-wide settings that belong to the program, applied by its entry points only.

Importing ``host`` changes no process setting, so a driver package, test run or tool that
imports a data type keeps its environment. ``device-plugin-host`` (the console script,
``host.cli.main``) and ``python -m host`` apply them first thing, before anything imports grpc
(grpc core reads them once, at its own import).
"""

from __future__ import annotations

import os

#: The settings and their defaults; an operator's own value always wins (setdefault).
GRPC_DEFAULTS = (
    # grpc core logs every GOAWAY at INFO: hundreds of lines per kubelet restart. Errors only,
    # unless the operator asks for more.
    ("GRPC_VERBOSITY", "ERROR"),
    # The host forks only to exec (a driver's pre-start program); grpc's fork handlers are for
    # children that keep using grpc, and some grpcio releases crash such a child in them.
    ("GRPC_ENABLE_FORK_SUPPORT", "false"),
)


def configure_process() -> None:
    """Apply the program's grpc defaults; must run before grpc is first imported."""
    for name, value in GRPC_DEFAULTS:
        os.environ.setdefault(name, value)


def main() -> int:
    """The ``device-plugin-host`` console script: the program's settings, then the command
    line. host.cli is imported only after them, since its imports load grpc."""
    from host.memory import pause_collector

    configure_process()
    pause_collector()
    from host.cli import main as cli_main

    return cli_main()
