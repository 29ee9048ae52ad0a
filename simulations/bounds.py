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
3. Occupancy (`occupancy_mean`): at every instant at least max(requests inside their own
   work since arrival, requests SRPT leaves unfinished on the merged server) are waiting
   for a first token; its integral is the sum of TTFTs. At least bounds 1 and 2.

`floor(any_order=True, after=descendants(loop.children))` is bound 1 for a closed loop
in any start order: a turn's later turns are sent after it finished, so their blocks are
never resident when it starts. `run_bounds` gathers the bounds of one run over its
measured requests (with a decode-step bound for the one-job-per-step engines), and
`SplitByOutput` is a witness schedule whose mean caps any valid bound
(`benchmarks/priority_bound.py`).
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ramjet.policy.base import FleetStats, GlobalMatch
from ramjet.policy.cost import prompt_work
from ramjet.policy.profile import EngineProfile
from ramjet.policy.views import Decision, EngineView, RequestView
from ramjet.types import PrefixKey
from simulations.workload import Request

if TYPE_CHECKING:
    from simulations.simulator import Outcome


@dataclass(frozen=True)
class Floor:
    work_s: list[float]
    new_tokens: list[int]

    @property
    def tokens(self) -> int:
        return sum(self.new_tokens)


def floor(
    requests: Sequence[Request],
    profile: EngineProfile,
    any_order: bool = False,
    after: Sequence[Collection[int]] | None = None,
) -> Floor:
    """Bound 1 per request. `any_order`: a block counts as cached when any *other* request
    holds it, earlier or later in the list (a closed loop's list order is not the order
    every schedule runs it in), so the bound holds whatever order requests start in.
    `after` (with `any_order`): per request (by list position), the positions of the
    requests that cannot have run before it starts; their blocks do not count for it.
    In a closed loop those are its descendants (`descendants`): each is sent after it
    finished, and a block becomes resident only at its holder's first token."""
    seen: set[PrefixKey] = set()
    holders: dict[PrefixKey, list[int]] = {}
    if any_order:
        for pos, r in enumerate(requests):
            for k in set(r.block_keys):
                holders.setdefault(k, []).append(pos)

    def held(k: PrefixKey, pos: int) -> bool:
        hs = holders.get(k, ())
        if after is None:
            return len(hs) >= 2
        late = after[pos]
        if len(hs) > len(late) + 1:
            return True
        return any(h != pos and h not in late for h in hs)

    work, new = [], []
    for pos, r in enumerate(requests):
        g = 0
        for i, k in enumerate(r.block_keys):
            if not held(k, pos) if any_order else (k not in seen):
                break
            g += r.block_tokens[i]
        g = min(g, r.prompt_tokens)
        q = r.boundaries[-1][0] if r.boundaries else 0
        w = prompt_work(profile, r.prompt_tokens, GlobalMatch(hbm=g), min(q, g))
        work.append(w.work_s)
        new.append(r.prompt_tokens - w.resume_tokens)
        seen.update(r.block_keys)
    return Floor(work, new)


def descendants(children: Sequence[Sequence[int]]) -> list[set[int]]:
    """Per request, every request released after it in a closed loop (`ClosedLoop.children`,
    transitively): its later turns (and their fan-out siblings)."""
    n = len(children)
    out: list[set[int] | None] = [None] * n
    for root in range(n):
        stack = [(root, False)]
        while stack:
            i, expanded = stack.pop()
            if out[i] is not None:
                continue
            if not expanded:
                stack.append((i, True))
                stack.extend((c, False) for c in children[i] if out[c] is None)
                continue
            d: set[int] = set()
            for c in children[i]:
                d.add(c)
                got = out[c]
                assert got is not None
                d |= got
            out[i] = d
    return [d if d is not None else set() for d in out]


def srpt_merged(
    requests: Sequence[Request], work_s: Sequence[float], speedup: float = 2.0
) -> list[float]:
    """Response times under preemptive SRPT on one server `speedup` times as fast
    (`requests` in arrival order)."""
    return srpt_response([r.arrival_s for r in requests], work_s, speedup)


def srpt_response(
    arrivals: Sequence[float], work_s: Sequence[float], speedup: float = 2.0
) -> list[float]:
    """`srpt_merged` on bare arrival times (non-decreasing)."""
    out = [0.0] * len(arrivals)
    heap: list[tuple[float, int]] = []
    now = 0.0
    i, n = 0, len(arrivals)
    while i < n or heap:
        if not heap:
            now = max(now, arrivals[i])
        # admit everything that has arrived
        while i < n and arrivals[i] <= now:
            heapq.heappush(heap, (work_s[i] / speedup, i))
            i += 1
        rem, j = heapq.heappop(heap)
        next_arrival = arrivals[i] if i < n else float("inf")
        if now + rem <= next_arrival:
            now += rem
            out[j] = now - arrivals[j]
        else:
            heapq.heappush(heap, (rem - (next_arrival - now), j))
            now = next_arrival
    return out


def occupancy_mean(arrivals: Sequence[float], work_s: Sequence[float], engines: int = 2) -> float:
    """A lower bound on the mean response time of jobs j (arriving at `arrivals[j]`, each
    needing `work_s[j]` seconds of service from one server at a time) on `engines`
    servers of speed 1, for every assignment and order, preemptive or not:
    (1/n) ∫ max(A(t), S(t)) dt.

    - A(t) = #{j : a_j <= t < a_j + w_j}: a job is unfinished for at least its own work
      after it arrives (one server serves it at speed at most 1).
    - S(t) = jobs unfinished at t under preemptive SRPT on one server of speed `engines`.
      Any schedule on the servers delivers service at a total rate of at most `engines`,
      so it is a schedule of that one fast server; SRPT maximises the number of jobs
      completed by every time t among all schedules of one server (Schrage 1968), so
      every schedule has at least S(t) jobs unfinished at t.

    Both hold at every t, so the schedule's count N(t) >= max(A(t), S(t)), and the sum of
    response times is ∫ N(t) dt. The bound is at least the mean work (A alone) and at
    least `srpt_merged`'s mean (S alone), and more than both where a burst queues."""
    n = len(arrivals)
    if n == 0:
        return 0.0
    order = sorted(range(n), key=lambda i: arrivals[i])
    done = srpt_response([arrivals[i] for i in order], [work_s[i] for i in order], engines)
    events: list[tuple[float, int, int]] = []
    for k, i in enumerate(order):
        a = arrivals[i]
        events += [(a, 0, 1), (a + work_s[i], 0, -1), (a, 1, 1), (a + done[k], 1, -1)]
    events.sort()
    count = [0, 0]
    total, last = 0.0, events[0][0]
    for t, kind, d in events:
        total += (t - last) * max(count)
        last = t
        count[kind] += d
    return total / n


def measured(out: Outcome) -> list[int]:
    """The requests a run measures: those sent inside its window (closed loop), else all."""
    win = out.window
    return [i for i, t in enumerate(out.arrival) if win is None or win[0] <= t <= win[1]]


@dataclass(frozen=True)
class Bounds:
    """Lower bounds on one run's mean TTFT over its measured requests (the arguments:
    `run_bounds`, `occupancy_mean`, `benchmarks/priority_bound.py`)."""

    alone: float
    steps: float
    """alone + steps; equal to `alone` on an engine model without a per-job step."""
    queue: float
    """`occupancy_mean` over the run's own arrival times."""

    def valid(self, open_loop: bool) -> tuple[float, str]:
        """The highest bound that holds for every schedule of the requests: the queue
        bound only in the open loop, where the arrival times are the trace's and not the
        schedule's. Of equal bounds, the simpler."""
        cands = [(self.alone, "alone"), (self.steps, "alone + steps")]
        if open_loop:
            cands.append((self.queue, "queue"))
        return max(cands, key=lambda c: c[0])

    @property
    def highest(self) -> float:
        """What the run's own mean must be at or above."""
        return max(self.alone, self.steps, self.queue)


def run_bounds(
    reqs: Sequence[Request],
    out: Outcome,
    work: Sequence[float],
    profile: EngineProfile,
    steps: bool,
) -> Bounds:
    """The bounds over a run's measured requests S. `work`: each request's floor work
    (`floor(any_order=True)`); `steps`: the engine model adds a decode step to every
    prefill chunk that starts while its engine decodes (the one-job-per-step engines).
    alone + steps: at most 2 + K requests of S escape the step, K the most whose decode
    times fit into twice (the span of S's arrivals + tau), tau the largest work and a
    step; every other one pays its work and a step (`benchmarks/priority_bound.py`)."""
    step, per_step = profile.decode_step_s, profile.spec_tokens_per_step
    s = measured(out)
    alone = statistics.fmean(work[i] for i in s)
    arr = [out.arrival[i] for i in s]
    queue = occupancy_mean(arr, [work[i] for i in s], len(out.busy_s) or 2)
    if not steps or step <= 0:
        return Bounds(alone, alone, queue)
    tau = max(work[i] for i in s) + step
    span = max(arr) - min(arr) + tau
    decode = sorted(math.ceil(reqs[i].output_tokens / per_step) * step for i in s)
    budget, k = 2 * span, 0
    for d in decode:
        if budget < d:
            break
        budget -= d
        k += 1
    escape = min(len(s), 2 + k)
    return Bounds(alone, alone + step * (len(s) - escape) / len(s), queue)


class SplitByOutput:
    """A witness schedule's routing, neither a bound nor a product policy: a request with
    no output (nothing to decode) goes to the last engine, every other one to the first.
    The last engine then never decodes, so none of its prefill chunks carries a decode
    step. Its mean is a ceiling on any valid lower bound over its requests. It reads the
    request's output length, which a router knows only as a maximum."""

    name = "split_by_output"

    def pick(
        self, request: RequestView, engines: Sequence[EngineView], fleet: FleetStats
    ) -> Decision:
        e = engines[-1] if request.max_output_tokens == 0 else engines[0]
        return Decision(e.id, self.name)
