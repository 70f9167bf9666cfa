"""Prometheus metrics of the DRA service, on the host's registry (host/metrics/__init__.py).

Prepare and unprepare are what a pod waits for on a DRA node, the DRA counterpart of
Allocate: their outcomes per claim, their latency per call, and how many claims the node
holds (the checkpoint's size) are what an operator needs to see a stuck or failing driver.
"""

from __future__ import annotations

from typing import Any


class DraMetrics:
    def __init__(self, registry: Any) -> None:
        from host.metrics import LATENCY_BUCKETS, PREFIX
        from host.metrics.prom import Counter, Gauge, Histogram

        self.claims = Counter(
            PREFIX + "dra_claims", "Claims handled by outcome (prepared, again: answered from "
            "the checkpoint, failed, unprepared, unprepare_failed)", ("driver", "outcome"),
            registry=registry)
        self.seconds = Histogram(
            PREFIX + "dra_call_duration_seconds", "Time to answer NodePrepareResources / "
            "NodeUnprepareResources", ("driver", "call"), buckets=LATENCY_BUCKETS,
            registry=registry)
        self.prepared = Gauge(PREFIX + "dra_prepared_claims",
                              "Claims prepared on this node (in the checkpoint)",
                              registry=registry)
        self.node_registered = Gauge(
            PREFIX + "dra_node_registered", "1 while this node's Node object exists, 0 while "
            "the host waits for the kubelet to register it (no ResourceSlices are written)",
            registry=registry)

        self.env_fallbacks = Counter(
            PREFIX + "dra_container_env_fallbacks", "Claims prepared with each request's "
            "list-valued env naming only that request's devices, since the pod or its other "
            "claims could not be read (unreadable) or the containers referencing a request "
            "receive different devices (containers_disagree)", ("driver", "reason"),
            registry=registry)

    def claim(self, driver: str, outcome: str) -> None:
        self.claims.labels(driver, outcome).inc()

    def env_fallback(self, driver: str, reason: str) -> None:
        self.env_fallbacks.labels(driver, reason).inc()

    def call(self, driver: str, call: str, seconds: float, prepared: int) -> None:
        self.seconds.labels(driver, call).observe(seconds)
        self.prepared.set(prepared)
