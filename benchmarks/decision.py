"""Decision time, and what the candidate adds to the router's per-request CPU in observe mode.

    .venv/bin/python benchmarks/decision.py [--repeats N] [--requests N]

1. For a 4 KB, 100 KB and 4 MB chat body (`benchmarks/prefix_keys.make_body`), the median
   of: parse (`parse_request`: JSON decode, validation, rendering, keys), keys alone
   (`render_chat` + `compute_keys`, part of parse), lookups (both engines' residency
   views: `global_match` + `swa_match` on populated `ResidencyTables`), and scoring (the
   `tier_aware` pick minus its lookups), plus the incumbent's (`prefix_affinity`) pick
   as the baseline measured in the same run; and `decision`, the whole decision after
   parsing as the router makes it in observe mode (fresh views, both picks sharing their
   lookups, the live engine's uncached tokens), with its ratio to parse. Every timed
   call gets fresh views: a view keeps its lookups for one request.
2. A real router process (`python -m ramjet serve`) in front of two in-process fake
   upstreams, `--requests` sequential 4 KB and 100 KB requests, incumbent alone vs observe
   mode with the candidate: the router process's CPU time per request (utime + stime from
   /proc/<pid>/stat) and the share of it the candidate adds.

Checked before the figures are printed (`self-check:` line; any miss stops the run): the
parsed request's model, message count and prompt tokens match the body sent; both
policies pick e0, the engine holding the whole prefix (e1 holds half, loads are equal);
every router answer is 200 with the upstream's exact stream (its 4 chunks, the finish
chunk and [DONE], byte for byte), and each upstream
received every request it was sent with the body's messages intact (JSON-parsed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))

from fake_upstream import Behavior, FakeUpstream, completion_body, sse_chunk
from prefix_keys import make_body

from ramjet.keys.prefix import compute_keys, key_seed, render_chat
from ramjet.policy.base import EngineLoad, EngineView, FleetStats
from ramjet.policy.baselines import PrefixAffinity
from ramjet.policy.candidates import uncached_prompt_tokens
from ramjet.policy.tier_aware import TierAware
from ramjet.request.parse import ParseLimits, parse_request, to_request_view
from ramjet.residency.tables import ResidencyTables
from ramjet.types import EngineId

PATH = "/v1/chat/completions"


class BenchError(RuntimeError):
    """A check failed: the figures would not measure what they claim."""


LIMITS = ParseLimits(max_body_bytes=64 << 20)
SIZES = (("4 KB", 4 << 10), ("100 KB", 100 << 10), ("4 MB", 4 << 20))


def median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def decision_breakdown(size: int, repeats: int) -> dict[str, float]:
    body = make_body(size)
    headers = {"Content-Type": "application/json"}
    parsed = parse_request(PATH, body, headers, LIMITS)
    obj = json.loads(body)
    rv = to_request_view(parsed, "r1")
    if parsed.model != obj["model"] or not rv.block_keys or rv.prompt_tokens <= 0:
        raise BenchError(f"{size} B body: parsed {parsed.model!r}, {len(rv.block_keys)} blocks")
    # e0 holds the whole prefix (recorded as routed); e1 the first half of it.
    tables = ResidencyTables()
    now = time.monotonic()
    tables.record_routed(EngineId("e0"), parsed.keys, now)
    half = dataclasses.replace(
        parsed.keys,
        blocks=parsed.keys.blocks[: len(parsed.keys.blocks) // 2],
        boundaries=parsed.keys.boundaries[:1],
    )
    tables.record_routed(EngineId("e1"), half, now)
    load = EngineLoad(inflight_requests=1, inflight_prompt_tokens=500)

    def fresh_views() -> list[EngineView]:
        # as the router does per request: a view answers for one request and one instant
        # (and keeps its lookups for the other policies), so every timed call gets new ones
        return [EngineView(EngineId(e), True, load, tables.view(EngineId(e), now)) for e in ("e0", "e1")]  # fmt: skip

    fleet = FleetStats(now_s=now, arrival_rate_per_s=20.0, mean_wait_s=0.05)
    cand, inc = TierAware(), PrefixAffinity()
    seed = key_seed(parsed.model)
    for p in (cand, inc):
        got = p.pick(rv, fresh_views(), fleet).engine
        if got != "e0":
            raise BenchError(f"{size} B body: {p.name} picked {got}, not e0 (whole prefix)")

    def lookups() -> None:
        for v in fresh_views():
            v.residency.global_match(rv.block_keys, rv.block_tokens)
            v.residency.swa_match(rv.boundary_keys)

    def decision() -> None:
        # the router's whole decision after parsing: views, both picks (observe mode) and
        # the live engine's predicted uncached tokens
        views = fresh_views()
        live = inc.pick(rv, views, fleet)
        cand.pick(rv, views, fleet)
        uncached_prompt_tokens(rv, next(v for v in views if v.id == live.engine))

    out = {
        "parse": median_s(lambda: parse_request(PATH, body, headers, LIMITS), repeats),
        "keys": median_s(
            lambda: compute_keys(render_chat(obj["messages"], obj.get("tools")), seed), repeats
        ),
        "lookups": median_s(lookups, repeats * 4),
        "candidate_pick": median_s(lambda: cand.pick(rv, fresh_views(), fleet), repeats * 4),
        "incumbent_pick": median_s(lambda: inc.pick(rv, fresh_views(), fleet), repeats * 4),
        "decision": median_s(decision, repeats * 4),
    }
    out["scoring"] = max(out["candidate_pick"] - out["lookups"], 0.0)
    out["blocks"] = float(len(rv.block_keys))
    return out


# -- router CPU share ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


async def router_cpu_per_request(
    urls: list[str], candidate: bool, body: bytes, n: int, tmp: Path, answers: set[bytes]
) -> float:
    policy: dict[str, Any] = {
        "engines": [
            {"id": f"e{i}", "url": u, "models": ["ramjet-ref"]} for i, u in enumerate(urls)
        ],
        "incumbent": {"name": "prefix_affinity"},
        "mode": {"kind": "observe", "candidate_budget_s": 1.0},
    }
    if candidate:
        policy["candidate"] = {"name": "tier_aware"}
    pf = tmp / f"policy-{candidate}.yaml"
    pf.write_text(yaml.safe_dump(policy))
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ramjet", "serve", "--policy", str(pf), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}{PATH}"
    try:
        async with aiohttp.ClientSession() as s:
            deadline = time.monotonic() + 30
            while True:
                with contextlib.suppress(aiohttp.ClientError):  # not listening yet
                    async with s.get(f"http://127.0.0.1:{port}/healthz") as r:
                        if r.status == 200:
                            break
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("router did not start")
                await asyncio.sleep(0.1)
            hdr = {"Content-Type": "application/json"}
            for _ in range(20):  # warm-up
                async with s.post(url, data=body, headers=hdr) as r:
                    await r.read()
            c0 = _cpu_s(proc.pid)
            for _ in range(n):
                async with s.post(url, data=body, headers=hdr) as r:
                    got = await r.read()
                    if r.status != 200 or got not in answers:
                        raise BenchError(f"router answered {r.status} {got[:200]!r}")
            return (_cpu_s(proc.pid) - c0) / n
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def expected_answer(u: FakeUpstream, stream: bool) -> bytes:
    """The exact body `u` sends: its completion, or its chunks, the finish chunk, [DONE]."""
    if not stream:
        return completion_body(u.name, u.model)
    n = Behavior().chunks
    chunks = [sse_chunk(u.name, u.model, i) for i in range(n)]
    return b"".join([*chunks, sse_chunk(u.name, u.model, n, finish=True), b"data: [DONE]\n\n"])


async def cpu_share(n: int) -> list[tuple[str, float, float]]:
    ups = [FakeUpstream("e0"), FakeUpstream("e1")]
    for u in ups:
        await u.start()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            seen = {u.name: 0 for u in ups}
            for label, size in SIZES[:2]:
                body = make_body(size)
                sent = json.loads(body)
                answers = {expected_answer(u, bool(sent.get("stream"))) for u in ups}
                urls = [u.url for u in ups]
                base = await router_cpu_per_request(urls, False, body, n, Path(tmp), answers)
                obs = await router_cpu_per_request(urls, True, body, n, Path(tmp), answers)
                rows.append((label, base, obs))
                got = [r for u in ups for r in u.generation_requests()[seen[u.name] :]]
                seen = {u.name: len(u.generation_requests()) for u in ups}
                intact = sum(json.loads(r.body)["messages"] == sent["messages"] for r in got)
                if len(got) != 2 * (n + 20) or intact != len(got):
                    raise BenchError(
                        f"{label}: upstreams got {len(got)} of {2 * (n + 20)} requests, "
                        f"{intact} with the messages sent"
                    )
    finally:
        for u in ups:
            await u.stop()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--no-router", action="store_true", help="skip the router CPU share (2.)")
    args = ap.parse_args()
    picks: dict[str, float] = {}
    print("decision time, median (ms):")
    print(f"{'body':>7} {'blocks':>7} {'parse':>9} {'(keys)':>9} {'lookups':>9} {'scoring':>9} "
          f"{'cand pick':>9} {'inc pick':>9} {'cand/inc':>8} {'decision':>9} {'dec/parse':>9}")  # fmt: skip
    for label, size in SIZES:
        r = decision_breakdown(
            size, args.repeats if size < (1 << 20) else max(args.repeats // 3, 3)
        )
        ms = {k: v * 1e3 for k, v in r.items()}
        picks[label] = r["candidate_pick"]
        print(
            f"{label:>7} {int(r['blocks']):>7} {ms['parse']:9.3f} {ms['keys']:9.3f} "
            f"{ms['lookups']:9.3f} {ms['scoring']:9.3f} {ms['candidate_pick']:9.3f} "
            f"{ms['incumbent_pick']:9.3f} {r['candidate_pick'] / r['incumbent_pick']:8.2f}"
            f" {ms['decision']:9.3f} {r['decision'] / r['parse']:9.2f}"
        )
    checked = "parsed model and prompt match each body; both policies pick e0 (whole prefix)"
    if args.no_router:
        print(f"self-check: {checked}")
        return 0
    print(f"\nrouter process CPU per request, {args.requests} sequential requests (ms):")
    print("(CPU clock ticks are 10 ms: the measured share is +-0.01/requests s per request;")
    print(" 'pick/CPU' is the candidate's median pick time over the observe router's CPU.)")
    print(
        f"{'body':>7} {'incumbent only':>15} {'observe+cand':>13} {'measured share':>15}"
        f" {'pick/CPU':>9}"
    )
    rows = asyncio.run(cpu_share(args.requests))
    for label, base, obs in rows:
        share = (obs - base) / obs if obs > 0 else float("nan")
        est = picks[label] / obs if obs > 0 else float("nan")
        print(
            f"{label:>7} {base * 1e3:15.3f} {obs * 1e3:13.3f} {share * 100:14.1f}%"
            f" {est * 100:8.1f}%"
        )
        print(
            f"figure: decision: router CPU per request / {label}, incumbent only = {base * 1e6:.0f} us"
        )
        print(
            f"figure: decision: router CPU per request / {label}, observe + candidate = {obs * 1e6:.0f} us"
        )
    print(
        f"self-check: {checked}; every router answer 200 with the upstream's exact stream (4 chunks, finish, [DONE]), "
        f"every request reached an upstream with its messages intact ({4 * (args.requests + 20)} checked)"
    )
    label = SIZES[0][0]
    print(
        f"decision result: the candidate's pick takes {picks[label] * 1e3:.3f} ms on a {label} "
        f"body, {picks[label] / rows[0][2] * 100:.1f}% of the observe router's CPU per request"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
