"""vLLM production-stack `prefixaware` routing (ANCHORS.md): the instance with the
longest matching prefix, ties broken at random (seeded), no load bound. Its realistic
knowledge is an HBM-only view: a prefix is forgotten once its GPU copy is gone."""

from __future__ import annotations

import random
from collections.abc import Sequence

from ramjet.policy.base import Decision, EngineView, FleetStats, RequestView


class ProdstackPrefix:
    def __init__(self, name: str = "prodstack_prefix", seed: int = 0) -> None:
        self.name = name
        self._rng = random.Random(seed)

    def pick(
        self, request: RequestView, engines: Sequence[EngineView], fleet: FleetStats
    ) -> Decision:
        matches = [
            e.residency.global_match(request.block_keys, request.block_tokens).total
            for e in engines
        ]
        best = max(matches)
        tied = [e for e, m in zip(engines, matches, strict=True) if m == best]
        return Decision(self._rng.choice(tied).id, self.name)
