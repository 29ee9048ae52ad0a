"""A/B of the router's CPU per request: two source trees against one upstream, in one run.

    .venv/bin/python benchmarks/router_ab.py TREE_A TREE_B [--rounds 5] [--seconds 2] [--large-mb 4]
    .venv/bin/python benchmarks/router_ab.py --quick   # make bench: this tree against itself

Each tree is a checkout of this repository (e.g. `git archive HEAD~1 | tar -x -C /tmp/a`);
its router runs as `python -m ramjet serve` with PYTHONPATH set to the tree, pinned to
CPU 0 (upstream and load on the others). Rounds alternate A and B, JSON then SSE (64
chunks 1 ms apart), with `benchmarks/proxy_overhead.py`'s upstream, load and checks
(every reply verified), so both share the machine's noise alike. Printed per mode: the
median CPU us/request of each tree, B/A, and every round's figures (a lever that wins
should win most rounds, not just the median). Every process started is stopped by pid.
`--python-a` / `--python-b` run a tree's router under another interpreter (one with the
project's dependencies installed), e.g. the same tree twice to compare two CPython builds.
`--quick` (make bench) runs this checkout as both A and B, 2 rounds of 1 s: an A/A run,
whose B/A is the noise a real A/B must clear; printed, not judged.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_overhead as po

LATENCIES: dict[str, list[list[float]]] = {}


async def measure(target: po.Target, mode: str, args: argparse.Namespace) -> int:
    """Requests answered (each checked) in one cell of `mode` (open loop: latencies kept
    in `LATENCIES[target.name]`)."""
    if mode == "json":
        check = partial(po.check_json, target.name, small=True)
        return await po.closed_loop(target, po.SMALL_RAW, check, args.seconds, args.concurrency)
    if mode == "stream64":
        check_s = partial(po.check_stream, target.name)
        return await po.closed_loop(target, po.STREAM_RAW, check_s, args.seconds, args.concurrency)
    if mode.startswith("open"):
        lat = await po.open_loop(target, args.open_rate, args.seconds)
        LATENCIES.setdefault(target.name, []).append(lat)
        return len(lat) + po.OPEN_WARM
    content = "p" * (args.large_mb << 20)
    raw = po.raw_post(po.chat_body(content, False))
    client = po.Client(target.url)
    try:
        for _ in range(args.large):
            status, body = await client.send(raw)
            po.check_json(target.name, status, body, len(content))
    finally:
        client.close()
    return args.large


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("tree_a", nargs="?")
    ap.add_argument("tree_b", nargs="?")
    ap.add_argument(
        "--quick", action="store_true", help="A/A on this checkout, 2 rounds of 1 s (make bench)"
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--large-mb", type=int, default=0, help="also prompts of this many MB")
    ap.add_argument("--large", type=int, default=4, help="large prompts per round")
    ap.add_argument(
        "--open-rate", type=float, default=0.0, help="also small requests at this rate, open loop"
    )
    ap.add_argument(
        "--observe",
        action="store_true",
        help="observe mode: tier_aware recorded, decision log on (default: prefix_affinity only)",
    )
    ap.add_argument(
        "--python-a", default=po.PY, help="interpreter of tree A's router (default: this one)"
    )
    ap.add_argument(
        "--python-b", default=po.PY, help="interpreter of tree B's router (default: this one)"
    )
    args = ap.parse_args()
    if args.quick:
        root = str(Path(__file__).resolve().parents[1])
        args.tree_a, args.tree_b = args.tree_a or root, args.tree_b or root
        args.rounds, args.seconds = 2, 1.0
    if not (args.tree_a and args.tree_b):
        ap.error("TREE_A and TREE_B are required (or --quick: this checkout twice)")
    pythons = [args.python_a, args.python_b]
    trees = [str(Path(args.tree_a).resolve()), str(Path(args.tree_b).resolve())]
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as d:
        try:
            up_port = po.free_port()
            os.sched_setaffinity(0, po.other_cpus())
            procs.append(
                subprocess.Popen(
                    [po.PY, po.__file__, "--upstream", str(up_port)],
                    preexec_fn=lambda: os.sched_setaffinity(0, po.other_cpus()),
                )
            )
            po.wait_http(f"http://127.0.0.1:{up_port}/health")
            policy = Path(d) / "ab.yaml"
            policy.write_text(
                f"engines:\n  - id: e0\n    url: http://127.0.0.1:{up_port}\n"
                "incumbent:\n  name: prefix_affinity\nlogging:\n  level: warning\n"
                + (
                    f"  decisions_path: {d}/decisions.jsonl\n"
                    "mode:\n  kind: observe\ncandidate:\n  name: tier_aware\n"
                    if args.observe
                    else ""
                )
                + f"limits:\n  max_body_bytes: {64 << 20}\n"
                "timeouts:\n  drain_s: 1\n"
            )
            routers: list[tuple[str, int]] = []
            for tree, python in zip(trees, pythons, strict=True):
                port = po.free_port()
                proc = subprocess.Popen(
                    po.pinned(
                        [
                            python,
                            "-m",
                            "ramjet",
                            "serve",
                            "--policy",
                            str(policy),
                            "--port",
                            str(port),
                        ]
                    ),
                    cwd=tree,
                    env=dict(os.environ, PYTHONPATH=tree),
                )
                procs.append(proc)
                po.wait_http(f"http://127.0.0.1:{port}/readyz")
                routers.append((f"http://127.0.0.1:{port}", proc.pid))
            modes = ["json", "stream64"] + ([f"{args.large_mb}mb"] if args.large_mb else [])
            modes += [f"open{args.open_rate:.0f}"] if args.open_rate else []
            runs: dict[tuple[int, str], list[float]] = {(i, m): [] for i in range(2) for m in modes}
            for _ in range(args.rounds):
                for mode in modes:
                    for i, (url, pid) in enumerate(routers):
                        target = po.Target("AB"[i], url)
                        c0 = po.cpu_seconds([pid])
                        n = uvloop.run(measure(target, mode, args))
                        runs[(i, mode)].append((po.cpu_seconds([pid]) - c0) / n * 1e6)
            figs: list[str] = []
            print(f"router CPU us/request, median of {args.rounds} interleaved rounds")
            print(f"  A = {trees[0]}\n  B = {trees[1]}")
            for mode in modes:
                a, b = (statistics.median(runs[(i, mode)]) for i in range(2))
                rounds = "  ".join(
                    f"{x:.0f}/{y:.0f}"
                    for x, y in zip(runs[(0, mode)], runs[(1, mode)], strict=True)
                )
                print(
                    f"  {mode:<9} A {a:6.0f}  B {b:6.0f}  B/A {b / a:5.3f}   rounds A/B: {rounds}"
                )
                figs.append(f"figure: router A/B, CPU per request / {mode} A = {a:.0f} us")
                figs.append(f"figure: router A/B, CPU per request / {mode} B = {b:.0f} us")
            for name in "AB":
                lats = LATENCIES.get(name, [])
                if lats:
                    p50 = statistics.median(po.pct(x, 0.5) for x in lats) * 1e6
                    p99 = statistics.median(po.pct(x, 0.99) for x in lats) * 1e6
                    print(f"  open loop latency {name}: p50 {p50:.0f} us, p99 {p99:.0f} us")
            print("\n".join(figs))
            print(f"self-check: every reply verified (status, body, chunks) in {len(modes)} modes")
        finally:
            for p in reversed(procs):
                po.stop(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
