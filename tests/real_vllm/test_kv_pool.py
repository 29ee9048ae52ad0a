"""Two real vLLM engines share prefix KV through our KV connector (`vllm_pool.connector`,
`connectors/vllm_pool/`) and a pool directory in host memory (`kvpool`, under /dev/shm).

- Engine A prefills a 4k-token prompt; engine B, sent the same prompt plus 100 tokens,
  loads the prefix from the pool: its first token comes at least 3x sooner than when B
  computes the prompt cold (measured in the same run), its greedy tokens and their
  logprobs equal the cold run's (the loaded KV is right, not just fast), and the pool
  directory holds exactly the blocks A computed, keyed by A's own block hashes; and the
  pool's signed residency (its reporter, `PoolWatcher` with `VllmPoolKeys`, signing as
  the pool; a router's report processor verifying it) equals the directory's content:
  the router keys of the prompt, the same keys the router computes for it and that A's
  KV events give for A's own copy.
- Both engines serve concurrent multi-turn sessions that move between them, writing and
  reading the pool at once under a capacity small enough to evict: no request fails,
  every answer equals a cold computation of the same prompt, and the pool stays within
  its capacity.

A cold computation is the same request with a fresh `cache_salt`: the salt enters the
first block's hash, so neither the engine's prefix cache nor the pool can supply it.
"""

from __future__ import annotations

import contextlib
import json
import math
import secrets
import shutil
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from vllm_engines import BLOCK, MODEL, RawEvents, VllmEngine, vllm_env

from kvpool import Pool
from ramjet.keys.tokens import chain_keys, token_key_seed

pytestmark = pytest.mark.timeout(900)

CAPACITY_GB = 0.12
"""The pool's capacity: 163 blocks of this model (768 KiB each in float32), enough for the 4k prompt
(128 blocks) and small enough that the concurrent sessions evict."""


@dataclass
class Answer:
    ttft_s: float
    tokens: list[str]
    """as `token_id:N` (`return_tokens_as_token_ids`)"""
    logprobs: list[float]
    top: list[dict[str, float]]
    """each position's 5 most likely tokens and their logprobs"""
    prompt_tokens: int
    cached_tokens: int

    @property
    def token_ids(self) -> list[int]:
        return [int(t.split(":")[1]) for t in self.tokens]


def complete(
    engine: VllmEngine, prompt: list[int], max_tokens: int, cache_salt: str | None = None
) -> Answer:
    """A streamed greedy completion: time to the first token, tokens and logprobs."""
    body: dict[str, Any] = {
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "logprobs": 5, "stream": True, "stream_options": {"include_usage": True},
        "ignore_eos": True, "return_tokens_as_token_ids": True,
    }  # fmt: skip
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    req = urllib.request.Request(
        engine.url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.monotonic()
    ttft = math.inf
    tokens: list[str] = []
    logprobs: list[float] = []
    top: list[dict[str, float]] = []
    usage: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=300) as resp:
        assert resp.status == 200
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                lp = choice.get("logprobs") or {}
                if lp.get("tokens"):
                    ttft = min(ttft, time.monotonic() - t0)
                    tokens += lp["tokens"]
                    logprobs += lp["token_logprobs"]
                    top += lp["top_logprobs"]
    assert len(tokens) == max_tokens, (engine.engine_id, tokens)
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens", 0)
    return Answer(ttft, tokens, logprobs, top, usage["prompt_tokens"], cached)


LOGPROB_TOL = 1e-3
"""How far two computations of the same tokens may differ in a logprob. The engines run
in float32 (`--dtype float32`; vLLM's CPU default would be bfloat16, whose rounding
alone moves these logprobs by up to 1e-2). KV computed in other chunks, or decoded in
other batches, differs in the last bits; the tiny random model's distributions are
nearly flat, so greedy decoding can then flip between two tokens that tie. A wrong
page (one head shifted, keys and values mixed, another block's KV) moves logprobs by
far more than this from the first token on."""


def logprob_gap(a: Answer, b: Answer) -> float:
    return max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True))


def close_answers(a: Answer, b: Answer) -> str | None:
    """None when `a` and `b` are the same greedy decoding up to float noise (vLLM's own
    check_logprobs_close rule): equal tokens with logprobs within LOGPROB_TOL, until a
    position where both chose tokens that tie within LOGPROB_TOL in each other's top 5;
    after such a tie the sequences are different prompts and are not compared."""
    for i, (ta, tb) in enumerate(zip(a.tokens, b.tokens, strict=True)):
        if ta == tb:
            if abs(a.logprobs[i] - b.logprobs[i]) >= LOGPROB_TOL:
                return f"position {i}: {ta} logprob {a.logprobs[i]} vs {b.logprobs[i]}"
            continue
        tie = (
            tb in a.top[i]
            and ta in b.top[i]
            and abs(a.top[i][ta] - a.top[i][tb]) < LOGPROB_TOL
            and abs(b.top[i][ta] - b.top[i][tb]) < LOGPROB_TOL
        )
        return None if tie else f"position {i}: {ta} vs {tb}, no tie: {a.top[i]} {b.top[i]}"
    return None


@dataclass
class PoolPair:
    a: VllmEngine
    b: VllmEngine
    pool: Pool
    raw_a: RawEvents


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolPair]:
    env = vllm_env()  # raises with the reason: these tests never skip
    work = tmp_path_factory.mktemp("kv-pool")
    pool_dir = Path("/dev/shm") / f"ramjet-test-pool-{secrets.token_hex(4)}"

    def args(eid: str) -> tuple[str, ...]:
        extra = {"pool_dir": str(pool_dir), "capacity_gb": CAPACITY_GB,
                 "stats_path": str(work / f"{eid}-pool-stats.json")}  # fmt: skip
        config = {"kv_connector": "PoolConnector", "kv_connector_module_path": "vllm_pool.connector",
                  "kv_role": "kv_both", "kv_connector_extra_config": extra}  # fmt: skip
        return ("--dtype", "float32", "--kv-transfer-config", json.dumps(config))

    engines = [
        VllmEngine(eid, env, core=core, extra_args=args(eid), workdir=work / eid)
        for eid, core in (("pool-a", 0), ("pool-b", 1))
    ]
    raw: RawEvents | None = None
    try:
        for e in engines:
            e.workdir.mkdir()
            e.start()
        for e in engines:
            e.wait_ready()
        for e in engines:  # the first request of an engine pays one-off set-up costs
            complete(e, list(range(10, 10 + 3 * BLOCK)), 2, cache_salt=secrets.token_hex(8))
        raw = RawEvents(engines[0].events_url)
        (namespace,) = list(pool_dir.iterdir())  # both engines: one fingerprint
        pool = Pool(namespace, int(CAPACITY_GB * 2**30))
        time.sleep(0.5)  # ZMQ slow joiner
        yield PoolPair(engines[0], engines[1], pool, raw)
    finally:
        if raw is not None:
            raw.close()
        for e in engines:
            e.stop()
        shutil.rmtree(pool_dir, ignore_errors=True)


def pool_stats(engine: VllmEngine) -> dict[str, int]:
    """The connector's counters (its `stats_path`): tokens loaded from the pool, ..."""
    path = engine.workdir.parent / f"{engine.engine_id}-pool-stats.json"
    try:
        out: dict[str, int] = json.loads(path.read_text())
    except FileNotFoundError:
        return {"loaded_tokens": 0, "loaded_blocks": 0, "save_blocks": 0}
    return out


def pool_residency(pool: Pool, candidates: set[int]) -> set[int]:
    """The pool's residency as a router holds it, among `candidates` (the router keys a
    test expects): the pool's reporter (`PoolWatcher`, vLLM keys) scans the directory
    and signs deltas and a snapshot as the pool; two routers' report processors verify
    them with the pool's public key and fill their tables, one from the deltas, one from
    the snapshot. Every block must map (none unmapped), and each router holds exactly as
    many keys as the pool has blocks."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from ramjet.reports.keys import KeyRing
    from ramjet.reports.processor import ReportProcessor
    from ramjet.reports.publisher import ReportPublisher
    from ramjet.reports.verify import Accepted
    from ramjet.residency.store import Table
    from ramjet.residency.tables import ResidencyTables
    from ramjet.sidecar.pool_watch import PoolWatcher, VllmPoolKeys
    from ramjet.types import EngineId, PrefixKey, Tier

    pool_id = EngineId("vllm-pool")
    key = Ed25519PrivateKey.generate()
    watchers: list[PoolWatcher] = []
    pub = ReportPublisher(pool_id, key, "pool-a", snapshot=lambda: watchers[0].snapshot())
    keymap = VllmPoolKeys(pool, MODEL, BLOCK)
    watcher = PoolWatcher(pool, pub, Tier.HOST, router_key_of=keymap)
    watchers.append(watcher)
    watcher.scan()
    assert watcher.unmapped == 0, keymap.stats
    blocks = len(pool.held_keys())
    held: list[set[int]] = []
    for from_snapshot in (False, True):
        tables = ResidencyTables()
        proc = ReportProcessor(KeyRing({"pool-a": (pool_id, key.public_key())}), tables)
        frames = [pub.snapshot_frame()] if from_snapshot else pub.frames_after(0)
        for frame in frames:
            assert isinstance(proc.submit(frame), Accepted)
        view = tables.view(pool_id)
        held.append({k for k in candidates if view.global_match([PrefixKey(k)], [BLOCK]).total})
        assert tables.size(Table.GLOBAL) == blocks
    assert held[0] == held[1]
    return held[0]


def chain_uses(pool: Pool) -> list[int]:
    """The last use (mtime, ns) of every block of the pool's one chain, from its start
    (the block without a parent) down, followed through the connector's metadata."""
    child: dict[str | None, str] = {}
    for b in pool.listing():
        meta = pool.meta(b.key)
        assert meta is not None, b.key
        child[json.loads(meta)["parent"]] = b.key
    uses, key = [], child.get(None)
    while key is not None:
        uses.append((pool.blocks / key).stat().st_mtime_ns)
        key = child.get(key)
    assert len(uses) == len(child), "the pool holds one chain"
    return uses


def stored_hashes(raw: RawEvents) -> set[Any]:
    with raw.lock:
        return set(raw.resident)


def as_event_hash(key: str, sample: Any) -> Any:
    """A pool key as vLLM's KV events carry block hashes: the bytes, or their low 64
    bits as an int (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)."""
    raw = bytes.fromhex(key)
    return raw if isinstance(sample, bytes) else int.from_bytes(raw, "big") & ((1 << 64) - 1)


def test_engine_b_loads_a_prefix_engine_a_computed(pair: PoolPair) -> None:
    rng = secrets.SystemRandom()
    # 4096 tokens: A computes them in two 2048-token steps, exactly as B cold computes the
    # first 4096 of its 4196, and B warm computes the last 100 as B cold's third step
    # does: the same shapes, so B warm must reproduce B cold bit for bit
    prompt = [rng.randrange(10, 2000) for _ in range(4096)]
    extended = prompt + [rng.randrange(10, 2000) for _ in range(100)]

    # B cold: nothing of this prompt anywhere (then forget it: B's cache, and the pool)
    cold = complete(pair.b, extended, 16)
    assert cold.cached_tokens == 0
    pair.b.reset_prefix_cache()
    pair.pool.evict_to(0)
    assert pair.pool.listing() == []

    # A prefills the prompt: every full block it computes is published, keyed by its hash
    pair.a.reset_prefix_cache()
    time.sleep(0.5)
    before = stored_hashes(pair.raw_a)
    complete(pair.a, prompt, 1)
    deadline = time.monotonic() + 10
    while len(stored_hashes(pair.raw_a) - before) < len(prompt) // BLOCK:
        assert time.monotonic() < deadline, "A's KV events did not arrive"
        time.sleep(0.1)
    computed = stored_hashes(pair.raw_a) - before
    listing = pair.pool.listing()
    files = {p.name: p.stat().st_size for p in (pair.pool.root / "blocks").iterdir()}
    assert {b.key: b.size for b in listing} == files  # the listing is the directory
    sample = next(iter(computed))
    assert {as_event_hash(b.key, sample) for b in listing} == computed
    assert len(listing) == len(prompt) // BLOCK == 128
    assert len(set(files.values())) == 1  # one page size for every block
    assert pair.pool.active_leases() == 0
    seed = token_key_seed(MODEL)
    expected = set(chain_keys(prompt, seed, BLOCK))
    assert pool_residency(pair.pool, expected) == expected == pair.raw_a.keys(seed) & expected
    # one use of the chain, its deepest block least recent: eviction takes the tail first
    assert chain_uses(pair.pool) == sorted(chain_uses(pair.pool), reverse=True)

    # B warm: the prefix comes from the pool
    loaded = pool_stats(pair.b)["loaded_tokens"]
    warm = complete(pair.b, extended, 16)
    assert warm.cached_tokens == len(prompt), warm
    assert pool_stats(pair.b)["loaded_tokens"] - loaded == len(prompt)
    assert warm.tokens == cold.tokens, (warm.tokens, cold.tokens)
    assert logprob_gap(warm, cold) < 1e-4, (warm.logprobs, cold.logprobs)
    print(f"largest logprob difference to the cold run: {logprob_gap(warm, cold):.2e}")
    ratio = cold.ttft_s / warm.ttft_s
    print(f"B cold TTFT {cold.ttft_s:.3f} s, B from the pool {warm.ttft_s:.3f} s: {ratio:.1f}x")
    assert ratio >= 3.0, (cold.ttft_s, warm.ttft_s)
    assert pair.pool.active_leases() == 0  # every lease released after the load


def test_two_engines_share_the_pool_under_concurrent_sessions(pair: PoolPair) -> None:
    rng = secrets.SystemRandom()
    system = [rng.randrange(10, 2000) for _ in range(1024)]
    sessions = [system + [rng.randrange(10, 2000) for _ in range(300)] for _ in range(4)]
    engines = (pair.a, pair.b)
    answers: list[tuple[int, int, list[int], Answer]] = []
    loaded0 = sum(pool_stats(e)["loaded_tokens"] for e in engines)
    failures: list[str] = []
    peak = 0
    done = threading.Event()

    def watch_capacity() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, pair.pool.used_bytes())
            time.sleep(0.02)

    def run_session(s: int) -> None:
        prompt = sessions[s]
        for turn in range(3):
            engine = engines[(s + turn) % 2]  # every turn moves to the other engine
            try:
                ans = complete(engine, prompt, 40)
            except Exception as err:  # recorded: the test fails on any
                failures.append(f"session {s} turn {turn} on {engine.engine_id}: {err!r}")
                return
            answers.append((s, turn, list(prompt), ans))
            prompt = prompt + ans.token_ids + [rng.randrange(10, 2000) for _ in range(100)]

    watcher = threading.Thread(target=watch_capacity, daemon=True)
    watcher.start()
    try:
        with ThreadPoolExecutor(len(sessions)) as ex:
            list(ex.map(run_session, range(len(sessions))))
    finally:
        done.set()
        watcher.join(5)
    assert failures == []
    assert len(answers) == 3 * len(sessions)

    # every answer equals a cold computation of the same prompt on the same engine
    wrong = []
    gaps: list[float] = []
    for s, turn, prompt, ans in answers:
        engine = engines[(s + turn) % 2]
        ref = complete(engine, prompt, 40, cache_salt=secrets.token_hex(8))
        assert ref.cached_tokens == 0
        why = close_answers(ans, ref)
        if why is not None:
            wrong.append((s, turn, engine.engine_id, ans.cached_tokens, why))
        gaps.append(abs(ans.logprobs[0] - ref.logprobs[0]))
    assert wrong == []
    print(f"largest first-token logprob difference to cold computations: {max(gaps):.2e}")
    # a session's second turn, on the engine that has not seen it, found the first
    # turn's blocks (the other engine computed them) in the pool: without the pool that
    # engine holds at most the shared system prompt
    moved = [a.cached_tokens for _, turn, _, a in answers if turn == 1]
    assert sum(c > len(system) for c in moved) >= len(sessions) // 2, moved
    loaded = sum(pool_stats(e)["loaded_tokens"] for e in engines) - loaded0
    print(f"pool-loaded tokens {loaded}, pool peak {peak / 2**20:.0f} MiB")
    assert loaded > 0
    assert 0 < peak <= pair.pool.capacity_bytes
    assert pair.pool.used_bytes() <= pair.pool.capacity_bytes
    assert pair.pool.active_leases() == 0
    with contextlib.suppress(FileNotFoundError):
        assert not list((pair.pool.root / "tmp").iterdir())
