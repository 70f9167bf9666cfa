"""Structured logs to stderr, plain or JSON, naming resource, driver and device when known.

Code passes context with ``extra={"resource": ..., "driver": ..., "device": ...}``; the plain
format appends it as key=value, the JSON format as fields, so a log pipeline can filter on it.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Optional

CONTEXT_FIELDS = ("resource", "driver", "device")
QUIET_LIBRARIES = ("httpx", "httpcore")  # at WARNING unless the level is debug

# The house style names what a line concerns in its text ("resource nvidia.com/gpu: ...",
# "driver 'gpu' ...", "device 0000:3b:00.0 ..."); these recover the fields from it for lines
# whose caller did not pass them with ``extra``, so JSON logs can be filtered on them.
_FROM_TEXT = {
    "resource": re.compile(r"\bresources? \(?([a-z0-9][-a-z0-9.]*/[A-Za-z0-9][-A-Za-z0-9_.]*)"),
    "driver": re.compile(r"\bdriver '([^']+)'|\bdriver ([A-Za-z0-9_.-]+)"),
    "device": re.compile(r"\bdevice ([^\s;,()']+)"),
}


class ContextFilter(logging.Filter):
    """Fill record.resource/driver/device from the message where not given explicitly."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string must still be logged
            return True
        for field, pattern in _FROM_TEXT.items():
            if hasattr(record, field):
                continue
            match = pattern.search(message)
            if match:
                value = next((g for g in match.groups() if g), None) if match.groups() else None
                if value:
                    setattr(record, field, value.rstrip(".:"))
        return True


class PlainFormatter(logging.Formatter):
    """For people: the message already names what it concerns, so no repeated fields."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in CONTEXT_FIELDS:
            if hasattr(record, key):
                entry[key] = getattr(record, key)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(level: str = "info", fmt: str = "plain", stream: Optional[object] = None,
                  native_stderr: bool = False) -> None:
    """``native_stderr``: with JSON, also turn what native code (gRPC) prints on fd 2 into
    JSON lines (host.cli.native_stderr); only for the host process, never inside tests."""
    if native_stderr and fmt == "json" and stream is None:
        from host.cli.native_stderr import json_stderr

        stream = json_stderr()
    handler = logging.StreamHandler(stream or sys.stderr)  # type: ignore[arg-type]
    handler.setFormatter(JsonFormatter() if fmt == "json" else PlainFormatter())
    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    # The API client's libraries log every request at INFO ("HTTP Request: GET ..."): one
    # line per ResourceSlice write and claim read. Shown only when debug logging is asked for.
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(logging.NOTSET if root.level <= logging.DEBUG
                                         else logging.WARNING)
