"""`python -m simulations compare A/results.csv [B/results.csv]`: a policy against the best
peer per load, and (given two files) how that ratio moved between them.

Peers are every router in the table but Ramjet's candidate family (`tier_aware*`), its
incumbent (`prefix_affinity`), the oracles and the bounds: the other routers (SMG,
llm-d, Dynamo, production-stack) and the generic baselines (round robin, least loaded,
session hash). Two peer sets, as in `docs/results.md`: "exact" (peers given
exact residency, plus those that use none) and "real" (peers with the knowledge they
really have, plus those that use none). A ratio below 1 means the policy is better.
"""

from __future__ import annotations

import argparse
import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from simulations.summary import Row


@dataclass(frozen=True)
class PeerRatio:
    scale: float
    load: float
    utilization: float
    mode: str
    best_mean: str
    mean_ratio: float
    best_p99: str
    p99_ratio: float
    floor_ratio: float
    oracle_ratio: float


def read_rows(path: str | Path) -> list[Row]:
    kinds = {f.name: str(f.type) for f in fields(Row)}
    out = []
    with Path(path).open() as f:
        for rec in csv.DictReader(f):
            vals: dict[str, object] = {}
            for k, v in rec.items():
                if k not in kinds:
                    continue
                t = kinds[k]
                vals[k] = v if t == "str" else (int(v) if t == "int" else float(v))
            out.append(Row(**vals))  # type: ignore[arg-type]
    return out


def is_peer(name: str, mode: str) -> bool:
    if name.startswith(("tier_aware", "oracle", "bound:")) or name == "prefix_affinity":
        return False
    if ":" not in name:
        return True
    return name.endswith(":" + mode)


def peer_ratios(rows: Sequence[Row], policy: str = "tier_aware") -> list[PeerRatio]:
    out = []
    for scale in dict.fromkeys(r.rate_scale for r in rows):
        these = [r for r in rows if r.rate_scale == scale]
        mine = next((r for r in these if r.policy == policy), None)
        oracle = next((r for r in these if r.policy == "oracle"), None)
        if mine is None:
            continue
        for mode in ("exact", "real"):
            peers = [r for r in these if is_peer(r.policy, mode)]
            if not peers:
                continue
            bm = min(peers, key=lambda r: r.ttft_mean_s)
            bp = min(peers, key=lambda r: r.ttft_p99_s)
            out.append(
                PeerRatio(
                    scale,
                    mine.load,
                    mine.utilization,
                    mode,
                    bm.policy,
                    mine.ttft_mean_s / bm.ttft_mean_s,
                    bp.policy,
                    mine.ttft_p99_s / bp.ttft_p99_s,
                    mine.floor_ratio,
                    mine.ttft_mean_s / oracle.ttft_mean_s if oracle else math.nan,
                )
            )
    return out


def render(ratios: Sequence[PeerRatio], policy: str) -> str:
    lines = [
        f"| load | util | peers | best mean peer | {policy} / it | best p99 peer | "
        f"{policy} / it | prefill / floor | {policy} / oracle |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in ratios:
        load = f"x{p.scale:g}" if math.isnan(p.load) else f"{p.load:.0%}"
        lines.append(
            f"| {load} | {p.utilization:.0%} | {p.mode} | {p.best_mean} | {p.mean_ratio:.3f} | "
            f"{p.best_p99} | {p.p99_ratio:.3f} | {p.floor_ratio:.3f} | {p.oracle_ratio:.3f} |"
        )
    return "\n".join(lines)


def condensed(rows: Sequence[Row]) -> str:
    """One line per policy, one column per load: mean TTFT s / p99 TTFT s / prefill ÷
    floor; column headers give the rate scale, the load asked for and tier_aware's
    realised utilisation."""
    scales = list(dict.fromkeys(r.rate_scale for r in rows))
    policies = list(dict.fromkeys(r.policy for r in rows))
    cell = {(r.policy, r.rate_scale): r for r in rows}
    heads = []
    for sc in scales:
        ta = cell.get(("tier_aware", sc))
        load = next((r.load for r in rows if r.rate_scale == sc), math.nan)
        util = f", util {ta.utilization:.0%}" if ta is not None else ""
        asked = "" if math.isnan(load) else f"load {load:.0%}"
        heads.append(f"x{sc:g} ({asked}{util})" if asked else f"x{sc:g} ({util[2:]})")
    lines = ["| policy | " + " | ".join(heads) + " |", "|---|" + "---|" * len(scales)]
    for p in policies:
        cells = []
        for sc in scales:
            r = cell.get((p, sc))
            cells.append(
                "-"
                if r is None
                else f"{r.ttft_mean_s:.3g} / {r.ttft_p99_s:.3g} / {r.floor_ratio:.3f}"
            )
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(a: argparse.Namespace) -> int:
    if a.condensed:
        for path in a.results:
            print(f"{path}:\n{condensed(read_rows(path))}\n")
        return 0
    first = peer_ratios(read_rows(a.results[0]), a.policy)
    print(f"{a.results[0]}:\n{render(first, a.policy)}")
    if len(a.results) > 1:
        second = peer_ratios(read_rows(a.results[1]), a.policy)
        print(f"\n{a.results[1]}:\n{render(second, a.policy)}")
        print(
            f"\nmoved (second / first, {a.policy} vs best peer):\n"
            "| load | peers | mean ratio | p99 ratio |\n|---|---|---|---|"
        )
        for x, y in zip(first, second, strict=False):
            load = f"x{x.scale:g}" if math.isnan(x.load) else f"{x.load:.0%}"
            print(
                f"| {load} | {x.mode} | {x.mean_ratio:.3f} -> {y.mean_ratio:.3f} | "
                f"{x.p99_ratio:.3f} -> {y.p99_ratio:.3f} |"
            )
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", help="one or two results.csv files")
    p.add_argument("--policy", default="tier_aware")
    p.add_argument(
        "--condensed",
        action="store_true",
        help="print each file's condensed table (mean / p99 / prefill per floor) instead",
    )
