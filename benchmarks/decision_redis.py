"""Decision time (residency lookups + policy scoring) with the Redis store against the
in-process store, measured in the same run on a real redis-server on loopback.

    .venv/bin/python benchmarks/decision_redis.py [--sessions 64] [--kb 128] [--decisions 2000]

Three ways to serve the lookups a decision needs:
- memory: `ResidencyTables` over `MemoryStore` (the default);
- redis mirror: `ResidencyTables` over `RedisStore` (lookups read its local mirror, which
  the background sync keeps up with Redis; what `store.kind: redis` runs);
- redis direct: the naive design for contrast: before each pick, fetch the request's
  block entries from Redis (one MGET per engine), then score. One string key per entry
  is what that design reads, so the store here writes the per-key encoding
  (`encoding: keys`); the mirror's lookups do not depend on the encoding. (With the
  packed default those keys do not exist: every direct read missed, and the pick check
  below failed.)
Each decision scores both `prefix_affinity` and `tier_aware` over two engines. Printed:
p50 and p99 per decision, and the ratios against memory. Needs `redis-server` on PATH;
starts one on a free port in a temp dir and stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import cast

from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
from redis_server import redis_server

from ramjet.policy.base import EngineLoad, EngineView, FleetStats, RequestView
from ramjet.policy.registry import create_policy
from ramjet.request.parse import ParseLimits, parse_request, to_request_view
from ramjet.residency.config import ResidencyConfig
from ramjet.residency.redis_link import RedisLink, RedisSettings
from ramjet.residency.redis_scripts import EngineKeys, key16
from ramjet.residency.redis_store import RedisStore
from ramjet.residency.store import Table
from ramjet.residency.tables import ResidencyTables, ViewMode
from ramjet.types import EngineId, PrefixKey, Tier

ENGINES = (EngineId("e0"), EngineId("e1"))
CFG = ResidencyConfig()


def requests(sessions: int, kb: int) -> list[RequestView]:
    rng = random.Random(1)
    out = []
    for s in range(sessions):
        text = "".join(rng.choice("abcdefgh \n") for _ in range(kb * 1024))
        body = {
            "model": "m",
            "messages": [{"role": "system", "content": text}, {"role": "user", "content": f"q{s}"}],
        }
        parsed = parse_request("/v1/chat/completions", json.dumps(body).encode(), {}, ParseLimits())
        out.append(to_request_view(parsed, f"r{s}"))
    return out


def fill(tables: ResidencyTables, reqs: list[RequestView], only: EngineId | None = None) -> None:
    """Request i's prefix on ENGINES[i % 2] (only that engine's requests when `only`)."""
    now = tables.clock()
    for i, rv in enumerate(reqs):
        engine = ENGINES[i % 2]
        if only is not None and engine != only:
            continue
        # fresh int objects, as when keys arrive in a report: a dict lookup with the very
        # object it holds skips the equality test, which would flatter the memory store
        keys = [PrefixKey(int(str(k))) for k in rv.block_keys]
        cut = len(keys) * 3 // 4  # the last quarter of each prompt sits on host memory
        tables.store_global(engine, keys[:cut], Tier.HBM, now)
        tables.store_global(engine, keys[cut:], Tier.HOST, now)
        tables.store_swa(engine, [PrefixKey(int(str(rv.boundary_keys[-1][1])))], now)
    for e in ENGINES:
        tables.set_mode(e, ViewMode.REPORTED)


Picks = dict[int, set[tuple[str, ...]]]
"""Request index -> the (prefix_affinity, tier_aware) engines each timed decision picked."""


def timed_local(
    tables: ResidencyTables, reqs: list[RequestView], n: int, picks: Picks | None = None
) -> list[float]:
    policies = [create_policy("prefix_affinity"), create_policy("tier_aware")]
    fleet = FleetStats()
    out = []
    for i in range(n):
        rv = reqs[i % len(reqs)]
        t0 = time.perf_counter()
        now = tables.clock()
        views = [EngineView(e, True, EngineLoad(), tables.view(e, now)) for e in ENGINES]
        got = tuple(p.pick(rv, views, fleet).engine for p in policies)
        out.append(time.perf_counter() - t0)
        if picks is not None:
            picks.setdefault(i % len(reqs), set()).add(got)
    return out


async def timed_direct(
    link: RedisLink, reqs: list[RequestView], n: int, picks: Picks | None = None
) -> list[float]:
    """Fetch each request's entries from Redis, load them into a scratch table, score."""
    policies = [create_policy("prefix_affinity"), create_policy("tier_aware")]
    fleet = FleetStats()
    keys = {e: EngineKeys("ramjet", e) for e in ENGINES}
    out = []
    for i in range(n):
        rv = reqs[i % len(reqs)]
        t0 = time.perf_counter()
        names = [key16(k) for k in rv.block_keys]
        scratch = ResidencyTables(CFG)
        now = scratch.clock()
        for e in ENGINES:
            # the link's client returns bytes (no decode_responses)
            vals = cast(
                "list[bytes | None]",
                await link.client.mget([keys[e].entry("gx", k) for k in names]),
            )
            held = [
                (k, int(v.split(b",")[0])) for k, v in zip(rv.block_keys, vals, strict=True) if v
            ]
            for tier in (Tier.HBM, Tier.HOST, Tier.SSD):
                ks = [k for k, t in held if t == tier]
                if ks:
                    scratch.store_global(e, ks, tier, now)
            scratch.set_mode(e, ViewMode.REPORTED)
        views = [EngineView(e, True, EngineLoad(), scratch.view(e, now)) for e in ENGINES]
        got = tuple(p.pick(rv, views, fleet).engine for p in policies)
        out.append(time.perf_counter() - t0)
        if picks is not None:
            picks.setdefault(i % len(reqs), set()).add(got)
    return out


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--kb", type=int, default=128)
    ap.add_argument("--decisions", type=int, default=2000)
    args = ap.parse_args()
    reqs = requests(args.sessions, args.kb)
    print(
        f"{args.sessions} sessions x {args.kb} KB prompts ({len(reqs[0].block_keys)} blocks), "
        f"{args.decisions} decisions, 2 engines, prefix_affinity + tier_aware"
    )
    memory = ResidencyTables(CFG)
    fill(memory, reqs)
    with redis_server() as server:
        reg = CollectorRegistry()
        link = RedisLink(RedisSettings(url=server.url, timeout_ms=1000, encoding="keys"), reg)
        store = RedisStore(link, CFG, ENGINES, reg)
        shared = ResidencyTables(CFG, store)
        t0 = time.perf_counter()
        for e in ENGINES:  # one report batch per engine
            with store.report(e, 1, 1):
                fill(shared, reqs, only=e)
        await store.sync_once()
        print(
            f"writing {store.size(Table.GLOBAL)} entries to Redis and syncing: {time.perf_counter() - t0:.2f} s"
        )
        other = RedisStore(
            RedisLink(
                RedisSettings(url=server.url, timeout_ms=5000, encoding="keys"),
                CollectorRegistry(),
            ),
            CFG,
            ENGINES,
        )
        t0 = time.perf_counter()
        await other.sync_once()
        print(
            f"a fresh replica's warm start (full pull): {time.perf_counter() - t0:.2f} s, {other.size(Table.GLOBAL)} entries"
        )
        await other.link.close()
        timed_local(memory, reqs, 200)  # warm up
        gc.collect()
        gc.freeze()  # the tables are long-lived: keep the collector from re-walking them
        results: dict[str, list[float]] = {"memory": [], "redis mirror": [], "redis direct": []}
        picks: dict[str, Picks] = {name: {} for name in results}
        rounds = 10  # interleaved, so load from other processes hits all three alike
        for _ in range(rounds):
            n = args.decisions // rounds
            results["memory"] += timed_local(memory, reqs, n, picks["memory"])
            results["redis mirror"] += timed_local(shared, reqs, n, picks["redis mirror"])
            results["redis direct"] += await timed_direct(
                link, reqs, max(20, n // 4), picks["redis direct"]
            )
        await link.close()
    # every way of serving the lookups must decide alike, and as the residency says:
    # request i's prefix sits on ENGINES[i % 2], so both policies pick that engine
    for name, by_req in picks.items():
        for i, got in by_req.items():
            want = {(ENGINES[i % 2], ENGINES[i % 2])}
            if got != want:
                raise SystemExit(f"FAILED: {name}: request {i} picked {sorted(got)}, want {want}")
    checked = {name: sum(1 for _ in by_req) for name, by_req in picks.items()}
    base = statistics.median(results["memory"])
    base99 = pct(results["memory"], 0.99)
    print(f"{'store':14} {'p50 us':>9} {'p99 us':>9} {'p50 x mem':>10} {'p99 x mem':>10}")
    for name, xs in results.items():
        p50, p99 = statistics.median(xs), pct(xs, 0.99)
        print(
            f"{name:14} {p50 * 1e6:9.1f} {p99 * 1e6:9.1f} {p50 / base:10.2f} {p99 / base99:10.2f}"
        )
        print(f"figure: decision redis: p50 per decision / {name} = {p50 * 1e6:.1f} us")
    print(
        f"self-check: {sum(len(x) for x in results.values())} timed decisions; every one picked "
        "the engine whose reported residency holds the request's prefix, with both policies, "
        f"alike over memory, the Redis mirror and direct Redis reads (requests per store: {checked})"
    )
    mirror = statistics.median(results["redis mirror"])
    print(f"decision redis result: Redis mirror p50 {mirror / base:.2f}x memory's")


if __name__ == "__main__":
    asyncio.run(main())
