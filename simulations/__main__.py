"""`python -m simulations run|plan`.

run: replay a trace through the engine pair under each named policy at each load, print
a table per load, write `results.csv`, `table.md` and `ttft_vs_load.png` to --out.
plan: the capacity planner (`simulations.plan`).

Traces with sessions and turns (the agent traces) replay closed-loop by default
(`simulations.sessions`); the others open-loop. The run fails (exit 3) when a policy
beats the oracle or a strict bound (`simulations.checks`).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from ramjet.config import FleetStatsConfig, PolicyFileError, load_policy
from ramjet.policy.base import RoutingPolicy
from simulations import compare
from simulations import plan as planner
from simulations.bounds import Floor, floor, srpt_merged
from simulations.breakdown import breakdown
from simulations.checks import (
    REPLAY,
    SHARED,
    Replay,
    beaten,
    saturated,
    violations,
    with_oracle,
)
from simulations.fabric import FABRICS, ISLANDS, Fabric
from simulations.lineup import ENTRANTS, resolve, variant
from simulations.preset import PRESETS, EngineSpec, engine_spec
from simulations.report import markdown, plot, table, write_csv
from simulations.sessions import ClosedLoop, SessionPlan, closed_loop_plan, scale_for_load, scaled
from simulations.simulator import Knowledge, Outcome, Simulation
from simulations.summary import Row, bound_row, summarize
from simulations.workload import Request, TraceError, load_trace, replicate, scale_rate


class Progress:
    """A one-line progress bar on stderr (requests simulated of the total)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = max(total, 1), 0, enabled
        self.t0 = time.perf_counter()
        self.label = ""

    def __call__(self, n: int) -> None:
        before = self.done * 100 // self.total
        self.done += n
        if not self.enabled or self.done * 100 // self.total == before:
            return
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(frac * 30)
        elapsed = time.perf_counter() - self.t0
        sys.stderr.write(f"\r[{bar:<30}] {frac:4.0%} {elapsed:6.1f}s {self.label:<28}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def _horizon(text: str) -> float:
    """A horizon in seconds (> 0), or 'none': no cap (infinite, `hint_key_s`)."""
    if text.strip().lower() == "none":
        return math.inf
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds or 'none'") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"horizon must be > 0 s (or 'none'), got {text}")
    return v


def _floats(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError("expected positive numbers")
    return vals


def closed_loop_wanted(mode: str, reqs: list[Request]) -> bool:
    """auto: closed loop when every request has a session and a turn (agent traces)."""
    if mode == "auto":
        return bool(reqs) and all(r.session is not None and r.turn is not None for r in reqs)
    return mode == "on"


def open_loop_scale(
    reqs: list[Request], work_s: Sequence[float], load: float, engines: int
) -> float:
    """The rate scale (4 decimals) at which open-loop arrivals offer `load` relative to
    the floor's work: floor seconds / (engines · span / scale)."""
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    return round(load * engines * span / sum(work_s), 4)


@dataclass(frozen=True, slots=True)
class RunSetup:
    """What every run at one load shares: the requests (scaled), the engines, the floor,
    the TTFT target and the router's time constants (`run_row`, `checked_rows`,
    `simulations.probes`)."""

    requests: list[Request]
    spec: EngineSpec
    scale: float
    block_tokens: int
    engines: int
    floor_: Floor
    ttft_target_s: float
    load: float
    fleet_stats: FleetStatsConfig
    loop: ClosedLoop | None
    fabric: Fabric = ISLANDS

    def simulation(
        self,
        policy: RoutingPolicy,
        knowledge: Knowledge,
        shared_cache: bool,
        progress: Progress | None = None,
        calibrate: bool | None = None,
    ) -> Simulation:
        """`calibrate`: overrides `fleet_stats.calibrate` (None: as configured)."""
        fleet = self.fleet_stats
        if calibrate is not None:
            fleet = fleet.model_copy(update={"calibrate": calibrate})
        return Simulation(
            self.requests,
            self.spec,
            policy,
            block_tokens=self.block_tokens,
            engines=self.engines,
            knowledge=knowledge,
            shared_cache=shared_cache,
            progress=progress,
            fleet_stats=fleet,
            loop=self.loop,
            fabric=self.fabric,
        )

    def row(self, label: str, out: Outcome) -> Row:
        """`out` summarised as row `label`."""
        fl = self.floor_
        return summarize(
            label, self.scale, self.requests, out, fl.tokens, self.ttft_target_s, self.load,
            fl.work_s,
        )  # fmt: skip


def run_row(
    label: str,
    policy: RoutingPolicy,
    setup: RunSetup,
    *,
    shared_cache: bool,
    knowledge: Knowledge,
    progress: Progress | None = None,
    calibrate: bool | None = None,
) -> Row:
    """One run of `policy` over `setup`'s requests, summarised as row `label` (the bound
    and replay rows of `checked_rows`, `simulations.probes --cross`)."""
    sim = setup.simulation(policy, knowledge, shared_cache, progress, calibrate)
    return setup.row(label, sim.run())


def checked_rows(
    rows: list[Row],
    setup: RunSetup,
    *,
    decisions: dict[str, list[int]],
    progress: Progress | None = None,
    policies: Mapping[str, tuple[Callable[[], RoutingPolicy], Knowledge]] | None = None,
    calibrate: Mapping[str, bool | None] | None = None,
    one_cache: str = "beaten",
) -> list[Row]:
    """The rows that bound `rows` at `setup.scale`: each policy that beats every oracle
    routing replayed on one shared cache (its own decisions: the oracle must bound it
    too) and, where `policies` can build it (a maker and the knowledge it runs with),
    also run itself on the shared cache (`oracle:run:<policy>`: in closed loop the
    replay's arrivals are not the policy's, and the policy reacting to the shared cache
    can be faster); then `bound:alone`, and for open-loop arrivals `bound:srpt_merged_2x`.
    `decisions`: each policy's chosen engine per request at this scale. `one_cache`
    (`ONE_CACHE`): "beaten" runs and replays on the shared cache only the policies that
    beat every oracle routing, as above; "every" also runs every policy `policies` can
    build on it (`oracle:run:<policy>` in every run, so that a routing's one-cache mean
    can be averaged over seeds without selecting the seeds where it was lucky);
    "every+replay" replays every policy's decisions on it as well. With
    `with_oracle` and `violations` this is the check every results table passes
    (`simulations run`, `simulations.probes`)."""
    out: list[Row] = []
    scale, fl = setup.scale, setup.floor_

    def shared_run(
        label: str, policy: RoutingPolicy, knowledge: Knowledge, cal: bool | None = None
    ) -> Row:
        if progress is not None:
            progress.label = f"{label} x{scale:g}"
        return run_row(
            label,
            policy,
            setup,
            shared_cache=True,
            knowledge=knowledge,
            progress=progress,
            calibrate=cal,
        )

    if one_cache not in ONE_CACHE:
        raise ValueError(f"one_cache must be one of {', '.join(ONE_CACHE)}, got {one_cache!r}")
    below = beaten(rows, scale)  # a policy below every oracle: run it shared
    every = one_cache != "beaten"
    routings = [n for n in decisions if not n.startswith(("oracle", "bound:"))]
    run_names = routings if every else below
    replay_names = routings if one_cache == "every+replay" else below
    for name in dict.fromkeys(below if not every else [*routings, *below]):
        if name in run_names and policies is not None and name in policies:
            make, knowledge = policies[name]
            cal = calibrate.get(name) if calibrate is not None else None
            out.append(shared_run(SHARED + name, make(), knowledge, cal))
        if name in replay_names:
            out.append(shared_run(REPLAY + name, Replay(name, decisions[name]), Knowledge()))
    target, load = setup.ttft_target_s, setup.load
    out.append(bound_row("bound:alone", scale, fl.work_s, fl.tokens, target, load))
    if setup.loop is None:  # SRPT over fixed arrivals: no bound when arrivals depend on service
        srpt = srpt_merged(setup.requests, fl.work_s)
        out.append(bound_row("bound:srpt_merged_2x", scale, srpt, fl.tokens, target, load))
    return out


ONE_CACHE = ("beaten", "every", "every+replay")
"""`simulations run --one-cache`: which policies also run on the oracle's one cache
(`checked_rows`)."""


def fabric_of(a: argparse.Namespace) -> Fabric:
    """The `--fabric` flags as a `Fabric` (a ValueError on a bad figure)."""

    def scaled(v: float | None, k: float) -> float | None:
        return None if v is None else v * k

    return Fabric(
        a.fabric,
        host_pool_tokens=a.pool_host_tokens,
        ssd_pool_tokens=a.pool_ssd_tokens,
        swa_pool_sequences=a.pool_swa_sequences,
        host_bytes_per_s=scaled(a.pool_host_gbps, 1e9),
        host_latency_s=scaled(a.pool_host_latency_ms, 1e-3),
        ssd_bytes_per_s=scaled(a.pool_ssd_gbps, 1e9),
        ssd_latency_s=scaled(a.pool_ssd_latency_ms, 1e-3),
        write_bytes_per_s=a.pool_write_gbps * 1e9,
        write_through=a.write_through == "on",
        swa_local=a.pool_swa_local == "on",
    )


def fabric_text(f: Fabric) -> str:
    if not f.shared:
        return "islands (host, SSD and SWA pool per engine)"

    def gb(v: float | None) -> str:
        return "profile's" if v is None else f"{v / 1e9:g} GB/s"

    return (
        f"shared (host pool {gb(f.host_bytes_per_s)}, SSD pool {gb(f.ssd_bytes_per_s)}, "
        f"write-through {'on' if f.write_through else 'off'} at {gb(f.write_bytes_per_s)}, "
        f"SWA state {'free where stored' if f.swa_local else 'pulled on every resume'}; "
        "FIFO link per pool)"
    )


def cmd_run(a: argparse.Namespace) -> int:
    try:
        entrants = resolve(a.policies) + [variant(v) for v in a.variant]
        reqs, block = load_trace(
            a.trace, block_tokens=a.block_tokens, jitter_s=a.jitter_s, seed=a.seed
        )
        spec = engine_spec(
            None if a.profile else a.preset,
            a.profile,
            bytes_per_token=a.bytes_per_token,
            scheduler=a.scheduler,
            swa_ttl_s=a.swa_ttl_s,
            chunk_tokens=a.chunk_tokens,
            hbm_tokens=a.hbm_tokens,
            host_tokens=a.host_tokens,
            ssd_tokens=a.ssd_tokens,
            aging=a.aging,
            horizon_s=a.horizon,
        )
        fabric = fabric_of(a)
        if a.engines < 1:
            raise ValueError(f"--engines must be >= 1, got {a.engines}")
        # as configured for these engines, and as each behaves on the fabric
        entrants = [e.on(spec).on_fabric(fabric) for e in entrants]
        if a.one_cache == "only":  # each policy on the oracle's one cache, nothing else
            entrants = [
                replace(e, name=SHARED + e.name, shared_cache=True)
                for e in entrants
                if not e.shared_cache
            ]
        fleet_cfg = load_policy(a.policy_file).fleet_stats if a.policy_file else FleetStatsConfig()
        closed = closed_loop_wanted(a.closed_loop, reqs)
        if a.limit:
            reqs = reqs[: a.limit]
        plan: SessionPlan | None = None
        if closed:
            sessions = a.sessions or len({r.session for r in reqs}) * a.replicate
            plan = closed_loop_plan(
                reqs,
                block,
                sessions=sessions,
                fanout=a.fanout,
                fanout_share=a.fanout_share,
                seed=a.seed,
            )
            reqs = plan.requests
        elif a.replicate > 1:
            reqs = replicate(reqs, a.replicate, block, a.seed)
        elif a.fanout > 1:
            raise ValueError("--fanout needs closed-loop replay (a trace with sessions and turns)")
        fl = floor(reqs, spec.profile)
        if plan is not None:
            loads = a.load or [math.nan] * len(a.rate_scale)
            scales = (
                [round(scale_for_load(plan, fl.work_s, x, a.engines), 4) for x in a.load]
                if a.load
                else a.rate_scale
            )
        else:
            loads = a.load or [math.nan] * len(a.rate_scale)
            scales = (
                [open_loop_scale(reqs, fl.work_s, x, a.engines) for x in a.load]
                if a.load
                else a.rate_scale
            )
    except (ValueError, TraceError, PolicyFileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if plan is not None:
        replay = (
            f"closed-loop replay: {plan.sessions} sessions, first turns at trace times "
            f"x scale, think time {plan.think.describe()}; fan-out "
            + (
                f"{a.fanout} siblings on {a.fanout_share:.0%} of later turns"
                if a.fanout > 1
                else "off"
            )
        )
        span_text = f"{plan.sessions * plan.period_s:.0f} s of session starts (unscaled)"
    else:
        replay = "open-loop replay: every request at its trace time x scale"
        span_text = f"{reqs[-1].arrival_s - reqs[0].arrival_s:.0f} s"
    print(
        f"trace {a.trace}: {len(reqs)} requests over {span_text}, block {block} tokens; "
        f"floor {fl.tokens / 1e6:.2f} M prefill tokens ({sum(fl.work_s):.0f} s of work); "
        f"scheduler {spec.scheduler}; engines {a.engines}; fabric {fabric_text(fabric)}\n{replay}"
    )
    progress = Progress(len(entrants) * len(scales) * len(reqs), not a.quiet)
    rows: list[Row] = []
    decisions: dict[tuple[str, float], list[int]] = {}
    t0 = time.perf_counter()
    for scale, load in zip(scales, loads, strict=True):
        run_reqs = scaled(plan, scale) if plan is not None else scale_rate(reqs, scale)
        setup = RunSetup(
            run_reqs, spec, scale, block, a.engines, fl, a.ttft_target_s, load, fleet_cfg,
            plan.loop if plan is not None else None, fabric,
        )  # fmt: skip
        for ent in entrants:
            progress.label = f"{ent.name} x{scale:g}"
            sim = setup.simulation(
                ent.make(a.seed), ent.knowledge, ent.shared_cache, progress, ent.calibrate
            )
            out = sim.run()
            decisions[(ent.name, scale)] = out.engine
            if a.breakdown:
                print(f"\n{ent.name} x{scale:g}: {breakdown(out, sim.loop).line()}", flush=True)
            rows.append(setup.row(ent.name, out))
        rows += checked_rows(
            rows,
            setup,
            decisions={n: d for (n, x), d in decisions.items() if x == scale},
            progress=progress,
            policies={
                e.name: (partial(e.make, a.seed), e.knowledge)
                for e in entrants
                if not e.shared_cache
            },
            calibrate={e.name: e.calibrate for e in entrants},
            one_cache="beaten" if a.one_cache == "only" else a.one_cache,
        )
    progress.close()
    rows = with_oracle(rows)
    elapsed = time.perf_counter() - t0
    md = [
        f"trace `{a.trace}`, {len(reqs)} requests, TTFT target {a.ttft_target_s:g} s\n\n{replay}\n"
    ]
    if fabric.shared:
        md.append(f"\n{a.engines} engines, fabric {fabric_text(fabric)}\n")
    for scale, load in zip(scales, loads, strict=True):
        these = [r for r in rows if r.rate_scale == scale]
        title = f"rate scale x{scale:g}" + ("" if math.isnan(load) else f" (load {load:g})")
        print()
        print(table(these, title))
        md.append(f"\n### {title}\n\n{markdown(these)}\n")
    problems = violations(rows)
    full = saturated(rows)
    if full:
        note = ", ".join(f"x{x:g}" for x in full)
        md.append(
            f"\n### Saturated: {note}\n\nEven the oracle keeps the engines busy 99% of the "
            "time: no steady state, no bound checked there.\n"
        )
        print(f"saturated (no steady state, not checked): {note}", file=sys.stderr)
    if problems:
        md.append(
            "\n### FAILED: a policy beats a bound\n\n" + "".join(f"- {p}\n" for p in problems)
        )
    write_csv(rows, out_dir / "results.csv")
    (out_dir / "table.md").write_text("".join(md))
    if not a.no_plot:
        plot(rows, out_dir / "ttft_vs_load.png", f"{Path(a.trace).name}: TTFT vs load")
    runs = len(entrants) * len(scales)
    print(
        f"\n{runs} runs of {len(reqs)} requests in {elapsed:.1f} s ({elapsed / runs:.2f} s per run); wrote {out_dir}/"
    )
    if problems:
        print("FAILED: a policy beats the oracle or a strict bound:", file=sys.stderr)
        for p in problems:
            print(f"  {p}", file=sys.stderr)
        return 3
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m simulations", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="replay a trace under several policies and loads")
    r.add_argument("--trace", required=True)
    r.add_argument(
        "--policies", default="all", help=f"'all' or a comma list of: {', '.join(ENTRANTS)}"
    )
    g = r.add_mutually_exclusive_group()
    g.add_argument(
        "--rate-scale", type=_floats, default=[0.5, 1.0, 2.0], help="arrival-rate multipliers"
    )
    g.add_argument(
        "--load", type=_floats, help="offered loads relative to the floor's work, e.g. 0.4,0.7,0.95"
    )
    r.add_argument("--out", default="sim-out")
    r.add_argument("--preset", default=PRESETS[0], choices=PRESETS)
    r.add_argument(
        "--profile", help="an EngineProfile JSON (the reference engine's profiler output)"
    )
    r.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="an extra tier_aware row with these params (ablation), e.g. "
        "'tier_aware:x0.5={\"externality_scale\": 0.5}'; repeatable",
    )
    r.add_argument(
        "--breakdown",
        action="store_true",
        help="print per run: wait vs service, moved later turns, per-engine wait gap",
    )
    r.add_argument("--engines", type=int, default=2)
    r.add_argument(
        "--fabric",
        choices=FABRICS,
        default="islands",
        help="islands: host, SSD and SWA pool per engine; shared: one host pool, SSD pool "
        "and SWA pool for all engines, HBM per engine (simulations.fabric)",
    )
    r.add_argument(
        "--pool-host-tokens", type=int, help="shared host pool (default: engines x host tier)"
    )
    r.add_argument(
        "--pool-ssd-tokens", type=int, help="shared SSD pool (default: engines x SSD tier)"
    )
    r.add_argument(
        "--pool-swa-sequences", type=int, help="shared SWA pool (default: engines x SWA pool)"
    )
    r.add_argument(
        "--pool-host-gbps", type=float, help="host pool link GB/s (default: profile's host tier)"
    )
    r.add_argument("--pool-host-latency-ms", type=float, help="per pull (default: profile's)")
    r.add_argument(
        "--pool-ssd-gbps", type=float, help="SSD pool link GB/s (default: profile's ssd tier)"
    )
    r.add_argument("--pool-ssd-latency-ms", type=float, help="per pull (default: profile's)")
    r.add_argument(
        "--pool-write-gbps",
        type=float,
        default=12.5,
        help="write-through bandwidth into the host pool, GB/s",
    )
    r.add_argument(
        "--write-through",
        choices=("on", "off"),
        default="on",
        help="shared fabric: publish computed blocks to the pool at once (off: by demotion)",
    )
    r.add_argument(
        "--pool-swa-local",
        choices=("on", "off"),
        default="on",
        help="shared fabric: the engine that stored a session's SWA state resumes it free "
        "(off: every SWA resume pulls it from the pool)",
    )
    r.add_argument(
        "--scheduler", choices=("fcfs", "priority", "vllm-fcfs", "vllm-priority"), default="fcfs"
    )
    r.add_argument("--aging", type=float, help="priority hint aging (s of work per s waited)")
    r.add_argument(
        "--horizon",
        type=_horizon,
        help="priority hint horizon (s, or 'none' for no cap): no request is overtaken by "
        "one that arrived more than this after it (default: the router's)",
    )
    r.add_argument("--swa-ttl-s", type=float)
    r.add_argument("--chunk-tokens", type=int)
    r.add_argument("--hbm-tokens", type=int)
    r.add_argument("--host-tokens", type=int)
    r.add_argument("--ssd-tokens", type=int)
    r.add_argument(
        "--bytes-per-token", type=float, help="rescale KV size (and tier capacities in tokens)"
    )
    r.add_argument("--block-tokens", type=int, help="override the trace's block size")
    r.add_argument(
        "--jitter-s", type=float, default=0.0, help="spread arrivals within buckets of this many s"
    )
    r.add_argument("--ttft-target-s", type=float, default=2.0)
    r.add_argument(
        "--replicate",
        type=int,
        default=1,
        help="overlay N copies of a session trace (closed-loop load)",
    )
    r.add_argument("--limit", type=int, default=0, help="first N requests only")
    r.add_argument(
        "--closed-loop",
        choices=("auto", "on", "off"),
        default="auto",
        help="session replay: a turn is sent a think time after the previous one ended "
        "(auto: when every request has session_id and turn)",
    )
    r.add_argument(
        "--sessions",
        type=int,
        default=0,
        help="closed loop: sessions in the run (default: the trace's x --replicate)",
    )
    r.add_argument(
        "--fanout", type=int, default=1, help="closed loop: split a turn into K siblings"
    )
    r.add_argument(
        "--fanout-share",
        type=float,
        default=0.25,
        help="closed loop: share of later turns that fan out",
    )
    r.add_argument(
        "--policy-file", help="take the fleet estimators' time constants from this policy file"
    )
    r.add_argument(
        "--one-cache",
        choices=(*ONE_CACHE, "only"),
        default="beaten",
        help="which policies also run on the oracle's one cache: beaten (those that beat "
        "every oracle routing, run and replayed: oracle:run:, oracle:as:), every (every "
        "policy run on it in every run; replays where beaten), every+replay (and every "
        "replay), only (just each policy run on it, rows oracle:run:<policy>: to add them "
        "to an earlier run's results, benchmarks/fabric_grid.py)",
    )
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--no-plot", action="store_true")
    r.add_argument("--quiet", action="store_true")
    r.set_defaults(handler=cmd_run)
    cp = sub.add_parser("compare", help="a policy against the best peer per load")
    compare.add_arguments(cp)
    cp.set_defaults(handler=compare.main)
    pl = sub.add_parser("plan", help="capacity planner for the target deployment")
    planner.add_arguments(pl)
    pl.set_defaults(handler=planner.main)
    args = p.parse_args(argv)
    code: int = args.handler(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
