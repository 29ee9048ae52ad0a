"""Islands against the shared fabric (issue 30): the simulator grid and its table.

    python benchmarks/fabric_grid.py run [--only NAME,...] [--seeds 0,1,2] [--fabric F]
    python benchmarks/fabric_grid.py run --one-cache only    # add the one-cache rows
    python benchmarks/fabric_grid.py table                   # the table (make bench)

`run` calls `python -m simulations run` once per (configuration, fabric, seed) and keeps
each run's `results.csv` under `docs/results/fabric/<config>_<fabric>_s<seed>/` (a run
whose CSV exists is skipped, so an interrupted grid resumes; `--redo` runs it again).
Every policy is also run and replayed on the oracle's one cache in every run
(`--one-cache every+replay`); `--one-cache only` adds just the runs on one cache
(`oracle:run:<policy>`) to runs made without them (`merge_one_cache`). Every run is
checked as `simulations run` checks it: no policy below the oracle or a strict bound
(exit 3, file `FAILED`).
`table` reads those CSVs and prints, per configuration and load, means over the seeds
present: tier_aware's mean TTFT over the oracle's (`oracle_of`: the routing on one
cache with the lowest mean over the seeds; the standard error of the per-seed ratios)
and over the mean of each seed's best one-cache row (the runs' `oracle` row, the earlier
definition, biased low), over its own routing on one cache (`oracle:tier_aware`), its
mean and p99 over the best peer's on the same fabric (the best of every peer row, exact
and real modes together), the same on islands, and tier_aware on the shared fabric over
the best peer on islands; then the issue's bars (within 5% of the oracle where
utilisation >= 40%; mean <= 1.02x and p99 <= 1.05x the best peer on the same fabric),
and a note where the oracle's routing itself misses the p99 bar. It ends with a
`self-check:` line: every run present for the seeds asked, no policy below the oracle
on the seeds' mean beyond their noise (`mean_violations`).
"""

from __future__ import annotations

import argparse
import csv
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from simulations.checks import SHARED, violations, with_oracle  # noqa: E402
from simulations.compare import read_rows  # noqa: E402
from simulations.report import markdown, write_csv  # noqa: E402

OUT = REPO / "docs" / "results" / "fabric"
TRACES = REPO.parent.parent / "shared" / "data" / "traces"
if not TRACES.exists():
    TRACES = Path("/work/shared/data/traces")
AGENT = TRACES / "agent"

PEERS = (
    "round_robin,least_loaded,session_hash,smg_cache_aware,smg_least_load,"
    "dynamo_kv,llmd_scorers,prodstack_prefix"
)
LINEUP = f"tier_aware,{PEERS},oracle:tier_aware,oracle:least_work,oracle:spread"
CLOSED_LOADS = "0.4,0.6,0.8,0.95"
UNCAL = "tier_aware:uncalibrated"
"""tier_aware with the router's online TTFT calibration off (`fleet_stats.calibrate`)."""
CANDIDATES = ("tier_aware", UNCAL)


@dataclass(frozen=True)
class Config:
    name: str
    trace: Path
    args: tuple[str, ...]
    seeds: tuple[int, ...] = (0, 1, 2)


def configs(sessions_swe: int, sessions_tau: int) -> list[Config]:
    swe = AGENT / "miniswe_interleaved_b64.jsonl"
    tau = AGENT / "taubench_raw_b64.jsonl"
    s_swe = ("--sessions", str(sessions_swe), "--load", CLOSED_LOADS)
    s_tau = ("--sessions", str(sessions_tau), "--load", CLOSED_LOADS)
    fan = ("--fanout", "3")
    one = (0,)
    return [
        Config("miniswe", swe, s_swe),
        Config("miniswe_fanout", swe, s_swe + fan),
        Config("taubench", tau, s_tau),
        Config("taubench_fanout", tau, s_tau + fan),
        Config(
            "mooncake",
            TRACES / "mooncake" / "synthetic_trace.jsonl",
            ("--load", "0.5,0.68,0.8"),
            one,
        ),
        Config(
            "miniswe_4engines",
            swe,
            ("--sessions", str(2 * sessions_swe), "--load", "0.6", "--engines", "4"),
        ),
        Config(
            "miniswe_8engines",
            swe,
            ("--sessions", str(4 * sessions_swe), "--load", "0.6", "--engines", "8"),
        ),
    ]


def run_dir(cfg: str, fabric: str, seed: int) -> Path:
    return OUT / f"{cfg}_{fabric}_s{seed}"


def cmd_run(a: argparse.Namespace) -> int:
    only = set(a.only.split(",")) if a.only else None
    bad = 0
    for c in configs(a.sessions_swe, a.sessions_tau):
        if only is not None and c.name not in only:
            continue
        seeds = c.seeds if a.seeds is None else tuple(int(s) for s in a.seeds.split(","))
        for seed in seeds:
            for fabric in ("islands", "shared"):
                if a.fabric is not None and fabric != a.fabric:
                    continue
                d = run_dir(c.name, fabric, seed)
                add = a.one_cache == "only"
                if add and not (d / "results.csv").exists():
                    print(f"error: {d} has no results to add one-cache rows to", file=sys.stderr)
                    return 2
                if add and one_cache_complete(d):
                    continue
                if not add and (d / "results.csv").exists() and not a.redo:
                    continue
                if not add:
                    (d / "FAILED").unlink(missing_ok=True)
                cmd = [sys.executable, "-m", "simulations", "run", "--trace", str(c.trace)]
                cmd += ["--policies", LINEUP, "--variant", UNCAL + '={"calibrate": false}']
                cmd += [*c.args, "--fabric", fabric, "--seed", str(seed)]
                out = Path(tempfile.mkdtemp(prefix="fabric-one-cache-")) if add else d
                cmd += ["--one-cache", a.one_cache, "--out", str(out), "--quiet", "--no-plot"]
                print(" ".join(cmd[1:]), flush=True)
                code = subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL).returncode
                if add and code == 0:
                    code = 3 if merge_one_cache(d, out / "results.csv") else 0
                    shutil.rmtree(out)
                if code == 3:
                    (d / "FAILED").write_text("a policy beats the oracle or a strict bound\n")
                    bad += 1
                elif code != 0:
                    print(f"error: exit {code}", file=sys.stderr)
                    return code
    return 1 if bad else 0


def one_cache_complete(d: Path) -> bool:
    """Whether the run in `d` has every policy's `oracle:run:` row at every load."""
    rows = read_rows(d / "results.csv")
    have = {(r.policy, r.rate_scale) for r in rows}
    return all(
        (SHARED + r.policy, r.rate_scale) in have
        for r in rows
        if is_peer(r.policy) or r.policy in CANDIDATES
    )


def merge_one_cache(d: Path, added: Path) -> bool:
    """Adds the `oracle:run:<policy>` rows of `added` (a `--one-cache only` run of the
    same configuration and seed) to `d`'s results: a row `d` already has must be equal
    (the simulator is deterministic), the `oracle` row of each load is taken again over
    all one-cache rows, `FAILED` is written or removed as `simulations run` decides
    (`violations`), and `table.md` gets the added rows. True where the run fails."""
    rows = read_rows(d / "results.csv")
    new = [r for r in read_rows(added) if r.policy.startswith(SHARED)]
    have = {(r.policy, r.rate_scale): r for r in rows}
    for r in new:
        old = have.get((r.policy, r.rate_scale))
        if old is not None and old.as_dict() != r.as_dict():
            raise RuntimeError(f"{d}: {r.policy} x{r.rate_scale:g} differs from the run's own")
    keys = {(r.policy, r.rate_scale) for r in new}
    kept = [r for r in rows if r.policy != "oracle" and (r.policy, r.rate_scale) not in keys]
    merged = with_oracle(kept + new)
    write_csv(merged, d / "results.csv")
    problems = violations(merged)
    if problems:
        (d / "FAILED").write_text("a policy beats the oracle or a strict bound\n")
    else:
        (d / "FAILED").unlink(missing_ok=True)
    md = [
        "\n## Every policy run on the oracle's one cache (`fabric_grid.py run --one-cache only`)\n"
    ]
    for scale in dict.fromkeys(r.rate_scale for r in new):
        these = [r for r in merged if r.rate_scale == scale]
        these = [r for r in these if r.policy.startswith(SHARED) or r.policy == "oracle"]
        md.append(f"\n### rate scale x{scale:g}\n\n{markdown(these)}\n")
    if problems:
        md.append(
            "\n### FAILED: a policy beats a bound\n\n" + "".join(f"- {p}\n" for p in problems)
        )
    else:
        md.append("\nWith these rows no policy beats the oracle or a strict bound.\n")
    with (d / "table.md").open("a") as f:
        f.write("".join(md))
    return bool(problems)


def is_peer(name: str) -> bool:
    return not name.startswith(("tier_aware", "oracle", "bound:")) and name != "prefix_affinity"


Cell = dict[str, tuple[float, float, float]]
"""policy → (mean TTFT, p99 TTFT, utilisation), means over seeds."""


Seeds = dict[float, dict[str, list[tuple[float, float, float]]]]
"""load → policy → per seed (mean TTFT, p99 TTFT, utilisation), in seed order."""


def load_seeds(name: str, fabric: str) -> tuple[Seeds, int, int]:
    """Per load, each policy's figures in every seed present, rows present in every seed
    only (`oracle:run:` and `oracle:as:` rows may not be); the number of seeds and of
    failed runs."""
    acc: Seeds = defaultdict(lambda: defaultdict(list))
    seeds = failed = 0
    for d in sorted(OUT.glob(f"{name}_{fabric}_s*")):
        if not (d / "results.csv").exists():
            continue
        seeds += 1
        failed += (d / "FAILED").exists()
        with (d / "results.csv").open() as f:
            for rec in csv.DictReader(f):
                load = float(rec["load"])
                acc[load][rec["policy"]].append(
                    (float(rec["ttft_mean_s"]), float(rec["ttft_p99_s"]), float(rec["utilization"]))
                )
    out: Seeds = {
        load: {p: vs for p, vs in pols.items() if len(vs) == seeds} for load, pols in acc.items()
    }
    return out, seeds, failed


def load_grid(name: str, fabric: str) -> tuple[dict[float, Cell], int, int]:
    """Per load: each policy's figures averaged over the seeds present (`load_seeds`);
    the number of seeds and of failed runs."""
    per_seed, seeds, failed = load_seeds(name, fabric)
    out: dict[float, Cell] = {}
    for load, pols in per_seed.items():
        out[load] = {
            p: (
                statistics.fmean(v[0] for v in vs),
                statistics.fmean(v[1] for v in vs),
                statistics.fmean(v[2] for v in vs),
            )
            for p, vs in pols.items()
        }
    return out, seeds, failed


ONE_CACHE = ("oracle:tier_aware", "oracle:least_work", "oracle:spread")
"""The oracle routings every run has; with them a cell's oracle takes every
`oracle:run:<policy>` and `oracle:as:<policy>` row present in all its seeds."""


def is_one_cache(name: str) -> bool:
    return name in ONE_CACHE or name.startswith(("oracle:run:", "oracle:as:"))


P99_BAR = 1.05
"""The issue's p99 bar: tier_aware's p99 at most this times the best peer's."""


def oracle_of(cell: Cell, max_p99: float = math.inf) -> tuple[str, float]:
    """The cell's oracle: the routing on one cache with the lowest mean TTFT over the
    seeds (each row's seed mean, rows present in every seed: `load_grid`). Not the mean
    of each seed's best row (the `oracle` row of a run): over 10-45 closed-loop rows
    that vary ±5-10% by seed, the per-seed minimum picks each seed's luckiest routing
    and lies below every routing's own mean. `max_p99`: only routings whose p99 (seed
    mean) is at most this."""
    rows = {p: v[0] for p, v in cell.items() if is_one_cache(p) and v[1] <= max_p99}
    name = min(rows, key=lambda p: rows[p])
    return name, rows[name]


def ratio_se(
    mine: Sequence[tuple[float, float, float]], of: Sequence[tuple[float, float, float]]
) -> float:
    """The standard error of the mean of the per-seed ratios of two rows' mean TTFT
    (NaN with one seed)."""
    ratios = [m[0] / o[0] for m, o in zip(mine, of, strict=True)]
    return statistics.stdev(ratios) / math.sqrt(len(ratios)) if len(ratios) > 1 else math.nan


def best(cell: Cell, k: int) -> tuple[str, float]:
    peers = {p: v for p, v in cell.items() if is_peer(p)}
    name = min(peers, key=lambda p: peers[p][k])
    return name, peers[name][k]


def cmd_table(a: argparse.Namespace) -> int:
    lines = [
        "| run | policy | load | util | seeds | TA/oracle ±SE (routing) | TA/per-seed min "
        "| TA/own routing on one cache "
        "| TA/best peer mean (peer) | TA/best p99 | "
        "oracle/best peer | islands: TA/oracle | islands: TA/best mean | islands: TA/best p99 "
        "| TA shared / best peer islands | bars |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    missing = failed_total = same = 0
    notes: list[str] = []
    figs: list[str] = []
    for c in configs(a.sessions_swe, a.sessions_tau):
        shared, n_sh, f_sh = load_grid(c.name, "shared")
        sh_seeds, _, _ = load_seeds(c.name, "shared")
        islands, n_is, f_is = load_grid(c.name, "islands")
        failed_total += f_sh + f_is
        if n_sh < len(c.seeds) or n_is < len(c.seeds):
            missing += 1
        for load, cand in ((x, p) for x in sorted(shared) for p in CANDIDATES):
            sh, isl = shared[load], islands.get(load)
            if cand not in sh or not any(is_one_cache(p) for p in sh):
                continue
            ta_m, ta_p, util = sh[cand]
            if (
                cand == UNCAL
                and (isl or {}).get(cand) == (isl or {}).get("tier_aware")
                and (sh[cand] == sh.get("tier_aware"))
            ):
                same += 1  # the calibration only fits, it does not decide: the same row
                continue
            or_name, oracle = oracle_of(sh)
            per_seed = sh["oracle"][0] if "oracle" in sh else math.nan
            peer_m, bm = best(sh, 0)
            _, bp = best(sh, 1)
            r_or, r_m, r_p = ta_m / oracle, ta_m / bm, ta_p / bp
            se = ratio_se(sh_seeds[load][cand], sh_seeds[load][or_name])
            r_se = "" if math.isnan(se) else f" ±{se:.3f}"
            if cand == "tier_aware" and sh[or_name][1] > P99_BAR * bp:
                fair = oracle_of(sh, max_p99=P99_BAR * bp)
                notes.append(
                    f"{c.name} {load:g}: the oracle ({or_name}) has p99 "
                    f"{sh[or_name][1] / bp:.3f}x the best peer's, past the p99 bar; the best "
                    f"one-cache routing within it is {fair[0]} (mean {fair[1]:.4g} s): "
                    f"TA/that {ta_m / fair[1]:.3f}"
                )
            own = sh.get("oracle:tier_aware")
            r_own = f"{ta_m / own[0]:.3f}" if own is not None else "-"
            bars = []
            if util >= 0.4:
                bars.append("oracle ok" if r_or <= 1.05 else "oracle MISSED")
            bars.append("peer mean ok" if r_m <= 1.02 else "peer mean MISSED")
            bars.append("p99 ok" if r_p <= P99_BAR else "p99 MISSED")
            if isl is not None and cand in isl:
                i_m, i_p, _ = isl[cand]
                _, ibm = best(isl, 0)
                _, ibp = best(isl, 1)
                islands_cols = (
                    f"{i_m / oracle_of(isl)[1]:.3f} | {i_m / ibm:.3f} | {i_p / ibp:.3f} "
                    f"| {ta_m / ibm:.3f}"
                )
            else:
                islands_cols = "- | - | - | -"
            if cand == "tier_aware":
                figs.append(
                    f"figure: fabric grid, TA over the oracle / {c.name} {load:g} = {r_or:.3f} x"
                )
            lines.append(
                f"| {c.name} | {'uncal.' if cand == UNCAL else 'default'} | {load:g} | {util:.0%} | {n_sh} | {r_or:.3f}{r_se} ({or_name.removeprefix('oracle:')}) | {ta_m / per_seed:.3f} | {r_own} | {r_m:.3f} ({peer_m}) "
                f"| {r_p:.3f} | {oracle / bm:.3f} | {islands_cols} | {', '.join(bars)} |"
            )
    print("\n".join(lines))
    for n in notes:
        print(f"\n{n}")
    if same:
        print(f"\n({same} uncal. rows equal to their default row on both fabrics: not shown)")
    beaten = mean_violations(a.sessions_swe, a.sessions_tau)
    for b in beaten:
        print(f"below the oracle on the seeds' mean: {b}")
    ok = missing == 0 and not beaten
    print()
    print("\n".join(figs))
    print(
        f"\nself-check: {'ok' if ok else 'FAILED'}: {missing} configurations short of their "
        f"seeds; {len(beaten)} policies below the oracle's mean TTFT on the seeds' mean "
        f"({failed_total} single runs had a policy below it: closed-loop seed noise)"
    )
    return 0 if ok else 1


SEED_NOISE = 0.01
"""How far a single run's mean may fall below the oracle's (a configuration with one
seed: Mooncake) before it counts as below it."""
NOISE_SE = 2.0
"""With several seeds, a policy counts as below the oracle only where the mean of its
per-seed ratios to the oracle's routing, plus this many standard errors of that mean,
is still below 1. A closed-loop oracle is the best routing on one cache, not a bound by
construction: on the shared fabric at 40% the pool costs tier_aware nothing measurable
(1.000 +- 0.009 of its own routing on one cache over 8 seeds, `fabric_seeds.py`), so
its seed mean lands on either side of that routing's by the seeds' noise."""


def mean_violations(sessions_swe: int = 100, sessions_tau: int = 100) -> list[str]:
    """Per configuration, fabric and load: every policy whose mean TTFT averaged over the
    seeds is below the oracle's (`oracle_of`: the best one-cache routing's seed mean)
    beyond the seeds' noise: in every seed its mean over the oracle routing's, the mean
    of those ratios plus `NOISE_SE` standard errors below 1 (one seed: below by more
    than `SEED_NOISE`)."""
    out = []
    for c in configs(sessions_swe, sessions_tau):
        for fabric in ("islands", "shared"):
            per_seed, n, _ = load_seeds(c.name, fabric)
            grid, _, _ = load_grid(c.name, fabric)
            for load, cell in sorted(grid.items()):
                if not any(is_one_cache(p) for p in cell):
                    continue
                routing, oracle = oracle_of(cell)
                for p, (m, _, _) in cell.items():
                    if p.startswith(("oracle", "bound:")) or m >= oracle:
                        continue
                    mine, of = per_seed[load][p], per_seed[load][routing]
                    ratio = statistics.fmean(x[0] / o[0] for x, o in zip(mine, of, strict=True))
                    if n >= 2:
                        se = ratio_se(mine, of)
                        below = ratio + NOISE_SE * se < 1
                        why = f"per-seed ratio {ratio:.3f} +- {se:.3f}"
                    else:
                        below, why = m < oracle * (1 - SEED_NOISE), "one seed"
                    if below:
                        out.append(
                            f"{c.name} {fabric} load {load:g}: {p} {m:.4f} s < {oracle:.4f} s "
                            f"({routing}; {why})"
                        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, fn in (("run", cmd_run), ("table", cmd_table)):
        s = sub.add_parser(name)
        s.add_argument("--sessions-swe", type=int, default=100)
        s.add_argument("--sessions-tau", type=int, default=100)
        s.set_defaults(fn=fn)
        if name == "run":
            s.add_argument("--only", help="comma list of configuration names")
            s.add_argument("--seeds", help="comma list of seeds (default: each config's)")
            s.add_argument("--fabric", choices=("islands", "shared"), help="one fabric only")
            s.add_argument(
                "--one-cache",
                default="every+replay",
                help="`simulations run --one-cache`: every routing run and replayed on "
                "the oracle's one cache in every seed (the table's oracle needs them)",
            )
            s.add_argument("--redo", action="store_true", help="re-run runs already present")
    a = p.parse_args(argv)
    code: int = a.fn(a)
    return code


if __name__ == "__main__":
    sys.exit(main())
