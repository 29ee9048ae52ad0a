"""Accounting: every decision record, once its response has ended, becomes metrics, a
line in the decision log (`ramjet.decisions.log`), and a sample of the fleet's mean wait.

`Accounting` is the router's `DecisionSink`. On the event loop, per record, it does
bounded work only: parse the engine's usage from the response tail (at most 16 KiB),
update counters and histograms, fold the wait into an EWMA, and hand the record to the
log's queue. What it measures, by `mode` (observe / canary / enforce):

- agreement: `ramjet_policy_compared_total` counts records where both the incumbent and
  the candidate picked, `ramjet_policy_agreed_total` those where they picked the same
  engine; agreement rate = agreed / compared.
- TTFT prediction error: the candidate's predicted `ttft_s` for the engine that answered
  minus the realized TTFT (`decisions.realized_ttft`), in seconds and relative to the
  realized value. Positive = the model was pessimistic. (A histogram with negative
  buckets exposes no `_sum`; `ramjet_ttft_prediction_abs_error_seconds` gives the mean
  absolute error.) `ramjet_ttft_predicted_seconds` and `ramjet_ttft_realized_seconds`
  observe the two sides of each such pair, so dashboards can plot predicted vs realized.
- cached-token prediction error: predicted `resume_tokens` (the tokens the model expects
  not to prefill) minus the engine's realized cached tokens (all tiers and SWA); the
  two sides are also summed (`ramjet_cached_tokens_{predicted,realized}_tokens_total`).
- estimated gain of the candidate over the incumbent: the candidate's own predicted TTFT
  for the incumbent's pick minus for its own pick. It is a prediction, not a measurement
  (only one of the two picks ran); positive = the candidate expects to be faster. Summed
  as two counters (gain, loss) because a Prometheus counter never falls, and observed
  as a histogram.

Calibration: each realized TTFT on an engine, with the raw features the candidate
recorded for that engine (`x_*_s`), is a sample of that engine's online TTFT calibration
(`ramjet.policy.calibration`); the router reads the weights into `FleetStats` for the
next decisions. Its weights are gauges, its samples a counter, and the calibrated
prediction's |relative error| a histogram (`..._abs_relative_error_ratio`).

Fleet stats: `mean_wait_s(now)` is an EWMA (time constant `wait_tau_s`) of each
request's wait, the W of the cost model's λ·W externality: the engine's realized
`prompt_work.queue_ms` where it reports one (the reference engine), else the router's
own measure, realized TTFT minus the calibrated service the candidate predicted on that
engine (prefill, restore, replay, fixed; vLLM, SGLang). The router reads it into
`FleetStats` next to its arrival-rate EWMA (λ). Both estimators are
`ramjet.policy.fleet_stats`'s (`MeanWait` is re-exported here), the ones the simulator runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge

from ramjet.decisions.log import (
    DecisionLog,
    RealizedWork,
    parse_realized,
    predicted_for,
    realized_ttft,
)
from ramjet.decisions.record import DecisionRecord, DecisionSink
from ramjet.metric_catalogue import counter, gauge
from ramjet.metrics import (
    CounterChild,
    HistogramChild,
    LoopCounter,
    loop_counter,
    loop_histogram,
)
from ramjet.policy.calibration import TERMS, Calibrations, features_of, service_s
from ramjet.policy.fleet_stats import DEFAULT_WAIT_TAU_S
from ramjet.policy.fleet_stats import MeanWait as MeanWait
from ramjet.types import EngineId

log = logging.getLogger(__name__)

Clock = Callable[[], float]


class AccountingMetrics:
    """The accounting's metrics, on the registry passed in (see module docstring)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.compared = loop_counter(r, "ramjet_policy_compared_total")
        self.agreed = loop_counter(r, "ramjet_policy_agreed_total")
        self.ttft_error = loop_histogram(r, "ramjet_ttft_prediction_error_seconds")
        self.ttft_abs_error = loop_histogram(r, "ramjet_ttft_prediction_abs_error_seconds")
        self.ttft_relative_error = loop_histogram(r, "ramjet_ttft_prediction_relative_error_ratio")
        self.ttft_predicted = loop_histogram(r, "ramjet_ttft_predicted_seconds")
        self.ttft_realized = loop_histogram(r, "ramjet_ttft_realized_seconds")
        self.cached_predicted = loop_counter(r, "ramjet_cached_tokens_predicted_tokens_total")
        self.cached_realized = loop_counter(r, "ramjet_cached_tokens_realized_tokens_total")
        self.cached_error = loop_histogram(r, "ramjet_cached_tokens_prediction_error_tokens")
        self.gain = loop_histogram(r, "ramjet_candidate_gain_estimate_seconds")
        self.gain_total = loop_counter(r, "ramjet_candidate_gain_seconds_total")
        self.loss_total = loop_counter(r, "ramjet_candidate_loss_seconds_total")
        self.realized_tokens = loop_counter(r, "ramjet_realized_prompt_tokens_total")
        self.usage_missing = loop_counter(r, "ramjet_realized_usage_missing_total")
        self.mean_wait = gauge(r, "ramjet_mean_wait_seconds")
        self.wait_samples = loop_counter(r, "ramjet_mean_wait_samples_total")
        self.ttft_abs_relative = loop_histogram(
            r, "ramjet_ttft_prediction_abs_relative_error_ratio"
        )
        self.calibration_weight = gauge(r, "ramjet_ttft_calibration_weight")
        self.calibration_samples = loop_counter(r, "ramjet_ttft_calibration_samples_total")
        self.log_lines = counter(r, "ramjet_decision_log_lines_total")
        self.log_dropped = counter(r, "ramjet_decision_log_dropped_total")
        self.log_rotations = counter(r, "ramjet_decision_log_rotations_total")
        self.reloads = counter(r, "ramjet_policy_reloads_total")


class _ModeSeries:
    """One mode's label children, made group by group on first use, as the accounting has
    always made them (a series appears when first touched: the comparison's four at the
    first comparison, the TTFT error's at the first prediction with a realized TTFT, ...):
    a request finds them with one dict hit instead of a cached `labels()` per metric."""

    __slots__ = ("cached", "compare", "gain", "m", "mode", "relative", "ttft")

    def __init__(self, m: AccountingMetrics, mode: str) -> None:
        self.m, self.mode = m, mode
        self.compare: tuple[CounterChild, CounterChild, CounterChild, CounterChild] | None = None
        self.gain: HistogramChild | None = None
        self.ttft: tuple[HistogramChild, HistogramChild, HistogramChild, HistogramChild] | None = (
            None
        )
        self.relative: HistogramChild | None = None
        self.cached: tuple[HistogramChild, CounterChild, CounterChild] | None = None

    def make_compare(self) -> tuple[CounterChild, CounterChild, CounterChild, CounterChild]:
        """(compared, agreed, gain_total, loss_total): all four exist from the first
        comparison (agreed at 0 until the first agreement: rate 0)."""
        m, mode = self.m, self.mode
        self.compare = (
            m.compared.labels(mode),
            m.agreed.labels(mode),
            m.gain_total.labels(mode),
            m.loss_total.labels(mode),
        )
        return self.compare

    def make_gain(self) -> HistogramChild:
        self.gain = self.m.gain.labels(self.mode)
        return self.gain

    def make_ttft(self) -> tuple[HistogramChild, HistogramChild, HistogramChild, HistogramChild]:
        """(error, abs error, predicted, realized)."""
        m, mode = self.m, self.mode
        self.ttft = (
            m.ttft_error.labels(mode),
            m.ttft_abs_error.labels(mode),
            m.ttft_predicted.labels(mode),
            m.ttft_realized.labels(mode),
        )
        return self.ttft

    def make_relative(self) -> HistogramChild:
        self.relative = self.m.ttft_relative_error.labels(self.mode)
        return self.relative

    def make_cached(self) -> tuple[HistogramChild, CounterChild, CounterChild]:
        """(error, predicted total, realized total)."""
        m, mode = self.m, self.mode
        self.cached = (
            m.cached_error.labels(mode),
            m.cached_predicted.labels(mode),
            m.cached_realized.labels(mode),
        )
        return self.cached


class Accounting:
    """The router's decision sink (see module docstring). `log` may be None (no file);
    `downstream` receives every record afterwards (tests, other consumers)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        log_path: str | None = None,
        log_max_bytes: int = 64 * 1024 * 1024,
        log_backups: int = 5,
        log_queue: int = 10_000,
        downstream: DecisionSink | None = None,
        clock: Clock = time.monotonic,
        wait_tau_s: float = DEFAULT_WAIT_TAU_S,
        calibration: Calibrations | None = None,
    ) -> None:
        """`calibration`: the TTFT calibration to feed (None: none is fitted)."""
        self.metrics = AccountingMetrics(registry)
        self.downstream = downstream
        self.clock = clock
        self.waits = MeanWait(wait_tau_s)
        self.calibration = calibration
        self._children: dict[tuple[int, tuple[str, ...]], CounterChild] = {}
        self._modes: dict[str, _ModeSeries] = {}
        self._abs_relative: dict[str, HistogramChild] = {}
        self._weight_gauges: dict[str, list[Gauge]] = {}
        """Each engine's `ramjet_ttft_calibration_weight` children, in `TERMS` order."""
        m = self.metrics
        self.log: DecisionLog | None = None
        if log_path is not None:
            self.log = DecisionLog(
                log_path,
                max_bytes=log_max_bytes,
                backups=log_backups,
                queue_size=log_queue,
                on_written=m.log_lines.inc,
                on_dropped=m.log_dropped.inc,
                on_rotated=m.log_rotations.inc,
            )

    def mean_wait_s(self) -> float:
        return self.waits.mean()

    def on_decision(self, record: DecisionRecord) -> None:
        realized = parse_realized(record.response_tail) if record.engine is not None else None
        try:
            self._measure(record, realized)
        except Exception:  # accounting must never fail a request
            log.exception("accounting failed for %s", record.request_id)
        if self.log is not None:
            self.log.submit(record, realized)
        if self.downstream is not None:
            self.downstream.on_decision(record)

    def _of(self, metric: LoopCounter, *values: str) -> CounterChild:
        """`metric.labels(*values)` (label order), cached: the accounting reads up to a
        dozen children per request and `labels()` validates and converts its values."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def _mode(self, mode: str) -> _ModeSeries:
        s = self._modes.get(mode)
        if s is None:
            s = self._modes[mode] = _ModeSeries(self.metrics, mode)
        return s

    def _measure(self, record: DecisionRecord, realized: RealizedWork | None) -> None:
        m, s = self.metrics, self._mode(record.mode)
        inc, cand = record.incumbent, record.candidate
        if inc is not None and cand is not None and record.status and record.status < 500:
            compared, agreed, gain_total, loss_total = s.compare or s.make_compare()
            compared.inc()
            if inc.engine == cand.engine:
                agreed.inc()
            on_inc = predicted_for(cand, inc.engine, "ttft_s")
            on_cand = predicted_for(cand, cand.engine, "ttft_s")
            if on_inc is not None and on_cand is not None:
                gain = on_inc - on_cand
                (s.gain or s.make_gain()).observe(gain)
                if gain > 0:
                    gain_total.inc(gain)
                elif gain < 0:
                    loss_total.inc(-gain)
        if record.engine is None or record.status >= 400:
            return
        # W: the router's own measure where it saw the first byte and the candidate priced
        # the engine (the engine's queue_ms misses the time before its scheduler saw the
        # request); else the engine's queue_ms
        comp = cand.components.get(record.engine) if cand is not None else None
        features = features_of(comp) if comp is not None else None
        router_wait = features is not None and (record.stream and record.ttft_s is not None)
        if realized is None:
            self._of(m.usage_missing, record.engine).inc()
        else:
            if not router_wait:
                self._wait(realized.queue_ms / 1e3, "engine")
            for source, n in (
                ("hbm", realized.hbm_tokens),
                ("host", realized.host_tokens),
                ("ssd", realized.ssd_tokens),
                ("pool", realized.pool_tokens),
                ("swa", realized.swa_tokens),
                ("replayed", realized.replayed_tokens),
                ("prefilled", realized.prefilled_tokens),
            ):
                if n:
                    self._of(m.realized_tokens, record.engine, source).inc(n)
        predicted = predicted_for(cand, record.engine, "ttft_s")
        real, _ = realized_ttft(record, realized)
        if predicted is not None and real is not None:
            error, abs_error, on_predicted, on_realized = s.ttft or s.make_ttft()
            error.observe(predicted - real)
            abs_error.observe(abs(predicted - real))
            on_predicted.observe(predicted)
            on_realized.observe(real)
            if real > 0:
                (s.relative or s.make_relative()).observe((predicted - real) / real)
                abs_rel = self._abs_relative.get(record.mode)
                if abs_rel is None:
                    abs_rel = m.ttft_abs_relative.labels(record.mode)
                    self._abs_relative[record.mode] = abs_rel
                abs_rel.observe(abs(predicted - real) / real)
        if real is not None and features is not None:
            self._calibrate(record.engine, features, real, router_wait or realized is None)
        resume = predicted_for(cand, record.engine, "resume_tokens")
        if resume is not None and realized is not None:
            cached_error, cached_predicted, cached_realized = s.cached or s.make_cached()
            cached_error.observe(resume - realized.cached_tokens)
            cached_predicted.inc(max(resume, 0))
            cached_realized.inc(realized.cached_tokens)

    def _wait(self, sample_s: float, source: str) -> None:
        self.waits.add(self.clock(), max(sample_s, 0.0))
        self.metrics.mean_wait.set(self.waits.mean())
        self._of(self.metrics.wait_samples, source).inc()

    def _calibrate(
        self, engine: str, features: list[float], real: float, measure_wait: bool
    ) -> None:
        """Fold one realized TTFT into `engine`'s calibration; with `measure_wait`, the
        request's wait is the realized TTFT minus the calibrated service."""
        cal = self.calibration
        if cal is None:
            return
        eid = EngineId(engine)
        if cal.observe(eid, features, real) is None:
            return
        m = self.metrics
        self._of(m.calibration_samples, engine).inc()
        w = cal.weights()[eid]
        gauges = self._weight_gauges.get(engine)
        if gauges is None:  # `labels()` validates and converts: once per engine, not per sample
            gauges = self._weight_gauges[engine] = [
                m.calibration_weight.labels(engine, term) for term in TERMS
            ]
        for child, value in zip(gauges, w.as_dict().values(), strict=True):
            child.set(value)
        if measure_wait:
            self._wait(real - service_s(w, features), "router")

    def start(self) -> None:
        return None

    def close(self, timeout_s: float = 5.0) -> None:
        if self.log is not None:
            self.log.close(timeout_s)
