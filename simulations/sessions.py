"""Closed-loop replay of session traces: a turn is sent only after the previous one ended.

An agent sends turn k+1 a think (or tool) time after turn k's last token arrived, so its
arrival depends on how fast the fleet served turn k. Replaying a session trace open-loop
at compressed timestamps makes turns arrive before their predecessor produced a token,
which no agent does. Here (`closed_loop_plan`):

- **Sessions** are the trace's `session_id` groups in `turn` order. The run holds
  `sessions` of them: the trace's own, then further copies with their own prefix keys
  (re-chained with the copy number as salt) and session ids, tiled in time at the
  trace's own session-start period, in start order.
- **First turns** arrive at their trace time, scaled: the start times are compressed or
  stretched by one factor (`scale_for_load`), which sets the session arrival rate and
  with it how many sessions run at once. Later turns are not scaled.
- **Think time** of turn k+1: the trace's own gap minus the trace's service time of turn
  k when every record has `service_ms` ("trace" source); otherwise (no trace here
  records service time) a log-normal fitted by maximum likelihood to the trace's
  inter-turn gaps, drawn per turn with a fixed seed, so every policy sees the same think
  times ("fitted" source). A fitted draw is never scaled: load is never raised by
  shrinking think times.
- **Load**: `--load x` keeps its meaning, the floor's prefill work over capacity. In
  steady state that is `session rate · floor work per session / engines`, so the start
  factor is chosen to make it x.
- **Fan-out** (`fanout` k ≥ 2, on a seeded `fanout_share` of the turns after the first):
  the turn becomes k siblings sent at once: the turn itself and k-1 parallel calls that
  share its prefix (the blocks it shares with the previous turn) and carry a suffix of
  their own of the same length (fresh keys chained on the prefix). The next turn waits
  for all k (a join) and then thinks.

The simulator (`simulations.simulator.Simulation(..., loop=plan.loop)`) releases each
non-first turn when the last of its parents finished plus its think time.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

import xxhash

from ramjet.types import PrefixKey
from simulations.workload import Request, finish

_xxh3 = xxhash.xxh3_64_intdigest


@dataclass(frozen=True)
class ClosedLoop:
    """Who releases whom: request i arrives `think_s[i]` after the last of its
    `parents[i]` requests finished (last token); a request with 0 parents (a session's
    first turn) arrives at its own `arrival_s`."""

    parents: list[int]
    children: list[list[int]]
    think_s: list[float]

    def roots(self) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == 0]


@dataclass(frozen=True)
class ThinkModel:
    source: str
    """"trace" (gap minus the trace's service time) or "fitted" (log-normal)."""
    mu: float = 0.0
    sigma: float = 0.0
    gaps: int = 0
    """Inter-turn gaps the model was built from."""

    def describe(self) -> str:
        if self.source == "trace":
            return f"trace gap minus trace service time ({self.gaps} gaps)"
        median = math.exp(self.mu)
        mean = math.exp(self.mu + self.sigma**2 / 2)
        return (
            f"log-normal fitted to {self.gaps} trace gaps (median {median:.2f} s, "
            f"mean {mean:.2f} s, sigma {self.sigma:.2f}): the trace has no service times"
        )


@dataclass(frozen=True)
class SessionPlan:
    requests: list[Request]
    """In nominal order (first turns at their unscaled times, later turns at the trace's
    gaps), renumbered; only first turns' `arrival_s` is used by a closed-loop run."""
    loop: ClosedLoop
    think: ThinkModel
    sessions: int
    period_s: float
    """Nominal time between session starts (before `scale_for_load`)."""


def session_groups(requests: Sequence[Request]) -> list[list[Request]]:
    """The trace's sessions, each in turn order, ordered by first arrival."""
    groups: dict[str, list[Request]] = {}
    for r in requests:
        if r.session is None:
            raise ValueError("closed-loop replay needs a session_id on every request")
        groups.setdefault(r.session, []).append(r)
    out = []
    for g in groups.values():
        g.sort(key=lambda r: (r.turn if r.turn is not None else 0, r.arrival_s))
        out.append(g)
    out.sort(key=lambda g: g[0].arrival_s)
    return out


def think_model(groups: Sequence[Sequence[Request]]) -> ThinkModel:
    pairs = [(a, b) for g in groups for a, b in itertools.pairwise(g)]
    if not pairs:
        return ThinkModel("fitted", 0.0, 0.0, 0)
    if all(a.service_s is not None for a, _ in pairs):
        return ThinkModel("trace", gaps=len(pairs))
    logs = [math.log(max(b.arrival_s - a.arrival_s, 1e-3)) for a, b in pairs]
    mu = statistics.fmean(logs)
    sigma = statistics.pstdev(logs) if len(logs) > 1 else 0.0
    return ThinkModel("fitted", mu, sigma, len(pairs))


def _think(model: ThinkModel, prev: Request, cur: Request, rng: random.Random) -> float:
    if model.source == "trace":
        assert prev.service_s is not None
        return max(cur.arrival_s - prev.arrival_s - prev.service_s, 0.0)
    return rng.lognormvariate(model.mu, model.sigma)


def _salted(keys: Sequence[PrefixKey], salt: int) -> list[PrefixKey]:
    return [PrefixKey(_xxh3(k.to_bytes(8, "little"), seed=salt)) for k in keys]


def _suffix(keys: Sequence[PrefixKey], shared: int, salt: int) -> list[PrefixKey]:
    """Keys for a sibling: the first `shared` keys kept, the rest fresh and chained."""
    out = list(keys[:shared])
    prev = out[-1] if out else PrefixKey(salt)
    for k in keys[shared:]:
        prev = PrefixKey(_xxh3((k ^ salt).to_bytes(8, "little"), seed=prev))
        out.append(prev)
    return out


def _shared_blocks(a: Sequence[PrefixKey], b: Sequence[PrefixKey]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def closed_loop_plan(
    requests: Sequence[Request],
    block: int,
    *,
    sessions: int | None = None,
    fanout: int = 1,
    fanout_share: float = 0.25,
    seed: int = 0,
) -> SessionPlan:
    """See the module docstring. `sessions` None: the trace's own sessions once."""
    if fanout < 1:
        raise ValueError("fanout must be at least 1")
    if not 0.0 <= fanout_share <= 1.0:
        raise ValueError("fanout_share must be in [0, 1]")
    groups = session_groups(requests)
    if not groups:
        raise ValueError("no sessions in the trace")
    model = think_model(groups)
    n = len(groups)
    t0 = groups[0][0].arrival_s
    starts = [g[0].arrival_s - t0 for g in groups]
    period = starts[-1] * n / (n - 1) if n > 1 and starts[-1] > 0 else 1.0
    total = sessions or n
    if total < 1:
        raise ValueError("sessions must be at least 1")
    rng = random.Random(seed)
    fan_rng = random.Random(seed ^ 0x5EED)
    out: list[Request] = []
    parents: dict[int, list[Request]] = {}
    think: dict[int, float] = {}
    for s in range(total):
        c, g = divmod(s, n)
        group = groups[g]
        shift = starts[g] + c * period
        base = group[0].arrival_s
        prev: list[Request] = []
        prev_src: Request | None = None
        for src in group:
            keys = src.block_keys if c == 0 else _salted(src.block_keys, c)
            sid = src.session if c == 0 else f"{src.session}#{c}"
            t = shift + (src.arrival_s - base)
            turn = Request(
                0,
                t,
                src.prompt_tokens,
                src.output_tokens,
                keys,
                src.block_tokens,
                sid,
                turn=src.turn,
                service_s=src.service_s,
            )
            turns = [turn]
            if prev_src is not None and fanout > 1 and fan_rng.random() < fanout_share:
                shared = _shared_blocks(prev[0].block_keys, keys)
                for j in range(1, fanout):
                    turns.append(replace(turn, block_keys=_suffix(keys, shared, j)))
            gap = 0.0 if prev_src is None else _think(model, prev_src, src, rng)
            for r in turns:
                parents[id(r)] = prev
                think[id(r)] = gap
            out.extend(turns)
            prev, prev_src = turns, src
    reqs = finish(out, block)
    m = len(reqs)
    loop = ClosedLoop([0] * m, [[] for _ in range(m)], [0.0] * m)
    for r in reqs:
        ps = parents[id(r)]
        loop.parents[r.index] = len(ps)
        loop.think_s[r.index] = think[id(r)]
        for p in ps:
            loop.children[p.index].append(r.index)
    return SessionPlan(reqs, loop, model, total, period / n)


def scale_for_load(
    plan: SessionPlan, floor_work_s: Sequence[float], load: float, engines: int
) -> float:
    """The factor on first-turn times that makes floor work / capacity = `load` in steady
    state: session rate = load · engines / (floor work per session)."""
    if load <= 0:
        raise ValueError("load must be positive")
    per_session = sum(floor_work_s) / plan.sessions
    if per_session <= 0:
        raise ValueError("the plan has no prefill work")
    rate = load * engines / per_session
    return rate * plan.period_s


def scaled(plan: SessionPlan, factor: float) -> list[Request]:
    """The plan's requests with first-turn times divided by `factor` (new objects)."""
    if factor <= 0:
        raise ValueError("scale must be positive")
    roots = set(plan.loop.roots())
    return [
        replace(r, arrival_s=r.arrival_s / factor) if r.index in roots else replace(r)
        for r in plan.requests
    ]
