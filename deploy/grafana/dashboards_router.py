"""Dashboard table, router side: routing, cache, observation, priority hints
(`dashboard_panels`)."""

from __future__ import annotations

from dashboard_panels import RI, Dashboard, Panel, q

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
            "Calibrated TTFT |relative error| (median and p90)",
            "|predicted - realized| / realized TTFT of the online-calibrated prediction, "
            "median over 10 minutes (ramjet:ttft_prediction_abs_relative_error:p50_10m) and "
            "p90 now. Target: median under 15%, p90 under 40%; alert "
            "RamjetPredictionErrorMedianHigh above 30%.",
            q(
                ("ramjet:ttft_prediction_abs_relative_error:p50_10m", "median 10m {{mode}}"),
                (
                    f"histogram_quantile(0.9, sum by (le, mode) (rate(ramjet_ttft_prediction_abs_relative_error_ratio_bucket[{RI}])))",
                    "p90 {{mode}}",
                ),
            ),
            unit="percentunit",
        ),
        Panel(
            "Calibration weights per engine",
            "The weight online calibration gives each cost-model term on each engine "
            "(ramjet_ttft_calibration_weight; 1 = the profile as probed). A weight far "
            "from 1 says the engine's profile no longer describes it (re-probe it); "
            "fixed_s is seconds.",
            q(("max by (engine, term) (ramjet_ttft_calibration_weight)", "{{engine}} {{term}}")),
        ),
        Panel(
            "Mean wait W by source",
            "Wait samples folded into the externality's W per second: engine (the "
            "engine's own queue_ms) or router (realized TTFT minus the calibrated service, "
            "for engines that report no queue time, such as vLLM).",
            q(
                (
                    f"sum by (source) (rate(ramjet_mean_wait_samples_total[{RI}]))",
                    "{{source}}",
                ),
            ),
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

PRIORITY = Dashboard(
    "ramjet-priority",
    "Ramjet / Priority",
    "Priority hints (docs/priority.md): what the routers compute and send per pool, and "
    "how the engines serve by them: queue wait by the hint's band, the oldest waiting "
    "request, preemptions. The engine panels read the reference engine's metrics "
    "(engine_stub); vLLM and SGLang export none of them.",
    (
        Panel(
            "Hints by pool and outcome",
            "Hints computed per second, by pool and outcome: sent (in the body), observe "
            "(mode observe: logged, not sent), canary_out (session outside the pool's "
            "share), client_kept and client_invalid (the request carried its own priority). "
            "Normal: in mode on with share 1, sent is the pool's request rate; canary_out "
            "is about 1 - share of it. A rising client_kept/client_invalid means clients "
            "send their own priority (invalid: not an integer, or over 1000 under combine); "
            "sent falling to 0 while requests flow means the pool is off or its engines "
            "were renamed.",
            q(
                (
                    f"sum by (pool, outcome) (rate(ramjet_priority_hints_total[{RI}]))",
                    "{{pool}} {{outcome}}",
                )
            ),
            unit="reqps",
        ),
        Panel(
            "Predicted work of hints (p50, p99)",
            "The prompt work each hint carries (restore + replay + prefill on the chosen "
            "engine), per pool. The key caps it at aging x horizon_s (1 s by default): "
            "requests above the cap keep arrival order among themselves. Normal: p50 well "
            "under the cap (warm turns), p99 at the cold prompts. A p50 rising towards the "
            "cap means the cache stopped helping (Ramjet / Cache); a p50 equal to the cold "
            "work of every prompt means the router has no residency (no reports), so every "
            "hint is cold work.",
            q(
                (
                    f"histogram_quantile(0.5, sum by (le, pool) (rate(ramjet_priority_hint_work_seconds_bucket[{RI}])))",
                    "p50 {{pool}}",
                ),
                (
                    f"histogram_quantile(0.99, sum by (le, pool) (rate(ramjet_priority_hint_work_seconds_bucket[{RI}])))",
                    "p99 {{pool}}",
                ),
            ),
            unit="s",
        ),
        Panel(
            "Engine queue wait p99 by priority band",
            "Arrival to first prefill chunk, p99, per engine and the hint's work band as the "
            "engine decodes it (lt_0.1s, 0.1_1s, 1_10s, ge_10s; a hint over the cap decodes "
            "as the cap). band=fcfs: the engine does not schedule by priority (hints are "
            "ignored); band=other: no decodable hint (no hint sent, a client's own priority, "
            "or the engine's --priority-aging differs from the pool's aging). Normal: short "
            "bands wait least, long bands longer but bounded: a request is overtaken only "
            "by arrivals within horizon_s (20 s) of its own. Short bands waiting as long as "
            "long ones: the hints are not honoured (convention). A long band's p99 climbing "
            "past the horizon: starvation, see the oldest waiting request.",
            q(
                (
                    f"histogram_quantile(0.99, sum by (le, engine, band) (rate(engine_queue_wait_by_band_seconds_bucket[{RI}])))",
                    "{{engine}} {{band}}",
                )
            ),
            unit="s",
            width=24,
        ),
        Panel(
            "Oldest waiting request",
            "Age of each engine's oldest request without its first token (waiting or "
            "prefilling). Normal: a sawtooth of a few seconds that falls back to 0 when the "
            "queue drains. A line that keeps climbing is one request never served: "
            "starvation (overtaken without bound: the engine does not read the key as sent, "
            "or aging is 0) or a stuck engine. Alert RamjetPriorityStarvation above 60 s "
            "for 2 minutes.",
            q(("max by (engine) (engine_oldest_waiting_seconds)", "{{engine}}")),
            unit="s",
        ),
        Panel(
            "Priority preemptions",
            "Prefilling requests per second that gave their slot to a better waiting one "
            "(the reference engine's chunk variant; always 0 under fcfs and the vllm "
            "variant). Normal: a trickle during bursts of short turns. A rate near the "
            "request rate means long prompts are set aside again and again: expect their "
            "band's queue wait and the oldest waiting age to rise.",
            q(
                (
                    f"sum by (engine) (rate(engine_priority_preemptions_total[{RI}]))",
                    "{{engine}}",
                )
            ),
            unit="reqps",
        ),
    ),
)
