"""SGLang model gateway (SMG) policies, as its source defines them (ANCHORS.md).

cache_aware: the pool is *imbalanced* if `max_load − min_load > abs_thr` and
`max_load > rel_thr · min_load` (defaults 64, 1.5), load = requests in flight. Imbalanced:
the least-loaded worker. Otherwise `match_rate = matched / input`; above `cache_thr`
(0.3) the worker with the longest match, else the least-loaded worker. The match comes
from the residency view: exact, or SMG's own approximate tree (a `RoutedIndex` with LRU
eviction) in the realistic mode.

least_load: `score = (queued_tokens + inflight_tokens) / throughput + λ · k / (1 − k)`,
k = KV utilization, λ = 0.15 s; throughput from the engine's profile (tokens/s at short
context).
"""

from __future__ import annotations

from collections.abc import Sequence

from ramjet.policy.base import Decision, EngineView, FleetStats, RequestView


class SmgCacheAware:
    def __init__(
        self,
        name: str = "smg_cache_aware",
        abs_thr: int = 64,
        rel_thr: float = 1.5,
        cache_thr: float = 0.3,
    ) -> None:
        self.name = name
        self.abs_thr, self.rel_thr, self.cache_thr = abs_thr, rel_thr, cache_thr

    def pick(
        self, request: RequestView, engines: Sequence[EngineView], fleet: FleetStats
    ) -> Decision:
        loads = [e.load.inflight_requests for e in engines]
        lo, hi = min(loads), max(loads)
        least = engines[loads.index(lo)]
        if hi - lo > self.abs_thr and hi > self.rel_thr * lo:
            return Decision(least.id, self.name, notes=("imbalanced",))
        matches = [
            e.residency.global_match(request.block_keys, request.block_tokens).total
            for e in engines
        ]
        best = max(matches)
        if request.prompt_tokens > 0 and best / request.prompt_tokens > self.cache_thr:
            return Decision(engines[matches.index(best)].id, self.name)
        return Decision(least.id, self.name)


class SmgLeastLoad:
    def __init__(self, name: str = "smg_least_load", kv_lambda_s: float = 0.15) -> None:
        self.name = name
        self.kv_lambda_s = kv_lambda_s

    def pick(
        self, request: RequestView, engines: Sequence[EngineView], fleet: FleetStats
    ) -> Decision:
        best, best_score = engines[0], float("inf")
        for e in engines:
            load = e.load
            tokens = (load.queued_prompt_tokens or 0) + load.inflight_prompt_tokens
            throughput = (
                1.0 / e.profile.prefill_curve[0].seconds_per_token if e.profile else 10_000.0
            )
            k = min(load.kv_utilization, 0.999)
            score = tokens / throughput + self.kv_lambda_s * k / (1 - k)
            if score < best_score:
                best, best_score = e, score
        return Decision(best.id, self.name)
