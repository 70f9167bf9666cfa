"""The host's own Prometheus instrumentation: counters, gauges, histograms and their exposition.

It imports nothing beyond the standard library's basics (no http.server, email, urllib or
wsgiref, which prometheus_client loads). What the host needs is fixed by the formats:

* the Prometheus text format 0.0.4 (``text/plain; version=0.0.4``), what every scraper accepts,
  and OpenMetrics 1.0 (``application/openmetrics-text; version=1.0.0``) when the scraper's
  Accept header asks for it, the same negotiation prometheus_client's ``choose_encoder`` does;
* metric families with fixed label names, children per label values, ``remove`` of a child;
* collectors that build a family at scrape time (``allocated_device``).

The ``_created`` series prometheus_client adds to counters and histograms are left out (they
are optional in both formats, and prometheus_client itself drops them with
PROMETHEUS_DISABLE_CREATED_SERIES). tests/test_prom.py parses every output with
prometheus_client's own parsers (a test dependency only) and compares it with what
prometheus_client writes for the same metrics.

Updates take a lock per family: the CDI writer's and the driver scans' threads update metrics
too, and ``value += 1`` on a shared float is not atomic across threads.
"""

from __future__ import annotations

import math
import threading
from typing import (
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    Protocol,
    Sequence,
    Tuple,
)

TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"

Labels = Tuple[str, ...]
#: One sample: name suffix ("", "_total", "_bucket", ...), extra label pairs, value.
Sample = Tuple[str, Tuple[Tuple[str, str], ...], float]


def format_value(value: float) -> str:
    """Go's strconv formatting as Prometheus reads it: +Inf, -Inf, NaN, else the shortest repr."""
    if value == math.inf:
        return "+Inf"
    if value == -math.inf:
        return "-Inf"
    if value != value:
        return "NaN"
    if float(value).is_integer() and abs(value) < 1e15:
        return f"{float(value):.1f}"
    return repr(float(value))


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str, openmetrics: bool) -> str:
    text = text.replace("\\", "\\\\").replace("\n", "\\n")
    return text.replace('"', '\\"') if openmetrics else text


class Family:
    """One metric family as a scrape sees it: type, help, label names and samples."""

    def __init__(self, name: str, documentation: str, kind: str,
                 labels: Sequence[str] = ()) -> None:
        self.name = name
        self.documentation = documentation
        self.kind = kind  # counter | gauge | histogram
        self.labels: Labels = tuple(labels)
        self.samples: List[Tuple[Labels, str, Tuple[Tuple[str, str], ...], float]] = []

    def add_metric(self, values: Sequence[str], value: float) -> None:
        """A gauge sample for ``values`` (a collector's way of filling the family)."""
        self.samples.append((tuple(str(v) for v in values), "", (), float(value)))


class Collector(Protocol):
    def collect(self) -> Iterable[Family]: ...


class Registry:
    """The families of one host, in registration order; never a process-global one."""

    def __init__(self) -> None:
        self._collectors: List[Collector] = []
        self._names: Dict[str, Collector] = {}
        self._lock = threading.Lock()

    def register(self, collector: Collector, names: Sequence[str] = ()) -> None:
        """Add a collector; a name already registered is a ValueError, as in prometheus_client
        (two families of one name would make the scrape invalid)."""
        with self._lock:
            for name in names:
                if name in self._names:
                    raise ValueError(f"Duplicated timeseries in Registry: {name}")
            for name in names:
                self._names[name] = collector
            self._collectors.append(collector)

    def collect(self) -> Iterator[Family]:
        with self._lock:
            collectors = list(self._collectors)
        for collector in collectors:
            yield from collector.collect()

    def get_sample_value(self, name: str,
                         labels: Optional[Mapping[str, str]] = None) -> Optional[float]:
        """One sample's value by its full name (``x_total``, ``x_bucket``) and labels, or None:
        what tests and tools read without parsing a scrape (prometheus_client's signature)."""
        wanted = dict(labels or {})
        for family in self.collect():
            if not name.startswith(family.name):
                continue
            for values, suffix, extra, value in family.samples:
                if family.name + suffix == name and \
                        dict((*zip(family.labels, values), *extra)) == wanted:
                    return value
        return None


class _Child:
    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        with self._lock:
            self.value += amount

    def set(self, value: float) -> None:
        with self._lock:
            self.value = float(value)

    def observe(self, value: float) -> None:
        raise TypeError("observe() is for histograms")

    def samples(self, kind: str) -> List[Sample]:
        return [("_total" if kind == "counter" else "", (), self.value)]


class _CounterChild(_Child):
    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        super().inc(amount)


class _HistogramChild(_Child):
    def __init__(self, lock: threading.Lock, buckets: Tuple[float, ...]) -> None:
        super().__init__(lock)
        self._bounds = buckets
        self._counts = [0] * len(buckets)
        self._sum = 0.0

    def inc(self, amount: float = 1.0) -> None:
        raise TypeError("inc() is not for histograms")

    def set(self, value: float) -> None:
        raise TypeError("set() is not for histograms")

    def observe(self, value: float) -> None:
        with self._lock:
            self._sum += value
            for index, bound in enumerate(self._bounds):
                if value <= bound:
                    self._counts[index] += 1
                    break

    def samples(self, kind: str) -> List[Sample]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        out: List[Sample] = []
        running = 0
        for bound, count in zip(self._bounds, counts):
            running += count
            out.append(("_bucket", (("le", format_value(bound)),), float(running)))
        out.append(("_count", (), float(running)))
        out.append(("_sum", (), total))
        return out


class _Metric:
    """A family with fixed label names whose children are made on first use."""

    kind = ""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (),
                 registry: Optional[Registry] = None) -> None:
        if self.kind == "counter" and name.endswith("_total"):
            name = name[: -len("_total")]
        self.name = name
        self.documentation = documentation
        self.labelnames: Labels = tuple(labelnames)
        self._lock = threading.Lock()
        self._children: Dict[Labels, _Child] = {}
        if not self.labelnames:
            self._children[()] = self._child()
        if registry is not None:
            registry.register(self, self._sample_names())

    def _sample_names(self) -> Tuple[str, ...]:
        return (self.name,)

    def _child(self) -> _Child:
        return _Child(self._lock)

    def labels(self, *values: object) -> _Child:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(self.labelnames)} label values expected,"
                             f" got {len(values)}")
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            with self._lock:
                child = self._children.setdefault(key, self._child())
        return child

    def remove(self, *values: object) -> None:
        """Drop one child's series; KeyError when it was never made (prometheus_client's)."""
        key = tuple(str(v) for v in values)
        with self._lock:
            del self._children[key]

    # The unlabelled metric is its own only child.
    def inc(self, amount: float = 1.0) -> None:
        self._children[()].inc(amount)

    def set(self, value: float) -> None:
        self._children[()].set(value)

    def observe(self, value: float) -> None:
        self._children[()].observe(value)

    def collect(self) -> Iterator[Family]:
        family = Family(self.name, self.documentation, self.kind, self.labelnames)
        with self._lock:
            children = list(self._children.items())
        for key, child in children:
            for suffix, extra, value in child.samples(self.kind):
                family.samples.append((key, suffix, extra, value))
        yield family


class Counter(_Metric):
    kind = "counter"

    def _child(self) -> _Child:
        return _CounterChild(self._lock)

    def _sample_names(self) -> Tuple[str, ...]:
        return (self.name, self.name + "_total")


class Gauge(_Metric):
    kind = "gauge"


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (),
                 buckets: Sequence[float] = (), registry: Optional[Registry] = None) -> None:
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.buckets: Tuple[float, ...] = tuple(bounds)
        super().__init__(name, documentation, labelnames, registry)

    def _sample_names(self) -> Tuple[str, ...]:
        return (self.name, self.name + "_bucket", self.name + "_count", self.name + "_sum")

    def _child(self) -> _Child:
        return _HistogramChild(self._lock, self.buckets)


def _label_text(names: Labels, values: Labels, extra: Tuple[Tuple[str, str], ...]) -> str:
    pairs = [*zip(names, values), *extra]
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{_escape_label(v)}"' for k, v in pairs) + "}"


def _render(registry: Registry, openmetrics: bool) -> bytes:
    """Both formats share the samples and differ in three places: the text format 0.0.4 names
    a counter family ``x_total`` and escapes no quote in HELP; OpenMetrics 1.0 names it ``x``,
    escapes quotes and ends with ``# EOF``."""
    lines: List[str] = []
    for family in registry.collect():
        name = family.name
        if family.kind == "counter" and not openmetrics:
            name += "_total"
        lines.append(f"# HELP {name} {_escape_help(family.documentation, openmetrics)}")
        lines.append(f"# TYPE {name} {family.kind}")
        for values, suffix, extra, value in family.samples:
            lines.append(f"{family.name}{suffix}{_label_text(family.labels, values, extra)}"
                         f" {format_value(value)}")
    if openmetrics:
        lines.append("# EOF")
    return ("\n".join(lines) + "\n").encode() if lines else b""


def wants_openmetrics(accept: str) -> bool:
    """OpenMetrics only when the scraper names it (Prometheus does, among others with
    q-values); the text format 0.0.4 is understood by every scraper."""
    return any(part.split(";")[0].strip().lower() == "application/openmetrics-text"
               for part in (accept or "").split(","))


def render(registry: Registry, accept: str = "") -> Tuple[bytes, str]:
    """The exposition for one scrape, and its content type, in the format asked for."""
    if wants_openmetrics(accept):
        return _render(registry, True), OPENMETRICS_CONTENT_TYPE
    return _render(registry, False), TEXT_CONTENT_TYPE


__all__ = [
    "OPENMETRICS_CONTENT_TYPE",
    "TEXT_CONTENT_TYPE",
    "Counter",
    "Family",
    "Gauge",
    "Histogram",
    "Registry",
    "format_value",
    "render",
]
