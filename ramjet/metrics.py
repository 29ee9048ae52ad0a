"""Router metrics (Prometheus, prefix `ramjet_`, units in names).

All metric objects live on a `CollectorRegistry` passed in, never the global default,
so several routers can live in one process (tests). Latencies are router-observed:
TTFT is from the request's arrival to the first response byte forwarded to the client.

The request path reaches label children through `Children` (one per labelled metric it
touches): `labels()` validates and locks on every call (~1.5 µs), a cached child is a
dict hit (~0.05 µs), and a request touches about ten of them. The cache holds exactly
the series the registry already holds, so it adds no cardinality.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

M = TypeVar("M", bound=MetricWrapperBase)

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)  # fmt: skip

UPSTREAM_ERROR_KINDS = (
    "connect", "first_byte_timeout", "idle_timeout", "disconnect", "status_5xx", "backpressure",
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
    Series are never removed from the router's metrics, so a cached child stays valid."""

    __slots__ = ("_cache", "_metric")

    def __init__(self, metric: M) -> None:
        self._metric = metric
        self._cache: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._cache.get(values)
        if child is None:
            child = self._cache[values] = self._metric.labels(*values)
        return child


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "ramjet_requests_total",
            "Requests answered, by engine that answered ('none' if no engine), status and live policy",
            ["engine", "status", "policy"],
            registry=r,
        )
        self.decisions = Counter(
            "ramjet_decisions_total",
            "Routing decisions by role (incumbent/candidate/live), policy and picked engine",
            ["role", "policy", "engine"],
            registry=r,
        )
        # Agreement is `ramjet_policy_compared_total` / `ramjet_policy_agreed_total` by mode
        # (`ramjet.decisions.accounting`): one pair, counted for every mode.
        self.policy_errors = Counter(
            "ramjet_policy_errors_total",
            "Policy picks that failed and were contained, by role (candidate, incumbent) and "
            "kind (raised, invalid, slow, skipped): live or accounting-only picks alike",
            ["role", "kind"],
            registry=r,
        )
        for role, kinds in POLICY_ERROR_KINDS.items():  # at 0 from start: series to alert on
            for kind in kinds:
                self.policy_errors.labels(role=role, kind=kind)
        self.ttft = Histogram(
            "ramjet_ttft_seconds",
            "Router-observed time from request arrival to the first response byte sent",
            ["engine"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "ramjet_request_duration_seconds",
            "Router-observed time from request arrival to the end of the response",
            ["engine"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge(
            "ramjet_inflight_requests", "Requests being forwarded", ["engine"], registry=r
        )
        self.inflight_prompt_tokens = Gauge(
            "ramjet_inflight_prompt_tokens",
            "Prompt tokens sent whose first response byte has not arrived",
            ["engine"],
            registry=r,
        )
        self.queued = Gauge(
            "ramjet_queued_requests", "Requests waiting for a forwarding slot", registry=r
        )
        self.retries = Counter(
            "ramjet_retries_total", "Retries on another engine, by reason", ["reason"], registry=r
        )
        self.retries_denied = Counter(
            "ramjet_retries_denied_total",
            "Retries not attempted because the retry budget was spent",
            registry=r,
        )
        self.ejections = Counter(
            "ramjet_ejections_total", "Engines ejected by outlier detection", ["engine"], registry=r
        )
        self.engine_healthy = Gauge(
            "ramjet_engine_healthy",
            "1 if the engine is routable (probe ok, not ejected)",
            ["engine"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "ramjet_upstream_errors_total",
            "Upstream failures by kind (connect, first_byte_timeout, idle_timeout, "
            "disconnect, status_5xx, backpressure)",
            ["engine", "kind"],
            registry=r,
        )
        self.rejected = Counter(
            "ramjet_rejected_requests_total",
            "Requests refused before forwarding, by reason",
            ["reason"],
            registry=r,
        )
        self.stream_errors = Counter(
            "ramjet_stream_errors_total",
            "Responses ended early after bytes reached the client, by reason",
            ["reason"],
            registry=r,
        )
        self.arrival_rate = Gauge(
            "ramjet_arrival_rate_per_second", "EWMA of the request arrival rate", registry=r
        )
        # Cached children for the metrics touched on every request (see module docstring).
        self.requests_of: Children[Counter] = Children(self.requests)
        """(engine, status, policy)"""
        self.decisions_of: Children[Counter] = Children(self.decisions)
        """(role, policy, engine)"""
        self.policy_errors_of: Children[Counter] = Children(self.policy_errors)
        """(role, kind)"""
        self.ttft_of: Children[Histogram] = Children(self.ttft)
        self.duration_of: Children[Histogram] = Children(self.duration)
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
