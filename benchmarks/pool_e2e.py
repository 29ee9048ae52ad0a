"""One fleet cache on the reference engines (issue 30): Ramjet enforce (`tier_aware`) on two
engines that share a host pool of global KV and an SWA pool, against Ramjet enforce on
the same engines as islands, against SMG `cache_aware` on the pool engines (its engines
pull from the pool on a miss whatever SMG knows), in one run.

    flock /tmp/ramjet-bench.lock .venv/bin/python benchmarks/pool_e2e.py [--quick]

Each arm gets fresh processes (`tests/helpers/pool_fleet.py`): two reference engines
(window 128, startup profile `fast`, so the router prices them as measured), the pools'
reporters and the router, all on loopback. The two engines are identical, so Ramjet's
policy names them one `profile_group` (`--profile-group`, default `ref`): each probes
itself at startup, and on a loaded host two probes differ by 2-5x; priced apart, the
luckier engine draws the sessions.

Workloads (closed loop, the same prompts in every arm): `--sessions` agent sessions
share a `--system-tokens` system prompt; `--concurrency` of them run at once, a slot
taking the next session when its session ends (an agent fleet). Each turn appends a tool
output (seeded) and the next turn is sent when the answer has arrived (`--max-tokens`
tokens; the assistant message appended is fixed text, so prompts do not depend on what
was generated). A moved session recomputes its prefix unless it can pull it from the
pool.

- `mixed` (default): sessions of unequal length (2 to `--max-turns` turns), tool outputs
  of 150-700 tokens. As sessions end and start, the load on the two engines becomes
  unequal, so a balancer may move sessions.
- `move`: sessions MUST move to stay balanced: 3 at once on two engines (an odd count,
  so a router that keeps every session on its engine leaves one engine with two and the
  other with one), each long (`--max-turns` / 2 to `--max-turns` turns) with tool
  outputs of 300-900 tokens, so a turn's prefill is long enough to queue behind.
  A move is counted as load-driven when, as the turn was sent, the session's previous
  engine had more of the benchmark's requests in flight than the engine it went to.

Checked (`self-check:`): every response 200, streamed content, `[DONE]`, usage with
`prompt_work`; each (session, turn) has the same prompt size in every arm; the islands
arm pulls nothing from a pool; the pool arms' moved sessions pull. Printed per arm: mean,
p50, p99 TTFT (request sent to first content chunk), prompt tokens prefilled (prompt -
cached), tokens pulled from the pool, tokens replayed, session moves; then the ratios of
Ramjet with the pool to each other arm (and per round each engine's startup profile's
prefill of 1,024 tokens: the router prices on it, so engines whose profiles disagree
are not priced alike), per round (each round runs every arm once,
alternating, so the arms of one round share the machine's load) and their mean over the
`--rounds` rounds; the pooled table sums every round's requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

from pool_fleet import pool_fleet  # noqa: E402
from sse import sse_data  # noqa: E402

from ramjet.policy.profile import EngineProfile  # noqa: E402

MODEL = "mini-v4"
PROFILE_PROBE_TOKENS = 1024
ARMS = ("ramjet_enforce_pool", "ramjet_enforce", "smg_cache_aware_pool")


class BenchError(RuntimeError):
    """A response that is not what was asked for: the run stops."""


@dataclass
class Result:
    session: int
    turn: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    pool_tokens: int
    replayed_tokens: int
    engine: str
    round: int = 0
    sent: float = 0.0
    ended: float = 0.0


@dataclass
class Run:
    name: str
    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0
    round_wall_s: dict[int, float] = field(default_factory=dict)
    profiled_s: dict[str, float] = field(default_factory=dict)
    """Per engine: its startup profile's prefill of `PROFILE_PROBE_TOKENS` tokens (the
    router prices on it; engines that disagree here are not priced alike)."""
    round_profiled_s: dict[int, dict[str, float]] = field(default_factory=dict)

    def moves(self) -> tuple[int, int]:
        """(turns sent to another engine than the session's previous turn, those of them
        sent while the previous engine had more requests in flight than the new one)."""
        last: dict[tuple[int, int], str] = {}
        n = driven = 0
        for r in sorted(self.results, key=lambda r: (r.round, r.session, r.turn)):
            s = (r.round, r.session)
            if s in last and last[s] != r.engine:
                n += 1
                driven += self.in_flight(r, last[s]) > self.in_flight(r, r.engine)
            last[s] = r.engine
        return n, driven

    def in_flight(self, at: Result, engine: str) -> int:
        """Other requests of `at`'s round on `engine`, sent and not ended as `at` was sent."""
        return sum(
            1
            for x in self.results
            if x is not at and x.round == at.round and x.engine == engine
            and x.sent <= at.sent < x.ended
        )  # fmt: skip

    def round_of(self, rnd: int) -> Run:
        rs = [r for r in self.results if r.round == rnd]
        return Run(self.name, rs, self.round_wall_s.get(rnd, 0.0),
                   profiled_s=self.round_profiled_s.get(rnd, {}))  # fmt: skip


def tool_output(session: int, turn: int, tokens: int) -> str:
    words = ("read", "file", "line", "test", "patch", "error", "assert", "value", "diff")
    out: list[str] = []
    i = 0
    while sum(len(w) + 1 for w in out) < tokens:
        out.append(f"{words[(session * 7 + turn * 3 + i) % len(words)]}{(session + i) % 89}")
        i += 1
    return " ".join(out)[:tokens]


def plan(sessions: int, max_turns: int, seed: int, workload: str = "mixed") -> list[list[int]]:
    """Tool-output sizes per session and turn (byte tokenizer: one token per byte), for
    the workload (module docstring)."""
    rng = random.Random(seed)
    if workload == "move":
        turns = [rng.randint(max(2, max_turns // 2), max_turns) for _ in range(sessions)]
        return [[rng.randint(300, 900) for _ in range(n)] for n in turns]
    turns = [rng.randint(2, max_turns) for _ in range(sessions)]
    return [[rng.randint(150, 700) for _ in range(n)] for n in turns]


async def stream_chat(
    http: aiohttp.ClientSession,
    url: str,
    messages: list[dict[str, Any]],
    max_tokens: int,
    sid: str,
) -> tuple[float, dict[str, Any], str]:
    """(TTFT, usage, engine id) of one streamed request."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    async with http.post(url + "/v1/chat/completions", json=body,
                         headers={"X-Session-Id": sid}) as r:  # fmt: skip
        if r.status != 200:
            raise BenchError(f"{url}: HTTP {r.status}: {(await r.text())[:300]}")
        engine = r.headers.get("X-Engine-Id", "?")
        done, ttft, usage = await _read_stream(r, t0)
    if not done or ttft is None or usage is None or "prompt_work" not in usage:
        raise BenchError(f"{url}: stream without content/usage.prompt_work/[DONE]: {usage}")
    return ttft, usage, engine


async def _read_stream(
    r: aiohttp.ClientResponse, t0: float
) -> tuple[bool, float | None, dict[str, Any] | None]:
    ttft: float | None = None
    usage: dict[str, Any] | None = None
    done = False
    async for data in sse_data(r.content.iter_any()):
        if data == b"[DONE]":
            done = True
            continue
        obj = json.loads(data)
        for ch in obj.get("choices") or []:
            if (ch.get("delta") or {}).get("content") and ttft is None:
                ttft = time.perf_counter() - t0
        if obj.get("usage"):
            usage = obj["usage"]
    return done, ttft, usage


async def workload(url: str, sizes: list[list[int]], args: argparse.Namespace) -> list[Result]:
    system = tool_output(999, 0, args.system_tokens)
    out: list[Result] = []
    total = sum(len(s) for s in sizes)

    async def one(si: int, turns: list[int], http: aiohttp.ClientSession) -> None:
        msgs: list[dict[str, Any]] = [{"role": "system", "content": system}]
        for ti, n in enumerate(turns):
            msgs.append({"role": "user", "content": f"s{si} t{ti}: " + tool_output(si, ti, n)})
            sent = time.perf_counter()
            ttft, usage, engine = await stream_chat(http, url, msgs, args.max_tokens, f"s{si}")
            w = usage["prompt_work"]
            out.append(Result(si, ti, ttft, usage["prompt_tokens"],
                              usage["prompt_tokens_details"]["cached_tokens"],
                              int(w.get("pool_tokens", 0)), int(w["replayed_tokens"]), engine,
                              sent=sent, ended=time.perf_counter()))  # fmt: skip
            print(f"\r  {len(out)}/{total} requests", end="", flush=True)
            msgs.append({"role": "assistant", "content": f"ok {ti}"})

    todo = list(enumerate(sizes))

    async def slot(http: aiohttp.ClientSession) -> None:
        while todo:
            si, turns = todo.pop(0)
            await one(si, turns, http)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        await asyncio.gather(*(slot(http) for _ in range(args.concurrency)))
    print()
    return out


async def run_arm(name: str, tmp: Path, sizes: list[list[int]], args: argparse.Namespace) -> Run:
    pools = name.endswith("_pool")
    router = "smg" if name.startswith("smg") else "ramjet"
    flags = {"window": 128, "profile": "fast", "max_gen": args.max_tokens, "threads": 1}
    group = args.profile_group or None
    with pool_fleet(
        tmp / name, pools=pools, router=router, engine_flags=flags, profile_group=group
    ) as f:
        assert f.router_url is not None
        await asyncio.sleep(1.0)  # the router's first pulls of reports and profiles
        t0 = time.monotonic()
        results = await workload(f.router_url, sizes, args)
        run = Run(name, results, time.monotonic() - t0)
        async with aiohttp.ClientSession() as http:
            for eid, eng in sorted(f.engines.items()):
                async with http.get(eng.url + "/profile") as r:
                    prof = EngineProfile.model_validate(await r.json())
                run.profiled_s[eid] = prof.prefill_seconds(PROFILE_PROBE_TOKENS)
        return run


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def figures(run: Run) -> dict[str, float]:
    t = [r.ttft_s for r in run.results]
    return {
        "mean": statistics.fmean(t),
        "p50": pct(t, 0.5),
        "p99": pct(t, 0.99),
        "prefilled": float(sum(r.prompt_tokens - r.cached_tokens for r in run.results)),
        "pool": float(sum(r.pool_tokens for r in run.results)),
        "replayed": float(sum(r.replayed_tokens for r in run.results)),
        "moves": float(run.moves()[0]),
        "load_moves": float(run.moves()[1]),
    }


def check(runs: list[Run], workload: str = "mixed") -> list[str]:
    """The self-checks; a list of failures (empty: all hold)."""
    bad = []
    if workload == "move":
        for r in runs:
            if r.name == "ramjet_enforce_pool" and figures(r)["load_moves"] == 0:
                bad.append(f"{r.name}: no load-driven move on the move workload")
    sizes = {r.name: {(x.session, x.turn): x.prompt_tokens for x in r.results} for r in runs}
    first = runs[0].name
    for r in runs[1:]:
        if sizes[r.name] != sizes[first]:
            bad.append(f"{r.name}: prompts differ from {first}'s")
    for r in runs:
        f = figures(r)
        if not r.name.endswith("_pool") and f["pool"] != 0:
            bad.append(f"{r.name}: pulled {f['pool']:.0f} tokens with no pool")
        if r.name.endswith("_pool") and f["moves"] > 0 and f["pool"] == 0:
            bad.append(f"{r.name}: {f['moves']:.0f} moves and nothing pulled from the pool")
    return bad


def print_table(runs: list[Run]) -> None:
    print("| arm | requests | mean TTFT s | p50 s | p99 s | prefilled tokens | pool-loaded tokens "
          "| replayed | moves (load-driven) | per engine | wall s | profiled prefill 1k s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        f = figures(r)
        per: dict[str, int] = {}
        for x in r.results:
            per[x.engine] = per.get(x.engine, 0) + 1
        print(f"| {r.name} | {len(r.results)} | {f['mean']:.3f} | {f['p50']:.3f} | {f['p99']:.3f} "
              f"| {f['prefilled']:.0f} | {f['pool']:.0f} | {f['replayed']:.0f} "
              f"| {f['moves']:.0f} ({f['load_moves']:.0f}) "
              f"| {' '.join(f'{k}:{v}' for k, v in sorted(per.items()))} | {r.wall_s:.1f} "
              f"| {' '.join(f'{k}:{v:.3f}' for k, v in sorted(r.profiled_s.items())) or '-'} |")  # fmt: skip


def print_ratios(runs: list[Run], rounds: int) -> None:
    """Ramjet with the pool over each other arm, per round and the mean over rounds."""
    by = {r.name: r for r in runs}
    pool = by.get("ramjet_enforce_pool")
    if pool is None:
        return
    print("\n| ramjet_enforce_pool / | round | mean TTFT | p99 TTFT | prefilled |")
    print("|---|---|---|---|---|")
    for other in ("ramjet_enforce", "smg_cache_aware_pool"):
        if other not in by:
            continue
        per: list[tuple[float, float, float]] = []
        for rnd in range(rounds):
            a, b = figures(pool.round_of(rnd)), figures(by[other].round_of(rnd))
            ratio = (a["mean"] / b["mean"], a["p99"] / b["p99"],
                     a["prefilled"] / max(b["prefilled"], 1))  # fmt: skip
            per.append(ratio)
            print(f"| {other} | {rnd + 1} | {ratio[0]:.2f}x | {ratio[1]:.2f}x | {ratio[2]:.2f}x |")
        m = [statistics.fmean(x[i] for x in per) for i in range(3)]
        lo = [min(x[i] for x in per) for i in range(3)]
        hi = [max(x[i] for x in per) for i in range(3)]
        print(f"| {other} | mean of {rounds} | {m[0]:.2f}x ({lo[0]:.2f}-{hi[0]:.2f}) "
              f"| {m[1]:.2f}x ({lo[1]:.2f}-{hi[1]:.2f}) | {m[2]:.2f}x ({lo[2]:.2f}-{hi[2]:.2f}) |")  # fmt: skip
    for other in ("ramjet_enforce", "smg_cache_aware_pool"):
        if other not in by:
            continue
        ratios = [
            figures(pool.round_of(k))["mean"] / figures(by[other].round_of(k))["mean"]
            for k in range(rounds)
        ]
        print(f"pool e2e result: ramjet_enforce_pool / {other}: mean TTFT "
              f"{statistics.fmean(ratios):.2f}x, the mean of {rounds} rounds' ratios "
              f"({', '.join(f'{x:.2f}' for x in ratios)})")  # fmt: skip


async def main_async(args: argparse.Namespace) -> int:
    sizes = plan(args.sessions, args.max_turns, args.seed, args.workload)
    arms = [a for a in ARMS if a in args.only.split(",")]
    turns = [len(s) for s in sizes]
    tools = "300-900" if args.workload == "move" else "150-700"
    print(f"workload {args.workload}: sessions {len(turns)} ({args.concurrency} at once), "
          f"turns {turns} ({sum(turns)} requests per arm), system {args.system_tokens} tokens, "
          f"tool outputs {tools} tokens, max_tokens {args.max_tokens}")  # fmt: skip
    by_name: dict[str, Run] = {}
    with tempfile.TemporaryDirectory(prefix="pool-e2e-") as tmp:
        for rnd in range(args.rounds):  # arms alternate, so they share the machine's noise
            for name in arms:
                print(f"== round {rnd + 1}/{args.rounds}: {name}")
                run = await run_arm(name, Path(tmp) / f"r{rnd}", sizes, args)
                for x in run.results:
                    x.round = rnd
                total = by_name.setdefault(name, Run(name))
                total.results += run.results
                total.wall_s += run.wall_s
                total.round_wall_s[rnd] = run.wall_s
                total.round_profiled_s[rnd] = run.profiled_s
    runs = list(by_name.values())
    print()
    for rnd in range(args.rounds):
        print(f"round {rnd + 1}:")
        print_table([r.round_of(rnd) for r in runs])
    print("all rounds pooled:")
    print_table(runs)
    for r in runs:
        f = figures(r)
        print(f"figure: pool e2e mean TTFT / {r.name} = {f['mean']:.4f} s")
        print(f"figure: pool e2e prefilled / {r.name} = {f['prefilled']:.0f} tokens")
        print(f"figure: pool e2e pool-loaded / {r.name} = {f['pool']:.0f} tokens")
    print_ratios(runs, args.rounds)
    if args.dump:
        with open(args.dump, "w") as out:
            for r in runs:
                for x in sorted(r.results, key=lambda x: (x.session, x.turn)):
                    out.write(json.dumps({"arm": r.name, **x.__dict__}) + "\n")
    bad = check(runs, args.workload)
    if bad:
        print("self-check: FAILED: " + "; ".join(bad))
        return 1
    print(f"self-check: ok: {sum(len(r.results) for r in runs)} responses 200 with content, "
          "[DONE] and prompt_work; identical prompts in every arm; no pool tokens without a "
          "pool; moved sessions pulled from the pool")  # fmt: skip
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", choices=("mixed", "move"), default="mixed",
                   help="module docstring; move: defaults --sessions 6 --concurrency 3 "
                   "--max-turns 12")  # fmt: skip
    p.add_argument("--sessions", type=int, default=None, help="default 12 (move: 6)")
    p.add_argument("--concurrency", type=int, default=None, help="at once; default 4 (move: 3)")
    p.add_argument("--max-turns", type=int, default=None, help="default 10 (move: 12)")
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=30)
    p.add_argument("--only", default=",".join(ARMS), help=f"arms, of {', '.join(ARMS)}")
    p.add_argument(
        "--profile-group",
        default="ref",
        help="the two engines' profile_group in Ramjet's policy (identical engines: priced "
        "with their probed profiles' mean); '' for none, each priced on its own probe",
    )
    p.add_argument("--rounds", type=int, default=2, help="rounds of every arm, alternating")
    p.add_argument("--dump", default=None, help="write every request's figures here (JSONL)")
    p.add_argument(
        "--quick", action="store_true", help="--sessions 6 --concurrency 3 --max-turns 6 --rounds 1"
    )
    args = p.parse_args()
    move = args.workload == "move"
    for k, mixed, moving in (("sessions", 12, 6), ("concurrency", 4, 3), ("max_turns", 10, 12)):
        if getattr(args, k) is None:
            setattr(args, k, moving if move else mixed)
    if args.quick:
        args.sessions, args.concurrency, args.max_turns, args.rounds = 6, 3, 6, 1
    try:
        return asyncio.run(main_async(args))
    except BenchError as exc:
        print(f"self-check: FAILED: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
