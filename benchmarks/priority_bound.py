"""How far down mean TTFT can go on the simulator's engine models: lower bounds for every
routing and every ordering, and a witness schedule that caps what any bound can prove,
against the issue's goal of 0.6x the best FCFS peer's mean (docs/results/history-priority.md, "Is 0.6x
reachable on the agent traces?").

    .venv/bin/python benchmarks/priority_bound.py [--traces taubench,miniswe,mooncake] [--quick]

Per trace at its middle load (`benchmarks.priority_sim.CASES`), for the set S of requests
a run measures (the closed loop's steady-state window; open loop: all):

- **alone** (every engine model): each request's TTFT is at least its own prompt work on
  the best cache any schedule could give it: every block that some *other* request which
  can run before it holds, resident in HBM, with live SWA state at its last boundary
  within that prefix (`simulations.bounds.floor(any_order=True, after=...)`). A block
  becomes resident only at its holder's first token (`Engine._first_token`); in the
  closed loop a turn's descendants (its later turns) are sent after it finished, so
  their blocks never count for it (`descendants`); any other request may have run first.
  The engine resumes at most at that prefix (`prompt_work`, q clipped to g), so this is
  at most its work in any run. No queueing, no decode interference.
- **alone + steps** (the one-job-per-step engines, `fcfs` and `priority`): those engines
  add one decode step (`decode_step_s`) to every prefill chunk that starts while a
  request decodes on the engine (`simulations.engine.Engine._chunk`; nothing skips it on
  them). A request escapes every step only if nothing decodes on its engine whenever its
  chunks start. For two such requests i, j on one engine with i's first token first,
  j's last chunk starts after i's first token and after i's decode has ended, so their
  first tokens are at least D_i apart (D = ceil(output / tokens per step) x step, the
  engine's fixed decode time). Every request whose first token comes later than
  tau = max work + step after the window's last arrival has TTFT > tau anyway. So at
  most 2 + K requests of S escape the step, K the largest k whose k smallest D sum to
  at most 2 x (window span + tau), and every other request pays at least its work plus
  one step. Not on vLLM's model: there a job whose whole prompt fits in the budget the
  previous job's last chunk left shares that chunk's step, however briefly it waited.
- **queue** (every engine model; `simulations.bounds.occupancy_mean`): the sum of TTFTs
  is the integral of the number of requests waiting for their first token, and at every
  instant that number is at least (a) the requests still inside their own work since
  arrival and (b) the requests SRPT would leave unfinished on one server as fast as both
  engines (SRPT completes the most jobs by every instant on one server; two engines
  deliver at most twice one's rate). It uses the run's arrival times: in the open loop
  those are the trace's, so it bounds every schedule; in the closed loop the arrivals
  depend on the schedule, so it bounds the run it is computed for (and is checked
  there) but does not enter the verdict.

Both hold for every routing and every order of the requests in S (any scheduler on that
engine model, any cache sharing, with perfect knowledge). In the closed loop, S itself
(which turns arrive inside the window) depends on the run: the bounds are computed over
the measured set of each run below and hold for every schedule of that set. The script
checks every run's mean against its bounds (and fails otherwise) and prints, per engine
model, the best FCFS peer's mean, 0.6x it, and the bounds over that peer's requests.

**Witness** (traces with turns that produce no output): `split_by_output` routes every
turn with nothing to decode to one engine and every other turn to the other, each engine
with its own cache and FCFS order. The first engine never decodes, so its chunks never
carry a step. It is one schedule of the model, so no valid lower bound over its requests
can exceed its mean; where that mean is at most 0.6x the best peer's, 0.6x is reachable
and no bound can rule it out (its measured set differs from the peer's by the closed
loop's few requests at the window's edge). It reads each turn's output length, which a
router knows only as a maximum: a ceiling for bounds, not a policy.

**What-if** (closed loop, not a bound): the queue bound over the best peer's arrivals
with one decode step added to every request's work, to show how far a step argument
could go at most where none is proven.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.priority_sim import (
    CASES,
    DEFAULT_AGING,
    DEFAULT_HORIZON,
    JUMPS,
    LWF_REFERENCE,
    PEERS,
    Workload,
    simulate,
    trace_names,
)
from simulations.bounds import (
    Bounds,
    SplitByOutput,
    descendants,
    floor,
    measured,
    occupancy_mean,
    run_bounds,
)
from simulations.preset import engine_spec
from simulations.simulator import Outcome, Simulation
from simulations.workload import Request

GOAL = 0.6
PER_JOB = ("fcfs", "priority")
"""Engine models whose every prefill chunk carries a decode step while the engine decodes."""


def bounds(reqs: Sequence[Request], out: Outcome, work: list[float], steps: bool) -> Bounds:
    """`run_bounds` on the simulator's engine profile (`engine_spec`)."""
    return run_bounds(reqs, out, work, engine_spec().profile, steps)


def every_step_what_if(out: Outcome, work: list[float]) -> float:
    """Not a bound: the occupancy bound if every measured request paid one decode step on
    top of its work (no argument forces that; see the docs)."""
    s = measured(out)
    step = engine_spec().profile.decode_step_s
    return occupancy_mean(
        [out.arrival[i] for i in s], [work[i] + step for i in s], len(out.busy_s) or 2
    )


def witness(w: Workload, load: float, scheduler: str) -> Outcome:
    """`SplitByOutput` on two engines of `scheduler`, each with its own cache (as the
    FCFS peers: no shared cache), exact knowledge."""
    spec = replace(engine_spec(scheduler=scheduler), horizon_s=DEFAULT_HORIZON)
    return Simulation(
        w.at(load),
        spec,
        SplitByOutput(),
        block_tokens=w.block,
        engines=2,
        loop=w.plan.loop if w.plan is not None else None,
    ).run()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--traces", default="taubench,miniswe,mooncake")
    ap.add_argument("--quick", action="store_true", help="tau-bench only (make bench, ~1 min)")
    args = ap.parse_args(argv)
    traces = trace_names(ap, "taubench" if args.quick else args.traces)
    problems: list[str] = []
    figs: list[str] = []
    for case in (c for c in CASES if c.name in traces):
        w = Workload(case, False)
        load = case.loads[1]
        open_loop = w.plan is None
        later = descendants(w.plan.loop.children) if w.plan is not None else None
        work = floor(w.reqs, engine_spec().profile, any_order=True, after=later).work_s
        silent = any(r.output_tokens == 0 for r in w.reqs)
        for prio, base in (("priority", "fcfs"), ("vllm-priority", "vllm-fcfs")):
            steps = base in PER_JOB
            runs: dict[str, tuple[float, Bounds, Outcome]] = {}
            for pol, sch, aging, hz in [
                (p, base, DEFAULT_AGING, DEFAULT_HORIZON) for p in PEERS
            ] + [
                ("tier_aware", base, DEFAULT_AGING, DEFAULT_HORIZON),
                ("tier_aware" + JUMPS, prio, DEFAULT_AGING, DEFAULT_HORIZON),
                (LWF_REFERENCE, prio, 0.0, None),
                (SplitByOutput.name, base, DEFAULT_AGING, DEFAULT_HORIZON),
            ]:
                if pol == SplitByOutput.name:
                    if not silent:
                        continue
                    out = witness(w, load, sch)
                else:
                    _, _, out = simulate(w, load, pol, sch, aging, hz)
                s = measured(out)
                mean = statistics.fmean(out.ttft[i] for i in s)
                b = bounds(w.reqs, out, work, steps and sch in PER_JOB)
                runs[f"{pol} on {sch}"] = (mean, b, out)
                if mean < b.highest - 1e-12:
                    problems.append(
                        f"{case.name} {pol} on {sch}: mean {mean:.4f} s under its bound "
                        f"{b.highest:.4f} s"
                    )
            peers = {k: v for k, v in runs.items() if k.split(" on ")[0] in PEERS}
            best = min(peers, key=lambda k: peers[k][0])
            m, b, out = peers[best]
            print(f"\n{case.name} load {load:g}, engine model {base}/{prio}:")
            for name, (mean, rb, _) in runs.items():
                extra = f", alone + steps {rb.steps:.4f} s" if rb.steps != rb.alone else ""
                print(
                    f"  {name:<40} mean {mean:.4f} s  bounds: alone {rb.alone:.4f} s{extra}, "
                    f"queue {rb.queue:.4f} s"
                )
            bound, what = b.valid(open_loop)
            wit = runs.get(f"{SplitByOutput.name} on {base}")
            if wit is not None and wit[0] <= GOAL * m:
                verdict = (
                    f"0.6x is REACHED by the witness schedule ({SplitByOutput.name}, "
                    f"{wit[0]:.4f} s = {wit[0] / m:.2f}x), so no valid bound can rule it out"
                )
            elif bound > GOAL * m:
                verdict = "0.6x is UNREACHABLE for every routing and ordering of these requests"
            else:
                verdict = "the bound does not rule 0.6x out"
            print(
                f"  best {base} peer {best.split(' on ')[0]} mean {m:.4f} s; {GOAL:g}x = "
                f"{GOAL * m:.4f} s; bound ({what}, over its requests) {bound:.4f} s = "
                f"{bound / m:.2f}x the peer: {verdict}"
            )
            ta = runs[f"tier_aware on {base}"][0]
            figs += [
                f"figure: priority bound over the best peer / {case.name} {base} bound = "
                f"{bound / m:.3f} x",
                f"figure: priority bound over the best peer / {case.name} {base} tier_aware = "
                f"{ta / m:.3f} x",
            ]
            if not open_loop:
                ceiling = every_step_what_if(out, work)
                print(
                    f"  what-if, not a bound: the queue bound with one decode step on every "
                    f"request, over the peer's arrivals: {ceiling:.4f} s = {ceiling / m:.2f}x"
                )
    print()
    print("\n".join(figs))
    for p in problems:
        print(f"FAIL: {p}")
    if not problems:
        print("\nself-check: every run's mean is at or above its bounds")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
