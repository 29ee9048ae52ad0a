"""`ramjet report LOG [LOG...] [--rotated] [--plot PNG] [--warmup N]`: the promotion
summary of a decision log: agreement, TTFT and cached-token prediction error
percentiles, estimated gain, by UTC hour and overall (`ramjet.decisions.summary`), as a
table; then the online calibration: the calibrated TTFT prediction's |relative error|
beside the raw profile's, overall and after the first N requests (`--warmup`, 16), and
after how many requests the rolling median of 10 stayed within 15%, and the error split
by whether a request shared its first-token step with a later arrival (the part of the
error no prediction at the decision can remove). Plots (matplotlib
with the Agg backend, imported only here, so the router never needs it): predicted vs
realized TTFT, and the |relative error| over time, calibrated and raw. Exit 1 if the log
holds no decision lines, 2 if it cannot be read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ramjet.decisions.summary import (
    SAME_STEP_S,
    batching_rows,
    calibration_rows,
    load,
    percentile,
    predicted,
    relative_errors,
    settled_after,
    summarize,
    table,
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("report", help="promotion summary of a decision log")
    p.add_argument("logs", nargs="+", metavar="LOG", help="decision log (JSON lines)")
    p.add_argument("--rotated", action="store_true", help="include LOG.1, LOG.2, ... too")
    p.add_argument(
        "--plot", type=Path, default=None, help="PNG to write (default: first LOG + .ttft.png)"
    )
    p.add_argument("--no-plot", action="store_true", help="print the table only")
    p.add_argument(
        "--warmup",
        type=int,
        default=16,
        metavar="N",
        help="requests the calibration may learn from before its errors count (16)",
    )
    p.set_defaults(handler=_run)


def plot_ttft(entries: list[dict[str, Any]], out: Path) -> int:
    """Scatter of predicted vs realized TTFT on the answering engine; returns points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_mode: dict[str, tuple[list[float], list[float]]] = {}
    for e in entries:
        p = predicted(e, e.get("engine"), "ttft_s")
        r = e.get("realized_ttft_s")
        if p is None or r is None or not (0 < int(e.get("status") or 0) < 400):
            continue
        xs, ys = by_mode.setdefault(str(e.get("mode")), ([], []))
        xs.append(float(r))
        ys.append(p)
    n = sum(len(xs) for xs, _ in by_mode.values())
    fig, ax = plt.subplots(figsize=(6, 6))
    hi = 0.0
    for mode, (xs, ys) in sorted(by_mode.items()):
        ax.scatter(xs, ys, s=10, alpha=0.6, label=f"{mode} ({len(xs)})")
        hi = max(hi, *xs, *ys)
    hi = hi * 1.05 or 1.0
    ax.plot([0, hi], [0, hi], color="grey", linewidth=1, label="predicted = realized")
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    ax.set_xlabel("realized TTFT (s)")
    ax.set_ylabel("predicted TTFT (s), candidate model, answering engine")
    ax.set_title(f"Predicted vs realized TTFT ({n} requests)")
    ax.legend(loc="upper left")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return n


def plot_errors(entries: list[dict[str, Any]], out: Path, warmup: int) -> int:
    """|relative error| of each answered request over time, calibrated and raw profile,
    with rolling medians of 10; returns points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    n = 0
    for label, name, colour in (
        ("calibrated", "ttft_s", "tab:blue"),
        ("profile (raw)", "ttft_raw_s", "tab:orange"),
    ):
        errs = relative_errors(entries, name)
        n = max(n, len(errs))
        if not errs:
            continue
        xs = list(range(1, len(errs) + 1))
        ax.scatter(xs, errs, s=8, alpha=0.35, color=colour)
        med = [percentile(errs[max(0, k - 9) : k + 1], 50) for k in range(len(errs))]
        ax.plot(xs, med, color=colour, label=f"{label}: rolling median of 10")
    ax.axvline(warmup + 0.5, color="grey", linestyle=":", label=f"warm-up ({warmup})")
    ax.axhline(0.15, color="grey", linewidth=0.8, linestyle="--", label="15%")
    ax.set_yscale("symlog", linthresh=0.1)
    ax.set_xlabel("request (answered, in log order)")
    ax.set_ylabel("|predicted - realized| / realized TTFT")
    ax.set_title("TTFT prediction error over time")
    ax.legend(loc="upper right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return n


def _run(args: argparse.Namespace) -> int:
    try:
        entries = load(args.logs, rotated=args.rotated)
    except OSError as exc:
        print(f"ramjet report: cannot read: {exc}", file=sys.stderr)
        return 2
    if not entries:
        print("ramjet report: no decision lines in " + ", ".join(args.logs), file=sys.stderr)
        return 1
    if args.warmup < 0:
        print("ramjet report: --warmup must be >= 0", file=sys.stderr)
        return 2
    rows = [g.row() for g in summarize(entries)]
    sys.stdout.write(table(rows))
    print()
    print("TTFT prediction, online-calibrated beside the profile as probed:")
    sys.stdout.write(table(calibration_rows(entries, args.warmup)))
    print()
    print(
        "Calibrated error by what the decision could see (first tokens within "
        f"{SAME_STEP_S * 1000:.0f} ms on one engine: one engine step):"
    )
    sys.stdout.write(table(batching_rows(entries, args.warmup)))
    took = settled_after(relative_errors(entries, "ttft_s"))
    if took is None:
        print("calibration: the rolling median of 10 |rel err| is not within 15% yet")
    else:
        print(f"calibration took {took} requests: rolling median of 10 within 15% from then on")
    if not args.no_plot:
        out = args.plot or Path(args.logs[0] + ".ttft.png")
        n = plot_ttft(entries, out)
        print(f"plot: {out} ({n} points)")
        err_out = out.with_name(out.name.removesuffix(".ttft.png").removesuffix(".png"))
        err_out = err_out.with_name(err_out.name + ".error.png")
        n = plot_errors(entries, err_out, args.warmup)
        print(f"plot: {err_out} ({n} points)")
    return 0
