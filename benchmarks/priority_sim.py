"""Priority hints in the simulator: FCFS against priority scheduling (the chunk-preemptive
engine and vLLM's variant) on the Mooncake, tau-bench and mini-SWE traces at three loads,
an aging sweep, and the worst wait of long cold prompts.

    .venv/bin/python benchmarks/priority_sim.py --out docs/results/priority [--quick]
    .venv/bin/python benchmarks/priority_sim.py --quick --middle --no-sweep \\
        --out out/bench/priority_sim                 # make bench: each middle load, ~1 min

For each trace and load: every FCFS peer (`simulations.lineup`), and tier_aware (and
prefix_affinity) under each scheduler of `simulations.engine`: `fcfs`, `priority`
(chunk-preemptive), `vllm-priority` (vLLM V1's) and `vllm-fcfs` (vLLM's step packing in
arrival order, to tell the packing from the order). Figures: mean / p99 / max TTFT over
the measured requests (the closed-loop window for the agent traces, as
`simulations.summary`), utilisation, and for long cold prompts (no cache hit, the
longest 5% of prompts) their worst wait before the first prefill chunk. The aging sweep
runs tier_aware as the router routes a pool in mode `on` (keyed wait, jumps charged:
`SWEPT`) with both priority variants at the middle load. Writes `tables.md`,
`results.csv`, `aging_sweep.png` and prints progress and the tables. Everything runs
the repository's simulator objects; nothing here models an engine.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ramjet.config import PriorityConfig
from ramjet.policy.base import RoutingPolicy
from simulations.__main__ import open_loop_scale
from simulations.bounds import floor
from simulations.checks import violations
from simulations.lineup import resolve
from simulations.preset import EngineSpec, engine_spec
from simulations.sessions import closed_loop_plan, scale_for_load, scaled
from simulations.simulator import Outcome, Simulation
from simulations.summary import summarize
from simulations.workload import Request, load_trace, scale_rate

TRACES = Path("/work/shared/data/traces")
if not TRACES.is_dir():
    TRACES = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"


@dataclass(frozen=True)
class TraceCase:
    name: str
    path: Path
    sessions_x: int
    """Closed-loop copies of the trace's sessions (0: open-loop)."""
    loads: tuple[float, float, float]
    """Offered loads relative to the floor's work, chosen so that tier_aware under FCFS
    runs its engines ~45-55% / 65-70% / 85-90% busy."""


CASES = (
    TraceCase("mooncake", TRACES / "mooncake/synthetic_trace.jsonl", 0, (0.42, 0.6, 0.78)),
    TraceCase("taubench", TRACES / "agent/taubench_raw_b64.jsonl", 30, (0.1, 0.15, 0.2)),
    TraceCase("miniswe", TRACES / "agent/miniswe_interleaved_b64.jsonl", 20, (0.3, 0.4, 0.5)),
)

PEERS = (
    "prefix_affinity",
    "smg_cache_aware:exact",
    "llmd_scorers:exact",
    "dynamo_kv:exact",
    "prodstack_prefix:real",
    "session_hash",
    "least_loaded",
)
SCHEDULERS = ("fcfs", "priority", "vllm-priority", "vllm-fcfs")
AGINGS = (0.0, 0.02, 0.03, 0.04, 0.05, 0.07, 0.1, 0.25, 0.5, 1.0, 2.0)
HORIZONS: tuple[float | None, ...] = (None, 10.0, 15.0, 20.0, 25.0, 30.0, 40.0, 60.0)
"""The sweep's grid (`SWEPT` at the middle load, both priority variants); a horizon
needs aging > 0 (`ramjet.config.PriorityConfig`)."""
DEFAULT_AGING: float = PriorityConfig.model_fields["aging"].default
DEFAULT_HORIZON: float | None = PriorityConfig.model_fields["horizon_s"].default
"""The router's defaults: the main tables run them; the sweep checks they are the rule's
choice (`choose_default`)."""
MAX_RATIO = 1.1
"""The default's rule: on Mooncake at the middle load, for both variants, worst TTFT at
most this times FCFS tier_aware's and p99 no worse; among those, the lowest mean (all of
it with `SWEPT`'s routing)."""


@dataclass
class Result:
    trace: str
    load: float
    policy: str
    scheduler: str
    aging: float
    horizon: float | None
    """The hint's horizon (s; None: uncapped, `ramjet.policy.priority_key`)."""
    util: float
    mean_s: float
    p99_s: float
    max_s: float
    long_n: int
    """Requests with the most uncached prompt tokens (top 5% of the measured ones)."""
    long_max_wait_s: float
    """Their worst wait before the first prefill chunk."""
    long_max_ttft_s: float
    long_worst_tokens: int
    """Uncached prompt tokens of the one that waited longest."""
    long_worst_hint_s: float
    """Its predicted prompt work (the hint), from which aging bounds its delay."""
    alone_mean_s: float
    """`bound:alone`'s mean over the same requests: a strict lower bound on `mean_s` for
    any router and scheduler (the FCFS oracle bounds no priority scheduler)."""
    problems: tuple[str, ...] = ()
    """Where this run beats a strict bound (`simulations.checks.violations`): a failed run."""


def _pct(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return math.nan
    i = min(len(sorted_vals) - 1, max(0, math.ceil(q * len(sorted_vals)) - 1))
    return sorted_vals[i]


class Workload:
    """One trace prepared once: requests (or the closed-loop plan) and per-load scales.
    `seed`: the closed-loop plan's (which sessions start when); open-loop traces have none."""

    def __init__(self, case: TraceCase, quick: bool, seed: int = 0) -> None:
        reqs, self.block = load_trace(case.path)
        self.case = case
        spec = engine_spec()
        self.plan = None
        if case.sessions_x:
            copies = max(1, case.sessions_x // (4 if quick else 1))
            sessions = len({r.session for r in reqs}) * copies
            self.plan = closed_loop_plan(reqs, self.block, sessions=sessions, seed=seed)
            reqs = self.plan.requests
        elif quick:
            reqs = reqs[: len(reqs) // 2]
        self.reqs: list[Request] = reqs
        self.fl = floor(reqs, spec.profile)
        self.scales: dict[float, float] = {}
        for x in case.loads:
            if self.plan is not None:
                self.scales[x] = round(scale_for_load(self.plan, self.fl.work_s, x, 2), 4)
            else:
                self.scales[x] = open_loop_scale(reqs, self.fl.work_s, x, 2)

    def at(self, load: float) -> list[Request]:
        s = self.scales[load]
        return scaled(self.plan, s) if self.plan is not None else scale_rate(self.reqs, s)


KEYED = "+keyed"
"""Suffix of a policy run with the cost model's priority-aware wait (`FleetStats.keyed`:
the router's view of a pool in mode `on`) and jumps free (`charge_jumps: false`);
without it the policy prices FCFS waits."""
JUMPS = "+keyed+jumps"
"""Suffix of a policy run with the keyed wait and each jump charged to the cost
(`KeyedQueue.charge_jumps`, `ramjet.policy.cost.jump_seconds`)."""
WAITS = ("", KEYED, JUMPS)
"""tier_aware's routing variants on a priority engine: FCFS wait, keyed wait, keyed wait
with the jump charge."""
SWEPT = "tier_aware" + JUMPS
"""The routing the aging x horizon sweep runs and the default is chosen for: the router's
own in mode `on` (keyed wait, jumps charged), since aging and the horizon change what the
keyed wait sees as well as the engines' order."""
LWF_REFERENCE = "oracle:tier_aware"
"""The perfect-knowledge reference: the shared-cache oracle's routing, on each engine
model's priority scheduler with aging 0 (least predicted work first; on the chunk-
preemptive engine, shortest remaining work first at chunk granularity)."""


def trace_names(ap: argparse.ArgumentParser, text: str) -> list[str]:
    """`--traces`' comma-separated names, each a `CASES` name (else a usage error)."""
    names = {c.name for c in CASES}
    traces = text.split(",")
    bad = [t for t in traces if t not in names]
    if bad:
        ap.error(f"unknown trace(s) {bad}; known: {sorted(names)}")
    return traces


def simulate(
    w: Workload,
    load: float,
    policy: str,
    scheduler: str,
    aging: float,
    horizon: float | None = None,
    wrap: Callable[[RoutingPolicy], RoutingPolicy] | None = None,
) -> tuple[list[Request], EngineSpec, Outcome]:
    """One run of `policy` (a lineup name, + `KEYED` or `JUMPS` for the keyed wait) on two
    engines; `wrap`: what routes, given the lineup's policy (benchmarks/priority_tail.py
    records its decisions)."""
    charged = policy.endswith(JUMPS)
    name = policy.removesuffix(JUMPS) if charged else policy
    keyed = charged or name.endswith(KEYED)
    # replace(): engine_spec drops None overrides, and None here means "no horizon"
    spec = replace(engine_spec(scheduler=scheduler, aging=aging), horizon_s=horizon)
    [made] = resolve(name.removesuffix(KEYED))
    ent = made.on(spec)  # configured for these engines
    reqs = w.at(load)
    routing = ent.make(0)
    sim = Simulation(
        reqs,
        spec,
        wrap(routing) if wrap is not None else routing,
        block_tokens=w.block,
        engines=2,
        knowledge=ent.knowledge,
        shared_cache=ent.shared_cache,
        loop=w.plan.loop if w.plan is not None else None,
        keyed_wait=keyed,
        charge_jumps=charged,
    )
    return reqs, spec, sim.run()


def run_one(
    w: Workload,
    load: float,
    policy: str,
    scheduler: str,
    aging: float,
    horizon: float | None = None,
) -> Result:
    reqs, spec, out = simulate(w, load, policy, scheduler, aging, horizon)
    row = summarize(policy, w.scales[load], reqs, out, w.fl.tokens, 2.0, load, w.fl.work_s)
    win = out.window
    counted = [i for i, t in enumerate(out.arrival) if win is None or win[0] <= t <= win[1]]
    counted = counted or list(range(len(out.ttft)))
    tt = sorted(out.ttft[i] for i in counted)
    by_new = sorted(counted, key=lambda i: out.new_tokens[i])
    long = by_new[int(0.95 * len(by_new)) :]
    worst = max(long, key=lambda i: out.wait[i])
    hint = spec.profile.prefill_seconds(
        out.new_tokens[worst], reqs[worst].prompt_tokens - out.new_tokens[worst]
    )
    return Result(
        trace=w.case.name,
        load=load,
        policy=policy,
        scheduler=scheduler,
        aging=aging,
        horizon=horizon,
        util=row.utilization,
        mean_s=row.ttft_mean_s,
        p99_s=_pct(tt, 0.99),
        max_s=tt[-1],
        long_n=len(long),
        long_max_wait_s=out.wait[worst],
        long_max_ttft_s=max(out.ttft[i] for i in long),
        long_worst_tokens=out.new_tokens[worst],
        long_worst_hint_s=hint,
        alone_mean_s=row.alone_mean_s,
        # violations() holds every policy but the oracle routings to bound:alone
        problems=tuple(violations([row]))
        + (
            (f"{policy} mean {row.ttft_mean_s:.4f} s beats bound:alone {row.alone_mean_s:.4f} s",)
            if policy.startswith("oracle:") and row.ttft_mean_s < row.alone_mean_s
            else ()
        ),
    )


def _fmt(r: Result) -> str:
    return f"{r.mean_s:.2f} / {r.p99_s:.1f} / {r.max_s:.1f}"


PAIRS = (("priority", "fcfs", "chunk-preemptive engine"), ("vllm-priority", "vllm-fcfs", "vLLM"))
"""(priority scheduler, its FCFS baseline on the same engine model, what it stands for)."""


def _find(rows: list[Result], load: float, policy: str, scheduler: str) -> Result | None:
    return next(
        (r for r in rows if r.load == load and r.policy == policy and r.scheduler == scheduler),
        None,
    )


def verdicts(rows: list[Result], load: float) -> list[str]:
    """Per engine model: tier_aware with hints against the best FCFS peer (mean) and FCFS
    tier_aware (p99), both on the same engine model."""
    out = []
    for prio, base, what in PAIRS:
        ta_fcfs = _find(rows, load, "tier_aware", base)
        peers = [
            r
            for r in rows
            if r.load == load
            and r.scheduler == base
            and r.policy != "tier_aware"
            and not r.policy.startswith("oracle")
        ]
        if ta_fcfs is None or not peers:
            continue
        best = min(peers, key=lambda r: r.mean_s)
        for pol in ("tier_aware" + v for v in WAITS):
            ta = _find(rows, load, pol, prio)
            if ta is None:
                continue
            m, p = ta.mean_s / best.mean_s, ta.p99_s / ta_fcfs.p99_s
            ok = "meets" if m <= 0.6 and p <= 1.0 else "misses"
            out.append(
                f"{what}: {pol} on {prio} mean {ta.mean_s:.3g} s = {m:.2f}x the best {base} "
                f"peer ({best.policy} {best.mean_s:.3g} s); p99 {ta.p99_s:.3g} s = {p:.2f}x "
                f"{base} tier_aware's; {ok} the goal (<= 0.6x, <= 1.0x)"
            )
        ref = next(
            (
                r
                for r in rows
                if r.load == load and (r.policy, r.scheduler, r.aging) == (LWF_REFERENCE, prio, 0.0)
            ),
            None,
        )
        if ref is not None:
            m = ref.mean_s / best.mean_s
            out.append(
                f"{what}: perfect-knowledge least-work-first ({LWF_REFERENCE}, shared cache, "
                f"{prio} at aging 0) mean {ref.mean_s:.3g} s = {m:.2f}x the best {base} peer: "
                + (
                    "0.6x is out of this reference's reach (one schedule, not a bound: "
                    "benchmarks/priority_bound.py)"
                    if m > 0.6
                    else "0.6x is within reach"
                )
            )
    return out


def tables(results: list[Result]) -> str:
    out: list[str] = []
    main = [
        r
        for r in results
        if (r.aging, r.horizon) == (DEFAULT_AGING, DEFAULT_HORIZON)
        or r.scheduler in ("fcfs", "vllm-fcfs")
        or r.policy == LWF_REFERENCE
    ]
    for case in CASES:
        rows = [r for r in main if r.trace == case.name]
        if not rows:
            continue
        loads = sorted({r.load for r in rows})
        utils = {x: getattr(_find(rows, x, "tier_aware", "fcfs"), "util", math.nan) for x in loads}
        out.append(
            f"\n### {case.name}: mean / p99 / max TTFT (s), aging {DEFAULT_AGING:g}, "
            f"horizon {_hz(DEFAULT_HORIZON)}\n"
        )
        head = " | ".join(f"load {x:g} ({utils[x]:.0%})" for x in loads)
        out.append(f"| policy | scheduler | {head} |")
        out.append("|---|---|" + "---|" * len(loads))
        keys = sorted(
            {(r.policy, r.scheduler) for r in rows},
            key=lambda k: (k[0] != "tier_aware", k[0], SCHEDULERS.index(k[1])),
        )
        for pol, sch in keys:
            cells = []
            for x in loads:
                hit = _find(rows, x, pol, sch)
                cells.append(_fmt(hit) if hit else "-")
            out.append(f"| {pol} | {sch} | " + " | ".join(cells) + " |")
        out.append("")
        for x in loads:
            for v in verdicts(rows, x):
                out.append(f"- load {x:g} ({utils[x]:.0%} FCFS util): {v}")
        out.append(
            f"\n{case.name}, tier_aware: the 5% of requests with the most uncached prompt "
            "tokens: worst wait before the first prefill chunk, its uncached tokens and "
            "predicted work (the hint h), the window after its arrival within which a "
            "later arrival may overtake it (min(h/aging, horizon)), and the worst TTFT "
            "among them\n"
        )
        out.append(
            "| load | scheduler | n | worst wait s | its tokens | h s | window s | worst TTFT s |"
        )
        out.append("|---|---|---|---|---|---|---|---|")
        for x in loads:
            for sch in SCHEDULERS:
                r = _find(rows, x, "tier_aware", sch)
                if r is None:
                    continue
                horizon = (
                    f"{min(r.long_worst_hint_s / r.aging, r.horizon or math.inf):.1f}"
                    if sch in ("priority", "vllm-priority") and r.aging > 0
                    else "-"
                )
                out.append(
                    f"| {x:g} | {sch} | {r.long_n} | {r.long_max_wait_s:.2f} | "
                    f"{r.long_worst_tokens} | {r.long_worst_hint_s:.2f} | {horizon} | "
                    f"{r.long_max_ttft_s:.2f} |"
                )
    for case in CASES:
        rows = [r for r in results if r.trace == case.name and r.load == case.loads[1]]
        grid = [r for r in rows if r.policy == SWEPT and r.scheduler in PRIO]
        if len({(r.aging, r.horizon) for r in grid}) < 2:
            continue
        base = {b: _find(rows, case.loads[1], "tier_aware", b) for b in BASE.values()}
        out.append(
            f"\n### {case.name}: aging x horizon sweep, {SWEPT} at load {case.loads[1]:g}: "
            "mean / p99 / max TTFT (s); worst wait of the most-work 5% (s); in brackets "
            "mean / p99 / max over FCFS tier_aware on the same engine model\n"
        )
        out.append("| aging | horizon s | priority (chunk) | vllm-priority |")
        out.append("|---|---|---|---|")
        for ag, hz in sorted({(r.aging, r.horizon) for r in grid}, key=_grid_order):
            cells = []
            for sch in PRIO:
                hit = next(
                    (r for r in grid if (r.aging, r.horizon, r.scheduler) == (ag, hz, sch)), None
                )
                b = base[BASE[sch]]
                if hit is None or b is None:
                    cells.append("-")
                    continue
                cells.append(
                    f"{_fmt(hit)}; {hit.long_max_wait_s:.2f} ({hit.mean_s / b.mean_s:.2f} / "
                    f"{hit.p99_s / b.p99_s:.2f} / {hit.max_s / b.max_s:.2f})"
                )
            mark = "**" if (ag, hz) == (DEFAULT_AGING, DEFAULT_HORIZON) else ""
            out.append(
                f"| {mark}{ag:g}{mark} | {mark}{_hz(hz)}{mark} | " + " | ".join(cells) + " |"
            )
    pick = choose_default(results)
    if pick is not None:
        ag, hz, worst_mean = pick
        agree = (ag, hz) == (DEFAULT_AGING, DEFAULT_HORIZON)
        out.append(
            f"\nThe rule (Mooncake, middle load, both variants: max <= {MAX_RATIO:g}x and p99 "
            f"<= 1x FCFS tier_aware's; lowest mean): aging {ag:g}, horizon {_hz(hz)} "
            f"(its worse variant's mean {worst_mean:.2f}x FCFS). The router's default: aging "
            f"{DEFAULT_AGING:g}, horizon {_hz(DEFAULT_HORIZON)}"
            + (" (the same)." if agree else " (DIFFERENT: revisit the default).")
        )
    return "\n".join(out) + "\n"


PRIO = ("priority", "vllm-priority")
BASE = {"priority": "fcfs", "vllm-priority": "vllm-fcfs"}


def _hz(h: float | None) -> str:
    return "none" if h is None else f"{h:g}"


def _grid_order(k: tuple[float, float | None]) -> tuple[float, float]:
    return (k[0], math.inf if k[1] is None else k[1])


def choose_default(results: list[Result]) -> tuple[float, float | None, float] | None:
    """(aging, horizon, the worse variant's mean ratio) of the grid point the rule picks
    on Mooncake at its middle load (see MAX_RATIO); None without the sweep."""
    case = next(c for c in CASES if c.name == "mooncake")
    rows = [r for r in results if r.trace == case.name and r.load == case.loads[1]]
    base = {b: _find(rows, case.loads[1], "tier_aware", b) for b in BASE.values()}
    best: tuple[float, float | None, float] | None = None
    points = {(r.aging, r.horizon) for r in rows if r.policy == SWEPT and r.scheduler in PRIO}
    for ag, hz in sorted(points, key=_grid_order):
        worst = 0.0
        for sch in PRIO:
            r = next(
                (
                    r
                    for r in rows
                    if r.policy == SWEPT and (r.aging, r.horizon, r.scheduler) == (ag, hz, sch)
                ),
                None,
            )
            b = base[BASE[sch]]
            if r is None or b is None or r.max_s > MAX_RATIO * b.max_s or r.p99_s > b.p99_s:
                worst = math.inf
                break
            worst = max(worst, r.mean_s / b.mean_s)
        if worst < math.inf and (best is None or worst < best[2]):
            best = (ag, hz, worst)
    return best


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(CASES), figsize=(5 * len(CASES), 8), squeeze=False)
    for col, case in enumerate(CASES):
        mid = case.loads[1]
        rows = [r for r in results if r.trace == case.name and r.load == mid]
        for sch, style in (("priority", "-"), ("vllm-priority", "--")):  # fmt: skip
            b = _find(rows, mid, "tier_aware", BASE[sch])
            if b is None:
                continue
            for hz in HORIZONS:
                line = sorted(
                    (
                        r
                        for r in rows
                        if r.policy == SWEPT and r.scheduler == sch and r.horizon == hz
                    ),
                    key=lambda r: r.aging,
                )
                if not line:
                    continue
                xs = [max(r.aging, 0.01) for r in line]
                label = f"{sch}, horizon {_hz(hz)}"
                axes[0][col].plot(
                    xs, [r.mean_s / b.mean_s for r in line], style, marker="o", label=label
                )
                axes[1][col].plot(
                    xs, [r.max_s / b.max_s for r in line], style, marker="x", label=label
                )
        for row, what in ((0, "mean"), (1, "max")):
            ax = axes[row][col]
            ax.axhline(1.0, color="grey", lw=1)
            ax.set_xscale("log")
            ax.set_xlabel("aging (s of work forgiven per s waited; 0 drawn at 0.01)")
            ax.set_ylabel(f"{what} TTFT / FCFS tier_aware's")
            ax.set_title(f"{case.name}, load {mid:g}, {SWEPT}: {what}")
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def read_results(path: Path) -> list[Result]:
    """Rows written by an earlier run (`results.csv`), for `--merge`."""
    out = []
    kinds = {f.name: f.type for f in fields(Result) if f.name != "problems"}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            vals: dict[str, object] = {}
            for k, kind in kinds.items():
                v = row[k]
                if kind == "str":
                    vals[k] = v
                elif kind == "int":
                    vals[k] = int(v)
                else:
                    vals[k] = None if v == "" else float(v)
            out.append(Result(**vals))  # type: ignore[arg-type]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="docs/results/priority")
    p.add_argument("--quick", action="store_true", help="fewer sessions / half Mooncake")
    p.add_argument("--traces", default=",".join(c.name for c in CASES))
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--middle", action="store_true", help="only each trace's middle load")
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the other traces' rows of OUT/results.csv (a run split by --traces)",
    )
    a = p.parse_args(argv)
    wanted = set(a.traces.split(","))
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan: list[tuple[TraceCase, float, str, str, float, float | None]] = []
    for case in CASES:
        if case.name not in wanted:
            continue
        for x in case.loads:
            if a.middle and x != case.loads[1]:
                continue
            for peer in PEERS:
                for base in ("fcfs", "vllm-fcfs"):
                    plan.append((case, x, peer, base, DEFAULT_AGING, DEFAULT_HORIZON))
            for sch in SCHEDULERS:
                plan.append((case, x, "tier_aware", sch, DEFAULT_AGING, DEFAULT_HORIZON))
            for sch in ("priority", "vllm-priority"):
                plan.append((case, x, "prefix_affinity", sch, DEFAULT_AGING, DEFAULT_HORIZON))
                for v in (KEYED, JUMPS):
                    plan.append((case, x, "tier_aware" + v, sch, DEFAULT_AGING, DEFAULT_HORIZON))
                if x == case.loads[1]:
                    plan.append((case, x, LWF_REFERENCE, sch, 0.0, None))
        if not a.no_sweep:
            for ag in AGINGS:
                for hz in HORIZONS:
                    if (ag, hz) == (DEFAULT_AGING, DEFAULT_HORIZON) or (hz is not None and ag == 0):
                        continue
                    for sch in PRIO:
                        plan.append((case, case.loads[1], SWEPT, sch, ag, hz))
    results: list[Result] = []
    if a.merge and (out_dir / "results.csv").is_file():
        results = [r for r in read_results(out_dir / "results.csv") if r.trace not in wanted]
    kept = len(results)
    workloads: dict[str, Workload] = {}
    t0 = time.perf_counter()
    for n, (case, x, pol, sch, ag, hz) in enumerate(plan, 1):
        # (the rows kept by --merge were checked when they were run)
        if case.name not in workloads:
            workloads[case.name] = Workload(case, a.quick)
        r = run_one(workloads[case.name], x, pol, sch, ag, hz)
        results.append(r)
        el = time.perf_counter() - t0
        print(
            f"[{n}/{len(plan)} {el:5.0f}s, ~{el / n * (len(plan) - n):.0f}s left] {case.name} "
            f"load {x:g} {pol} {sch} aging {ag:g} horizon {_hz(hz)}: util {r.util:.0%} "
            f"{_fmt(r)}",
            flush=True,
        )
    with open(out_dir / "results.csv", "w", newline="") as f:
        fields = [k for k in asdict(results[0]) if k != "problems"]
        wr = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        wr.writeheader()
        for r in results:
            wr.writerow(asdict(r))
    text = tables(results)
    (out_dir / "tables.md").write_text(text)
    plot(results, out_dir / "aging_sweep.png")
    print(text)
    print(f"{len(plan)} runs in {time.perf_counter() - t0:.0f} s; wrote {out_dir}/")
    failed = [
        f"{r.trace} {r.scheduler} aging {r.aging:g} horizon {_hz(r.horizon)}: {p}"
        for r in results[kept:]
        for p in r.problems
    ]
    if failed:
        print("FAILED: runs that beat a strict bound (the model is wrong):", *failed, sep="\n  ")
        return 3
    for line in figure_lines(results[kept:]):
        print(line)
    print("self-check: every run's mean TTFT respects bound:alone over the same requests")
    return 0


def figure_lines(results: list[Result]) -> list[str]:
    """Per trace and load: tier_aware's mean TTFT under each scheduler over the best FCFS
    peer's (`fcfs` engine), as `figure:` lines."""
    out = []
    cells = sorted({(r.trace, r.load) for r in results})
    for trace, load in cells:
        rs = [r for r in results if (r.trace, r.load) == (trace, load) and r.aging == DEFAULT_AGING]
        peers = [r.mean_s for r in rs if r.policy in PEERS and r.scheduler == "fcfs"]
        if not peers:
            continue
        best = min(peers)
        for r in rs:
            if r.policy == "tier_aware":
                out.append(
                    f"figure: priority sim, tier_aware mean over the best FCFS peer / "
                    f"{trace} {load:g} {r.scheduler} = {r.mean_s / best:.3f} x"
                )
    return out


if __name__ == "__main__":
    sys.exit(main())
