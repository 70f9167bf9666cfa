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


_heap_returned = False


def return_freed_heap() -> None:
    """Once per process, when start-up is over: hand glibc's free heap pages back to the
    kernel (``malloc_trim(0)``).

    Registering every resource is a burst: 64 Register calls in flight at once, the kubelet
    dialling each socket back, 64 first ListAndWatch snapshots. What grpc and Python
    allocated for it is freed, but glibc keeps the pages of the main heap and of grpc's
    threads' arenas. Idle afterwards,
    the host would never reuse most of them. Only once: later bursts (a kubelet restart)
    reuse what this leaves. A libc without malloc_trim (musl) is left alone.
    """
    global _heap_returned
    if _heap_returned:
        return
    _heap_returned = True
    try:
        import ctypes

        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def configure_process() -> None:
    """Apply the program's grpc defaults; must run before grpc is first imported."""
    for name, value in GRPC_DEFAULTS:
        os.environ.setdefault(name, value)


def pause_collector() -> None:
    """The program's entry points turn the cyclic garbage collector off until start-up is
    over: importing ~300 modules and building the first inventory set off collections whose
    passes over an ever larger heap found next to nothing, ~24 M instructions of a ~550 M
    start. ``run`` turns it back on (``collect_again``) once it has
    frozen what the start built, every other command as soon as its command line is parsed.
    Not part of configure_process: the test kit applies that one inside long test runs."""
    import gc

    gc.disable()


def collect_again() -> None:
    """The collector back on (see pause_collector); a no-op where it was never off."""
    import gc

    gc.enable()


def main() -> int:
    """The ``device-plugin-host`` console script: the program's settings, then the command
    line. host.cli is imported only after them, since its imports load grpc."""
    configure_process()
    pause_collector()
    from host.cli import main as cli_main

    return cli_main()
