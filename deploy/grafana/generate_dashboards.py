"""Writes deploy/grafana/dashboards/*.json: Ramjet's Grafana dashboards, from one table.

Run `python deploy/grafana/generate_dashboards.py` after editing; a test checks that the
committed JSON is what this script writes, and runs every panel's query against a live
Prometheus (tests/integration/test_ops_prometheus.py). Queries use `$__rate_interval`
(Grafana's rate window, at least four scrape intervals); `ramjet:*` series are the
recording rules of deploy/prometheus/rules/ramjet-recording.yml.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

DATASOURCE = {"type": "prometheus", "uid": "ramjet-prometheus"}
OUT = Path(__file__).resolve().parent / "dashboards"
RI = "$__rate_interval"


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    targets: tuple[tuple[str, str], ...]  # (expr, legend)
    unit: str = "short"
    kind: str = "timeseries"  # or "stat"
    width: int = 12
    extra: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...]


def q(*pairs: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    return pairs


ROUTING = Dashboard(
    "ramjet-routing",
    "Ramjet / Routing",
    "Which engine each request went to, under which policy, and how fast it started.",
    (
        Panel(
            "Live decisions by engine and policy",
            "Requests per second routed to each engine, by the policy whose pick was used "
            "(the incumbent in observe mode; the candidate for the canary share or in "
            'enforce). From ramjet_decisions_total{role="live"}.',
            q(
                (
                    f'sum by (engine, policy) (rate(ramjet_decisions_total{{role="live"}}[{RI}]))',
                    "{{engine}} via {{policy}}",
                )
            ),
            unit="reqps",
        ),
        Panel(
            "Picks by role: incumbent vs candidate",
            "What each policy picked, whether or not its pick was used: role=incumbent and "
            "role=candidate per engine. In observe mode the candidate line shows where the "
            "new policy would have sent traffic.",
            q(
                (
                    f'sum by (role, engine) (rate(ramjet_decisions_total{{role!="live"}}[{RI}]))',
                    "{{role}} -> {{engine}}",
                )
            ),
            unit="reqps",
        ),
        Panel(
            "Requests by status",
            "Answered requests per second by HTTP status (engine 'none' means the router "
            "answered itself, e.g. 503 when no engine or slot was free).",
            q((f"sum by (status) (rate(ramjet_requests_total[{RI}]))", "{{status}}")),
            unit="reqps",
        ),
        Panel(
            "Error ratio (5xx)",
            "Share of requests answered with a 5xx over 5 minutes (recording rule "
            "ramjet:request_error_ratio:rate5m). Alert RamjetHighErrorRate fires above 5%.",
            q(("ramjet:request_error_ratio:rate5m", "5xx share")),
            unit="percentunit",
            kind="stat",
            width=6,
        ),
        Panel(
            "Retries not attempted (budget spent)",
            "Retries the router refused because the retry budget (retry.budget_ratio of "
            "active requests) was spent: non-zero means engines fail often enough that "
            "retrying would amplify load.",
            q((f"sum(rate(ramjet_retries_denied_total[{RI}]))", "denied retries")),
            unit="reqps",
            width=6,
        ),
        Panel(
            "TTFT by engine (p50, p99)",
            "Router-observed time from request arrival to the first response byte, per "
            "answering engine: the figure the candidate policy exists to lower.",
            q(
                (
                    f"histogram_quantile(0.5, sum by (le, engine) (rate(ramjet_ttft_seconds_bucket[{RI}])))",
                    "p50 {{engine}}",
                ),
                (
                    f"histogram_quantile(0.99, sum by (le, engine) (rate(ramjet_ttft_seconds_bucket[{RI}])))",
                    "p99 {{engine}}",
                ),
            ),
            unit="s",
        ),
        Panel(
            "Request duration p99 by engine",
            "Arrival to the end of the response (streams included), per engine.",
            q(
                (
                    f"histogram_quantile(0.99, sum by (le, engine) (rate(ramjet_request_duration_seconds_bucket[{RI}])))",
                    "p99 {{engine}}",
                )
            ),
            unit="s",
        ),
        Panel(
            "In flight and queued",
            "Requests being forwarded per engine, and requests waiting for a forwarding "
            "slot (limits.max_concurrent) across the router.",
            q(
                ("sum by (engine) (ramjet_inflight_requests)", "in flight {{engine}}"),
                ("sum(ramjet_queued_requests)", "queued"),
            ),
        ),
        Panel(
            "Arrival rate",
            "The router's EWMA of request arrivals (lambda in the cost model's "
            "externality term), summed over replicas.",
            q(("sum(ramjet_arrival_rate_per_second)", "arrivals/s")),
            unit="reqps",
        ),
    ),
)

CACHE = Dashboard(
    "ramjet-cache",
    "Ramjet / Cache",
    "Where prompt tokens came from, what the router believes is resident, and how fresh.",
    (
        Panel(
            "Prompt tokens by source (hit ratio by tier)",
            "Share of prompt tokens the engines took from each source, from their own "
            "usage.prompt_work: hbm/host/ssd (global KV by tier), swa (resumed SWA state), "
            "replayed (bounded replay after an SWA miss), prefilled (computed).",
            q(
                (
                    f"sum by (source) (rate(ramjet_realized_prompt_tokens_total[{RI}])) / ignoring (source) group_left sum(rate(ramjet_realized_prompt_tokens_total[{RI}]))",
                    "{{source}}",
                ),
            ),
            unit="percentunit",
            extra={"stacking": True},
        ),
        Panel(
            "Prompt cache hit ratio",
            "1 - prefilled share over 5 minutes (ramjet:prompt_cache_hit:ratio_rate5m): "
            "tokens the engines did not have to compute.",
            q(("ramjet:prompt_cache_hit:ratio_rate5m", "hit ratio")),
            unit="percentunit",
            kind="stat",
            width=6,
        ),
        Panel(
            "Replayed tokens by engine",
            "Tokens replayed per second because the SWA state had expired but the global "
            "KV prefix was warm: the floor cost of a warm prefix.",
            q(
                (
                    f'sum by (engine) (rate(ramjet_realized_prompt_tokens_total{{source="replayed"}}[{RI}]))',
                    "{{engine}}",
                )
            ),
            unit="short",
            width=6,
        ),
        Panel(
            "Engine-side prompt tokens by source",
            "The engines' own counters (engine_prompt_tokens_total) per engine and source; "
            "should match the router's view above.",
            q(
                (
                    f"sum by (engine, source) (rate(engine_prompt_tokens_total[{RI}]))",
                    "{{engine}} {{source}}",
                )
            ),
        ),
        Panel(
            "Residency table size",
            "Entries in the router's residency tables (global KV, SWA sessions), per "
            "replica. Bounded by residency limits; a flat line under load means the tables "
            "are not being fed.",
            q(("sum by (instance, table) (ramjet_residency_entries)", "{{instance}} {{table}}")),
        ),
        Panel(
            "Engine-resident global KV by tier",
            "Bytes of global KV each engine holds per tier (hbm, host, ssd), and its pooled "
            "SWA bytes.",
            q(
                ("sum by (engine, tier) (engine_kv_resident_bytes)", "{{engine}} {{tier}}"),
                ("sum by (engine) (engine_swa_pool_bytes)", "{{engine}} swa pool"),
            ),
            unit="bytes",
        ),
        Panel(
            "Report staleness",
            "Seconds since each replica last accepted a report from each engine. Trust "
            "degrades after reports.stale_after_s; residency stops steering after "
            "reports.stale_ttl_s. Alert RamjetResidencyStale at 30 s.",
            q(("max by (engine) (ramjet_reports_staleness_seconds)", "{{engine}}")),
            unit="s",
        ),
        Panel(
            "Trust grade per engine",
            "0 exact (signed reports, no gap), 1 degraded (gap or silence), 2 approximate "
            "(no report accepted: only what the router routed). Worst over replicas.",
            q(("max by (engine) (ramjet_reports_trust_grade)", "{{engine}}")),
            kind="stat",
            extra={
                "mappings": [
                    {
                        "type": "value",
                        "options": {
                            "0": {"text": "exact", "color": "green"},
                            "1": {"text": "degraded", "color": "orange"},
                            "2": {"text": "approximate", "color": "red"},
                        },
                    }
                ]
            },
        ),
    ),
)

OBSERVE = Dashboard(
    "ramjet-observation",
    "Ramjet / Observation and promotion",
    "The evidence for observe -> canary -> enforce (docs/operations.md): agreement, "
    "prediction error, estimated gain.",
    (
        Panel(
            "Agreement rate by mode",
            "Share of answered requests where the incumbent and the candidate picked the "
            "same engine (ramjet:policy_agreement:ratio_rate5m). Low agreement is where the "
            "candidate would change placement; read it with the gain.",
            q(("ramjet:policy_agreement:ratio_rate5m", "{{mode}}")),
            unit="percentunit",
        ),
        Panel(
            "Predicted vs realized TTFT (mean)",
            "Mean candidate-predicted TTFT on the answering engine and mean realized TTFT "
            "of the same requests.",
            q(
                (
                    f"sum by (mode) (rate(ramjet_ttft_predicted_seconds_sum[{RI}])) / sum by (mode) (rate(ramjet_ttft_predicted_seconds_count[{RI}]))",
                    "predicted {{mode}}",
                ),
                (
                    f"sum by (mode) (rate(ramjet_ttft_realized_seconds_sum[{RI}])) / sum by (mode) (rate(ramjet_ttft_realized_seconds_count[{RI}]))",
                    "realized {{mode}}",
                ),
            ),
            unit="s",
        ),
        Panel(
            "TTFT prediction error quantiles",
            "Signed error, predicted minus realized (positive: the model was pessimistic), "
            "p10/p50/p90.",
            q(
                (
                    f"histogram_quantile(0.1, sum by (le, mode) (rate(ramjet_ttft_prediction_error_seconds_bucket[{RI}])))",
                    "p10 {{mode}}",
                ),
                (
                    f"histogram_quantile(0.5, sum by (le, mode) (rate(ramjet_ttft_prediction_error_seconds_bucket[{RI}])))",
                    "p50 {{mode}}",
                ),
                (
                    f"histogram_quantile(0.9, sum by (le, mode) (rate(ramjet_ttft_prediction_error_seconds_bucket[{RI}])))",
                    "p90 {{mode}}",
                ),
            ),
            unit="s",
        ),
        Panel(
            "Relative TTFT error (MAE / mean realized)",
            "Mean absolute TTFT error over mean realized TTFT, 10 minutes "
            "(ramjet:ttft_prediction_relative_mae:ratio_rate10m). Promotion to canary "
            "wants it under 0.25; alert RamjetPredictionErrorHighInObserve above 0.5.",
            q(("ramjet:ttft_prediction_relative_mae:ratio_rate10m", "{{mode}}")),
            unit="percentunit",
        ),
        Panel(
            "Predicted vs realized cached tokens",
            "Tokens per second the candidate expected the answering engine not to "
            "prefill, next to the cached tokens (all tiers and SWA) it reported.",
            q(
                (
                    f"sum by (mode) (rate(ramjet_cached_tokens_predicted_tokens_total[{RI}]))",
                    "predicted {{mode}}",
                ),
                (
                    f"sum by (mode) (rate(ramjet_cached_tokens_realized_tokens_total[{RI}]))",
                    "realized {{mode}}",
                ),
            ),
        ),
        Panel(
            "Cached-token error quantiles",
            "Predicted resume tokens minus realized cached tokens per request, p10/p90.",
            q(
                (
                    f"histogram_quantile(0.1, sum by (le, mode) (rate(ramjet_cached_tokens_prediction_error_tokens_bucket[{RI}])))",
                    "p10 {{mode}}",
                ),
                (
                    f"histogram_quantile(0.9, sum by (le, mode) (rate(ramjet_cached_tokens_prediction_error_tokens_bucket[{RI}])))",
                    "p90 {{mode}}",
                ),
            ),
        ),
        Panel(
            "Estimated gain per compared request",
            "The candidate's predicted TTFT on the incumbent's pick minus on its own pick, "
            "net of losses, per compared request (ramjet:candidate_gain_seconds:mean_rate10m). "
            "A prediction, not a measurement: only one pick ran.",
            q(("ramjet:candidate_gain_seconds:mean_rate10m", "{{mode}}")),
            unit="s",
        ),
        Panel(
            "Estimated gain distribution",
            "p50 and p90 of the per-request estimated gain.",
            q(
                (
                    f"histogram_quantile(0.5, sum by (le, mode) (rate(ramjet_candidate_gain_estimate_seconds_bucket[{RI}])))",
                    "p50 {{mode}}",
                ),
                (
                    f"histogram_quantile(0.9, sum by (le, mode) (rate(ramjet_candidate_gain_estimate_seconds_bucket[{RI}])))",
                    "p90 {{mode}}",
                ),
            ),
            unit="s",
        ),
        Panel(
            "Policy errors (contained)",
            "Picks that raised, named an engine not offered, ran past "
            "mode.candidate_budget_s, or were skipped, by role: a failed live pick falls "
            "back (to the other policy, then least loaded); a failed accounting-only pick "
            "(the incumbent in canary/enforce) leaves no comparison. Never fails a request.",
            q(
                (
                    f"sum by (role, kind) (rate(ramjet_policy_errors_total[{RI}]))",
                    "{{role}} {{kind}}",
                )
            ),
            unit="reqps",
        ),
    ),
)

ENGINES = Dashboard(
    "ramjet-engines",
    "Ramjet / Engines",
    "Engine health as the routers see it, ejections, and load from both sides.",
    (
        Panel(
            "Routable engines",
            "1 when a router replica can route to the engine (probe ok, not ejected); the "
            "minimum over replicas.",
            q(("min by (engine) (ramjet_engine_healthy)", "{{engine}}")),
            kind="stat",
        ),
        Panel(
            "Ejections",
            "Outlier ejections per engine in the window, summed over replicas. Each "
            "ejection lasts longer than the last (health.ejection_base_s .. ejection_max_s).",
            q((f"sum by (engine) (increase(ramjet_ejections_total[{RI}]))", "{{engine}}")),
        ),
        Panel(
            "Upstream errors by kind",
            "Failures talking to each engine: connect, first_byte_timeout, idle_timeout, "
            "disconnect, status_5xx, backpressure (503/429, not counted toward ejection).",
            q(
                (
                    f"sum by (engine, kind) (rate(ramjet_upstream_errors_total[{RI}]))",
                    "{{engine}} {{kind}}",
                )
            ),
            unit="reqps",
        ),
        Panel(
            "Scrape targets up",
            "Prometheus' own view: 1 when a router replica or engine answered its last scrape.",
            q(('up{job=~"ramjet-router|ramjet-engine"}', "{{job}} {{instance}}")),
        ),
        Panel(
            "Engine queue and running",
            "Requests waiting for admission and holding a batch slot, from each engine.",
            q(
                ("sum by (engine) (engine_queue_waiting_requests)", "waiting {{engine}}"),
                ("sum by (engine) (engine_running_requests)", "running {{engine}}"),
            ),
        ),
        Panel(
            "In-flight prompt tokens (router view)",
            "Prompt tokens the router has sent to each engine whose first byte has not "
            "come back: the load the cost model corrects stale reports with.",
            q(("sum by (engine) (ramjet_inflight_prompt_tokens)", "{{engine}}")),
        ),
        Panel(
            "Engine requests by outcome",
            "Requests each engine finished, by outcome.",
            q(
                (
                    f"sum by (engine, outcome) (rate(engine_requests_total[{RI}]))",
                    "{{engine}} {{outcome}}",
                )
            ),
            unit="reqps",
        ),
        Panel(
            "Engine TTFT and queue time p90",
            "The engine's own arrival-to-first-token and arrival-to-admission, p90.",
            q(
                (
                    f"histogram_quantile(0.9, sum by (le, engine) (rate(engine_ttft_seconds_bucket[{RI}])))",
                    "ttft {{engine}}",
                ),
                (
                    f"histogram_quantile(0.9, sum by (le, engine) (rate(engine_queue_seconds_bucket[{RI}])))",
                    "queue {{engine}}",
                ),
            ),
            unit="s",
        ),
        Panel(
            "Mean realized wait",
            "EWMA of the engines' reported queue wait (W in the cost model's lambda*W).",
            q(("max(ramjet_mean_wait_seconds)", "wait")),
            unit="s",
        ),
    ),
)

REPORTS = Dashboard(
    "ramjet-reports",
    "Ramjet / Signed reports",
    "Verification of the engines' signed cache reports: what was accepted, what was "
    "rejected and why, gaps and epochs.",
    (
        Panel(
            "Verification failures by reason",
            "Reports rejected per second by engine ('unknown' when the claimed engine is "
            "not configured) and reason (bad_signature, unknown_key, retired_key, "
            "wrong_engine_key, replayed, too_old, future, oversize, ...). A rejection "
            "changes nothing. Alert RamjetReportVerificationFailures.",
            q(("ramjet:report_rejections:rate5m", "{{engine}} {{reason}}")),
        ),
        Panel(
            "Accepted reports by kind",
            "Reports accepted per second by engine and kind (delta, snapshot, load, profile).",
            q(("ramjet:reports_accepted:rate5m", "{{engine}} {{kind}}")),
        ),
        Panel(
            "Sequence gaps and snapshots",
            "Gaps in report sequence (each makes the view DEGRADED until a snapshot) and "
            "snapshots fetched to heal them, per engine.",
            q(
                (f"sum by (engine) (increase(ramjet_reports_gaps_total[{RI}]))", "gaps {{engine}}"),
                (
                    f"sum by (engine) (increase(ramjet_reports_snapshots_fetched_total[{RI}]))",
                    "snapshots {{engine}}",
                ),
            ),
        ),
        Panel(
            "Engine epochs",
            "Each engine's current epoch as the routers see it (it increases when the "
            "engine restarts; the old epoch's residency is purged).",
            q(("max by (engine) (ramjet_reports_epoch)", "{{engine}}")),
            kind="stat",
        ),
        Panel(
            "Epoch changes",
            "New epochs seen per engine: restarts, or a publisher that lost its state.",
            q(
                (
                    f"sum by (engine) (increase(ramjet_reports_epoch_changes_total[{RI}]))",
                    "{{engine}}",
                )
            ),
        ),
    ),
)

REDIS = Dashboard(
    "ramjet-redis",
    "Ramjet / Redis",
    "The shared residency store of the router replicas: degraded mode, resyncs, queues.",
    (
        Panel(
            "Degraded (running from local state)",
            "1 per replica while its Redis breaker is open or probing: it routes from its "
            "local mirror (fail open). Alert RamjetRedisDegraded.",
            q(("max by (instance) (ramjet_redis_degraded)", "{{instance}}")),
            kind="stat",
        ),
        Panel(
            "Resyncs",
            "Full resyncs of an engine's residency: pull (mirror from Redis) or push (seed "
            "Redis from the mirror), by reason (start, redis_empty, ...).",
            q(
                (
                    f"sum by (direction, reason) (increase(ramjet_redis_resyncs_total[{RI}]))",
                    "{{direction}} {{reason}}",
                )
            ),
        ),
        Panel(
            "Breaker opens and recoveries",
            "Times the Redis breaker opened, and times Redis came back after it had.",
            q(
                (f"sum(increase(ramjet_redis_breaker_opens_total[{RI}]))", "opens"),
                (f"sum(increase(ramjet_redis_recoveries_total[{RI}]))", "recoveries"),
            ),
        ),
        Panel(
            "Write batches",
            "Residency write batches sent to Redis by result, pending in each replica's "
            "queue, and dropped when the queue filled while Redis was away.",
            q(
                (f"sum by (result) (rate(ramjet_redis_batches_total[{RI}]))", "{{result}}"),
                ("sum by (instance) (ramjet_redis_pending_batches)", "pending {{instance}}"),
                (f"sum(increase(ramjet_redis_dropped_batches_total[{RI}]))", "dropped"),
            ),
        ),
        Panel(
            "Redis call latency p99",
            "Latency of successful Redis calls per replica (the link times out at "
            "store.timeout_ms and fails open).",
            q(
                (
                    f"histogram_quantile(0.99, sum by (le, instance) (rate(ramjet_redis_call_seconds_bucket[{RI}])))",
                    "{{instance}}",
                )
            ),
            unit="s",
        ),
        Panel(
            "Change-log entries applied and script reloads",
            "Entries from any replica's change log applied to this replica's mirror, and "
            "Lua scripts loaded again after NOSCRIPT (flush, failover, restart).",
            q(
                (
                    f"sum by (instance) (rate(ramjet_redis_log_entries_applied_total[{RI}]))",
                    "applied {{instance}}",
                ),
                (f"sum(increase(ramjet_redis_script_reloads_total[{RI}]))", "script reloads"),
            ),
        ),
    ),
)

DASHBOARDS = (ROUTING, CACHE, OBSERVE, ENGINES, REPORTS, REDIS)


def _panel(p: Panel, pid: int, x: int, y: int) -> dict[str, object]:
    h = 8
    defaults: dict[str, object] = {"unit": p.unit}
    custom: dict[str, object] = {}
    if p.extra.get("stacking"):
        custom["stacking"] = {"mode": "normal", "group": "A"}
    if "mappings" in p.extra:
        defaults["mappings"] = p.extra["mappings"]
    if custom:
        defaults["custom"] = custom
    return {
        "id": pid,
        "type": p.kind,
        "title": p.title,
        "description": p.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": h, "w": p.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}}
        if p.kind == "timeseries"
        else {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": DATASOURCE,
                "expr": expr,
                "legendFormat": legend,
                "range": True,
            }
            for i, (expr, legend) in enumerate(p.targets)
        ],
    }


def render(d: Dashboard) -> dict[str, object]:
    panels, x, y = [], 0, 0
    for i, p in enumerate(d.panels, start=1):
        if x + p.width > 24:
            x, y = 0, y + 8
        panels.append(_panel(p, i, x, y))
        x += p.width
    return {
        "uid": d.uid,
        "title": d.title,
        "description": d.description,
        "tags": ["ramjet"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": False,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": []},
        "annotations": {"list": []},
        "links": [{"title": "Ramjet", "type": "dashboards", "tags": ["ramjet"]}],
        "panels": panels,
    }


def files() -> dict[str, str]:
    """File name -> JSON text, for every dashboard."""
    return {
        f"{d.uid}.json": json.dumps(render(d), indent=2, sort_keys=False) + "\n" for d in DASHBOARDS
    }


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in files().items():
        (OUT / name).write_text(text)
        print(f"wrote {OUT / name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
