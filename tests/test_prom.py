"""host/metrics/prom.py, the host's own Prometheus exposition, held to prometheus_client (a test
dependency only): for the same metrics and updates, both write the same families and samples
(prometheus_client's optional ``_created`` series aside), and prometheus_client's strict
OpenMetrics parser accepts what we write."""

from __future__ import annotations

import math
import threading

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client import Counter as RefCounter
from prometheus_client import Gauge as RefGauge
from prometheus_client import Histogram as RefHistogram
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families as parse_text

from host.metrics import prom

BUCKETS = (0.001, 0.01, 0.1, 1.0)
ODD = 'quote " backslash \\ newline \n end'


def _both(update):
    """Run ``update(Counter, Gauge, Histogram, registry)`` against both libraries."""
    ours = prom.Registry()
    update(prom.Counter, prom.Gauge, prom.Histogram, ours)
    ref = CollectorRegistry(auto_describe=True)
    update(RefCounter, RefGauge, RefHistogram, ref)
    return ours, ref


def _scenario(Counter, Gauge, Histogram, registry):
    calls = Counter("dph_calls", "Calls by outcome\nsecond line", ("resource", "outcome"),
                    registry=registry)
    calls.labels("example.com/gpu", "ok").inc()
    calls.labels("example.com/gpu", "ok").inc(2)
    calls.labels(ODD, "refused").inc()
    restarts = Counter("dph_restarts_total", "Restarts", registry=registry)
    restarts.inc(3)
    gauge = Gauge("dph_devices", "Devices", ("resource", "health"), registry=registry)
    gauge.labels("a", "Healthy").set(4)
    gauge.labels("a", "Unhealthy").set(0)
    gauge.labels("b", "Healthy").set(1.5)
    gauge.labels("gone", "Healthy").set(9)
    gauge.remove("gone", "Healthy")
    Gauge("dph_inf", "Infinite", registry=registry).set(math.inf)
    seconds = Histogram("dph_seconds", "Latency", ("resource",), buckets=BUCKETS,
                        registry=registry)
    for value in (0.0005, 0.001, 0.05, 0.5, 2.0, 3.0):
        seconds.labels("example.com/gpu").observe(value)
    Histogram("dph_empty_seconds", "Never observed", buckets=BUCKETS, registry=registry)


def _families(parsed):
    out = {}
    for family in parsed:
        samples = sorted((s.name, tuple(sorted(s.labels.items())), s.value)
                         for s in family.samples if not s.name.endswith("_created"))
        if family.name.endswith("_created") and family.type == "gauge":
            continue  # prometheus_client's own _created series (text format)
        out[family.name] = (family.type, family.documentation, samples)
    return out


def test_the_text_format_says_what_prometheus_client_says():
    ours, ref = _both(_scenario)
    mine = prom.render(ours, "")[0].decode()
    assert _families(parse_text(mine)) == _families(parse_text(generate_latest(ref).decode()))


def test_openmetrics_says_what_prometheus_client_says_and_parses_strictly():
    ours, ref = _both(_scenario)
    body, content_type = prom.render(
        ours, "application/openmetrics-text; version=1.0.0,text/plain;version=0.0.4;q=0.5")
    assert content_type == prom.OPENMETRICS_CONTENT_TYPE
    text = body.decode()
    assert text.endswith("# EOF\n")
    assert _families(parse_openmetrics(text)) == _families(
        parse_openmetrics(generate_openmetrics(ref).decode()))


def test_plain_scrapers_get_the_text_format():
    ours, _ = _both(_scenario)
    for accept in ("", "*/*", "text/plain", "text/plain;version=0.0.4"):
        assert prom.render(ours, accept)[1] == prom.TEXT_CONTENT_TYPE


def test_get_sample_value_reads_what_prometheus_client_reads():
    ours, ref = _both(_scenario)
    for name, labels in (("dph_calls_total", {"resource": "example.com/gpu", "outcome": "ok"}),
                         ("dph_restarts_total", None),
                         ("dph_seconds_bucket", {"resource": "example.com/gpu", "le": "0.01"}),
                         ("dph_seconds_count", {"resource": "example.com/gpu"}),
                         ("dph_seconds_sum", {"resource": "example.com/gpu"}),
                         ("dph_devices", {"resource": "gone", "health": "Healthy"}),
                         ("dph_nothing", None)):
        assert ours.get_sample_value(name, labels) == ref.get_sample_value(name, labels), name


def test_misuse_fails_as_prometheus_client_does():
    registry = prom.Registry()
    counter = prom.Counter("x", "x", ("a",), registry=registry)
    with pytest.raises(ValueError):
        prom.Counter("x", "again", registry=registry)  # one name, one family
    with pytest.raises(ValueError):
        counter.labels("a", "b")
    with pytest.raises(ValueError):
        counter.labels("a").inc(-1)
    with pytest.raises(KeyError):
        counter.remove("never")


def test_updates_from_many_threads_are_all_counted():
    registry = prom.Registry()
    counter = prom.Counter("n", "n", ("t",), registry=registry)
    seconds = prom.Histogram("s", "s", buckets=BUCKETS, registry=registry)

    def work():
        for _ in range(5000):
            counter.labels("x").inc()
            seconds.observe(0.005)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert registry.get_sample_value("n_total", {"t": "x"}) == 20000
    assert registry.get_sample_value("s_count") == 20000
