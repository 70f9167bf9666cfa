"""Structured logs to stderr, plain or JSON, naming resource, driver and device when known.

Code passes context with ``extra={"resource": ..., "driver": ..., "device": ...}``; the plain
format appends it as key=value, the JSON format as fields, so a log pipeline can filter on it.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Optional

CONTEXT_FIELDS = ("resource", "driver", "device")


class PlainFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        context = " ".join(
            f"{key}={getattr(record, key)}" for key in CONTEXT_FIELDS if hasattr(record, key)
        )
        return f"{text} [{context}]" if context else text


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


def setup_logging(level: str = "info", fmt: str = "plain", stream: Optional[object] = None) -> None:
    handler = logging.StreamHandler(stream or sys.stderr)  # type: ignore[arg-type]
    handler.setFormatter(JsonFormatter() if fmt == "json" else PlainFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
