"""Dashboard table, fleet side: engines, signed reports, Redis (`dashboard_panels`)."""

from __future__ import annotations

from dashboard_panels import RI, Dashboard, Panel, q

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
