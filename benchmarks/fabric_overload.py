"""Where an overloaded open-loop cell's mean TTFT comes from: per engine and by job size.

    python benchmarks/fabric_overload.py [--load 0.8] [--fabric shared]

Mooncake (open loop, no jitter, the grid's one run) at `--load`. Rows: `tier_aware` on
the fabric and on the oracle's one cache (`oracle:tier_aware`), `oracle:least_work`,
SMG cache_aware run on one cache (`oracle:run:smg_cache_aware:exact`, the oracle row of
docs/results/fabric.md's Mooncake 80% cell) and on the fabric, and the probe
`ext:social:1` (`simulations.probes`: tier_aware pricing its own work by the later
arrivals of the engine it joins). For each: mean, p50 and p99 TTFT; per engine the
requests, their mean new (prefilled) tokens, floor work, busy time, mean wait and TTFT
and p99; then the mean TTFT of the smallest half, the 50-90th percentile and the largest
10% of requests by floor work, and the share of each sent to engine 0. Ratios are over
`tier_aware` on the fabric, same run. Ends with `self-check:` (every run served every
request, and the engines' busy time covers the floor's work).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ramjet.config import FleetStatsConfig  # noqa: E402
from ramjet.policy.base import RoutingPolicy  # noqa: E402
from simulations.__main__ import RunSetup, open_loop_scale  # noqa: E402
from simulations.bounds import floor  # noqa: E402
from simulations.fabric import FABRICS, Fabric  # noqa: E402
from simulations.lineup import ENTRANTS  # noqa: E402
from simulations.preset import engine_spec  # noqa: E402
from simulations.probes import BusyPeriod  # noqa: E402
from simulations.simulator import Knowledge  # noqa: E402
from simulations.workload import load_trace, scale_rate  # noqa: E402

TRACE = REPO.parent.parent / "shared" / "data" / "traces" / "mooncake" / "synthetic_trace.jsonl"
if not TRACE.exists():
    TRACE = Path("/work/shared/data/traces/mooncake/synthetic_trace.jsonl")


def pct(xs: Sequence[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * len(s)))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--load", type=float, default=0.8)
    p.add_argument("--fabric", choices=FABRICS, default="shared")
    p.add_argument("--trace", default=str(TRACE))
    a = p.parse_args(argv)
    reqs, block = load_trace(a.trace, seed=0)
    spec = engine_spec()
    fab = Fabric(a.fabric)
    fl = floor(reqs, spec.profile)
    scale = open_loop_scale(reqs, fl.work_s, a.load, 2)
    setup = RunSetup(
        scale_rate(reqs, scale), spec, scale, block, 2, fl, 2.0, a.load, FleetStatsConfig(), None,
        fab,
    )  # fmt: skip
    work = fl.work_s
    n = len(work)
    print(
        f"{Path(a.trace).name} load {a.load:g} (rate x{scale:g}), fabric {a.fabric}: {n} "
        f"requests, floor work {sum(work):.0f} s (p50 {pct(work, 0.5):.3f} s, p90 "
        f"{pct(work, 0.9):.3f} s, max {max(work):.2f} s)"
    )

    def entrant(name: str) -> tuple[RoutingPolicy, Knowledge]:
        e = ENTRANTS[name].on(spec).on_fabric(fab)
        return e.make(0), e.knowledge

    ta_know = entrant("tier_aware")[1]
    rows: list[tuple[str, RoutingPolicy, Knowledge, bool]] = [
        ("tier_aware", *entrant("tier_aware"), False),
        ("oracle:tier_aware", *entrant("tier_aware"), True),
        ("oracle:least_work", *entrant("oracle:least_work"), True),
        ("oracle:run:smg_cache_aware:exact", *entrant("smg_cache_aware:exact"), True),
        ("smg_cache_aware:exact", *entrant("smg_cache_aware:exact"), False),
        ("ext:social:1", BusyPeriod("ext:social:1", own=1.0), ta_know, False),
    ]
    bands = (
        ("smallest half", 0.0, pct(work, 0.5)),
        ("p50-p90", pct(work, 0.5), pct(work, 0.9)),
        ("largest 10%", pct(work, 0.9), float("inf")),
    )
    ok = True
    base: tuple[float, float] | None = None
    figs: list[str] = []
    for label, policy, knowledge, shared in rows:
        out = setup.simulation(policy, knowledge, shared).run()
        t = out.ttft
        ok &= len(t) == n and all(x >= 0 for x in t) and sum(out.busy_s) >= sum(work) * 0.999
        mean, p99 = statistics.fmean(t), pct(t, 0.99)
        base = base or (mean, p99)
        print(
            f"\n{label} ({'one cache' if shared else a.fabric}): mean {mean:.2f} s "
            f"({mean / base[0]:.3f}x), p50 {pct(t, 0.5):.2f} s, p99 {p99:.2f} s "
            f"({p99 / base[1]:.3f}x)"
        )
        figs.append(
            f"figure: fabric overload, mean TTFT over tier_aware / {label} = {mean / base[0]:.3f} x"
        )
        for e in range(2):
            idx = [i for i in range(n) if out.engine[i] == e]
            if not idx:
                print(f"  engine {e}: no requests")
                continue
            te = [t[i] for i in idx]
            print(
                f"  engine {e}: {len(idx)} requests, new tokens {statistics.fmean(out.new_tokens[i] for i in idx):.0f}, "
                f"floor work {sum(work[i] for i in idx):.0f} s, busy {out.busy_s[e]:.0f} s, "
                f"wait {statistics.fmean(out.wait[i] for i in idx):.2f} s, TTFT {statistics.fmean(te):.2f} s, "
                f"p99 {pct(te, 0.99):.2f} s"
            )  # fmt: skip
        for name, lo, hi in bands:
            idx = [i for i in range(n) if lo <= work[i] < hi]
            on0 = sum(out.engine[i] == 0 for i in idx) / len(idx)
            print(
                f"  {name:13s}: {len(idx)} requests, TTFT {statistics.fmean(t[i] for i in idx):.2f} s, "
                f"{on0:.0%} on engine 0"
            )  # fmt: skip
    print()
    print("\n".join(figs))
    print(
        f"self-check: {'ok' if ok else 'FAILED'}: every run served all {n} requests and "
        "its engines' busy time covers the floor's work"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
