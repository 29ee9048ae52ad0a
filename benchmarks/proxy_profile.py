"""Where the router's CPU goes per small request: py-spy (`pip install -e '.[bench]'`) on a
real `ramjet serve` under `benchmarks/proxy_overhead.py`'s checked load, split by stage of
the request path.

    .venv/bin/python benchmarks/proxy_profile.py [--mode observe|enforce|round_robin]
                                                 [--seconds 6] [--rate 250]
    .venv/bin/python benchmarks/proxy_profile.py --quick     # make bench: 2 s per phase

The router runs pinned to CPU 0 (upstreams and load on the others). First its CPU per
request is measured without the profiler (closed loop, 32 connections, every reply
checked); then py-spy samples it under the same load. Each sample is given to the
innermost frame that names a stage:

  accept+parse   aiohttp's server: accept, HTTP parse, request objects, dispatch, and the
                 event loop itself (a sample with no Ramjet frame inside the handler)
  admission      ramjet.request.admission, Router.handle_completion
  parse+keys     ramjet.request.parse, ramjet.keys
  views+policies ramjet.fleet.views, ramjet.app.modes, ramjet.policy, Router._admitted
  forward        ramjet.proxy.forward/http1/headers/retries/exchange, Router._forward
  relay          ramjet.proxy.stream (and aiohttp's response writer under it)
  accounting     ramjet.decisions (but log), Router._account
  metrics        prometheus_client
  logging        ramjet.decisions.log, logging

A stage's us/request is its share of the busy samples times the unprofiled CPU per
request (py-spy's own cost does not inflate it). Socket writes are counted where they are
made (forward: the request to the engine; relay: the answer to the client). Samples of
threads waiting (the decision log's writer idle) are left out. Every process started here
is stopped by pid before exit. Every reply of both phases is checked (status and body);
then a `self-check:` line and each stage's us/request as `figure:` lines.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_overhead as po

STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("metrics", ("prometheus_client/",)),
    ("logging", ("ramjet/decisions/log.py", "logging/__init__")),
    ("accounting", ("ramjet/decisions/",)),
    ("views+policies", ("ramjet/policy/", "ramjet/app/modes.py", "ramjet/fleet/views.py")),
    ("parse+keys", ("ramjet/request/parse.py", "ramjet/keys/")),
    ("admission", ("ramjet/request/admission.py",)),
    ("relay", ("ramjet/proxy/stream.py",)),
    ("forward", ("ramjet/proxy/",)),
]
ROUTER_FUNCTIONS = {
    "Router._account": "accounting",
    "Router.handle_completion": "admission",
    "Router._admitted": "views+policies",
    "Router._forward": "forward",
}
IDLE = ("Condition.wait", "Queue.get", "Event.wait")


def stage_of(frames: list[str]) -> str:
    for f in reversed(frames):
        for name, patterns in STAGES:
            if any(p in f for p in patterns):
                return name
        if "ramjet/app/router.py" in f:
            return ROUTER_FUNCTIONS.get(f.split(" (")[0], "router (other)")
    return "accept+parse"


def split(raw: Path) -> tuple[collections.Counter[str], dict[str, collections.Counter[str]]]:
    """Busy samples per stage, and per stage the frames that spent them (self time)."""
    per_stage: collections.Counter[str] = collections.Counter()
    leaves: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in raw.read_text().splitlines():
        if not line.strip():
            continue
        stack, count = line.rsplit(" ", 1)
        frames = stack.split(";")
        if any(frames[-1].startswith(i) for i in IDLE):
            continue
        s = stage_of(frames)
        per_stage[s] += int(count)
        leaves[s][frames[-1]] += int(count)
    return per_stage, leaves


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["observe", "enforce", "round_robin"], default="observe")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--quick", action="store_true", help="--seconds 2 (make bench)")
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--raw", type=Path, help="also keep py-spy's raw samples here")
    ap.add_argument(
        "--stream", action="store_true", help=f"SSE requests ({po.CHUNKS} chunks) instead"
    )
    args = ap.parse_args()
    if args.quick:
        args.seconds = 2.0
    spy = shutil.which("py-spy") or str(Path(po.PY).parent / "py-spy")
    if not Path(spy).exists():
        print("FAILED: py-spy is not installed (pip install -e '.[bench]')", file=sys.stderr)
        return 1
    os.sched_setaffinity(0, po.other_cpus())
    up: subprocess.Popen[bytes] | None = None
    router: po.Target | None = None
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        try:
            ports = [po.free_port(), po.free_port()]
            up = subprocess.Popen(
                [po.PY, po.__file__, "--upstream", ",".join(map(str, ports))],
                preexec_fn=lambda: os.sched_setaffinity(0, po.other_cpus()),
            )
            ups = [f"http://127.0.0.1:{p}" for p in ports]
            for u in ups:
                po.wait_http(u + "/health", proc=up)
            mode = "observe" if args.mode == "round_robin" else args.mode
            router = po.start_ramjet(f"ramjet_{args.mode}", ups, tmp, mode)
            if args.mode == "round_robin":  # the policy work at its least
                assert router.proc is not None
                po.stop(router.proc)
                policy = tmp / "rr.yaml"
                engines = "".join(f"  - id: e{i}\n    url: {u}\n" for i, u in enumerate(ups))
                policy.write_text(
                    f"engines:\n{engines}incumbent:\n  name: round_robin\n"
                    "limits:\n  max_concurrent: 4096\nlogging:\n  level: warning\n"
                )
                port = po.free_port()
                cmd = [po.PY, "-m", "ramjet", "serve", "--policy", str(policy)]
                proc = subprocess.Popen(po.pinned([*cmd, "--port", str(port)]), cwd=po.ROOT)
                router = po.Target("ramjet_round_robin", f"http://127.0.0.1:{port}", proc)
                po.wait_http(router.url + "/readyz", proc=proc)
            uvloop.run(po.verify(router))
            check = partial(po.check_json, router.name, small=True)
            raw_request = po.SMALL_RAW
            if args.stream:
                check, raw_request = partial(po.check_stream, router.name), po.STREAM_RAW
            pids = router.pids()
            c0 = po.cpu_seconds(pids)
            n = uvloop.run(po.closed_loop(router, raw_request, check, args.seconds, 32))
            cpu_us = (po.cpu_seconds(pids) - c0) / n * 1e6
            raw = tmp / "samples.txt"
            assert router.proc is not None
            record = [spy, "record", "-r", str(args.rate), "-f", "raw", "-o", str(raw)]
            rec = subprocess.Popen(
                [*record, "-p", str(router.proc.pid), "-d", str(int(args.seconds) + 1)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(0.5)
            n2 = uvloop.run(po.closed_loop(router, raw_request, check, args.seconds, 32))
            if rec.wait(30) != 0 or not raw.exists():
                print("FAILED: py-spy recorded nothing (ptrace allowed?)", file=sys.stderr)
                return 1
            per_stage, leaves = split(raw)
            if args.raw is not None:
                shutil.copyfile(raw, args.raw)
        finally:
            if router is not None and router.proc is not None:
                po.stop(router.proc)
            if up is not None:
                po.stop(up)
    busy = sum(per_stage.values())
    if busy == 0:
        print("FAILED: no busy samples", file=sys.stderr)
        return 1
    what = f"SSE request ({po.CHUNKS} chunks)" if args.stream else "small request"
    print(
        f"ramjet {args.mode}: {cpu_us:.0f} us CPU per {what} unprofiled "
        f"({n} checked requests); {busy} busy samples under py-spy"
    )
    print(f"{'stage':<16} {'share':>6} {'~us/req':>8}   top frames (self samples)")
    for s, k in per_stage.most_common():
        top = ", ".join(f"{f.split(' (')[0]} {c}" for f, c in leaves[s].most_common(3))
        print(f"{s:<16} {k / busy:6.1%} {cpu_us * k / busy:8.0f}   {top}")
    print(f"figure: proxy profile, CPU per {what} / total, unprofiled = {cpu_us:.0f} us")
    for s, k in per_stage.most_common():
        print(f"figure: proxy profile, CPU per {what} / {s} = {cpu_us * k / busy:.0f} us")
    print(
        f"self-check: all {n + n2} replies checked (status, body), {n2} of them under py-spy; "
        f"{busy} busy samples split by stage"
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except po.BenchError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        sys.exit(1)
