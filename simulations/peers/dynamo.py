"""NVIDIA Dynamo KV router (ANCHORS.md), temperature 0.

    credit = device_blocks + 0.75 · host_blocks + 0.25 · disk_blocks
    cost   = prefill_load_scale · max(active_prefill_blocks + prompt_blocks − credit, 0)
             + (active_decode_blocks + prompt_blocks)

argmin. Blocks are counted in tokens here (one unit for every term, so the argmin is
the same). Active prefill = the engine's queued prompt tokens; active decode = context
tokens of its decoding requests. In the realistic mode the residency is Dynamo's
approximate mode: its own routing with a 120 s TTL, every block credited as device.
"""

from __future__ import annotations

from collections.abc import Sequence

from ramjet.policy.base import Decision, EngineView, FleetStats, RequestView


class DynamoKv:
    def __init__(self, name: str = "dynamo_kv", prefill_load_scale: float = 1.0) -> None:
        self.name = name
        self.scale = prefill_load_scale

    def pick(
        self, request: RequestView, engines: Sequence[EngineView], fleet: FleetStats
    ) -> Decision:
        n = request.prompt_tokens
        best, best_cost = engines[0], float("inf")
        for e in engines:
            m = e.residency.global_match(request.block_keys, request.block_tokens)
            credit = m.hbm + 0.75 * m.host + 0.25 * m.ssd
            prefill = e.load.queued_prompt_tokens or 0
            decode = e.load.decode_tokens or 0
            cost = self.scale * max(prefill + n - credit, 0.0) + (decode + n)
            if cost < best_cost:
                best, best_cost = e, cost
        return Decision(best.id, self.name)
