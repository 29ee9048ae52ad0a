"""A/B of the router's CPU per request: two source trees against one upstream, in one run.

    .venv/bin/python benchmarks/router_ab.py TREE_A TREE_B [--rounds 5] [--seconds 2]

Each tree is a checkout of this repository (e.g. `git archive HEAD~1 | tar -x -C /tmp/a`);
its router runs as `python -m ramjet serve` with PYTHONPATH set to the tree, pinned to
CPU 0 (upstream and load on the others). Rounds alternate A and B, JSON then SSE (64
chunks 1 ms apart), with `benchmarks/proxy_overhead.py`'s upstream, load and checks
(every reply verified), so both share the machine's noise alike. Printed per mode: the
median CPU us/request of each tree, B/A, and every round's figures (a lever that wins
should win most rounds, not just the median). Every process started is stopped by pid.
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("tree_a")
    ap.add_argument("tree_b")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--concurrency", type=int, default=32)
    args = ap.parse_args()
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
                "timeouts:\n  drain_s: 1\n"
            )
            routers: list[tuple[str, int]] = []
            for tree in trees:
                port = po.free_port()
                proc = subprocess.Popen(
                    po.pinned(
                        [
                            po.PY,
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
            runs: dict[tuple[int, bool], list[float]] = {
                (i, s): [] for i in range(2) for s in (False, True)
            }
            for _ in range(args.rounds):
                for stream in (False, True):
                    for i, (url, pid) in enumerate(routers):
                        target = po.Target("AB"[i], url)
                        raw, check = (
                            (po.STREAM_RAW, partial(po.check_stream, target.name))
                            if stream
                            else (po.SMALL_RAW, partial(po.check_json, target.name, small=True))
                        )
                        c0 = po.cpu_seconds([pid])
                        n = uvloop.run(
                            po.closed_loop(target, raw, check, args.seconds, args.concurrency)
                        )
                        runs[(i, stream)].append((po.cpu_seconds([pid]) - c0) / n * 1e6)
            print(f"router CPU us/request, median of {args.rounds} interleaved rounds")
            print(f"  A = {trees[0]}\n  B = {trees[1]}")
            for stream in (False, True):
                a, b = (statistics.median(runs[(i, stream)]) for i in range(2))
                rounds = "  ".join(
                    f"{x:.0f}/{y:.0f}"
                    for x, y in zip(runs[(0, stream)], runs[(1, stream)], strict=True)
                )
                mode = "stream64" if stream else "json"
                print(
                    f"  {mode:<9} A {a:6.0f}  B {b:6.0f}  B/A {b / a:5.3f}   rounds A/B: {rounds}"
                )
        finally:
            for p in reversed(procs):
                po.stop(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
