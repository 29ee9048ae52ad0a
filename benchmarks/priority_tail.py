"""Why routing with the keyed wait raises the agent traces' p99
(docs/results/history-priority.md, "Why the keyed wait costs the agent traces' tail"): tier_aware routed with FCFS waits against the
keyed wait (`Simulation(keyed_wait=True, charge_jumps=False)`) and the keyed wait with
each jump charged (`charge_jumps=True`, `ramjet.policy.cost.jump_seconds`), all on the
same priority engine, at each trace's middle load, per closed-loop seed.

    .venv/bin/python benchmarks/priority_tail.py [--traces taubench,miniswe] [--seeds 0,1]
    .venv/bin/python benchmarks/priority_tail.py --quick    # make bench: taubench, seed 0

Per run: mean / p99 TTFT and the session turns sent to another engine than their previous
turn (moves); for the tail (TTFT at or over the p99) and for all measured requests: uncached
tokens, the share moved, how often they were overtaken (requests on the same engine that
arrived after them and started before them) and by how many uncached tokens, and the
router's predicted wait against the wait before the first prefill chunk. With the keyed
wait, each decision is also priced with FCFS waits (the same policy's `estimates` with
`FleetStats.keyed` empty) to count the decisions the keyed wait changes: how often its
choice is the engine with more queued prompt tokens, and how many queued requests it
jumps there (`ramjet.policy.cost.keyed_jumped`: queued with a higher key, or a started
prefill with a higher key where the engine preempts). Simulated time; everything is the
repository's simulator and cost model. Ends with `self-check:` (every request decided
once and its decision found by its arrival; every measured request served) and the
p99 of each wait as `figure:` lines.
"""

from __future__ import annotations

import argparse
import bisect
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.priority_sim import (
    CASES,
    DEFAULT_AGING,
    DEFAULT_HORIZON,
    JUMPS,
    KEYED,
    WAITS,
    Workload,
    simulate,
    trace_names,
)
from ramjet.policy.base import Decision, EngineView, FleetStats, RequestView, RoutingPolicy
from ramjet.policy.cost import keyed_jumped
from ramjet.policy.priority_key import hint_key_s
from ramjet.policy.tier_aware import TierAware
from simulations.simulator import Outcome
from simulations.summary import percentile


@dataclass
class Choice:
    now_s: float
    session: str | None
    prompt_tokens: int
    wait_s: float
    """The predicted wait on the chosen engine."""
    differs: bool = False
    """With the keyed wait: FCFS pricing would have chosen the other engine."""
    busier: bool = False
    """The chosen engine had more queued prompt tokens than the other."""
    jumped: int = 0
    """Requests the choice overtakes on its engine (`keyed_jumped`)."""


@dataclass
class Recorder:
    """tier_aware, recording each decision (and, with the keyed wait, FCFS pricing's)."""

    policy: TierAware
    name: str = "tier_aware"
    choices: list[Choice] = field(default_factory=list)

    def pick(
        self, request: RequestView, engines: Sequence[EngineView], fleet: FleetStats
    ) -> Decision:
        fcfs = None
        if fleet.keyed:  # estimates() reads state only; pick() below updates it once
            ests = self.policy.estimates(request, engines, replace(fleet, keyed={}))
            fcfs = min(ests, key=lambda s: (s.cost_s, s.wait_s)).engine
        d = self.policy.pick(request, engines, fleet)
        comp = d.components[d.engine]
        c = Choice(fleet.now_s, request.session, request.prompt_tokens, comp["wait_s"])
        if fcfs is not None:
            q = fleet.keyed[d.engine]
            key = hint_key_s(comp["work_s"], q.aging, fleet.now_s, q.horizon_s)
            c.differs = fcfs != d.engine
            c.jumped = keyed_jumped(q, key)
            queued = {e.id: e.load.queued_prompt_tokens or 0 for e in engines}
            mine = queued.pop(d.engine)
            c.busier = mine > max(queued.values(), default=0)
        self.choices.append(c)
        return d


def _overtaken(out: Outcome, i: int, by_engine: dict[int, list[int]]) -> tuple[int, int]:
    """(requests, uncached tokens) on i's engine that arrived after i and started first."""
    lst = by_engine[out.engine[i]]
    start_i = out.arrival[i] + out.wait[i]
    k = bisect.bisect_right([out.arrival[j] for j in lst], out.arrival[i])
    n = tokens = 0
    while k < len(lst) and out.arrival[lst[k]] < start_i:
        j = lst[k]
        if out.arrival[j] + out.wait[j] < start_i:
            n += 1
            tokens += out.new_tokens[j]
        k += 1
    return n, tokens


LABELS = {"": "FCFS wait       ", KEYED: "keyed wait      ", JUMPS: "keyed+jump charge"}


def run(trace: str, scheduler: str, seed: int, variant: str) -> tuple[list[str], float]:
    """One run; `variant`: one of `WAITS` ("" FCFS wait, `KEYED`, `JUMPS`)."""
    [case] = [c for c in CASES if c.name == trace]
    w = Workload(case, False, seed)
    load = case.loads[1]
    recs: list[Recorder] = []

    def wrap(policy: RoutingPolicy) -> RoutingPolicy:
        assert isinstance(policy, TierAware)
        recs.append(Recorder(policy))
        return recs[-1]

    name = "tier_aware" + variant
    reqs, _, out = simulate(w, load, name, scheduler, DEFAULT_AGING, DEFAULT_HORIZON, wrap)
    [rec] = recs
    if len(rec.choices) != len(reqs):
        raise SystemExit(f"{len(rec.choices)} decisions for {len(reqs)} requests")
    win = out.window
    measured = [i for i, t in enumerate(out.arrival) if win is None or win[0] <= t <= win[1]]
    by_key = {(c.session, c.prompt_tokens, c.now_s): c for c in rec.choices}
    choice = [by_key[(reqs[i].session, reqs[i].prompt_tokens, out.arrival[i])] for i in measured]
    moved: dict[int, bool] = {}
    last: dict[str, int] = {}
    for i in sorted(range(len(reqs)), key=lambda i: out.arrival[i]):
        s = reqs[i].session
        if s is not None:
            if s in last:
                moved[i] = out.engine[i] != out.engine[last[s]]
            last[s] = i
    by_engine: dict[int, list[int]] = {}
    for i in sorted(range(len(reqs)), key=lambda i: out.arrival[i]):
        by_engine.setdefault(out.engine[i], []).append(i)
    tt = sorted(out.ttft[i] for i in measured)
    if not measured or any(t != t or t < 0 for t in tt):  # NaN: a request never served
        raise SystemExit(f"{trace} seed {seed} {scheduler}: a measured request has no TTFT")
    p99 = percentile(tt, 99)
    pred = dict(zip(measured, (c.wait_s for c in choice), strict=True))
    mean = statistics.fmean
    label = LABELS[variant]
    lines = [
        f"{trace} seed {seed} {scheduler} {label}: mean {mean(tt):.4f} p99 {p99:.4f} "
        f"moves {sum(moved.get(i, False) for i in measured)} of {len(measured)}"
    ]
    tail = [i for i in measured if out.ttft[i] >= p99]
    for name, sel in (("tail", tail), ("all ", measured)):
        ov = [_overtaken(out, i, by_engine) for i in sel]
        lines.append(
            f"  {name} n={len(sel)}: new tokens {mean(out.new_tokens[i] for i in sel):.0f}, "
            f"moved {mean(moved.get(i, False) for i in sel):.2f}, "
            f"overtaken {mean(o[0] for o in ov):.2f}x by {mean(o[1] for o in ov):.0f} tokens, "
            f"predicted wait {mean(pred[i] for i in sel):.4f} s, "
            f"wait {mean(out.wait[i] for i in sel):.4f} s, ttft {mean(out.ttft[i] for i in sel):.4f} s"
        )
    if variant:
        diff = [c for c in choice if c.differs]
        if diff:
            lines.append(
                f"  decisions the keyed wait changes: {len(diff)} of {len(choice)} "
                f"({len(diff) / len(choice):.1%}); onto the engine with more queued tokens "
                f"{mean(c.busier for c in diff):.2f}; queued requests jumped there "
                f"{mean(c.jumped for c in diff):.2f} (unchanged decisions: "
                f"{mean(c.jumped for c in choice if not c.differs):.2f})"
            )
    return lines, p99


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--traces", default="taubench,miniswe")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--schedulers", default="priority,vllm-priority")
    ap.add_argument(
        "--quick", action="store_true", help="--traces taubench --seeds 0 --schedulers priority"
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.traces, args.seeds, args.schedulers = "taubench", "0", "priority"
    traces = trace_names(ap, args.traces)
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds: comma-separated integers, got {args.seeds!r}")
    figs, runs = [], 0
    for trace in traces:
        for seed in seeds:
            for scheduler in args.schedulers.split(","):
                for variant in WAITS:
                    lines, p99 = run(trace, scheduler, seed, variant)
                    print("\n".join(lines), flush=True)
                    runs += 1
                    figs.append(
                        f"figure: priority tail p99 TTFT / {trace} s{seed} {scheduler} "
                        f"{LABELS[variant].strip()} = {p99 * 1e3:.1f} ms"
                    )
    print("\n".join(figs))
    print(
        f"self-check: {runs} runs: every request decided once, each decision found by its "
        "arrival, every measured request served"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
