"""Summaries of decision-log lines (`ramjet.decisions.log`) for `ramjet report` and
`ramjet explain`: prediction errors per line, percentiles, the promotion summary by
hour, and plain-text tables.

Per line (only lines answered by an engine with status < 400 count as outcomes):
- TTFT error = the candidate's predicted `ttft_s` for the engine that answered minus the
  realized TTFT (`realized_ttft_s`); relative = error / realized.
- cached-token error = predicted `resume_tokens` on that engine minus the engine's
  realized `cached_tokens`.
- estimated gain = predicted `ttft_s` on the incumbent's pick minus on the candidate's
  pick (both from the candidate's components); a prediction, not a measurement.
Percentiles are linear interpolation between order statistics (numpy's default).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ramjet.decisions.log import read_log


def log_files(path: str | Path, rotated: bool) -> list[Path]:
    """`path`, and with `rotated` its backups `path.N`, oldest first."""
    p = Path(path)
    files = [p]
    if rotated:
        backups = []
        for q in p.parent.glob(p.name + ".*"):
            suffix = q.name[len(p.name) + 1 :]
            if suffix.isdigit():
                backups.append((int(suffix), q))
        files = [q for _, q in sorted(backups, reverse=True)] + files
    return files


def load(paths: Iterable[str | Path], rotated: bool = False) -> list[dict[str, Any]]:
    """Every decision line of the files, in file order; raises OSError."""
    out: list[dict[str, Any]] = []
    for p in paths:
        for f in log_files(p, rotated):
            out.extend(read_log(f))
    return out


def predicted(entry: dict[str, Any], engine: str | None, name: str) -> float | None:
    if engine is None:
        return None
    comp = (entry.get("predicted") or {}).get(engine)
    if not isinstance(comp, dict) or name not in comp:
        return None
    return float(comp[name])


def answered(entry: dict[str, Any]) -> bool:
    status = entry.get("status") or 0
    return entry.get("engine") is not None and 0 < int(status) < 400


def ttft_error(entry: dict[str, Any]) -> float | None:
    p = predicted(entry, entry.get("engine"), "ttft_s")
    r = entry.get("realized_ttft_s")
    if p is None or r is None or not answered(entry):
        return None
    return p - float(r)


def cached_error(entry: dict[str, Any]) -> float | None:
    p = predicted(entry, entry.get("engine"), "resume_tokens")
    real = entry.get("realized")
    if p is None or not isinstance(real, dict) or not answered(entry):
        return None
    return p - float(real.get("cached_tokens", 0))


def estimated_gain(entry: dict[str, Any]) -> float | None:
    inc, cand = entry.get("incumbent"), entry.get("candidate")
    if not isinstance(inc, dict) or not isinstance(cand, dict):
        return None
    on_inc = predicted(entry, inc.get("engine"), "ttft_s")
    on_cand = predicted(entry, cand.get("engine"), "ttft_s")
    if on_inc is None or on_cand is None:
        return None
    return on_inc - on_cand


def percentile(values: Sequence[float], q: float) -> float:
    """q in [0, 100]; NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Group:
    """The promotion summary of one set of lines (an hour, or all)."""

    label: str
    requests: int = 0
    compared: int = 0
    agreed: int = 0
    candidate_errors: int = 0
    ttft_err: list[float] = field(default_factory=list)
    ttft_rel: list[float] = field(default_factory=list)
    cached_err: list[float] = field(default_factory=list)
    gains: list[float] = field(default_factory=list)
    realized_ttft: list[float] = field(default_factory=list)

    def add(self, e: dict[str, Any]) -> None:
        self.requests += 1
        if e.get("candidate_error"):
            self.candidate_errors += 1
        inc, cand = e.get("incumbent"), e.get("candidate")
        if isinstance(inc, dict) and isinstance(cand, dict):
            self.compared += 1
            self.agreed += inc.get("engine") == cand.get("engine")
        err = ttft_error(e)
        if err is not None:
            self.ttft_err.append(err)
            real = float(e["realized_ttft_s"])
            if real > 0:
                self.ttft_rel.append(err / real)
        c = cached_error(e)
        if c is not None:
            self.cached_err.append(c)
        g = estimated_gain(e)
        if g is not None:
            self.gains.append(g)
        if answered(e) and e.get("realized_ttft_s") is not None:
            self.realized_ttft.append(float(e["realized_ttft_s"]))

    @property
    def agreement(self) -> float:
        return self.agreed / self.compared if self.compared else math.nan

    def row(self) -> dict[str, float | int | str]:
        abs_err = [abs(x) for x in self.ttft_err]
        abs_rel = [abs(x) for x in self.ttft_rel]
        abs_cached = [abs(x) for x in self.cached_err]
        mean_gain = sum(self.gains) / len(self.gains) if self.gains else math.nan
        return {
            "hour": self.label,
            "requests": self.requests,
            "agree_%": 100.0 * self.agreement,
            "cand_err": self.candidate_errors,
            "ttft_err_p50_s": percentile(self.ttft_err, 50),
            "|ttft_err|_p50_s": percentile(abs_err, 50),
            "|ttft_err|_p90_s": percentile(abs_err, 90),
            "|ttft_err|_p99_s": percentile(abs_err, 99),
            "|rel_err|_p50": percentile(abs_rel, 50),
            "|rel_err|_p90": percentile(abs_rel, 90),
            "|cached_err|_p50": percentile(abs_cached, 50),
            "|cached_err|_p90": percentile(abs_cached, 90),
            "gain_mean_s": mean_gain,
            "gain_sum_s": sum(self.gains),
            "ttft_mean_s": (
                sum(self.realized_ttft) / len(self.realized_ttft)
                if self.realized_ttft
                else math.nan
            ),
        }


def hour_of(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:00", time.gmtime(t))


def summarize(entries: Iterable[dict[str, Any]]) -> list[Group]:
    """One group per UTC hour (in time order), then "all"."""
    hours: dict[str, Group] = {}
    total = Group("all")
    for e in entries:
        label = hour_of(float(e.get("t") or 0.0))
        hours.setdefault(label, Group(label)).add(e)
        total.add(e)
    return [hours[k] for k in sorted(hours)] + [total]


def _cell(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.4g}"
    return str(v)


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Rows of dicts as an aligned plain-text table (first column left-aligned)."""
    if not rows:
        return "(no rows)\n"
    cols = list(columns or rows[0].keys())
    cells = [[_cell(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.ljust(w) if i == 0 else v.rjust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    out = [line(cols), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out) + "\n"


def relative_errors(entries: Iterable[dict[str, Any]], name: str) -> list[float]:
    """Per answered line in order: |`name` predicted on the answering engine - realized|
    / realized TTFT (`ttft_s`: the calibrated prediction; `ttft_raw_s`: the profile as
    probed). Lines without the figure are skipped."""
    return [err for _, err in _scored(entries, name)]


def _scored(entries: Iterable[dict[str, Any]], name: str) -> list[tuple[dict[str, Any], float]]:
    out = []
    for e in entries:
        p = predicted(e, e.get("engine"), name)
        r = e.get("realized_ttft_s")
        if p is None or r is None or not answered(e) or float(r) <= 0:
            continue
        out.append((e, abs(p - float(r)) / float(r)))
    return out


SAME_STEP_S = 0.005
"""First tokens this close together on one engine came out of one engine step."""


def batched_with_later(
    requests: Sequence[tuple[str | None, float, float]], same_step_s: float = SAME_STEP_S
) -> list[bool]:
    """Per request (engine, sent at, TTFT): whether a request sent to the same engine
    after it reached its first token in the same engine step (within `same_step_s`).

    A batching engine (vLLM, SGLang) prefills every request waiting when a step starts
    in that step, and all of them get their first token at its end; a request's TTFT
    then includes the prefill of requests that arrived after its routing decision,
    which no prediction made at the decision can see. Splitting the error by this flag
    says how much of it is that."""
    out = [False] * len(requests)
    by_engine: dict[str, list[tuple[float, float, int]]] = {}
    for i, (engine, sent, ttft) in enumerate(requests):
        if engine is not None:
            by_engine.setdefault(engine, []).append((sent + ttft, sent, i))
    for items in by_engine.values():
        items.sort()
        for k, (first, sent, i) in enumerate(items):
            for step in (-1, 1):
                j = k + step
                while 0 <= j < len(items) and abs(items[j][0] - first) <= same_step_s:
                    if items[j][1] > sent:
                        out[i] = True
                        break
                    j += step
    return out


def batching_rows(entries: list[dict[str, Any]], warmup: int) -> list[dict[str, Any]]:
    """The calibrated |relative error| split by `batched_with_later`: requests that shared
    their first-token step with a later arrival, and the rest."""
    scored = _scored(entries, "ttft_s")
    flags = batched_with_later(
        [(e["engine"], float(e.get("t") or 0.0), float(e["realized_ttft_s"])) for e, _ in scored]
    )
    rows = []
    for label, want in (
        ("alone or last in its step", False),
        ("batched with a later arrival", True),
    ):
        errs = [err for (_, err), f in zip(scored, flags, strict=True) if f is want]
        after = [
            err
            for k, ((_, err), f) in enumerate(zip(scored, flags, strict=True))
            if f is want and k >= warmup
        ]
        rows.append(
            {
                "requests": label,
                "count": len(errs),
                "share": len(errs) / len(scored) if scored else math.nan,
                "|rel_err|_p50": percentile(errs, 50),
                "|rel_err|_p90": percentile(errs, 90),
                f"after_{warmup}_p50": percentile(after, 50),
                f"after_{warmup}_p90": percentile(after, 90),
            }
        )
    return rows


def settled_after(errors: Sequence[float], target: float = 0.15, window: int = 10) -> int | None:
    """The number of requests after which the rolling median of `window` |relative
    errors| stays at or under `target` to the end (None: it never does, or too few)."""
    if len(errors) < window:
        return None
    medians = [percentile(errors[k : k + window], 50) for k in range(len(errors) - window + 1)]
    k = len(medians)
    while k > 0 and medians[k - 1] <= target:
        k -= 1
    return None if k == len(medians) else k


def calibration_rows(entries: list[dict[str, Any]], warmup: int) -> list[dict[str, Any]]:
    """The calibrated prediction beside the raw profile's: |relative error| p50 and p90
    over every answered request and over those after the first `warmup`."""
    rows = []
    for label, name in (("calibrated", "ttft_s"), ("profile (raw)", "ttft_raw_s")):
        errs = relative_errors(entries, name)
        after = errs[warmup:]
        rows.append(
            {
                "prediction": label,
                "requests": len(errs),
                "|rel_err|_p50": percentile(errs, 50),
                "|rel_err|_p90": percentile(errs, 90),
                f"after_{warmup}_p50": percentile(after, 50),
                f"after_{warmup}_p90": percentile(after, 90),
            }
        )
    return rows
