"""The host's small HTTP/1.1 endpoint: /metrics, /healthz and a pointer at /.

An asyncio server on the host's loop rather than a thread of its own: nothing extra to
stop, a scrape can await the kubelet's PodResources answer, and /healthz is answered by the
loop itself, so a stuck loop fails the probe by its timeout. It speaks just enough HTTP for
Prometheus and the kubelet's probes: one request per connection, GET and HEAD, bounded
request size and time.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Dict, List, Optional, Set, Tuple

log = logging.getLogger("host.metrics")  # operators filter the metrics endpoint's lines by it

DEFAULT_ADDRESS = "127.0.0.1:9400"
MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT_S = 10.0

Render = Callable[[str], Awaitable[Tuple[bytes, str]]]  # Accept header -> body, content type
Health = Callable[[], Tuple[int, bytes]]


def parse_address(address: str) -> Optional[Tuple[Optional[str], int]]:
    """"host:port", "[v6]:port" or ":port" (every interface); "" disables (None).

    Raises ValueError with the reason, so config validation can reuse it.
    """
    text = address.strip()
    if not text:
        return None
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep or not host:
            raise ValueError(f"{address!r}: write an IPv6 address as [addr]:port")
    else:
        host, sep, port = text.rpartition(":")
        if not sep:
            raise ValueError(f"{address!r}: expected host:port, [ipv6]:port or :port")
        if ":" in host:
            raise ValueError(f"{address!r}: put an IPv6 address in brackets: [addr]:port")
    if not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        raise ValueError(f"{address!r}: port must be a number from 0 to 65535")
    return (host or None), int(port)


class HttpEndpoint:
    """Serves ``render`` at /metrics and ``health`` at /healthz; owns its connection tasks."""

    def __init__(self, render: Render, health: Health) -> None:
        self._render = render
        self._health = health
        self._server: Optional[asyncio.AbstractServer] = None
        self._connections: Set[asyncio.Task] = set()
        self.address: Optional[Tuple[str, int]] = None

    async def start(self, address: str = DEFAULT_ADDRESS) -> Optional[Tuple[str, int]]:
        """The bound (host, port), or None when disabled or the bind failed.

        A failed bind is logged, not raised: devices must be served even when a port clashes.
        """
        try:
            parsed = parse_address(address)
        except ValueError as error:
            log.error("metrics disabled: %s", error)
            return None
        if parsed is None:
            return None
        host, port = parsed
        try:
            self._server = await asyncio.start_server(
                self._serve_connection, host, port, reuse_address=True,
                limit=MAX_REQUEST_BYTES,
            )
        except OSError as error:
            log.error("metrics disabled: cannot listen on %s: %s", address, error.strerror)
            return None
        sockname = self._server.sockets[0].getsockname()
        self.address = (sockname[0], sockname[1])
        log.info("metrics on http://%s/metrics", _join(*self.address))
        return self.address

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if server is not None:
            await server.wait_closed()

    async def _serve_connection(self, reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
        try:
            await asyncio.wait_for(self._answer(reader, writer), REQUEST_TIMEOUT_S)
        except (asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError,
                asyncio.LimitOverrunError, ValueError):
            pass
        except Exception:
            log.exception("metrics: scrape failed")
        finally:
            if task is not None:
                self._connections.discard(task)
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, asyncio.CancelledError):
                pass

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            await _respond(writer, 400, b"bad request\n")
            return
        method, target = parts[0], parts[1]
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        path = target.split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            await _respond(writer, 405, b"only GET\n", extra={"Allow": "GET, HEAD"})
            return
        if path == "/metrics":
            body, content_type = await self._render(headers.get("accept", ""))
        elif path == "/healthz":
            status, body = self._health()
            await _respond(writer, status, body, head_only=method == "HEAD")
            return
        elif path == "/":
            body, content_type = (b"device-plugin-host: metrics at /metrics, liveness at "
                                  b"/healthz\n", "text/plain; charset=utf-8")
        else:
            await _respond(writer, 404, b"not found; try /metrics or /healthz\n")
            return
        await _respond(writer, 200, body, content_type, head_only=method == "HEAD")


def healthz(liveness: Optional[Callable[[], List[str]]],
            notes: Optional[Callable[[], List[str]]] = None) -> Tuple[int, bytes]:
    """/healthz: 503 with one line per problem the liveness check reports; "ok" when there is
    no check, or when the check itself fails (a bug there must not restart a working host).
    ``notes`` (transient states, such as waiting for the Node) follow "ok" one per line as
    "note: ...", and never turn the answer into a failure."""
    extra = ""
    if notes is not None:
        try:
            extra = "".join(f"note: {n}\n" for n in notes())
        except Exception:
            log.exception("metrics: the /healthz notes failed")
    if liveness is None:
        return 200, f"ok\n{extra}".encode()
    try:
        problems = liveness()
    except Exception as error:
        log.exception("metrics: the liveness check failed")
        return 200, f"ok (the registration check failed: {error})\n{extra}".encode()
    if not problems:
        return 200, f"ok\n{extra}".encode()
    return 503, ("".join(f"unhealthy: {p}\n" for p in problems) + extra).encode()


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            503: "Service Unavailable"}


async def _respond(writer: asyncio.StreamWriter, status: int, body: bytes,
                   content_type: str = "text/plain; charset=utf-8", *,
                   head_only: bool = False, extra: Optional[Dict[str, str]] = None) -> None:
    headers = {"Content-Type": content_type, "Content-Length": str(len(body)),
               "Connection": "close", **(extra or {})}
    head = f"HTTP/1.1 {status} {_REASONS[status]}\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    writer.write(head.encode("latin-1") + (b"" if head_only else body))
    await writer.drain()
