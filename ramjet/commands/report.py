"""`ramjet report LOG [LOG...] [--rotated] [--plot PNG]`: the promotion summary of a
decision log: agreement, TTFT and cached-token prediction error percentiles, estimated
gain, by UTC hour and overall (`ramjet.decisions.summary`), as a table; and a plot of
predicted vs realized TTFT (matplotlib with the Agg backend, imported only here, so the
router never needs it). Exit 1 if the log holds no decision lines, 2 if it cannot be read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ramjet.decisions.summary import load, predicted, summarize, table


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("report", help="promotion summary of a decision log")
    p.add_argument("logs", nargs="+", metavar="LOG", help="decision log (JSON lines)")
    p.add_argument("--rotated", action="store_true", help="include LOG.1, LOG.2, ... too")
    p.add_argument(
        "--plot", type=Path, default=None, help="PNG to write (default: first LOG + .ttft.png)"
    )
    p.add_argument("--no-plot", action="store_true", help="print the table only")
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


def _run(args: argparse.Namespace) -> int:
    try:
        entries = load(args.logs, rotated=args.rotated)
    except OSError as exc:
        print(f"ramjet report: cannot read: {exc}", file=sys.stderr)
        return 2
    if not entries:
        print("ramjet report: no decision lines in " + ", ".join(args.logs), file=sys.stderr)
        return 1
    rows = [g.row() for g in summarize(entries)]
    sys.stdout.write(table(rows))
    if not args.no_plot:
        out = args.plot or Path(args.logs[0] + ".ttft.png")
        n = plot_ttft(entries, out)
        print(f"plot: {out} ({n} points)")
    return 0
