"""Strict lower bounds on TTFT for a workload, for any router and scheduler.

1. Alone, every earlier block cached: request r's TTFT is at least its prompt work with
   g = the longest prefix of blocks seen in any earlier request (an infinite cache, all
   in HBM) and, where an earlier request ended on r's prefix, live SWA state there
   (no replay): `cost.prompt_work` on that match, no queueing. Its uncached tokens are
   the trace's *floor*: tokens no cache could have saved.
2. SRPT on one merged engine of twice the speed: preemptive shortest-remaining-work-first
   over bound 1's work (halved). SRPT minimises mean response time on one server, and
   one server of twice the speed does at least as well as two, so its mean is a bound on
   the mean TTFT of any router and any engine scheduler (decode interference ignored).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from ramjet.policy.base import GlobalMatch
from ramjet.policy.cost import prompt_work
from ramjet.policy.profile import EngineProfile
from ramjet.types import PrefixKey
from simulations.workload import Request


@dataclass(frozen=True)
class Floor:
    work_s: list[float]
    new_tokens: list[int]

    @property
    def tokens(self) -> int:
        return sum(self.new_tokens)


def floor(requests: Sequence[Request], profile: EngineProfile, any_order: bool = False) -> Floor:
    """Bound 1 per request. `any_order`: a block counts as cached when any *other* request
    holds it, earlier or later in the list (a closed loop's list order is not the order
    every schedule runs it in), so the bound holds whatever order requests start in."""
    seen: set[PrefixKey] = set()
    others: dict[PrefixKey, int] = {}
    if any_order:
        for r in requests:
            for k in set(r.block_keys):
                others[k] = others.get(k, 0) + 1
    work, new = [], []
    for r in requests:
        g = 0
        for i, k in enumerate(r.block_keys):
            if (others.get(k, 0) < 2) if any_order else (k not in seen):
                break
            g += r.block_tokens[i]
        g = min(g, r.prompt_tokens)
        q = r.boundaries[-1][0] if r.boundaries else 0
        w = prompt_work(profile, r.prompt_tokens, GlobalMatch(hbm=g), min(q, g))
        work.append(w.work_s)
        new.append(r.prompt_tokens - w.resume_tokens)
        seen.update(r.block_keys)
    return Floor(work, new)


def srpt_merged(
    requests: Sequence[Request], work_s: Sequence[float], speedup: float = 2.0
) -> list[float]:
    """Response times under preemptive SRPT on one server `speedup` times as fast."""
    out = [0.0] * len(requests)
    heap: list[tuple[float, int]] = []
    now = 0.0
    i, n = 0, len(requests)
    while i < n or heap:
        if not heap:
            now = max(now, requests[i].arrival_s)
        # admit everything that has arrived
        while i < n and requests[i].arrival_s <= now:
            heapq.heappush(heap, (work_s[i] / speedup, i))
            i += 1
        rem, j = heapq.heappop(heap)
        next_arrival = requests[i].arrival_s if i < n else float("inf")
        if now + rem <= next_arrival:
            now += rem
            out[j] = now - requests[j].arrival_s
        else:
            heapq.heappush(heap, (rem - (next_arrival - now), j))
            now = next_arrival
    return out
