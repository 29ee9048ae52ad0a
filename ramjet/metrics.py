"""Router metrics (Prometheus, prefix `ramjet_`, units in names), registered from their
entries in `ramjet.metric_catalogue` (name, type, unit, labels, help, buckets).

All metric objects live on a `CollectorRegistry` passed in, never the global default,
so several routers can live in one process (tests). Latencies are router-observed:
TTFT is from the request's arrival to the first response byte forwarded to the client.

The request path reaches label children through `Children` (one per labelled metric it
touches): `labels()` validates on every call, a cached child is a dict hit (~0.05 µs),
and a request touches about ten of them. The cache holds exactly the series the registry
already holds, so it adds no cardinality. The series only the event loop writes are
`LoopCounter` / `LoopHistogram` families (below): prometheus_client's exposition, without
its per-update lock and interpreted code.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar, cast

import prometheus_client.metrics as _prom
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ramjet.metric_catalogue import COUNTER, HISTOGRAM, counter, gauge
from ramjet.metric_catalogue import Metric as Entry
from ramjet.metric_catalogue import entry as catalogue_entry


class _Labelled(Protocol):
    def labels(self, *values: str) -> object: ...


M = TypeVar("M")

UPSTREAM_ERROR_KINDS = (
    "connect", "first_byte_timeout", "generation_timeout", "idle_timeout", "disconnect",
    "status_5xx", "backpressure",
)  # fmt: skip
"""The `kind` values of `ramjet_upstream_errors_total` (`ramjet.proxy.forward`)."""
POLICY_ERROR_KINDS = {
    "candidate": ("raised", "invalid", "slow", "skipped"),
    "incumbent": ("raised", "invalid"),
}
"""The (`role`, `kind`) series of `ramjet_policy_errors_total` (`ramjet.app.modes`)."""


class Children(Generic[M]):
    """The label children of one metric, cached by label values (in the metric's label
    order): `children(*values)` is `metric.labels(*values)` without its per-call cost.
    Series are never removed from the router's metrics, so a cached child stays valid.
    `M` is the child's type (`Gauge`, `CounterChild`, ...)."""

    __slots__ = ("_cache", "_metric")

    def __init__(self, metric: _Labelled) -> None:
        self._metric = metric
        self._cache: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._cache.get(values)
        if child is None:
            child = self._cache[values] = cast(M, self._metric.labels(*values))
        return child


# -- the request path's counters and histograms ------------------------------------------
#
# prometheus_client's children take a lock and run interpreted code on every update
# (~0.55 us an `inc`, ~1.2 us an `observe` on this host), and a request makes a dozen.
# The series the event loop alone updates (the router's per-request series and the
# accounting's) are `LoopCounter` / `LoopHistogram` families instead: a child is a native
# object (compiled, `ramjet.native`) whose update is a float add, with no lock, since
# every writer is the loop thread (a scrape reads on that thread too). They register on
# the same `CollectorRegistry` and expose exactly what prometheus_client's `Counter` and
# `Histogram` expose for the same updates (`_total` / `_bucket` `_count` `_sum`, `_created`
# unless PROMETHEUS_DISABLE_CREATED_SERIES; a test compares the text). A series updated
# from another thread stays on prometheus_client's classes.


class CounterChild:
    """One series of a `LoopCounter`."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount


class HistogramChild:
    """One series of a `LoopHistogram`: a count per bucket (not cumulative; the scrape
    adds them up) and the sum."""

    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.counts = [0.0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        """As prometheus_client: the first bucket whose bound is >= `amount` (the last is
        +Inf; a NaN falls in none), and the sum."""
        self.sum += amount
        bounds = self.bounds
        for i in range(len(bounds)):
            if amount <= bounds[i]:
                self.counts[i] += 1.0
                return


class _LoopFamily:
    """A labelled family of one catalogued metric on a registry (see above)."""

    def __init__(self, registry: CollectorRegistry, m: Entry) -> None:
        self.entry = m
        self.labelnames = m.labels
        self.name = m.name.removesuffix("_total") if m.kind == COUNTER else m.name
        self._children: dict[tuple[str, ...], object] = {}
        registry.register(cast(Collector, self))  # describe() and collect(), duck-typed

    def _key(self, values: tuple[object, ...], kw: dict[str, object]) -> tuple[str, ...]:
        if not self.labelnames:
            raise ValueError(f"No label names were set when constructing {self.entry.name}")
        if values and kw:
            raise ValueError("Can't pass both *args and **kwargs")
        if kw:
            if sorted(kw) != sorted(self.labelnames):
                raise ValueError(f"Incorrect label names for {self.entry.name}")
            values = tuple(kw[n] for n in self.labelnames)
        elif len(values) != len(self.labelnames):
            raise ValueError(f"Incorrect label count for {self.entry.name}")
        return tuple(v if isinstance(v, str) else str(v) for v in values)

    def _child(
        self, values: tuple[object, ...], kw: dict[str, object], make: Callable[[], object]
    ) -> object:
        """The series for these label values (`labels()`'s arguments), made on first use."""
        key = self._key(values, kw)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = make()
        return child

    def _metric(self) -> Metric:
        return Metric(self.name, self.entry.help, self.entry.kind)

    def _series(self, only: object | None) -> list[tuple[dict[str, str], object]]:
        """(labels, child) per series; `only`: an unlabelled family's one child."""
        if only is not None:
            return [({}, only)]
        names = self.labelnames
        return [(dict(zip(names, v, strict=True)), c) for v, c in self._children.items()]

    def describe(self) -> list[Metric]:
        return [self._metric()]


class LoopCounter(_LoopFamily):
    """A catalogued counter updated from the event loop thread only (see above)."""

    def __init__(self, registry: CollectorRegistry, m: Entry) -> None:
        super().__init__(registry, m)
        self._only = None if m.labels else CounterChild()

    def labels(self, *values: object, **kw: object) -> CounterChild:
        child = self._child(values, kw, CounterChild)
        assert isinstance(child, CounterChild)
        return child

    def inc(self, amount: float = 1.0) -> None:
        if self._only is None:
            raise ValueError(f"{self.entry.name} has labels: inc() a child")
        self._only.inc(amount)

    def collect(self) -> list[Metric]:
        out = self._metric()
        created = bool(_prom._use_created)  # prometheus_client's switch (disable_created_metrics)
        for labels, c in self._series(self._only):
            assert isinstance(c, CounterChild)
            out.add_sample(self.name + "_total", labels, c.value)
            if created:
                out.add_sample(self.name + "_created", labels, c.created)
        return [out]


class LoopHistogram(_LoopFamily):
    """A catalogued histogram updated from the event loop thread only (see above)."""

    def __init__(self, registry: CollectorRegistry, m: Entry) -> None:
        super().__init__(registry, m)
        if m.buckets is None:
            raise ValueError(f"{m.name}: a loop histogram needs the catalogue's buckets")
        bounds = [float(b) for b in m.buckets]
        if bounds != sorted(bounds):
            raise ValueError(f"{m.name}: buckets not in sorted order")
        if bounds[-1] != float("inf"):
            bounds.append(float("inf"))
        self.bounds = bounds
        self._le: list[str] = [floatToGoString(b) for b in bounds]  # type: ignore[no-untyped-call]
        self._only = None if m.labels else HistogramChild(bounds)

    def labels(self, *values: object, **kw: object) -> HistogramChild:
        child = self._child(values, kw, self._new_child)
        assert isinstance(child, HistogramChild)
        return child

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self.bounds)

    def observe(self, amount: float) -> None:
        if self._only is None:
            raise ValueError(f"{self.entry.name} has labels: observe() a child")
        self._only.observe(amount)

    def collect(self) -> list[Metric]:
        out = self._metric()
        created = bool(_prom._use_created)  # prometheus_client's switch (disable_created_metrics)
        has_sum = self.bounds[0] >= 0  # prometheus_client: no _sum with negative buckets
        for labels, h in self._series(self._only):
            assert isinstance(h, HistogramChild)
            acc = 0.0
            for le, n in zip(self._le, h.counts, strict=True):
                acc += n
                out.add_sample(self.name + "_bucket", {**labels, "le": le}, acc)
            out.add_sample(self.name + "_count", labels, acc)
            if has_sum:
                out.add_sample(self.name + "_sum", labels, h.sum)
            if created:
                out.add_sample(self.name + "_created", labels, h.created)
        return [out]


def loop_counter(registry: CollectorRegistry, name: str) -> LoopCounter:
    """The catalogued counter `name` as a `LoopCounter` on `registry`."""
    m = catalogue_entry(name)
    if m.kind != COUNTER:
        raise TypeError(f"{name} is catalogued as a {m.kind}, not a counter")
    return LoopCounter(registry, m)


def loop_histogram(registry: CollectorRegistry, name: str) -> LoopHistogram:
    """The catalogued histogram `name` as a `LoopHistogram` on `registry`."""
    m = catalogue_entry(name)
    if m.kind != HISTOGRAM:
        raise TypeError(f"{name} is catalogued as a {m.kind}, not a histogram")
    return LoopHistogram(registry, m)


class RouterMetrics:
    """The request path's metrics (entries of `ramjet.metric_catalogue`, source
    `ramjet.metrics`) on one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = loop_counter(r, "ramjet_requests_total")
        self.decisions = loop_counter(r, "ramjet_decisions_total")
        # Agreement is `ramjet_policy_compared_total` / `ramjet_policy_agreed_total` by mode
        # (`ramjet.decisions.accounting`): one pair, counted for every mode.
        self.policy_errors = loop_counter(r, "ramjet_policy_errors_total")
        for role, kinds in POLICY_ERROR_KINDS.items():  # at 0 from start: series to alert on
            for kind in kinds:
                self.policy_errors.labels(role=role, kind=kind)
        self.ttft = loop_histogram(r, "ramjet_ttft_seconds")
        self.duration = loop_histogram(r, "ramjet_request_duration_seconds")
        self.inflight = gauge(r, "ramjet_inflight_requests")
        self.inflight_prompt_tokens = gauge(r, "ramjet_inflight_prompt_tokens")
        self.queued = gauge(r, "ramjet_queued_requests")
        self.retries = counter(r, "ramjet_retries_total")
        self.retries_denied = counter(r, "ramjet_retries_denied_total")
        self.ejections = counter(r, "ramjet_ejections_total")
        self.engine_healthy = gauge(r, "ramjet_engine_healthy")
        self.upstream_errors = counter(r, "ramjet_upstream_errors_total")
        self.rejected = counter(r, "ramjet_rejected_requests_total")
        self.stream_errors = counter(r, "ramjet_stream_errors_total")
        self.arrival_rate = gauge(r, "ramjet_arrival_rate_per_second")
        # Cached children for the metrics touched on every request (see module docstring).
        self.requests_of: Children[CounterChild] = Children(self.requests)
        """(engine, status, policy)"""
        self.decisions_of: Children[CounterChild] = Children(self.decisions)
        """(role, policy, engine)"""
        self.policy_errors_of: Children[CounterChild] = Children(self.policy_errors)
        """(role, kind)"""
        self.ttft_of: Children[HistogramChild] = Children(self.ttft)
        self.duration_of: Children[HistogramChild] = Children(self.duration)
        self.inflight_of: Children[Gauge] = Children(self.inflight)
        self.inflight_prompt_tokens_of: Children[Gauge] = Children(self.inflight_prompt_tokens)

    def init_engines(self, engines: Iterable[str]) -> None:
        """Create each configured engine's error series at 0, so a healthy router exports
        them (a dashboard or alert on a series that never appeared sees nothing)."""
        for engine in engines:
            self.ejections.labels(engine=engine)
            for kind in UPSTREAM_ERROR_KINDS:
                self.upstream_errors.labels(engine=engine, kind=kind)

    def render(self) -> bytes:
        data: bytes = generate_latest(self.registry)
        return data
