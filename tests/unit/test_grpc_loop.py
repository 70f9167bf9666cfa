"""grpc.aio's spurious wake-up reports are dropped; every other report still reaches the
handler that was there (host/kubelet/aio.py)."""

from __future__ import annotations

import asyncio
import logging

from host.kubelet.aio import quiet_poller_wakeups

SPURIOUS = {"message": "Exception in callback PollerCompletionQueue._handle_events(<loop>)()",
            "exception": BlockingIOError(11, "Resource temporarily unavailable")}


def test_only_the_pollers_blocking_io_error_is_dropped(caplog):
    loop = asyncio.new_event_loop()
    seen = []
    try:
        loop.set_exception_handler(lambda loop, context: seen.append(context))
        quiet_poller_wakeups(loop)
        quiet_poller_wakeups(loop)  # once per loop: not wrapped twice
        handler = loop.get_exception_handler()
        assert handler is not None
        handler(loop, SPURIOUS)
        assert seen == []
        other = {"message": "Exception in callback something_else()",
                 "exception": BlockingIOError(11, "x")}
        handler(loop, other)
        real = {"message": SPURIOUS["message"], "exception": RuntimeError("a real failure")}
        handler(loop, real)
        assert seen == [other, real]
    finally:
        loop.close()


def test_without_a_handler_other_reports_reach_the_default_one(caplog):
    loop = asyncio.new_event_loop()
    try:
        quiet_poller_wakeups(loop)
        handler = loop.get_exception_handler()
        assert handler is not None
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            handler(loop, SPURIOUS)
            assert caplog.records == []
            handler(loop, {"message": "boom", "exception": ValueError("boom")})
        assert [r.getMessage() for r in caplog.records] == ["boom"]
    finally:
        loop.close()
