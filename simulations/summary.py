"""One row of results per (policy, load): the figures the tables, CSV and plots show."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from simulations.simulator import Outcome
from simulations.workload import Request


@dataclass(frozen=True)
class Row:
    policy: str
    rate_scale: float
    utilization: float
    """Busy prefill time / (engines · trace span)."""
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    prefill_tokens: int
    floor_ratio: float
    """Prefill tokens computed / the trace's floor (tokens no cache could have saved)."""
    hit_hbm: float
    hit_host: float
    hit_ssd: float
    """Prompt tokens resumed from each tier / all prompt tokens."""
    swa_resumes: float
    """Share of requests that resumed from live SWA state."""
    replays: int
    imbalance: float
    """max engine busy time / mean − 1 (0 = balanced)."""
    within_target: float
    """Share of requests with TTFT ≤ the target."""
    load: float = math.nan
    """The nominal load asked for (floor prefill work / capacity); NaN for --rate-scale."""
    alone_mean_s: float = math.nan
    """`bound:alone`'s mean over the same requests the TTFT figures count (a policy below
    it has broken the bound)."""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def percentile(sorted_values: Sequence[float], p: float) -> float:
    if not sorted_values:
        return math.nan
    k = min(len(sorted_values) - 1, max(0, math.ceil(p / 100 * len(sorted_values)) - 1))
    return sorted_values[k]


def summarize(
    policy: str,
    scale: float,
    reqs: Sequence[Request],
    out: Outcome,
    floor_tokens: int,
    target_s: float,
    load: float = math.nan,
    alone_s: Sequence[float] | None = None,
) -> Row:
    """TTFT figures over the requests sent inside `out.window` (all when None), and the
    utilisation inside it; prefill and hit figures over all requests."""
    w = out.window
    counted = [i for i, t in enumerate(out.arrival) if w is None or (w[0] <= t <= w[1])] or list(
        range(len(out.ttft))
    )
    tt = sorted(out.ttft[i] for i in counted)
    n = len(tt)
    prompt = sum(r.prompt_tokens for r in reqs) or 1
    hits = [sum(h[t] for h in out.hit) for t in range(3)]
    busy = out.busy_s
    mean_busy = sum(busy) / len(busy) if busy else 0.0
    if w is not None and w[1] > w[0]:
        util = sum(out.busy_window_s) / (len(busy) * (w[1] - w[0]))
    else:
        util = sum(busy) / (len(busy) * out.span_s) if out.span_s > 0 else math.nan
    alone = math.nan if alone_s is None else sum(alone_s[i] for i in counted) / len(counted)
    return Row(
        policy=policy,
        rate_scale=scale,
        utilization=util,
        ttft_mean_s=sum(tt) / n if n else math.nan,
        ttft_p50_s=percentile(tt, 50),
        ttft_p99_s=percentile(tt, 99),
        prefill_tokens=sum(out.new_tokens),
        floor_ratio=sum(out.new_tokens) / floor_tokens if floor_tokens else math.nan,
        hit_hbm=hits[0] / prompt,
        hit_host=hits[1] / prompt,
        hit_ssd=hits[2] / prompt,
        swa_resumes=sum(1 for r in out.resume if r == "swa") / len(out.resume)
        if out.resume
        else 0.0,
        replays=sum(out.replay),
        imbalance=max(busy) / mean_busy - 1 if mean_busy > 0 else 0.0,
        within_target=sum(1 for t in tt if t <= target_s) / n if n else 0.0,
        load=load,
        alone_mean_s=alone,
    )


def bound_row(
    policy: str,
    scale: float,
    ttft: Sequence[float],
    floor_tokens: int,
    target_s: float,
    load: float = math.nan,
) -> Row:
    tt = sorted(ttft)
    n = len(tt)
    nan = math.nan
    return Row(
        policy, scale, nan, sum(tt) / n if n else nan, percentile(tt, 50), percentile(tt, 99),
        floor_tokens, 1.0, nan, nan, nan, nan, 0, nan,
        sum(1 for t in tt if t <= target_s) / n if n else 0.0, load,
    )  # fmt: skip
