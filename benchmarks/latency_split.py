"""Where a small request's latency goes inside the router at 500 req/s: a syscall timeline
of an instrumented copy of the tree, stage by stage.

    .venv/bin/python benchmarks/latency_split.py                 # observe and enforce, ~6 min
    .venv/bin/python benchmarks/latency_split.py --modes enforce --seconds 3
    .venv/bin/python benchmarks/latency_split.py --quick     # make bench: enforce, 1 s,
                                                             # pure Python, no build

A profiler's samples say where the CPU goes; they do not say what sits between a
request's bytes arriving and the engine's request leaving, which is what the added latency
is made of. This measures that directly:

1. The committed tree (HEAD) is checked out into a scratch git worktree, and a marker
   syscall, `os.umask(N)` (one syscall, never fails, its argument visible to a tracer), is
   put at each stage boundary of the request path (`MARKS` below: each is an exact line of
   the source, so a moved line fails the run rather than measuring something else). The
   product is never changed; the copy is compiled like the product (`scripts/build_native.py`).
2. A router from that copy (`ramjet serve`, pinned to CPU 0, the same set-up as
   `proxy_overhead.py`'s, whose targets this imports from the copy) gets
   `proxy_overhead`'s open loop: a small chat request every 2 ms, every reply checked.
3. `perf record -e raw_syscalls:*` on the router's threads records every syscall with its
   first argument: the client's read, the markers, the engine's write, the engine's
   response read, the client's write.
4. Per request, the time between consecutive events on the event loop's thread; the table
   is each step's median over the steady state (the first quarter dropped), the request
   side (client read to engine write) and the response side (engine read to client write)
   summed, and their share of the added latency.
5. Baselines from the same run, each under the same open loop just before the
   instrumented router: no hop (`direct`: the upstream itself), and the product router
   from this tree's build. The instrumented router's added latency over the product's
   says what the markers and perf cost; the steps' share is of the instrumented one's.

Needs `perf` with tracepoint access (root, or `kernel.perf_event_paranoid` <= 1) and
`taskset`. Every process it starts is stopped by pid; the worktree is removed. `--quick`
runs both routers, the instrumented copy and the product, in pure Python
(`RAMJET_NATIVE=0`): compiling the copy takes minutes, and the split of a pure-Python
router is not the compiled product's (its steps are slower), so a quick run checks the
method and prints its figures, and the full run measures the product. Ends with
a `self-check:` line (every marker line found once and recorded at least 50 times per
step, every reply checked) and each mode's added latency and steps as `figure:` lines.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import importlib.util
import itertools
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]

# (file, exact source line, marker id, the marker goes after the line instead of before)
MARKS: list[tuple[str, str, int, bool]] = [
    ("ramjet/app/fast_server.py", "head = self._parse_head(bytes(buf[: end + 4]))", 32, True),
    ("ramjet/app/fast_server.py", "self.task = self._loop.create_task(self._run(req))", 30, False),
    ("ramjet/app/fast_server.py", "resp = await self._server.handler(req)", 31, False),
    ("ramjet/app/router.py", "self.arrivals.arrive(t0)", 1, False),
    ("ramjet/app/router.py", "return await self._admitted(request, t0, body)", 2, False),
    ("ramjet/app/router.py", "body = await self.admission.read_body(request)", 3, True),
    (
        "ramjet/app/router.py",
        "parsed = parse_request(request.path, body, request.headers, self.parse_limits)",
        4,
        True,
    ),
    ("ramjet/app/router.py", "if not serving:", 5, False),
    (
        "ramjet/app/router.py",
        "outcome = self.modes.decide(rv, views, fleet, session_key, defer=not self.priority)",
        6,
        False,
    ),
    (
        "ramjet/app/router.py",
        "live = next((v for v in views if v.id == outcome.live.engine), None)",
        7,
        False,
    ),
    ("ramjet/app/router.py", "return await self._forward(", 8, False),
    ("ramjet/app/router.py", "resp, res = await self.proxy.forward(", 9, False),
    ("ramjet/proxy/forward.py", "self.budget.active += 1", 10, False),
    (
        "ramjet/proxy/forward.py",
        "upstream = await pool.request(method, path_qs, headers, body)",
        11,
        False,
    ),
    ("ramjet/transport/http1.py", "conn = await self._acquire()", 12, False),
    ("ramjet/proxy/forward.py", "exchange.upstream = upstream", 43, False),
    ("ramjet/proxy/forward.py", "first = await upstream.readany()", 44, True),
    ("ramjet/proxy/forward.py", "if opened is None:", 45, False),
    ("ramjet/proxy/stream.py", "status = upstream.status", 20, False),
    ("ramjet/proxy/stream.py", 'out_headers["X-Ramjet-Engine"] = engine.id', 40, True),
    (
        "ramjet/proxy/stream.py",
        "relay = _Relay(direct, res, self._cfg.limits.stream_buffer_bytes)",
        42,
        True,
    ),
    ("ramjet/proxy/stream.py", "chunk = first", 21, False),
]

# consecutive events -> the stage they bound (events: marker ids, "read", "write")
STAGES: list[tuple[str, str, str, str]] = [
    ("request", "read", "m32", "request head parsed and checked (fast_server)"),
    ("request", "m32", "m30", "request object, body sliced"),
    ("request", "m30", "m31", "handler task created and started"),
    ("request", "m31", "m1", "into the router"),
    ("request", "m1", "m3", "arrival, early refusals, body read"),
    ("request", "m3", "m2", "a forwarding slot"),
    ("request", "m2", "m4", "body parsed, prompt rendered and keyed"),
    ("request", "m4", "m5", "request id, engine views"),
    ("request", "m5", "m6", "request view, session, fleet figures"),
    ("request", "m6", "m7", "the live pick (the accounting-only one deferred)"),
    ("request", "m7", "m8", "in-flight tokens, routed work, priority"),
    ("request", "m8", "m9", "pending residency, exchange"),
    ("request", "m9", "m10", "engine request headers"),
    ("request", "m10", "m11", "attempt, ticket, first-byte deadline"),
    ("request", "m11", "m12", "engine request head"),
    ("request", "m12", "write", "engine connection, write"),
    ("response", "read", "m43", "engine response head parsed, the handler woken"),
    ("response", "m43", "m44", "status checks, first body piece"),
    ("response", "m44", "m45", "attempt closed"),
    ("response", "m45", "m20", "into the relay"),
    ("response", "m20", "m40", "client response headers"),
    ("response", "m40", "m42", "response object and relay"),
    ("response", "m42", "m21", "into the write loop"),
    ("response", "m21", "write", "framing and the client write"),
]


def instrument(tree: Path) -> None:
    by_file: dict[str, list[tuple[str, int, bool]]] = collections.defaultdict(list)
    for f, line, mark, after in MARKS:
        by_file[f].append((line, mark, after))
    for f, marks in by_file.items():
        path = tree / f
        lines = path.read_text().split("\n")
        for line, mark, after in marks:
            hits = [i for i, text in enumerate(lines) if text.strip() == line]
            if len(hits) != 1:
                raise SystemExit(f"latency_split: {f}: {len(hits)} lines are {line!r}")
            i = hits[0]
            indent = re.match(r" *", lines[i])
            assert indent is not None
            pos = i + 1 if after else i
            lines.insert(pos, f"{indent.group(0)}__import__('os').umask({mark})")
        path.write_text("\n".join(lines))


def load_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def events(perf_txt: str) -> list[tuple[float, str]]:
    """The event loop's thread's events: (time, "mN" | "read" | "write")."""
    rows = perf_txt.splitlines()
    tids = collections.Counter(r.split()[0] for r in rows if r.strip())
    main = tids.most_common(1)[0][0]
    out = []
    for r in rows:
        p = r.split()
        if not p or p[0] != main:
            continue
        m = re.search(r"sys_enter: NR (\d+) \(([0-9a-f]+)", r)
        if m is None:
            continue
        nr, arg = int(m.group(1)), int(m.group(2), 16)
        t = float(p[1].rstrip(":"))
        if nr == 95:  # umask
            out.append((t, f"m{arg}"))
        elif nr == 0:
            out.append((t, "read"))
        elif nr == 1:
            out.append((t, "write"))
    return out


def split(evs: list[tuple[float, str]]) -> dict[tuple[str, str], list[float]]:
    evs = evs[len(evs) // 4 :]
    steps: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for (t0, a), (t1, b) in itertools.pairwise(evs):
        steps[(a, b)].append((t1 - t0) * 1e6)
    return steps


def p50_us(lat: list[float]) -> float:
    return statistics.median(lat) * 1e6


def report(
    mode: str,
    steps: dict[tuple[str, str], list[float]],
    lat: list[float],
    direct: list[float],
    product: list[float],
) -> None:
    """The steps of the instrumented router (`lat`: its client-side latencies), against
    the same run's baselines: no hop (`direct`) and the uninstrumented router
    (`product`), each measured just before it under the same open loop."""
    print(f"\n{mode}: median us per step at 500 req/s ({len(lat)} requests checked)")
    sums: dict[str, float] = collections.defaultdict(float)
    for side, a, b, what in STAGES:
        xs = steps.get((a, b), [])
        if len(xs) < 50:
            raise SystemExit(f"latency_split: too few {a}->{b} steps ({len(xs)}): markers missed")
        med = statistics.median(xs)
        sums[side] += med
        print(f"  {side:8s} {a:>5s} -> {b:<5s} {med:7.1f}  {what}")
    steps_us = sums["request"] + sums["response"]
    base = p50_us(direct)
    added, added_product = p50_us(lat) - base, p50_us(product) - base
    print(f"  request side (client read -> engine write): {sums['request']:.0f} us")
    print(f"  response side (engine read -> client write): {sums['response']:.0f} us")
    print(
        f"  added latency p50 (over no hop, {base:.0f} us, same run): instrumented under perf "
        f"+{added:.0f} us, the product router +{added_product:.0f} us "
        f"({added / added_product:.2f}x: what the markers and perf cost)"
    )
    print(f"  the router's steps: {steps_us:.0f} us, {steps_us / added:.0%} of the added latency")
    print(f"figure: latency split, {mode} / added p50, product router = {added_product:.0f} us")
    print(f"figure: latency split, {mode} / added p50, instrumented under perf = {added:.0f} us")
    for side in ("request", "response"):
        print(f"figure: latency split, {mode} / {side} side steps = {sums[side]:.0f} us")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="observe,enforce")
    ap.add_argument("--seconds", type=float, default=2.0, help="open-loop time per mode")
    ap.add_argument(
        "--quick", action="store_true", help="--modes enforce --seconds 1, pure Python, no build"
    )
    args = ap.parse_args()
    if args.quick:
        args.modes, args.seconds = "enforce", 1.0
        os.environ["RAMJET_NATIVE"] = "0"  # both routers (they inherit it); no build
    for tool in ("perf", "taskset", "git"):
        if shutil.which(tool) is None:
            raise SystemExit(f"latency_split: needs {tool}")
    if subprocess.run(
        ["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--", "ramjet"]
    ).returncode:
        print("latency_split: ramjet/ has uncommitted changes; measuring HEAD", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix="ramjet-split-"))
    tree = tmp / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree), "HEAD"], check=True)  # fmt: skip
    try:
        (tree / ".venv").symlink_to(ROOT / ".venv")
        instrument(tree)
        if args.quick:
            print("latency_split: --quick: both routers in pure Python (RAMJET_NATIVE=0)")
        else:
            print("latency_split: building the instrumented copy ...", flush=True)
            # the build script itself, not `make native`: make would see the fresh
            # checkout's pyproject.toml newer than the shared venv's stamp and reinstall
            # the package into that venv from the scratch copy
            subprocess.run([sys.executable, "scripts/build_native.py"], cwd=tree, check=True)
        po = load_module(tree / "benchmarks" / "proxy_overhead.py", "proxy_overhead_split")
        product = load_module(ROOT / "benchmarks" / "proxy_overhead.py", "proxy_overhead_product")
        checked = sum(
            run_mode(po, product, mode, args.seconds, tmp) for mode in args.modes.split(",")
        )
        print(
            f"self-check: all {len(MARKS)} marker lines found once; each step recorded at least "
            f"50 times; {checked} replies of the instrumented routers checked (and the baselines')"
        )
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)  # fmt: skip
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def run_mode(po: ModuleType, product: ModuleType, mode: str, seconds: float, tmp: Path) -> int:
    """`po`: the instrumented copy's proxy_overhead (its routers run the copy), `product`:
    this tree's (its routers run the product build), for the baselines."""
    ports = [po.free_port(), po.free_port()]
    cpus = ",".join(map(str, sorted(po.other_cpus())))
    script = str(po.__file__)
    up = subprocess.Popen(["taskset", "-c", cpus, po.PY, script, "--upstream", ",".join(map(str, ports))])  # fmt: skip
    target = None
    try:
        ups = [f"http://127.0.0.1:{p}" for p in ports]
        for u in ups:
            po.wait_http(u + "/v1/models", proc=up)
        # the baselines, in this run: no hop, then the product router (stopped after)
        direct = asyncio.run(po.open_loop(po.Target("direct", ups[0]), 500, seconds))
        base = product.start_ramjet(f"product_{mode}", ups, tmp, mode)
        try:
            asyncio.run(product.verify(base))
            asyncio.run(product.open_loop(base, 500, 1.0))  # warm
            product_lat = asyncio.run(product.open_loop(base, 500, seconds))
        finally:
            product.stop(base.proc)
        target = po.start_ramjet(f"split_{mode}", ups, tmp, mode)
        asyncio.run(po.verify(target))
        asyncio.run(po.open_loop(target, 500, 1.0))  # warm
        data = tmp / f"{mode}.perf"
        rec = subprocess.Popen(
            ["perf", "record", "-q", "-e", "raw_syscalls:sys_enter", "-o", str(data),
             "-p", ",".join(map(str, target.pids())), "--", "sleep", str(seconds + 1.0)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(0.3)
        print(f"latency_split: {mode}: {seconds:.0f} s at 500 req/s under perf ...", flush=True)
        lat = asyncio.run(po.open_loop(target, 500, seconds))
        rec.wait()
        txt = subprocess.run(
            ["perf", "script", "-i", str(data), "-F", "tid,time,event,trace"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        report(mode, split(events(txt)), lat, direct, product_lat)
        return len(lat)
    finally:
        if target is not None and target.proc is not None:
            po.stop(target.proc)
        up.terminate()
        up.wait()


if __name__ == "__main__":
    sys.exit(main())
