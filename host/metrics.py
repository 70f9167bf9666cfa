"""Prometheus metrics of the host, served over HTTP from the event loop.

Everything lives in this object's own CollectorRegistry, never prometheus_client's global one,
so tests and several hosts in one process do not collide. The HTTP endpoint is a small asyncio
server on the host's loop rather than prometheus_client's thread: nothing extra to stop, and a
scrape can await the kubelet's PodResources answer that fills ``allocated_device``.

The methods the host calls on its hot paths (Allocate, rescans, registration) only touch
in-memory counters and never raise: a metrics bug must not fail an allocation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import (
    TYPE_CHECKING,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    Set,
    Tuple,
)

import grpc

from host import __version__
from host.model import Device

if TYPE_CHECKING:  # prometheus_client (and its http/email/wsgiref imports) load with HostMetrics
    from prometheus_client import Gauge
    from prometheus_client.core import Metric

    from host.podresources import PodResourcesClient

log = logging.getLogger(__name__)

PREFIX = "device_plugin_host_"
DEFAULT_ADDRESS = "127.0.0.1:9400"
OUTCOMES = ("ok", "refused", "error")
HEALTH = ("Healthy", "Unhealthy")
# Allocate is a dictionary lookup (~50 µs) unless a driver hook runs (up to its 5 s timeout).
LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                   0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
POD_LIST_TIMEOUT_S = 2.0  # a scrape must not hang on a stuck kubelet
POD_LIST_MIN_INTERVAL_S = 1.0  # scrape storms share one List: the kubelet rate-limits at 100/s
MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT_S = 10.0
# Codes that mean the driver or the host failed, as opposed to the kubelet asking wrongly.
_ERROR_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE}

PodRow = Tuple[str, str, str, str, str]  # resource, device, pod, namespace, container


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


class _AllocatedDevices:
    """``allocated_device`` from the last PodResources List, our resources only."""

    name = PREFIX + "allocated_device"
    documentation = "1 for each device of ours that a container holds (from the kubelet)"
    labels = ("resource", "device", "pod", "namespace", "container")

    def __init__(self, metrics: HostMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterator[Metric]:
        from prometheus_client.core import GaugeMetricFamily

        yield GaugeMetricFamily(self.name, self.documentation, labels=self.labels)

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labels)
        ours = self._metrics.resources
        for row in self._metrics.pod_rows:
            if row[0] in ours:
                family.add_metric(list(row), 1.0)
        yield family


class HostMetrics:
    """The host's metrics and their HTTP endpoint.

    ``pod_resources_socket`` (HostSettings.pod_resources_socket) fills ``allocated_device`` on
    each scrape; None leaves it empty. Scrapes closer together than ``pod_list_min_interval_s``
    reuse the last List.
    """

    def __init__(
        self,
        *,
        pod_resources_socket: Optional[str] = None,
        version: str = __version__,
        pod_list_timeout_s: float = POD_LIST_TIMEOUT_S,
        pod_list_min_interval_s: float = POD_LIST_MIN_INTERVAL_S,
    ) -> None:
        import platform

        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.devices = Gauge(PREFIX + "devices", "Devices advertised per resource and health",
                             ("resource", "health"), registry=r)
        self.allocations = Counter(
            PREFIX + "allocations", "Allocate calls by outcome (refused: the request was "
            "wrong or a device unhealthy; error: a driver hook failed or timed out)",
            ("resource", "outcome"), registry=r)
        self.allocate_seconds = Histogram(
            PREFIX + "allocate_duration_seconds", "Time to answer Allocate",
            ("resource",), buckets=LATENCY_BUCKETS, registry=r)
        self.registrations = Counter(PREFIX + "registrations",
                                     "Successful registrations with the kubelet",
                                     ("resource",), registry=r)
        self.kubelet_restarts = Counter(PREFIX + "kubelet_restarts",
                                        "Kubelet restarts seen (a new kubelet.sock)", registry=r)
        self.driver_errors = Counter(PREFIX + "driver_errors",
                                     "Driver scans that raised, hung or returned garbage",
                                     ("driver",), registry=r)
        self.driver_last_success = Gauge(
            PREFIX + "driver_last_success_timestamp_seconds",
            "Unix time of the driver's last successful scan", ("driver",), registry=r)
        self.build_info = Gauge(PREFIX + "build_info", "Always 1; the version in labels",
                                ("version", "python"), registry=r)
        self.build_info.labels(version, platform.python_version()).set(1)
        self.pod_resources_up: Optional[Gauge] = None
        if pod_resources_socket:
            self.pod_resources_up = Gauge(
                PREFIX + "pod_resources_up",
                "1 when the kubelet's PodResources List answered on the last scrape",
                registry=r)
        r.register(_AllocatedDevices(self))

        self.resources: Set[str] = set()
        self.pod_rows: List[PodRow] = []
        self._pods: Optional[PodResourcesClient] = None  # made at the first scrape
        self._pods_socket = pod_resources_socket
        self._pods_timeout_s = pod_list_timeout_s
        self._pods_at: Optional[float] = None
        self._pods_min_interval_s = pod_list_min_interval_s
        self._pods_lock: Optional[asyncio.Lock] = None
        self._pods_error: Optional[str] = None
        self._driver_errors_seen: Dict[str, int] = {}
        self._restarts_seen = 0
        self._server: Optional[asyncio.AbstractServer] = None
        self._connections: Set[asyncio.Task] = set()
        self.address: Optional[Tuple[str, int]] = None
        # /healthz: None answers "ok" whenever the loop answers; the host sets its
        # registration check (host/liveness.py), whose problems turn the answer into a 503.
        self.liveness: Optional[Callable[[], List[str]]] = None

    # -- what the host calls (cheap, never raising) -----------------------------------------
    def set_devices(self, resource: str, devices: Iterable[Device]) -> None:
        """The resource's current device list (call whenever its snapshot is updated)."""
        try:
            healthy = unhealthy = 0
            for device in devices:
                if device.healthy:
                    healthy += 1
                else:
                    unhealthy += 1
            self.resources.add(resource)
            self.devices.labels(resource, "Healthy").set(healthy)
            self.devices.labels(resource, "Unhealthy").set(unhealthy)
        except Exception:
            log.exception("metrics: set_devices(%s) failed", resource)

    def observe_allocate(self, resource: str, seconds: Optional[float], outcome: str) -> None:
        """One Allocate call; ``seconds`` None counts it without a latency sample."""
        try:
            if outcome not in OUTCOMES:
                outcome = "error"
            self.allocations.labels(resource, outcome).inc()
            if seconds is not None and seconds >= 0:
                self.allocate_seconds.labels(resource).observe(seconds)
        except Exception:
            log.exception("metrics: observe_allocate(%s) failed", resource)

    def allocate_observer(self, resource: str, event: str, detail: object,
                          seconds: Optional[float] = None) -> None:
        """DevicePluginService's ``observer`` hook: ("allocated" | "refused", request or
        RequestError[, seconds]). A refusal carrying a server-side gRPC code (a driver hook that
        failed or timed out) counts as an error."""
        if event in ("allocated", "ok"):
            outcome = "ok"
        elif event == "refused":
            code = getattr(detail, "code", None)
            outcome = "error" if code in _ERROR_CODES else "refused"
        else:
            outcome = "error"
        self.observe_allocate(resource, seconds, outcome)

    def registered(self, resource: str) -> None:
        try:
            self.resources.add(resource)
            self.registrations.labels(resource).inc()
        except Exception:
            log.exception("metrics: registered(%s) failed", resource)

    def kubelet_restart(self) -> None:
        """One restart seen; either this or kubelet_restarts_seen, not both."""
        self.kubelet_restarts.inc()

    def kubelet_restarts_seen(self, total: int) -> None:
        """Catch up with a running total (KubeletLink.restarts_seen); safe to call often."""
        if total > self._restarts_seen:
            self.kubelet_restarts.inc(total - self._restarts_seen)
            self._restarts_seen = total

    def driver_scan(self, driver: str, ok: bool, when: Optional[float] = None) -> None:
        """One scan of ``driver``; either this or sync_drivers, not both."""
        try:
            if ok:
                self.driver_last_success.labels(driver).set(time.time() if when is None else when)
            else:
                self.driver_errors.labels(driver).inc()
        except Exception:
            log.exception("metrics: driver_scan(%s) failed", driver)

    def sync_drivers(self, statuses: Mapping[str, object]) -> None:
        """Catch up with Inventory.status (DriverStatus: last_ok, errors) after a scan."""
        try:
            for name, status in statuses.items():
                errors = int(getattr(status, "errors", 0) or 0)
                seen = self._driver_errors_seen.get(name, 0)
                counter = self.driver_errors.labels(name)  # the series exists from the start, at 0
                if errors > seen:
                    counter.inc(errors - seen)
                    self._driver_errors_seen[name] = errors
                last_ok = getattr(status, "last_ok", None)
                if last_ok is not None:
                    self.driver_last_success.labels(name).set(last_ok)
        except Exception:
            log.exception("metrics: sync_drivers failed")

    def remove_resource(self, resource: str) -> None:
        """A resource no longer served: drop its series (its pods vanish at once too)."""
        self.resources.discard(resource)
        series: List[Tuple[object, Tuple[str, ...]]] = [
            *((self.devices, (resource, health)) for health in HEALTH),
            *((self.allocations, (resource, outcome)) for outcome in OUTCOMES),
            (self.allocate_seconds, (resource,)),
            (self.registrations, (resource,)),
        ]
        for metric, labels in series:
            try:
                metric.remove(*labels)  # type: ignore[attr-defined]
            except KeyError:
                pass

    # -- pods ---------------------------------------------------------------------------------
    async def refresh_pods(self) -> None:
        """At most one PodResources List, shared by scrapes that arrive together."""
        if not self._pods_socket:
            return
        if self._pods is None:
            from host.podresources import PodResourcesClient

            self._pods = PodResourcesClient(self._pods_socket, timeout_s=self._pods_timeout_s)
        if self._pods_lock is None:
            self._pods_lock = asyncio.Lock()
        async with self._pods_lock:
            now = time.monotonic()
            if self._pods_at is not None and now - self._pods_at < self._pods_min_interval_s:
                return
            self._pods_at = now
            from host.podresources import PodResourcesError

            try:
                pods = await self._pods.list()
            except PodResourcesError as error:
                self._pod_list_failed(str(error))
                return
            except Exception as error:  # the scrape must still answer
                self._pod_list_failed(f"{type(error).__name__}: {error}")
                return
            rows: List[PodRow] = []
            for pod in pods:
                for container in pod.containers:
                    for entry in container.devices:
                        for device_id in entry.device_ids:
                            rows.append((entry.resource_name, device_id, pod.name,
                                         pod.namespace, container.name))
            self.pod_rows = list(dict.fromkeys(rows))  # one id per NUMA node: once here
            if self.pod_resources_up is not None:
                self.pod_resources_up.set(1)
            if self._pods_error is not None:
                log.info("metrics: the kubelet's PodResources API answers again")
            self._pods_error = None

    def _pod_list_failed(self, reason: str) -> None:
        self.pod_rows = []
        if self.pod_resources_up is not None:
            self.pod_resources_up.set(0)
        if reason != self._pods_error:
            log.warning("metrics: allocated_device is empty: %s", reason)
        self._pods_error = reason

    async def render(self, accept: str = "") -> Tuple[bytes, str]:
        """The exposition for one scrape, in the format the scraper asked for."""
        try:
            await self.refresh_pods()
        except Exception:
            log.exception("metrics: refreshing pods failed")
        from prometheus_client.exposition import choose_encoder

        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type

    # -- HTTP ---------------------------------------------------------------------------------
    async def start(self, address: str = DEFAULT_ADDRESS) -> Optional[Tuple[str, int]]:
        """Serve /metrics; the bound (host, port), or None when disabled or the bind failed.

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
        if self._pods is not None:
            await self._pods.close()

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
            body, content_type = await self.render(headers.get("accept", ""))
        elif path == "/healthz":
            status, body = self.health()
            await _respond(writer, status, body, head_only=method == "HEAD")
            return
        elif path == "/":
            body, content_type = (b"device-plugin-host: metrics at /metrics, liveness at "
                                  b"/healthz\n", "text/plain; charset=utf-8")
        else:
            await _respond(writer, 404, b"not found; try /metrics or /healthz\n")
            return
        await _respond(writer, 200, body, content_type, head_only=method == "HEAD")

    def health(self) -> Tuple[int, bytes]:
        """/healthz: answered on the event loop, so a stuck loop fails the probe by its
        timeout; 503 with one line per problem the liveness check reports."""
        if self.liveness is None:
            return 200, b"ok\n"
        try:
            problems = self.liveness()
        except Exception as error:  # a bug in the check must not restart a working host
            log.exception("metrics: the liveness check failed")
            return 200, f"ok (the registration check failed: {error})\n".encode()
        if not problems:
            return 200, b"ok\n"
        return 503, "".join(f"unhealthy: {p}\n" for p in problems).encode()


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


__all__ = ["DEFAULT_ADDRESS", "HostMetrics", "parse_address"]
