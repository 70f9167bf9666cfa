"""The event loop's side of grpc.aio.

grpc.aio wakes every event loop that ever used it in the process through one notification
socket (its ``PollerCompletionQueue``; grpc/grpc#25364): where more than one is bound, every
bound loop is woken, one reads the byte, and grpc's callback in the others raises
BlockingIOError into their exception handler, which logs an ERROR with a traceback although
nothing was lost. ``quiet_poller_wakeups`` drops exactly that report.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Dict

log = logging.getLogger(__name__)
_POLLER_CALLBACK = "PollerCompletionQueue._handle_events"


def _spurious(context: Dict[str, Any]) -> bool:
    return (isinstance(context.get("exception"), BlockingIOError)
            and _POLLER_CALLBACK in str(context.get("message", "")))


def quiet_poller_wakeups(loop: asyncio.AbstractEventLoop) -> None:
    """Install, once per loop, a handler that drops grpc's spurious BlockingIOError reports
    and hands every other report to the handler that was there (or the loop's default)."""
    previous = loop.get_exception_handler()
    if getattr(previous, "quiet_poller_wakeups", False):
        return

    def handler(loop: asyncio.AbstractEventLoop, context: Dict[str, Any]) -> None:
        if _spurious(context):
            log.debug("grpc woke this loop for an event another loop took (grpc/grpc#25364)")
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    handler.quiet_poller_wakeups = True  # type: ignore[attr-defined]
    loop.set_exception_handler(handler)
