"""Prometheus metrics of the host: the counters and gauges its hot paths update.

Everything lives in this object's own Registry (host/metrics/prom.py, the host's own
instrumentation: prometheus_client cost a sixth of the start-up to import), never a process-global
one, so tests and several hosts in one process do not collide. Served by host/metrics/http.py (with
/healthz); ``allocated_device`` comes from the PodResources join in host/metrics/pods.py.

The methods the host calls on its hot paths (Allocate, rescans, registration) only touch
in-memory counters and never raise: a metrics bug must not fail an allocation.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import (
    TYPE_CHECKING,
    Callable,
    Dict,
    Iterable,
    List,
    Mapping,
    Optional,
    Set,
    Tuple,
)

import grpc

from host import __version__
from host.core.model import Device, Health
from host.metrics.http import DEFAULT_ADDRESS, HttpEndpoint, healthz, parse_address
from host.metrics.pods import (
    POD_LIST_MIN_INTERVAL_S,
    POD_LIST_TIMEOUT_S,
    AllocatedDevices,
    PodAllocations,
)

if TYPE_CHECKING:
    from host.metrics.prom import Gauge

log = logging.getLogger(__name__)

PREFIX = "device_plugin_host_"
OUTCOMES = ("ok", "refused", "error")
HEALTH = tuple(h.value for h in Health)
# Allocate is a dictionary lookup (~50 µs) unless a driver hook runs (up to its 5 s timeout).
LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                   0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# Codes that mean the driver or the host failed, as opposed to the kubelet asking wrongly.
_ERROR_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE}



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
        from host.metrics.prom import Counter, Gauge, Histogram, Registry

        self.registry = Registry()
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
        python = ".".join(map(str, sys.version_info[:3]))  # platform.python_version()
        self.build_info.labels(version, python).set(1)
        self.pod_resources_up: Optional[Gauge] = None
        if pod_resources_socket:
            self.pod_resources_up = Gauge(
                PREFIX + "pod_resources_up",
                "1 when the kubelet's PodResources List answered on the last scrape",
                registry=r)
        self.resources: Set[str] = set()
        self.pods = PodAllocations(pod_resources_socket, timeout_s=pod_list_timeout_s,
                                   min_interval_s=pod_list_min_interval_s,
                                   up=self.pod_resources_up)
        allocated = AllocatedDevices(PREFIX + "allocated_device", self.pods, self.resources)
        r.register(allocated, (allocated.name,))
        self._driver_errors_seen: Dict[str, int] = {}
        self._restarts_seen = 0
        self._endpoint = HttpEndpoint(self.render, self.health)
        # /healthz: None answers "ok" whenever the loop answers; the host sets its
        # registration check (host/kubelet/liveness.py), whose problems turn the answer into a 503.
        self.liveness: Optional[Callable[[], List[str]]] = None
        # /healthz notes: transient states worth showing that a restart would not cure (the
        # host waiting for its Node object); listed under "ok", never a failure.
        self.notes: Optional[Callable[[], List[str]]] = None

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
            self.devices.labels(resource, Health.HEALTHY.value).set(healthy)
            self.devices.labels(resource, Health.UNHEALTHY.value).set(unhealthy)
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
        await self.pods.refresh()

    async def render(self, accept: str = "") -> Tuple[bytes, str]:
        """The exposition for one scrape, in the format the scraper asked for."""
        try:
            await self.refresh_pods()
        except Exception:
            log.exception("metrics: refreshing pods failed")
        from host.metrics.prom import render

        return render(self.registry, accept)

    # -- HTTP ---------------------------------------------------------------------------------
    @property
    def address(self) -> Optional[Tuple[str, int]]:
        return self._endpoint.address

    async def start(self, address: str = DEFAULT_ADDRESS) -> Optional[Tuple[str, int]]:
        """Serve /metrics and /healthz; the bound (host, port), or None when disabled or the
        bind failed (logged, not raised: devices must be served even when a port clashes)."""
        return await self._endpoint.start(address)

    async def stop(self) -> None:
        await self._endpoint.stop()
        await self.pods.close()

    def health(self) -> Tuple[int, bytes]:
        """/healthz, answered on the event loop (host/metrics/http.py healthz)."""
        return healthz(self.liveness, self.notes)


__all__ = ["DEFAULT_ADDRESS", "HostMetrics", "parse_address"]
