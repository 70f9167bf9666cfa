"""The process's memory around start-up: the cyclic collector paused while it starts, and
glibc's freed heap handed back to the kernel once it has."""

from __future__ import annotations

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


def pause_collector() -> None:
    """The program's entry points turn the cyclic garbage collector off until start-up is
    over: importing ~300 modules and building the first inventory set off collections whose
    passes over an ever larger heap found next to nothing, ~24 M instructions of a ~550 M
    start. ``run`` turns it back on (``collect_again``) once it has frozen what the start
    built, every other command as soon as its command line is parsed. Not part of
    host/process.py's configure_process: the test kit applies that one inside long test
    runs."""
    import gc

    gc.disable()


def collect_again() -> None:
    """The collector back on (see ``pause_collector``); a no-op where it was never off."""
    import gc

    gc.enable()
