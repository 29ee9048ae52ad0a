"""The one catalogue of Ramjet's Prometheus metrics: name, type, unit, labels, help.

Adding a metric is one `Metric(...)` entry in `CATALOGUE`; the code that registers it
asks for it by name, on the registry it was given (never the global default):

    self.hints = counter(registry, "ramjet_priority_hints_total")
    fam = family("ramjet_residency_entries")        # a gauge read at scrape time

Made from the same entries:
- the metrics table of docs/metrics.md (`markdown_table()`; rewrite it with
  `python -m ramjet.metric_catalogue docs/metrics.md`; a test compares the two);
- the Grafana generator's check that every panel and recording rule queries a
  catalogued series of the right type (`check_queries`, run by
  deploy/grafana/generate_dashboards.py before it writes anything);
- a test that what each module registers is its entry (name, type, labels, help), for
  the few that still build their metric objects themselves.

Rules, checked when this module loads (`_check`): names unique and prefixed `ramjet_`;
counters end in `_total`, nothing else does; a unit, when there is one, is in the name
(Prometheus: units in names, base units: seconds, not milliseconds); buckets only on
histograms; the registering module is named (`source`), so the docs say where to look.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

Kind = Literal["counter", "gauge", "histogram"]
COUNTER: Kind = "counter"
GAUGE: Kind = "gauge"
HISTOGRAM: Kind = "histogram"
UNITS = ("", "seconds", "tokens", "ratio", "bytes", "per_second")

_INF = float("inf")
LATENCY_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)  # fmt: skip
"""Router-observed latencies (TTFT, request duration)."""
_PREDICTION = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
PREDICTION_S = (*_PREDICTION, _INF)
SIGNED_S = (*sorted(-b for b in _PREDICTION), 0.0, *_PREDICTION, _INF)
"""Signed differences of seconds (prediction errors, estimated gains)."""
RELATIVE = (-1.0, -0.5, -0.25, -0.1, -0.05, 0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, _INF)
ABS_RELATIVE = (0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 5.0, _INF)
"""|relative error|: fine where the calibrated model lands (the alert reads its median)."""
_TOKENS = (16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0)
SIGNED_TOKENS = (*sorted(-b for b in _TOKENS), 0.0, *_TOKENS, _INF)
PRIORITY_WORK_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
REDIS_CALL_S = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


@dataclass(frozen=True)
class Metric:
    name: str
    kind: Kind
    unit: str
    """One of `UNITS`; "" for counts and grades."""
    labels: tuple[str, ...]
    source: str
    """The module that registers it."""
    help: str
    buckets: tuple[float, ...] | None = None
    """Histograms: the bucket bounds (None: prometheus_client's defaults)."""
    at_scrape: bool = False
    """Read from live state by a collector at scrape time (`family`), not updated."""


# fmt: off
CATALOGUE: tuple[Metric, ...] = (
    # -- ramjet.app.priority ------------------------------------------------------------
    Metric("ramjet_priority_hints_total", COUNTER, "", ("pool", "outcome"), "ramjet.app.priority",
           "Priority hints computed, by pool and outcome (sent, observe, canary_out, client_kept, client_invalid)"),
    Metric("ramjet_priority_hint_work_seconds", HISTOGRAM, "seconds", ("pool",), "ramjet.app.priority",
           "Predicted prompt work of each hint (sent or observed)", buckets=PRIORITY_WORK_S),
    # -- ramjet.decisions.accounting ----------------------------------------------------
    Metric("ramjet_policy_compared_total", COUNTER, "", ("mode",), "ramjet.decisions.accounting",
           "Answered requests where both incumbent and candidate picked, by mode"),
    Metric("ramjet_policy_agreed_total", COUNTER, "", ("mode",), "ramjet.decisions.accounting",
           "Answered requests where incumbent and candidate picked the same engine, by mode"),
    Metric("ramjet_ttft_prediction_error_seconds", HISTOGRAM, "seconds", ("mode",), "ramjet.decisions.accounting",
           "Candidate-predicted TTFT on the answering engine minus realized TTFT", buckets=SIGNED_S),
    Metric("ramjet_ttft_prediction_abs_error_seconds", HISTOGRAM, "seconds", ("mode",), "ramjet.decisions.accounting",
           "|predicted - realized| TTFT (the signed histograms expose no _sum: negative buckets; this one gives the mean absolute error)", buckets=PREDICTION_S),
    Metric("ramjet_ttft_prediction_relative_error_ratio", HISTOGRAM, "ratio", ("mode",), "ramjet.decisions.accounting",
           "(predicted - realized) / realized TTFT", buckets=RELATIVE),
    Metric("ramjet_ttft_predicted_seconds", HISTOGRAM, "seconds", ("mode",), "ramjet.decisions.accounting",
           "Candidate-predicted TTFT on the answering engine (observed with ramjet_ttft_realized_seconds, one pair per request: compare their means)", buckets=PREDICTION_S),
    Metric("ramjet_ttft_realized_seconds", HISTOGRAM, "seconds", ("mode",), "ramjet.decisions.accounting",
           "Realized TTFT of the requests observed in ramjet_ttft_predicted_seconds", buckets=PREDICTION_S),
    Metric("ramjet_cached_tokens_predicted_tokens_total", COUNTER, "tokens", ("mode",), "ramjet.decisions.accounting",
           "Predicted resume tokens, summed over the requests in the cached-token error"),
    Metric("ramjet_cached_tokens_realized_tokens_total", COUNTER, "tokens", ("mode",), "ramjet.decisions.accounting",
           "Realized cached tokens (all tiers and SWA) of the same requests"),
    Metric("ramjet_cached_tokens_prediction_error_tokens", HISTOGRAM, "tokens", ("mode",), "ramjet.decisions.accounting",
           "Predicted resume tokens minus the engine's realized cached tokens", buckets=SIGNED_TOKENS),
    Metric("ramjet_candidate_gain_estimate_seconds", HISTOGRAM, "seconds", ("mode",), "ramjet.decisions.accounting",
           "Predicted TTFT on the incumbent's pick minus on the candidate's pick", buckets=SIGNED_S),
    Metric("ramjet_candidate_gain_seconds_total", COUNTER, "seconds", ("mode",), "ramjet.decisions.accounting",
           "Sum of positive estimated gains of the candidate over the incumbent"),
    Metric("ramjet_candidate_loss_seconds_total", COUNTER, "seconds", ("mode",), "ramjet.decisions.accounting",
           "Sum of negative estimated gains (as positive seconds)"),
    Metric("ramjet_realized_prompt_tokens_total", COUNTER, "tokens", ("engine", "source"), "ramjet.decisions.accounting",
           "Prompt tokens by where the engine got them (hbm, host, ssd, pool, swa, replayed, prefilled), from its usage.prompt_work"),
    Metric("ramjet_realized_usage_missing_total", COUNTER, "", ("engine",), "ramjet.decisions.accounting",
           "Answered requests whose response carried no readable usage.prompt_work"),
    Metric("ramjet_mean_wait_seconds", GAUGE, "seconds", (), "ramjet.decisions.accounting",
           "EWMA of the engines' realized queue wait: usage.prompt_work.queue_ms where the engine reports it, else realized TTFT minus the calibrated service"),
    Metric("ramjet_mean_wait_samples_total", COUNTER, "", ("source",), "ramjet.decisions.accounting",
           "Wait samples folded into the mean wait W, by source (engine: the engine's queue_ms; router: realized TTFT minus the calibrated service)"),
    Metric("ramjet_ttft_prediction_abs_relative_error_ratio", HISTOGRAM, "ratio", ("mode",), "ramjet.decisions.accounting",
           "|predicted - realized| / realized TTFT of the candidate's calibrated prediction (the alert reads its median)", buckets=ABS_RELATIVE),
    Metric("ramjet_ttft_calibration_weight", GAUGE, "", ("engine", "term"), "ramjet.decisions.accounting",
           "Online-calibrated weight of a cost-model term per engine (prefill, resume, wait, packing: 1 = the profile as probed; fixed_s: seconds)"),
    Metric("ramjet_ttft_calibration_samples_total", COUNTER, "", ("engine",), "ramjet.decisions.accounting",
           "Realized TTFTs the engine's calibration has learnt from"),
    Metric("ramjet_decision_log_lines_total", COUNTER, "", (), "ramjet.decisions.accounting",
           "Decision records written"),
    Metric("ramjet_decision_log_dropped_total", COUNTER, "", (), "ramjet.decisions.accounting",
           "Decision records dropped because the writer queue was full"),
    Metric("ramjet_decision_log_rotations_total", COUNTER, "", (), "ramjet.decisions.accounting",
           "Decision log file rotations"),
    Metric("ramjet_policy_reloads_total", COUNTER, "", ("result",), "ramjet.decisions.accounting",
           "Live reloads of mode and policies (ramjet.app.reload), by result (ok, refused)"),
    # -- ramjet.metrics -----------------------------------------------------------------
    Metric("ramjet_requests_total", COUNTER, "", ("engine", "status", "policy"), "ramjet.metrics",
           "Requests answered, by engine that answered ('none' if no engine), status and live policy"),
    Metric("ramjet_decisions_total", COUNTER, "", ("role", "policy", "engine"), "ramjet.metrics",
           "Routing decisions by role (incumbent/candidate/live), policy and picked engine"),
    Metric("ramjet_policy_errors_total", COUNTER, "", ("role", "kind"), "ramjet.metrics",
           "Policy picks that failed and were contained, by role (candidate, incumbent) and kind (raised, invalid, slow, skipped): live or accounting-only picks alike"),
    Metric("ramjet_ttft_seconds", HISTOGRAM, "seconds", ("engine",), "ramjet.metrics",
           "Router-observed time from request arrival to the first response byte sent", buckets=LATENCY_S),
    Metric("ramjet_request_duration_seconds", HISTOGRAM, "seconds", ("engine",), "ramjet.metrics",
           "Router-observed time from request arrival to the end of the response", buckets=LATENCY_S),
    Metric("ramjet_inflight_requests", GAUGE, "", ("engine",), "ramjet.metrics",
           "Requests being forwarded"),
    Metric("ramjet_inflight_prompt_tokens", GAUGE, "tokens", ("engine",), "ramjet.metrics",
           "Prompt tokens sent whose first response byte has not arrived"),
    Metric("ramjet_queued_requests", GAUGE, "", (), "ramjet.metrics",
           "Requests waiting for a forwarding slot"),
    Metric("ramjet_retries_total", COUNTER, "", ("reason",), "ramjet.metrics",
           "Retries on another engine, by reason"),
    Metric("ramjet_retries_denied_total", COUNTER, "", (), "ramjet.metrics",
           "Retries not attempted because the retry budget was spent"),
    Metric("ramjet_ejections_total", COUNTER, "", ("engine",), "ramjet.metrics",
           "Engines ejected by outlier detection"),
    Metric("ramjet_engine_healthy", GAUGE, "", ("engine",), "ramjet.metrics",
           "1 if the engine is routable (probe ok, not ejected)"),
    Metric("ramjet_upstream_errors_total", COUNTER, "", ("engine", "kind"), "ramjet.metrics",
           "Upstream failures by kind (connect, first_byte_timeout, generation_timeout, idle_timeout, disconnect, status_5xx, backpressure)"),
    Metric("ramjet_rejected_requests_total", COUNTER, "", ("reason",), "ramjet.metrics",
           "Requests refused before forwarding, by reason"),
    Metric("ramjet_stream_errors_total", COUNTER, "", ("reason",), "ramjet.metrics",
           "Responses ended early after bytes reached the client, by reason"),
    Metric("ramjet_arrival_rate_per_second", GAUGE, "per_second", (), "ramjet.metrics",
           "EWMA of the request arrival rate"),
    # -- ramjet.reports.metrics ---------------------------------------------------------
    Metric("ramjet_reports_rejected_total", COUNTER, "", ("engine", "reason"), "ramjet.reports.metrics",
           "Reports rejected, by reason"),
    Metric("ramjet_reports_accepted_total", COUNTER, "", ("engine", "kind"), "ramjet.reports.metrics",
           "Reports accepted, by kind"),
    Metric("ramjet_reports_gaps_total", COUNTER, "", ("engine",), "ramjet.reports.metrics",
           "Sequence gaps seen"),
    Metric("ramjet_reports_snapshots_fetched_total", COUNTER, "", ("engine",), "ramjet.reports.metrics",
           "Snapshots the router fetched"),
    Metric("ramjet_reports_epoch_changes_total", COUNTER, "", ("engine",), "ramjet.reports.metrics",
           "New engine epochs seen"),
    Metric("ramjet_reports_snapshots_abandoned_total", COUNTER, "", ("engine", "reason"),
           "ramjet.reports.metrics",
           "Snapshots sent in parts given up before their last part (gap, out_of_order, "
           "restarted, interrupted); nothing the previous state vouched for was removed"),
    Metric("ramjet_reports_revoked_purges_total", COUNTER, "", ("engine",), "ramjet.reports.metrics",
           "Engine views purged because a key that signed them was revoked by a reload"),
    Metric("ramjet_reports_epoch", GAUGE, "", ("engine",), "ramjet.reports.metrics",
           "Current epoch", at_scrape=True),
    Metric("ramjet_reports_trust_grade", GAUGE, "", ("engine",), "ramjet.reports.metrics",
           "Trust in the engine's residency: 0 exact, 1 degraded, 2 approximate", at_scrape=True),
    Metric("ramjet_reports_staleness_seconds", GAUGE, "seconds", ("engine",), "ramjet.reports.metrics",
           "Seconds since the engine's last accepted report", at_scrape=True),
    # -- ramjet.app.profile_source ------------------------------------------------------
    Metric("ramjet_engine_profile_source", GAUGE, "", ("engine", "source"), "ramjet.app.profile_source",
           "1 for the profile the cost model prices the engine with: reported (signed by the engine), policy_default (candidate.params.default_profile), builtin_estimate (the hard-coded DeepSeek-V4.1-Flash TP4 estimate, not a measurement)", at_scrape=True),
    # -- ramjet.reports.ingest ----------------------------------------------------------
    Metric("ramjet_reports_pull_failures_total", COUNTER, "", ("engine",), "ramjet.reports.ingest",
           "Polls of the engine's pull target that failed (no answer, HTTP error, a response over the cap)"),
    Metric("ramjet_reports_pull_silent_seconds", GAUGE, "seconds", ("engine",), "ramjet.reports.ingest",
           "Seconds since the engine's pull target last answered a poll (since the router started, if it never has)", at_scrape=True),
    # -- ramjet.reports.push ------------------------------------------------------------
    Metric("ramjet_reports_push_limited_total", COUNTER, "", (), "ramjet.reports.push",
           "Pushed report frames refused by the per-source limit before being read or verified (reports.push.rate_per_s)"),
    Metric("ramjet_reports_push_refused_total", COUNTER, "", ("reason",), "ramjet.reports.push",
           "Push requests refused before verification for their form (bad head, no length, wrong path or method, too many connections, idle)"),
    Metric("ramjet_reports_push_connections", GAUGE, "", (), "ramjet.reports.push",
           "Open connections on the report push listener"),
    # -- ramjet.reports.redis_cursors ---------------------------------------------------
    Metric("ramjet_reports_unclaimed_total", COUNTER, "", ("engine",), "ramjet.reports.redis_cursors",
           "Reports applied without a shared claim because Redis was unreachable"),
    Metric("ramjet_reports_shared_absorbed_total", COUNTER, "", ("engine",), "ramjet.reports.redis_cursors",
           "Times this replica moved an engine's report state forward from Redis"),
    Metric("ramjet_reports_shared_rejected_total", COUNTER, "", ("reason",), "ramjet.reports.redis_cursors",
           "Shared report cursors, loads and profiles read from Redis and ignored: bad or missing MAC, or an epoch or issue time in the future"),
    # -- ramjet.residency.redis_link ----------------------------------------------------
    Metric("ramjet_redis_degraded", GAUGE, "", (), "ramjet.residency.redis_link",
           "1 while the Redis breaker is open or probing: routing runs from local state"),
    Metric("ramjet_redis_errors_total", COUNTER, "", ("kind",), "ramjet.residency.redis_link",
           "Redis calls that failed, by kind (timeout, connection, breaker_open, oom, response, other)"),
    Metric("ramjet_redis_command_errors_total", COUNTER, "", (), "ramjet.residency.redis_link",
           "Redis calls answered with an error reply (OOM at maxmemory, script error): failures that changed nothing"),
    Metric("ramjet_redis_breaker_opens_total", COUNTER, "", (), "ramjet.residency.redis_link",
           "Times the Redis breaker opened"),
    Metric("ramjet_redis_script_reloads_total", COUNTER, "", (), "ramjet.residency.redis_link",
           "Scripts loaded again after NOSCRIPT (cache flush, failover, restart)"),
    Metric("ramjet_redis_call_seconds", HISTOGRAM, "seconds", (), "ramjet.residency.redis_link",
           "Latency of successful Redis calls", buckets=REDIS_CALL_S),
    # -- ramjet.residency.redis_sync ----------------------------------------------------
    Metric("ramjet_redis_resyncs_total", COUNTER, "", ("direction", "reason"), "ramjet.residency.redis_sync",
           "Full resyncs of one engine's residency: pull (mirror from Redis) or push (seed Redis from the mirror), by reason"),
    Metric("ramjet_redis_recoveries_total", COUNTER, "", (), "ramjet.residency.redis_sync",
           "Times Redis came back after the breaker had opened"),
    Metric("ramjet_redis_pending_batches", GAUGE, "", (), "ramjet.residency.redis_sync",
           "Residency write batches waiting for Redis"),
    Metric("ramjet_redis_dropped_batches_total", COUNTER, "", (), "ramjet.residency.redis_sync",
           "Residency write batches dropped because the queue was full while Redis was away"),
    Metric("ramjet_redis_batches_total", COUNTER, "", ("result",), "ramjet.residency.redis_sync",
           "Residency write batches sent to Redis, by result (ok, dup, stale, missing; skipped: a later chunk of a refused batch; refused: dropped after repeated error replies)"),
    Metric("ramjet_redis_log_entries_applied_total", COUNTER, "", (), "ramjet.residency.redis_sync",
           "Change-log entries (any replica's) applied to this replica's mirror"),
    Metric("ramjet_redis_rejected_total", COUNTER, "", ("reason",), "ramjet.residency.redis_sync",
           "Change-log entries, stored entries and cursors read from Redis and skipped, unapplied: bad or missing MAC, malformed, unknown op, kind or tier, future epoch"),
    # -- ramjet.residency.tables --------------------------------------------------------
    Metric("ramjet_residency_entries", GAUGE, "", ("table",), "ramjet.residency.tables",
           "Entries held per residency table", at_scrape=True),
    Metric("ramjet_residency_pending_entries", GAUGE, "", (), "ramjet.residency.tables",
           "Pending (engine, key) holds: requests sent, not yet confirmed by a report", at_scrape=True),
    Metric("ramjet_residency_global_cap_entries", GAUGE, "", (), "ramjet.residency.tables",
           "Cap of the in-process global residency table: capacity_headroom x the engines' reported capacity, within max_global_entries .. max_global_entries_ceiling", at_scrape=True),
    Metric("ramjet_residency_cap_evictions_total", COUNTER, "", ("engine",), "ramjet.residency.tables",
           "Exact (report-confirmed) global entries evicted because the table was at its cap: the router forgot blocks the engine still holds"),
    Metric("ramjet_residency_capped", GAUGE, "", ("engine",), "ramjet.residency.tables",
           "1 while the cap has evicted an exact entry of the engine since its last snapshot: its matches may be missing blocks", at_scrape=True),
    # -- ramjet.keys.pools ---------------------------------------------------------------
    Metric("ramjet_token_keys_fallback_total", COUNTER, "", ("pool",), "ramjet.keys.pools",
           "Requests of a token-keys pool keyed by text: the pool's chat template could not render them"),
    # -- ramjet.sidecar.metrics ---------------------------------------------------------
    Metric("ramjet_sidecar_unknown_fields_total", COUNTER, "", ("event", "field"), "ramjet.sidecar.metrics",
           "Fields of known KV events the decoder ignored"),
    Metric("ramjet_sidecar_unknown_events_total", COUNTER, "", ("event",), "ramjet.sidecar.metrics",
           "KV events of unknown type, skipped"),
    Metric("ramjet_sidecar_malformed_events_total", COUNTER, "", ("event",), "ramjet.sidecar.metrics",
           "Known KV events dropped for a malformed field"),
    Metric("ramjet_sidecar_resyncs_total", COUNTER, "", (), "ramjet.sidecar.metrics",
           "Batches whose dropped event forced a new epoch"),
    Metric("ramjet_sidecar_events_decoded_total", COUNTER, "", ("event",), "ramjet.sidecar.metrics",
           "KV events decoded and applied, by type"),
    Metric("ramjet_sidecar_event_to_report_seconds", HISTOGRAM, "seconds", (), "ramjet.sidecar.metrics",
           "Engine timestamp of the oldest batch in a delta to the delta's signing",
           buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)),
    Metric("ramjet_sidecar_events_silent", GAUGE, "", (), "ramjet.sidecar.metrics",
           "1 while no KV event arrived within --events-warn-after seconds of start"),
    Metric("ramjet_sidecar_events_down", GAUGE, "", (), "ramjet.sidecar.metrics",
           "1 while the KV-event path is down (its thread died): residency purged, load reports paused"),
    Metric("ramjet_sidecar_event_path_restarts_total", COUNTER, "", (), "ramjet.sidecar.metrics",
           "Restarts of the KV-event path after it died"),
)
# fmt: on


BY_NAME: dict[str, Metric] = {m.name: m for m in CATALOGUE}


def _check(metrics: Sequence[Metric]) -> None:
    seen: set[str] = set()
    for m in metrics:
        where = f"metric catalogue: {m.name}"
        if m.name in seen:
            raise ValueError(f"{where}: listed twice")
        seen.add(m.name)
        if not re.fullmatch(r"ramjet_[a-z][a-z0-9_]*", m.name):
            raise ValueError(f"{where}: names are ramjet_ + lower_snake_case")
        if (m.kind == COUNTER) != m.name.endswith("_total"):
            raise ValueError(f"{where}: counters, and only counters, end in _total")
        if m.unit not in UNITS:
            raise ValueError(f"{where}: unit {m.unit!r} is not one of {UNITS}")
        if m.unit and f"_{m.unit}" not in m.name:
            raise ValueError(f"{where}: the unit {m.unit!r} must appear in the name")
        if m.buckets is not None and m.kind != HISTOGRAM:
            raise ValueError(f"{where}: buckets on a {m.kind}")
        if m.at_scrape and m.kind != GAUGE:
            raise ValueError(f"{where}: only gauges are read at scrape time here")
        if not m.help.strip() or not m.source.startswith("ramjet."):
            raise ValueError(f"{where}: help and source are required")


_check(CATALOGUE)


def entry(name: str) -> Metric:
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not in ramjet/metric_catalogue.py: add its entry") from None


def _of(name: str, kind: Kind) -> Metric:
    m = entry(name)
    if m.kind != kind or m.at_scrape:
        raise TypeError(f"{name} is a {'scraped ' if m.at_scrape else ''}{m.kind}, not a {kind}")
    return m


def counter(registry: CollectorRegistry, name: str) -> Counter:
    m = _of(name, COUNTER)
    return Counter(m.name, m.help, m.labels, registry=registry)


def gauge(registry: CollectorRegistry, name: str) -> Gauge:
    m = _of(name, GAUGE)
    return Gauge(m.name, m.help, m.labels, registry=registry)


def histogram(registry: CollectorRegistry, name: str) -> Histogram:
    m = _of(name, HISTOGRAM)
    if m.buckets is None:
        return Histogram(m.name, m.help, m.labels, registry=registry)
    return Histogram(m.name, m.help, m.labels, buckets=m.buckets, registry=registry)


def family(name: str, value: float | None = None) -> GaugeMetricFamily:
    """A gauge family for a collector (`at_scrape` entries): add samples, then yield it.
    `value`: the one sample of an unlabelled gauge."""
    m = entry(name)
    if not m.at_scrape:
        raise TypeError(f"{name} is updated in place, not read at scrape time")
    if m.labels:
        return GaugeMetricFamily(m.name, m.help, labels=list(m.labels))
    return GaugeMetricFamily(m.name, m.help, value=value)


# -- what is made from the catalogue ------------------------------------------------------

_SUFFIXES = {"_bucket": HISTOGRAM, "_sum": HISTOGRAM, "_count": HISTOGRAM, "_created": None}
_SERIES = re.compile(r"\bramjet_[a-z0-9_]+\b")


def series_metric(series: str) -> Metric | None:
    """The catalogued metric a series name belongs to (`x_bucket` -> histogram `x`)."""
    if series in BY_NAME:
        return BY_NAME[series]
    for suffix, kind in _SUFFIXES.items():
        base = series.removesuffix(suffix)
        if base != series and base in BY_NAME:
            m = BY_NAME[base]
            return m if kind is None or m.kind == kind else None
    return None


def check_queries(queries: Iterable[tuple[str, str]]) -> list[str]:
    """Problems with PromQL queries, given as (where, expr): a `ramjet_` series that is
    not catalogued (or a histogram suffix on a non-histogram). Empty when all is well."""
    bad = []
    for where, expr in queries:
        for series in _SERIES.findall(expr):
            if series_metric(series) is None:
                bad.append(f"{where}: {series} is not in the metric catalogue")
    return bad


def markdown_table(metrics: Sequence[Metric] = CATALOGUE) -> str:
    rows = [
        "| metric | type | unit | labels | registered by | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for m in sorted(metrics, key=lambda m: m.name):
        labels = ", ".join(m.labels)
        text = m.help.replace("|", "\\|")
        scraped = " (read at scrape)" if m.at_scrape else ""
        rows.append(
            f"| `{m.name}` | {m.kind}{scraped} | {m.unit} | {labels} | `{m.source}` | {text} |"
        )
    return "\n".join(rows) + "\n"


BEGIN = "<!-- metric catalogue: begin (generated: python -m ramjet.metric_catalogue docs/metrics.md) -->"
END = "<!-- metric catalogue: end -->"


def render_doc(text: str) -> str:
    """`text` with the part between BEGIN and END replaced by `markdown_table()`."""
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError("the document has no metric catalogue markers")
    return f"{head}{BEGIN}\n{markdown_table()}{END}{tail}"


def main(argv: Sequence[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m ramjet.metric_catalogue docs/metrics.md", file=sys.stderr)
        return 2
    path = Path(argv[0])
    path.write_text(render_doc(path.read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
