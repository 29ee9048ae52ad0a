"""The oracle row and the run's sanity check: no routing policy may beat a bound.

The oracle is full knowledge without a partitioned cache: both engines share one cache
and one SWA pool, so a block computed anywhere is a hit everywhere and a request never
prefills more than the floor plus what causality forces (a block still being computed
for a sibling sent at the same instant). Two routings run on it, `oracle:tier_aware`
(the cost model's pick) and `oracle:least_work` (the engine with the fewest predicted
uncached tokens queued: on a shared cache that is the earliest free engine, central
FCFS), and `oracle:spread` (round robin); the `oracle` row at each load is the one of
them with the lowest mean TTFT. Where a policy still beats all three, the runner adds
that policy's own decisions replayed on the shared cache (`Replay`, rows
`oracle:as:<policy>`) and the policy itself run on the shared cache (rows
`oracle:run:<policy>`), and takes the best again: without the partition no request of
that routing finds less cache, so the replay bounds it by construction in open-loop
FCFS runs; in closed loop the replay's arrivals are not the policy's, and the policy
run on the shared cache is the candidate that reacts as it does. Where both are slower
(priority scheduling, closed loop) the run fails.

`violations` lists every row that beats the oracle's mean TTFT or a strict bound's
(`bound:alone` always, over the same requests the row counts; `bound:srpt_merged_2x` in
open-loop runs, where arrivals do not depend on the policy); the runner fails a run
that has any. A load where even the oracle keeps the engines busy 99% of the time has
no steady state and is reported as saturated instead of checked (`saturated`).
Closed-loop rows count the requests sent in the steady-state window
(`simulations.simulator.WARMUP_SHARE`), so the oracle and a policy are compared over
the same sessions' steady-state turns, not the identical request set.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from ramjet.policy.base import Decision, EngineView, FleetStats, RequestView
from simulations.summary import Row

ORACLES = ("oracle:tier_aware", "oracle:least_work", "oracle:spread")
REPLAY = "oracle:as:"
"""Prefix of a replay row: a policy's own decisions, request by request, on the shared
cache (`Replay`)."""
SHARED = "oracle:run:"
"""Prefix of a row of a policy itself run on the shared cache (deciding as it would
there), added where it beats every other oracle routing: in closed loop a replay's
arrivals are not the policy's own, so the replay alone need not bound it."""


class Replay:
    """Routes request i to the engine another run sent it to (`Outcome.engine[i]`):
    that policy's decisions without the partitioned cache. Run on a shared cache every
    request finds at least what it found there, so (FCFS, open loop) no request is
    slower: the oracle then bounds that policy by construction."""

    def __init__(self, of: str, engines: Sequence[int]) -> None:
        self.name = REPLAY + of
        self.engines = list(engines)

    def pick(
        self, request: RequestView, engines: Sequence[EngineView], fleet: FleetStats
    ) -> Decision:
        return Decision(engines[self.engines[int(request.request_id)]].id, self.name)


def beaten(rows: Sequence[Row], scale: float) -> list[str]:
    """Policies at `scale` whose mean TTFT is below every oracle routing's there."""
    these = [r for r in rows if r.rate_scale == scale]
    oracles = [r.ttft_mean_s for r in these if r.policy.startswith("oracle:")]
    if not oracles:
        return []
    best = min(oracles)
    return [
        r.policy
        for r in these
        if not r.policy.startswith(("oracle", "bound:")) and r.ttft_mean_s < best
    ]


def with_oracle(rows: Sequence[Row]) -> list[Row]:
    """`rows` plus, per load, an `oracle` row: the best of the oracle routings (the
    named ones and any replays)."""
    out = list(rows)
    for scale in dict.fromkeys(r.rate_scale for r in rows):
        cands = [
            r
            for r in rows
            if r.rate_scale == scale
            and (r.policy in ORACLES or r.policy.startswith((REPLAY, SHARED)))
        ]
        if cands:
            best = min(cands, key=lambda r: r.ttft_mean_s)
            out.append(replace(best, policy="oracle"))
    return out


SATURATED = 0.99
"""Oracle busy share at or above which a load has no steady state (see `saturated`)."""


def saturated(rows: Sequence[Row]) -> list[float]:
    """Loads (rate scales) where even the oracle keeps the engines busy ≥ 99% of the
    measured window. Such a queue has no steady state: in closed loop the sessions in
    the system pile up for as long as the run lasts, every policy's mean TTFT is set by
    the run's length, and arrivals depend on the policy, so the oracle bounds nothing
    there. Such loads are reported as saturated and not checked."""
    out = []
    for scale in dict.fromkeys(r.rate_scale for r in rows):
        oracle = next((r for r in rows if r.rate_scale == scale and r.policy == "oracle"), None)
        if oracle is not None and oracle.utilization >= SATURATED:
            out.append(scale)
    return out


ROUNDING = 1e-9
"""Relative slack for float rounding in the bound checks."""


def violations(rows: Sequence[Row], tolerance: float = 0.0) -> list[str]:
    """Rows whose mean TTFT is below the oracle's or a strict bound's at the same load
    (saturated loads excepted), by more than `tolerance` and float rounding (`ROUNDING`:
    a policy that meets bound:alone exactly sums the same TTFTs in another order)."""
    tolerance += ROUNDING
    problems = []
    skip = set(saturated(rows))
    for scale in dict.fromkeys(r.rate_scale for r in rows):
        if scale in skip:
            continue
        these = [r for r in rows if r.rate_scale == scale]
        bounds = [
            r
            for r in these
            if r.policy == "oracle" or r.policy.startswith("bound:")
            if not math.isnan(r.ttft_mean_s)
        ]
        for r in these:
            if r.policy == "oracle" or r.policy.startswith(("bound:", "oracle:")):
                continue
            if r.ttft_mean_s < r.alone_mean_s * (1 - tolerance):
                problems.append(
                    f"x{scale:g}: {r.policy} mean TTFT {r.ttft_mean_s:.4f} s beats bound:alone "
                    f"{r.alone_mean_s:.4f} s over the same requests"
                )
            for b in bounds:
                if b.policy == "bound:alone" and not math.isnan(r.alone_mean_s):
                    continue  # compared over the same requests above
                if r.ttft_mean_s < b.ttft_mean_s * (1 - tolerance):
                    problems.append(
                        f"x{scale:g}: {r.policy} mean TTFT {r.ttft_mean_s:.4f} s beats "
                        f"{b.policy} {b.ttft_mean_s:.4f} s"
                    )
        for b in these:  # the oracle itself must respect the strict bounds
            if b.policy != "oracle":
                continue
            for s in these:
                if s.policy.startswith("bound:") and b.ttft_mean_s < s.ttft_mean_s:
                    problems.append(
                        f"x{scale:g}: oracle mean TTFT {b.ttft_mean_s:.4f} s beats {s.policy}"
                    )
    return problems
