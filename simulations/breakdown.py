"""Where a closed-loop run's TTFT goes: queueing against service, how many later turns
moved engines and what a move cost, and how far the engines' queues drift apart.

`breakdown` reads one run's `Outcome` over the requests its summary counts (sent inside
`out.window`); `python -m simulations run ... --breakdown` prints it per run. It is how
docs/results/history-results.md's "Where the 60% gap goes" table was measured.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from simulations.sessions import ClosedLoop
from simulations.simulator import Outcome


@dataclass(frozen=True)
class Breakdown:
    requests: int
    ttft_mean_s: float
    wait_mean_s: float
    """Arrival to the start of prefill."""
    service_mean_s: float
    """TTFT − wait: restore, replay, prefill and its decode interference."""
    later_turns: int
    """Counted requests with a parent (released by the closed loop)."""
    moved: int
    """Later turns sent to another engine than their (first) parent's."""
    moved_new_tokens_mean: float
    moved_wait_mean_s: float
    wait_gap_s: float
    """Mean over `bin_s` windows (by arrival) with requests on two engines or more of the
    largest minus the smallest engine's mean wait."""

    def line(self) -> str:
        return (
            f"n {self.requests}: TTFT {self.ttft_mean_s:.3f} = wait {self.wait_mean_s:.3f}"
            f" + service {self.service_mean_s:.3f} s; moved {self.moved} of"
            f" {self.later_turns} later turns (new tokens {self.moved_new_tokens_mean:.0f},"
            f" wait {self.moved_wait_mean_s:.3f} s); per-engine wait gap"
            f" {self.wait_gap_s:.3f} s"
        )


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def breakdown(out: Outcome, loop: ClosedLoop | None, bin_s: float = 5.0) -> Breakdown:
    """See the module docstring. `loop` None (open loop): no request is a later turn."""
    if bin_s <= 0:
        raise ValueError("bin_s must be > 0")
    w = out.window
    idx = [i for i, t in enumerate(out.arrival) if w is None or w[0] <= t <= w[1]]
    parent: dict[int, int] = {}
    if loop is not None:
        for p, kids in enumerate(loop.children):
            for c in kids:
                parent.setdefault(c, p)
    later = [i for i in idx if i in parent]
    moved = [i for i in later if out.engine[i] != out.engine[parent[i]]]
    bins: dict[int, dict[int, list[float]]] = {}
    for i in idx:
        bins.setdefault(int(out.arrival[i] // bin_s), {}).setdefault(out.engine[i], []).append(
            out.wait[i]
        )
    gaps = [
        max(map(_mean, per.values())) - min(map(_mean, per.values()))
        for per in bins.values()
        if len(per) > 1
    ]
    return Breakdown(
        requests=len(idx),
        ttft_mean_s=_mean([out.ttft[i] for i in idx]),
        wait_mean_s=_mean([out.wait[i] for i in idx]),
        service_mean_s=_mean([out.ttft[i] - out.wait[i] for i in idx]),
        later_turns=len(later),
        moved=len(moved),
        moved_new_tokens_mean=_mean([float(out.new_tokens[i]) for i in moved]),
        moved_wait_mean_s=_mean([out.wait[i] for i in moved]),
        wait_gap_s=_mean(gaps),
    )
