"""`python -m simulations run|plan`.

run: replay a trace through the engine pair under each named policy at each load, print
a table per load, write `results.csv`, `table.md` and `ttft_vs_load.png` to --out.
plan: the capacity planner (`simulations.plan`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from simulations import plan as planner
from simulations.bounds import floor, srpt_merged
from simulations.lineup import ENTRANTS, resolve
from simulations.preset import PRESETS, engine_spec
from simulations.report import markdown, plot, table, write_csv
from simulations.simulator import Simulation
from simulations.summary import Row, bound_row, summarize
from simulations.workload import TraceError, load_trace, replicate, scale_rate


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


def cmd_run(a: argparse.Namespace) -> int:
    try:
        entrants = resolve(a.policies)
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
        )
    except (ValueError, TraceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if a.limit:
        reqs = reqs[: a.limit]
    if a.replicate > 1:
        reqs = replicate(reqs, a.replicate, block, a.seed)
    fl = floor(reqs, spec.profile)
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    if a.load:
        # offered load relative to the floor's work: floor seconds / (engines · span / scale)
        scales = [round(x * a.engines * span / sum(fl.work_s), 4) for x in a.load]
    else:
        scales = a.rate_scale
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"trace {a.trace}: {len(reqs)} requests over {span:.0f} s, block {block} tokens; "
        f"floor {fl.tokens / 1e6:.2f} M prefill tokens ({sum(fl.work_s):.0f} s of work); "
        f"scheduler {spec.scheduler}; engines {a.engines}"
    )
    progress = Progress(len(entrants) * len(scales) * len(reqs), not a.quiet)
    rows: list[Row] = []
    t0 = time.perf_counter()
    for scale in scales:
        scaled = scale_rate(reqs, scale)
        for ent in entrants:
            progress.label = f"{ent.name} x{scale:g}"
            sim = Simulation(
                scaled,
                spec,
                ent.make(a.seed),
                block_tokens=block,
                engines=a.engines,
                knowledge=ent.knowledge,
                shared_cache=ent.shared_cache,
                progress=progress,
            )
            rows.append(summarize(ent.name, scale, scaled, sim.run(), fl.tokens, a.ttft_target_s))
        rows.append(bound_row("bound:alone", scale, fl.work_s, fl.tokens, a.ttft_target_s))
        rows.append(
            bound_row(
                "bound:srpt_merged_2x",
                scale,
                srpt_merged(scaled, fl.work_s),
                fl.tokens,
                a.ttft_target_s,
            )
        )
    progress.close()
    elapsed = time.perf_counter() - t0
    md = [f"trace `{a.trace}`, {len(reqs)} requests, TTFT target {a.ttft_target_s:g} s\n"]
    for scale in scales:
        these = [r for r in rows if r.rate_scale == scale]
        print()
        print(table(these, f"rate scale x{scale:g}"))
        md.append(f"\n### rate scale x{scale:g}\n\n{markdown(these)}\n")
    write_csv(rows, out_dir / "results.csv")
    (out_dir / "table.md").write_text("".join(md))
    if not a.no_plot:
        plot(rows, out_dir / "ttft_vs_load.png", f"{Path(a.trace).name}: TTFT vs load")
    runs = len(entrants) * len(scales)
    print(
        f"\n{runs} runs of {len(reqs)} requests in {elapsed:.1f} s ({elapsed / runs:.2f} s per run); wrote {out_dir}/"
    )
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
    r.add_argument("--engines", type=int, default=2)
    r.add_argument("--scheduler", choices=("fcfs", "priority"), default="fcfs")
    r.add_argument("--aging", type=float, help="priority hint aging (s of work per s waited)")
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
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--no-plot", action="store_true")
    r.add_argument("--quiet", action="store_true")
    r.set_defaults(handler=cmd_run)
    pl = sub.add_parser("plan", help="capacity planner for the target deployment")
    planner.add_arguments(pl)
    pl.set_defaults(handler=planner.main)
    args = p.parse_args(argv)
    code: int = args.handler(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
