"""`make bench`: every benchmark in quick mode, one summary table and its plots.

    .venv/bin/python benchmarks/bench_all.py --quick --out out/bench [--only NAME,NAME]

Quick mode is bounded (each benchmark in seconds to about a minute; the whole list in
about 8 minutes on two cores, with the native build) and reports its figures without judging them: a quick run's
noise can cross a target that its full run (the command in each benchmark's docstring)
holds, as `report_flood` once read +11.0% against its +10%. A benchmark fails here on
what it verified (its `self-check:`), its exit status or its time limit.

Runs each benchmark of `BENCHMARKS` whose file exists, one after another (they measure
CPU time and share a 2-core machine: never two at once), echoing its output line by
line with its name in front, and keeps what it printed in `OUT/NAME.log`. Two kinds of
line are collected:

- `self-check: ...`: what the benchmark verified before it trusted its figures (status,
  bodies, chunk counts, counters). A benchmark that exits 0 without one fails here: a
  figure nobody checked is not reported.
- `figure: GROUP / LABEL = VALUE UNIT`: a figure to tabulate and plot; every GROUP gets
  one bar chart, `OUT/GROUP.png` (matplotlib, Agg).

`OUT/summary.md` holds one table (benchmark, command, status, seconds, self-check,
headline line) and the plots. Exit 1 when any benchmark failed, timed out or printed no
self-check line; the summary is written either way.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


@dataclass(frozen=True)
class Bench:
    name: str
    quick: tuple[str, ...]
    """Arguments for quick mode (`make bench`)."""
    full: tuple[str, ...] = ()
    headline: str = ""
    """Regex of the lines to show in the table (default: the last line printed)."""
    timeout_s: float = 600.0


BENCHMARKS = (
    Bench(
        "proxy_overhead",
        ("--quick",),
        headline=r"^figure +direct|^CPU per small JSON request|^figure +ramjet_observe",
        timeout_s=300,
    ),
    Bench("report_flood", ("--quick",), headline=r"^report flood result:", timeout_s=300),
    Bench("hostile_clients", ("--quick",), headline=r"^self-check:", timeout_s=600),
    Bench(
        "big_body_loop",
        ("--rounds", "4"),
        headline=r"^figure: big body loop / stall",
        timeout_s=300,
    ),
    Bench(
        "decision",
        ("--repeats", "5", "--requests", "300"),
        headline=r"^decision result:",
        timeout_s=300,
    ),
    Bench("report_verify", ("--quick",), headline=r"^report verify result:", timeout_s=300),
    Bench("model_step", ("--quick",), headline=r"^model step result:", timeout_s=600),
    Bench("kernels_compile", (), headline=r"^kernels compile result:", timeout_s=600),
    Bench(
        "decision_redis",
        ("--sessions", "16", "--kb", "32", "--decisions", "600"),
        headline=r"^decision redis result:",
        timeout_s=300,
    ),
    Bench("pool_e2e", ("--quick",), headline=r"^pool e2e result:", timeout_s=600),
    Bench("prefix_keys", ("--quick",), headline=r"^figure: prefix keys ratio", timeout_s=300),
    Bench("request_path_cpu", ("--quick",), headline=r"^figure: request path CPU / sum"),
    Bench("sidecar", ("--quick",), headline=r"^figure: sidecar event to router table / p"),
    Bench("router_ab", ("--quick",), headline=r"^  (json|stream64) "),
    Bench("proxy_profile", ("--quick",), headline=r"/ total, unprofiled"),
    Bench("latency_split", ("--quick",), headline=r"added p50", timeout_s=900),
    Bench("residency_scale", ("--quick",), headline=r"RSS per block / "),
    Bench("residency_scale_redis", ("--quick",), headline=r"bytes per block \(steady\) / "),
    Bench("engine_profile", ("--quick",), headline=r"^figure: engine restore TTFT"),
    Bench("kernels", ("--quick",), headline=r"^device:"),
    Bench("priority_e2e", ("--quick",), headline=r"^figure: priority e2e"),
    Bench("e2e_vllm", ("--quick",), headline=r"mean TTFT / ", timeout_s=900),
    Bench(
        "priority_sim",
        ("--quick", "--middle", "--no-sweep", "--out", "{out}/priority_sim"),
        headline=r"^figure: priority sim.* priority = ",
    ),
    Bench("priority_bound", ("--quick",), headline=r"^figure: priority bound"),
    Bench("priority_tail", ("--quick",), headline=r"^figure: priority tail"),
    Bench("fabric_grid", ("table",), headline=r"^self-check:"),
    Bench("fabric_seeds", ("--quick",), headline=r"^figure: fabric seeds"),
    Bench("fabric_overload", (), headline=r"^figure: fabric overload"),
)
"""Every benchmark in benchmarks/ is here, and `make bench` runs each one's quick mode.
Not benchmarks: `loop_trace.py` (the residency benchmarks' loop-turn tracer, turned on
with `RAMJET_TRACE_TURNS_MS`), `vcpu_pauses.py` (their `--perf` accounting of vCPU
pauses) and `gpu_check.sh` (the kernel tests and this kernel benchmark on a GPU
machine). Quick figures are printed, never judged against a target
that a quick run's noise could cross: each benchmark's full run judges its targets."""

_FIGURE = re.compile(
    r"^figure: (?P<group>[^/]+?) / (?P<label>.+?) = (?P<value>[-+0-9.eE]+) (?P<unit>\S+)\s*$"
)


@dataclass
class Outcome:
    bench: Bench
    cmd: list[str]
    rc: int | None = None
    seconds: float = 0.0
    lines: list[str] = field(default_factory=list)

    @property
    def self_checks(self) -> list[str]:
        return [ln for ln in self.lines if ln.startswith("self-check:")]

    @property
    def status(self) -> str:
        if self.rc is None:
            return "TIMEOUT"
        if self.rc != 0:
            return f"FAIL (exit {self.rc})"
        if not self.self_checks:
            return "FAIL (no self-check line)"
        return "ok"

    def headline(self) -> str:
        """The lines matching the benchmark's pattern, joined (else its last line)."""
        pattern = self.bench.headline
        hits = [ln for ln in self.lines if pattern and re.search(pattern, ln)]
        if not hits:
            hits = [ln for ln in self.lines if ln.strip()][-1:]
        return " / ".join(" ".join(h.split()) for h in hits[:4])


def run(b: Bench, args: list[str], out: Path) -> Outcome:
    args = [a.replace("{out}", str(out)) for a in args]
    cmd = [PY, str(ROOT / "benchmarks" / f"{b.name}.py"), *args]
    o = Outcome(b, cmd)
    print(f"== {b.name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    assert proc.stdout is not None
    deadline = t0 + b.timeout_s
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            o.lines.append(line)
            print(f"[{b.name}] {line}", flush=True)
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(cmd, b.timeout_s)
        o.rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()  # our own child, by its handle
        proc.wait()
        o.rc = None
    o.seconds = time.monotonic() - t0
    (out / f"{b.name}.log").write_text("\n".join(o.lines) + "\n")
    print(f"== {b.name}: {o.status} in {o.seconds:.0f} s", flush=True)
    return o


def figures(outcomes: list[Outcome]) -> dict[str, list[tuple[str, float, str]]]:
    groups: dict[str, list[tuple[str, float, str]]] = defaultdict(list)
    for o in outcomes:
        for ln in o.lines:
            m = _FIGURE.match(ln)
            if m:
                groups[m["group"].strip()].append(
                    (m["label"].strip(), float(m["value"]), m["unit"])
                )
    return dict(groups)


def slug(group: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", group.lower()).strip("_")


def plot(groups: dict[str, list[tuple[str, float, str]]], out: Path) -> list[tuple[str, Path]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    for group, rows in groups.items():
        fig, ax = plt.subplots(figsize=(7, 0.5 * len(rows) + 1.5))
        labels = [f"{label} ({unit})" for label, _, unit in rows]
        values = [v for _, v, _ in rows]
        bars = ax.barh(labels, values, color="tab:blue")
        ax.bar_label(bars, fmt="%.4g", padding=3)
        ax.invert_yaxis()
        ax.set_title(group)
        ax.margins(x=0.2)
        fig.tight_layout()
        path = out / f"{slug(group)}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        made.append((group, path))
    return made


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def summary(outcomes: list[Outcome], plots: list[tuple[str, Path]], mode: str) -> str:
    lines = [
        f"# Benchmarks ({mode} mode)",
        "",
        f"`make bench` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; each log is "
        "`NAME.log` beside this file.",
        "",
        "| benchmark | command | status | s | self-check | headline |",
        "|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        checks = " / ".join(c.removeprefix("self-check:").strip() for c in o.self_checks)
        lines.append(
            f"| {o.bench.name} | `{cell(' '.join(['benchmarks/' + o.bench.name + '.py', *o.cmd[2:]]))}` "
            f"| {o.status} | {o.seconds:.0f} | {cell(checks) or '-'} | {cell(o.headline())} |"
        )
    for group, path in plots:
        lines += ["", f"## {group}", "", f"![{group}]({path.name})"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="each benchmark's quick arguments")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "bench")
    ap.add_argument("--only", default="", help="comma-separated benchmark names")
    args = ap.parse_args()
    wanted = set(filter(None, args.only.split(",")))
    unknown = wanted - {b.name for b in BENCHMARKS}
    if unknown:
        print(f"bench_all: unknown benchmarks {sorted(unknown)}", file=sys.stderr)
        return 2
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    outcomes = []
    for b in BENCHMARKS:
        if wanted and b.name not in wanted:
            continue
        if not (ROOT / "benchmarks" / f"{b.name}.py").exists():
            print(f"== {b.name}: not in this tree, skipped")
            continue
        outcomes.append(run(b, list(b.quick if args.quick else b.full), out))
    plots = plot(figures(outcomes), out)
    text = summary(outcomes, plots, "quick" if args.quick else "full")
    (out / "summary.md").write_text(text)
    print()
    print(text)
    print(f"bench_all: wrote {out / 'summary.md'} and {len(plots)} plot(s)")
    failed = [o.bench.name for o in outcomes if o.status != "ok"]
    if failed:
        print(f"bench_all: FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
