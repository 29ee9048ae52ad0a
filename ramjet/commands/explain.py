"""`ramjet explain LOG (REQUEST_ID | --last N) [--rotated]`: why a request went where
it went. For each decision line: the picks (incumbent, candidate, live and its role),
the candidate's components per engine as a table (wait, restore, replay, prefill, work,
externality, the jump charge inside it (`-` on an engine that serves by no key), cost,
predicted TTFT (calibrated, and as the raw profile prices it) and cached tokens by tier;
`*` marks its pick, the least cost), the calibration's weights on each engine, its notes
spelled out (default profile, the built-in estimate profile, degraded view, beyond the
probed context, profile off, externality off, residency capped), and the realized
outcome (engine, status, TTFT, the engine's prompt_work) with the
prediction errors, and the priority hint (value and key, sent or only observed). Exit 1
if no line matches, 2 if the log cannot be read.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ramjet.decisions.summary import cached_error, estimated_gain, load, table, ttft_error

_COLUMNS = (
    ("wait_s", "wait_s"),
    ("restore_s", "restore_s"),
    ("replay_s", "replay_s"),
    ("prefill_s", "prefill_s"),
    ("work_s", "work_s"),
    ("externality_s", "extern_s"),
    ("jump_s", "jump_s"),
    ("cost_s", "cost_s"),
    ("ttft_s", "ttft_s"),
    ("ttft_raw_s", "raw_s"),
    ("hbm_tokens", "hbm"),
    ("host_tokens", "host"),
    ("ssd_tokens", "ssd"),
    ("swa_tokens", "swa"),
    ("resume_tokens", "resume"),
)

_NOTES = {
    "default_profile": "has reported no profile: priced with the policy's default profile",
    "degraded": "view degraded (reports lost or stale): default profile, no SWA credit, "
    "matches charged as SSD restores",
    "externality_off": "no measured arrival rate or wait yet: externality term is zero",
    "beyond_profile": "the prompt is longer than the largest context its profile was "
    "probed at: its prefill is extrapolated from the curve's last point",
    "profile_off": "the online calibration finds its probed prefill more than 2x off (a "
    "profile probed while the host was busy?): calibration has taken over; re-probe it "
    "on an idle host",
    "estimate_profile": "priced with the built-in DeepSeek-V4.1-Flash TP4 ESTIMATE "
    "(ramjet/policy/cost.py), not a measured profile: its predicted times are guesses; "
    "let the engine report a profile (the sidecar probes it) or set "
    "candidate.params.default_profile",
    "residency_capped": "the residency table is at its cap and evicted blocks this engine's "
    "reports confirmed: its cached-prefix match may be missing some (priced as recompute); "
    "see ramjet_residency_cap_evictions_total and residency.capacity_headroom",
}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("explain", help="why a request went where it went")
    p.add_argument("log", metavar="LOG", help="decision log (JSON lines)")
    p.add_argument("request_id", nargs="?", default=None, help="request id (X-Request-Id)")
    p.add_argument("--last", type=int, default=None, metavar="N", help="the last N requests")
    p.add_argument("--rotated", action="store_true", help="search LOG.1, LOG.2, ... too")
    p.set_defaults(handler=_run)


def _note(note: str) -> str:
    kind, _, engine = note.partition(":")
    text = _NOTES.get(kind)
    if text is None:
        return note
    return f"{engine}: {text}" if engine else text


def _cost(comp: dict[str, Any]) -> float:
    return float(comp.get("cost_s", comp.get("ttft_s", float("inf"))))


def _pick(p: Any) -> str:
    if not isinstance(p, dict):
        return "-"
    return f"{p.get('engine')} ({p.get('policy')})"


def _priority_line(p: Any) -> str:
    if not isinstance(p, dict):
        return "  priority: none (engine in no priority pool)"
    verb = "sent" if p.get("sent") else f"not sent ({p.get('outcome')})"
    client = f", client's priority {p['client']}" if p.get("client") is not None else ""
    return (
        f"  priority ({p.get('pool')}, {p.get('mode')}): {verb}: value {p.get('value')}, "
        f"key {p.get('key_ms')} ms from predicted work {p.get('work_s')} s on "
        f"{p.get('engine')}{client}"
    )


_WEIGHTS = (
    ("prefill", "x_prefill_s"),
    ("context", "x_context_s"),
    ("resume", "x_resume_s"),
    ("wait", "x_wait_s"),
    ("packing", "x_packing_s"),
)


def calibration_line(engine: str, comp: dict[str, Any]) -> str | None:
    """The calibrated weights a decision applied on `engine`, and its fixed time; None
    for a line without them (a log from before calibration)."""
    if "w_prefill" not in comp:
        return None
    parts = [f"{name} x{float(comp.get('w_' + name, 1.0)):.3g}" for name, _ in _WEIGHTS]
    fixed = float(comp.get("fixed_s", 0.0))
    return (
        f"    {engine}: {', '.join(parts)}, fixed {fixed * 1e3:.3g} ms; "
        f"TTFT {float(comp.get('ttft_s', 0.0)):.4g} s calibrated, "
        f"{float(comp.get('ttft_raw_s', 0.0)):.4g} s as profiled"
    )


def explain(e: dict[str, Any]) -> str:
    """The explanation of one decision line, as text."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(e.get("t") or 0)))
    out = [
        f"request {e.get('id')}  at {when} UTC  mode {e.get('mode')}  "
        f"session {e.get('session') or '-'}  prompt {e.get('prompt_tokens')} tokens",
        f"  live: {_pick(e.get('live'))} as {e.get('live_role')}   "
        f"incumbent: {_pick(e.get('incumbent'))}   candidate: {_pick(e.get('candidate'))}"
        f"  ({e.get('candidate_ms')} ms)",
    ]
    if e.get("candidate_error"):
        out.append(f"  candidate had no pick: {e['candidate_error']}")
    pred = e.get("predicted") or {}
    if pred:
        cand_engine = (e.get("candidate") or {}).get("engine")
        best = cand_engine if cand_engine in pred else min(pred, key=lambda k: _cost(pred[k]))
        rows = []
        for engine, comp in pred.items():
            row: dict[str, Any] = {"engine": engine + (" *" if engine == best else "")}
            for key, col in _COLUMNS:
                row[col] = float(comp[key]) if key in comp else float("nan")
            rows.append(row)
        out.append("  candidate's components per engine (seconds, tokens; * = its pick):")
        out += ["    " + line for line in table(rows).rstrip("\n").split("\n")]
        cal = [c for c in (calibration_line(k, v) for k, v in pred.items()) if c is not None]
        if cal:
            out.append(
                "  calibration (weights fitted online; the predicted TTFT applies them, the cost"
                " only with fleet_stats.calibrated_decisions):"
            )
            out += cal
        others = [k for k in pred if k != best]
        if others:
            runner = min(others, key=lambda k: _cost(pred[k]))
            b, r = pred[best], pred[runner]
            out.append(
                f"  why: {best} costs {b.get('cost_s', 0):.4g} s against {runner}'s "
                f"{r.get('cost_s', 0):.4g} s (wait {b.get('wait_s', 0):.4g} vs "
                f"{r.get('wait_s', 0):.4g}, work {b.get('work_s', 0):.4g} vs "
                f"{r.get('work_s', 0):.4g})"
            )
    notes = (e.get("candidate") or {}).get("notes") or []
    for n in notes:
        out.append(f"  note: {_note(n)}")
    inc_comp = e.get("incumbent_components") or {}
    if inc_comp:
        out.append("  incumbent's figures: " + "; ".join(f"{k}: {v}" for k, v in inc_comp.items()))
    out.append(
        f"  outcome: engine {e.get('engine') or '-'}  status {e.get('status')}  end {e.get('end')}"
        f"  router ttft {e.get('ttft_s')} s  duration {e.get('duration_s')} s"
        f"  attempts {e.get('attempts')}"
    )
    out.append(_priority_line(e.get("priority")))
    real = e.get("realized")
    if isinstance(real, dict):
        out.append(
            "  engine's prompt_work: "
            + ", ".join(f"{k} {v}" for k, v in real.items() if k != "restore_io_ms")
        )
    else:
        out.append("  engine's prompt_work: not reported")
    err, cerr, gain = ttft_error(e), cached_error(e), estimated_gain(e)
    parts = []
    if err is not None:
        parts.append(
            f"TTFT predicted - realized = {err:+.4g} s ({e.get('ttft_source')} TTFT "
            f"{e.get('realized_ttft_s')} s)"
        )
    if cerr is not None:
        parts.append(f"cached tokens predicted - realized = {cerr:+.0f}")
    if gain is not None:
        parts.append(f"estimated gain of candidate over incumbent = {gain:+.4g} s")
    if parts:
        out.append("  accounting: " + "; ".join(parts))
    return "\n".join(out) + "\n"


def _run(args: argparse.Namespace) -> int:
    if (args.request_id is None) == (args.last is None):
        print("ramjet explain: give a REQUEST_ID or --last N (one of them)", file=sys.stderr)
        return 2
    if args.last is not None and args.last < 1:
        print("ramjet explain: --last must be >= 1", file=sys.stderr)
        return 2
    try:
        entries = load([args.log], rotated=args.rotated)
    except OSError as exc:
        print(f"ramjet explain: cannot read: {exc}", file=sys.stderr)
        return 2
    if args.request_id is not None:
        chosen = [e for e in entries if e.get("id") == args.request_id]
    else:
        chosen = entries[-args.last :]
    if not chosen:
        what = args.request_id if args.request_id is not None else "any request"
        print(f"ramjet explain: no decision line for {what} in {args.log}", file=sys.stderr)
        return 1
    sys.stdout.write("\n".join(explain(e) for e in chosen))
    return 0
