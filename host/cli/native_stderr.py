"""gRPC's own log lines as JSON, for ``log_format = "json"``.

gRPC core writes its messages ("E1202 06:41:54.387951 32344 add_port.cc:83] ...") straight to
file descriptor 2, past Python's logging, and reads its verbosity only when it is imported:
too early for the config to decide. So with JSON logs the process's fd 2 becomes a pipe; one
thread (owned here, started once, a daemon because it must outlive nothing) reads it line by
line and writes each line to the real stderr as a JSON object, keeping lines that already are
JSON. Python's own handler writes to the real stderr directly.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import IO, Optional

_LEVELS = {"I": "info", "W": "warning", "E": "error", "F": "critical", "D": "debug"}
_installed: Optional[IO[str]] = None
_lock = threading.Lock()


def _entry(line: str) -> str:
    if line.startswith("{"):
        try:
            json.loads(line)
            return line
        except ValueError:
            pass
    level = "error"
    if len(line) > 5 and line[0] in _LEVELS and line[1:5].isdigit():  # glog/absl prefix
        level = _LEVELS[line[0]]
    now = time.time()
    return json.dumps({
        "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now))
        + f".{int(now * 1000) % 1000:03d}Z",
        "level": level,
        "logger": "grpc" if level != "error" or ".cc:" in line else "stderr",
        "message": line,
    })


def _pump(read_fd: int, out: IO[str]) -> None:
    with os.fdopen(read_fd, "rb") as pipe:
        for raw in pipe:
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            if line:
                try:
                    out.write(_entry(line) + "\n")
                    out.flush()
                except (OSError, ValueError):
                    return


def json_stderr() -> IO[str]:
    """Route fd 2 through the JSON wrapper (once); returns the real stderr as a text stream,
    for the logging handler."""
    global _installed
    with _lock:
        if _installed is not None:
            return _installed
        real = os.dup(2)
        read_fd, write_fd = os.pipe()
        os.dup2(write_fd, 2)
        os.close(write_fd)
        out = os.fdopen(real, "w", buffering=1, encoding="utf-8", errors="replace")
        threading.Thread(target=_pump, args=(read_fd, out), name="stderr-json",
                         daemon=True).start()
        _installed = out
        return out
