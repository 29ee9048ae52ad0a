"""llm-d / Gateway API inference extension weighted scorers (ANCHORS.md).

    score = 2 · queue + 2 · kv + 3 · prefix        (argmax; ties in turn)
    queue  = (max − q) / (max − min) over engines' waiting requests (1 when all equal)
    kv     = 1 − KV utilization
    prefix = matched blocks / total blocks

In the realistic mode the prefix scorer's index is its approximate LRU of routed blocks
per engine: `lruCapacityPerServer` 31,250 blocks of 64 tokens (2M tokens), matching at
most 256 blocks (16,384 tokens) of a prompt — llm-d's defaults as read from its source,
stated as an estimate in docs/simulation.md.

On the shared fabric (`simulations.fabric`) llm-d weights its prefix match by tier,
gpu 1.0 and cpu 0.8 (`cpu_weight`; llm-d's tiered prefix scorer, the issue's figures):
a block in the pool counts 0.8 of one in the engine's HBM. Its P2P source (a pod pulls
a prefix from a peer's CPU tier) is the pool there: every engine pulls from it on a miss.
`cpu_weight=None` (islands) counts every resident token alike, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

from ramjet.policy.base import Decision, EngineView, FleetStats, RequestView


class LlmdScorers:
    def __init__(
        self,
        name: str = "llmd_scorers",
        w_queue: float = 2,
        w_kv: float = 2,
        w_prefix: float = 3,
        cpu_weight: float | None = None,
    ) -> None:
        self.name = name
        self.cpu_weight = cpu_weight
        self.w = (w_queue, w_kv, w_prefix)
        self._turn = 0

    def pick(
        self, request: RequestView, engines: Sequence[EngineView], fleet: FleetStats
    ) -> Decision:
        qs = [
            e.load.inflight_requests if e.load.waiting_requests is None else e.load.waiting_requests
            for e in engines
        ]
        lo, hi = min(qs), max(qs)
        n = max(request.prompt_tokens, 1)
        wq, wk, wp = self.w
        scores = []
        for e, q in zip(engines, qs, strict=True):
            queue = 1.0 if hi == lo else (hi - q) / (hi - lo)
            m = e.residency.global_match(request.block_keys, request.block_tokens)
            w = self.cpu_weight
            prefix = (m.total if w is None else m.hbm + w * (m.host + m.ssd)) / n
            scores.append(wq * queue + wk * (1 - e.load.kv_utilization) + wp * prefix)
        best = max(scores)
        tied = [e for e, s in zip(engines, scores, strict=True) if s == best]
        self._turn += 1
        return Decision(tied[self._turn % len(tied)].id, self.name)
