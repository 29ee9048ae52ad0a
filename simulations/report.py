"""Tables, CSV and plots of a run's rows."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path

from simulations.summary import Row

_COLS = (
    ("policy", "{:<24}", 24),
    ("util", "{:>5.0%}", 5),
    ("mean s", "{:>7.2f}", 7),
    ("p50 s", "{:>7.2f}", 7),
    ("p99 s", "{:>7.2f}", 7),
    ("prefill Mtok", "{:>12.2f}", 12),
    ("/floor", "{:>6.3f}", 6),
    ("hbm", "{:>5.1%}", 5),
    ("host", "{:>5.1%}", 5),
    ("ssd", "{:>5.1%}", 5),
    ("swa", "{:>5.1%}", 5),
    ("replays", "{:>7d}", 7),
    ("imbal", "{:>6.3f}", 6),
    ("<=target", "{:>8.1%}", 8),
)


def _cells(r: Row) -> list[object]:
    return [
        r.policy, r.utilization, r.ttft_mean_s, r.ttft_p50_s, r.ttft_p99_s, r.prefill_tokens / 1e6,
        r.floor_ratio, r.hit_hbm, r.hit_host, r.hit_ssd, r.swa_resumes, r.replays, r.imbalance,
        r.within_target,
    ]  # fmt: skip


def table(rows: Sequence[Row], title: str) -> str:
    head = " ".join(f"{name:>{w}}" if i else f"{name:<{w}}" for i, (name, _, w) in enumerate(_COLS))
    lines = [title, head, "-" * len(head)]
    for r in rows:
        cells = []
        for (_, fmt, w), v in zip(_COLS, _cells(r), strict=True):
            if isinstance(v, float) and math.isnan(v):
                cells.append(f"{'-':>{w}}")
            else:
                cells.append(fmt.format(v))
        lines.append(" ".join(cells))
    return "\n".join(lines)


def markdown(rows: Sequence[Row]) -> str:
    head = "| " + " | ".join(name for name, _, _ in _COLS) + " |"
    sep = "|" + "---|" * len(_COLS)
    out = [head, sep]
    for r in rows:
        cells = []
        for (_, fmt, _), v in zip(_COLS, _cells(r), strict=True):
            cells.append("-" if isinstance(v, float) and math.isnan(v) else fmt.format(v).strip())
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def write_csv(rows: Sequence[Row], path: Path) -> None:
    if not rows:
        return
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].as_dict()))
        w.writeheader()
        for r in rows:
            w.writerow(r.as_dict())


def plot(rows: Sequence[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_policy: dict[str, list[Row]] = {}
    for r in rows:
        by_policy.setdefault(r.policy, []).append(r)
    by_load = None if any(math.isnan(r.load) for r in rows) else True
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, attr, label in (
        (axes[0], "ttft_mean_s", "mean TTFT (s)"),
        (axes[1], "ttft_p99_s", "p99 TTFT (s)"),
    ):
        for name, rs in by_policy.items():
            rs = sorted(rs, key=lambda r: r.rate_scale)
            style = "--" if name.startswith(("bound", "oracle")) else "-"
            width = 2.5 if name.startswith("tier_aware") or name == "prefix_affinity" else 1.0
            ax.plot(
                [r.rate_scale if by_load is None else r.load for r in rs],
                [getattr(r, attr) for r in rs],
                style,
                lw=width,
                marker="o",
                ms=3,
                label=name,
            )
        ax.set_xlabel(
            "rate scale (x trace arrival rate)"
            if by_load is None
            else "load (floor prefill work / capacity)"
        )
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=7, loc="upper left", ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
