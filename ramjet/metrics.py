"""Router metrics (Prometheus, prefix `ramjet_`, units in names), registered from their
entries in `ramjet.metric_catalogue` (name, type, unit, labels, help, buckets).

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

from ramjet.metric_catalogue import counter, gauge, histogram

M = TypeVar("M", bound=MetricWrapperBase)

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
    """The request path's metrics (entries of `ramjet.metric_catalogue`, source
    `ramjet.metrics`) on one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = counter(r, "ramjet_requests_total")
        self.decisions = counter(r, "ramjet_decisions_total")
        # Agreement is `ramjet_policy_compared_total` / `ramjet_policy_agreed_total` by mode
        # (`ramjet.decisions.accounting`): one pair, counted for every mode.
        self.policy_errors = counter(r, "ramjet_policy_errors_total")
        for role, kinds in POLICY_ERROR_KINDS.items():  # at 0 from start: series to alert on
            for kind in kinds:
                self.policy_errors.labels(role=role, kind=kind)
        self.ttft = histogram(r, "ramjet_ttft_seconds")
        self.duration = histogram(r, "ramjet_request_duration_seconds")
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
