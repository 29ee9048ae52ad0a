"""The Redis half of the residency-at-scale benchmark (issue 33): Redis memory per block,
snapshot write and pull rates, and `global_match` p99 on a replica's mirror, for the
packed encoding against the per-key one (the encoding before issue 33) in the same run,
on a real redis-server on loopback.

    .venv/bin/python benchmarks/residency_scale_redis.py [--blocks 200000] [--full]

`--full` loads 20M blocks (hours of Lua and tens of GB of memory for the per-key
encoding on a small box: that one is skipped above `--keys-max`, 2M by default).
`measure_redis(n_blocks, encoding)` is the function `benchmarks/residency_scale.py` can
call; it returns a dict:
- `bytes_per_block`: (Redis `used_memory` after - before) / blocks, once the change log
  has aged out (steady state; trimmed by hand rather than waiting `log_max_age_s`);
  `bytes_per_block_with_log` right after the load, the snapshot's chunks still logged;
  `data_bytes_per_block`: `MEMORY USAGE` of the entry keys (packed: the four hashes);
- `snapshot_write_blocks_per_s`: one engine's signed-state snapshot (`replace_exact`)
  through the sync (MACs, chunks of `snapshot_chunk_entries`, the APPLY script), then
  deltas; `snapshot_pull_blocks_per_s`: a fresh replica's full pull;
- `global_match_p99_ms`: `ResidencyTables.view(...).global_match` for a 50k-token
  prompt (782 blocks of 64 tokens, all held) on the pulled replica's mirror;
- `max_call_ms`: the slowest single Redis call of the load (each must fit `timeout_ms`).

Self-check: the pulled replica holds exactly the loaded blocks (minus the deltas'
removals), answers `global_match` as the writer does, and both encodings give the same
answers. Needs `redis-server` on PATH; starts one per encoding in a temp dir, stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
from redis_server import redis_server

from ramjet.residency.config import ResidencyConfig
from ramjet.residency.redis_link import RedisLink, RedisSettings, RedisUnavailable
from ramjet.residency.redis_scripts import KINDS, EngineKeys
from ramjet.residency.redis_store import RedisStore
from ramjet.residency.store import Table
from ramjet.residency.tables import ResidencyTables
from ramjet.types import EngineId, PrefixKey, Tier

ENGINE = EngineId("e0")
BLOCK_TOKENS = 64
PROMPT_BLOCKS = 50_000 // BLOCK_TOKENS  # a 50k-token prompt
SECRET = "benchmark-shared-secret-0123456789"


def _settings(url: str, encoding: str, n: int) -> RedisSettings:
    return RedisSettings(
        url=url,
        encoding=encoding,
        timeout_ms=5_000,  # measured, not enforced: max_call_ms says what one call took
        max_global_entries_per_engine=max(n * 2, 1),
        max_pending_writes=1_000_000,
        shared_secret=SECRET,
    )


def _residency(n: int) -> ResidencyConfig:
    return ResidencyConfig(max_global_entries=max(n * 2, 1))


async def _used(store: RedisStore) -> int:
    info = await store.link.client.info("memory")
    return int(info["used_memory"])


async def _data_bytes(store: RedisStore, encoding: str) -> int:
    keys = EngineKeys(store.settings.key_prefix, ENGINE)
    c = store.link.client
    if encoding == "packed":
        total = 0
        for kind in KINDS:
            total += int(await c.memory_usage(keys.packed(kind), samples=0) or 0)
        return total
    total = 0
    async for name in c.scan_iter(match=keys.base + ":gx:*", count=10_000):
        total += int(await c.memory_usage(name) or 0)
    return total + int(await c.memory_usage(keys.index("gx"), samples=0) or 0)


async def _measure(url: str, n: int, encoding: str, seed: int) -> dict[str, Any]:
    reg = CollectorRegistry()
    settings = _settings(url, encoding, n)
    writer = RedisStore(RedisLink(settings, reg), _residency(n), engines=(ENGINE,), registry=reg)
    calls: list[float] = []
    link_call = writer.link.call

    async def timed(fn: Any, timeout_s: float | None = None) -> Any:
        t0 = time.perf_counter()
        try:
            return await link_call(fn, timeout_s)
        finally:
            calls.append(time.perf_counter() - t0)

    writer.link.call = timed  # type: ignore[method-assign]
    try:
        await writer.sync_once()
        before = await _used(writer)
        rng = random.Random(seed)
        keys = [PrefixKey(rng.getrandbits(64)) for _ in range(n)]
        now = writer.clock()
        tiers = (Tier.HBM, Tier.HOST, Tier.SSD)
        entries = [(k, tiers[i % 3], now + 72 * 3600) for i, k in enumerate(keys)]
        timeouts = 0
        t0 = time.perf_counter()
        writer.replace_exact(Table.GLOBAL, ENGINE, entries, now)  # the signed snapshot
        gone = keys[: min(1000, n // 10)]
        writer.remove(Table.GLOBAL, ENGINE, gone)  # then deltas
        writer.put(Table.GLOBAL, ENGINE, gone[:10], Tier.HOST, now, now + 3600, True)
        while writer.pending:
            try:
                await writer.sync_once()
            except RedisUnavailable:  # a call past timeout_ms on a loaded box: retried
                timeouts += 1
                await asyncio.sleep(settings.breaker_open_ms / 1000)
        write_s = time.perf_counter() - t0
        with_log = await _used(writer) - before
        # steady state: the log's entries age out after `log_max_age_s` (120 s); trimmed
        # here by hand instead of waiting
        await writer.link.client.xtrim(EngineKeys(settings.key_prefix, ENGINE).log, maxlen=0)
        steady = await _used(writer) - before
        data = await _data_bytes(writer, encoding)
        expected = n - len(gone) + 10
        del entries
        gc.collect()

        reader = RedisStore(
            RedisLink(settings, CollectorRegistry()), _residency(n), engines=(ENGINE,)
        )
        try:
            t0 = time.perf_counter()
            await reader.sync_once()  # a fresh replica: a full pull
            pull_s = time.perf_counter() - t0
            held = reader.local.size(Table.GLOBAL)
            tables = ResidencyTables(_residency(n), reader)
            wtables = ResidencyTables(_residency(n), writer)
            prompt = keys[len(gone) : len(gone) + PROMPT_BLOCKS]
            tokens = [BLOCK_TOKENS] * len(prompt)
            samples = []
            for _ in range(300):
                view = tables.view(ENGINE)
                t = time.perf_counter()
                match = view.global_match(prompt, tokens)
                samples.append((time.perf_counter() - t) * 1000)
            want = wtables.view(ENGINE).global_match(prompt, tokens)
            partial = keys[:PROMPT_BLOCKS]  # starts with removed blocks (10 put back)
            answers = (
                match,
                tables.view(ENGINE).global_match(partial, [BLOCK_TOKENS] * len(partial)),
            )
            ok = held == expected and match == want and match.blocks == len(prompt)
        finally:
            await reader.link.close()
        return {
            "encoding": encoding,
            "blocks": n,
            "bytes_per_block": steady / n,
            "bytes_per_block_with_log": with_log / n,
            "data_bytes_per_block": data / n,
            "snapshot_write_blocks_per_s": n / write_s,
            "snapshot_pull_blocks_per_s": n / pull_s,
            # one name for the scale helper's table: the rate Redis took the snapshot
            "snapshot_apply_blocks_per_s": n / write_s,
            "global_match_p99_ms": statistics.quantiles(samples, n=100)[98],
            "max_call_ms": max(calls) * 1000,
            "timeouts": timeouts,
            "ok": ok,
            "answers": answers,
        }
    finally:
        await writer.link.close()


def measure_redis(n_blocks: int, encoding: str = "packed", seed: int = 1) -> dict[str, Any]:
    """Load `n_blocks` for one engine into a fresh redis-server in `encoding`; see the
    module docstring for what the dict holds."""
    with redis_server() as server:
        return asyncio.run(_measure(server.url, n_blocks, encoding, seed))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=200_000)
    ap.add_argument("--full", action="store_true", help="20M blocks")
    ap.add_argument("--keys-max", type=int, default=2_000_000)
    ap.add_argument(
        "--keys-blocks",
        type=int,
        default=None,
        help="blocks for the per-key encoding (default: N up to --keys-max; its per-block "
        "figures stay comparable at a smaller size, which it needs: ~320 B a block)",
    )
    args = ap.parse_args()
    n = 20_000_000 if args.full else args.blocks
    keys_n = args.keys_blocks if args.keys_blocks is not None else n
    print(f"blocks: {n:,} for one engine; 50k-token prompt = {PROMPT_BLOCKS} blocks")
    t0 = time.perf_counter()
    packed = measure_redis(n, "packed")
    print(f"  packed: {n:,} blocks measured in {time.perf_counter() - t0:.0f} s", flush=True)
    base = None
    if keys_n <= args.keys_max:
        t0 = time.perf_counter()
        base = measure_redis(keys_n, "keys")
        print(f"  per-key: {keys_n:,} blocks in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = [
        ("Redis bytes per block (steady)", "bytes_per_block", "{:.1f}"),
        ("Redis bytes per block (log not yet trimmed)", "bytes_per_block_with_log", "{:.1f}"),
        ("entry data bytes per block (MEMORY USAGE)", "data_bytes_per_block", "{:.1f}"),
        ("snapshot write to Redis, blocks/s", "snapshot_write_blocks_per_s", "{:,.0f}"),
        ("fresh replica pull, blocks/s", "snapshot_pull_blocks_per_s", "{:,.0f}"),
        ("global_match p99 (50k tokens), ms", "global_match_p99_ms", "{:.3f}"),
        ("slowest Redis call, ms", "max_call_ms", "{:.1f}"),
        ("calls past timeout_ms (retried)", "timeouts", "{}"),
    ]
    print(f"{'blocks':44} {n:>14,} {keys_n if base else 0:>18,}")
    print(f"{'':44} {'packed':>14} {'per-key (before)':>18} {'ratio':>8}")
    for label, key, fmt in rows:
        p = packed[key]
        b = base[key] if base else None
        ratio = f"{p / b:.3f}" if b else "-"
        shown = fmt.format(b) if b is not None else "skipped"
        print(f"{label:44} {fmt.format(p):>14} {shown:>18} {ratio:>8}")
    target = packed["bytes_per_block"] <= 48
    print(f"target <= 48 bytes per block in Redis: {'met' if target else 'NOT met'}")
    same = base is None or keys_n != n or base["answers"] == packed["answers"]
    ok = packed["ok"] and (base is None or base["ok"]) and same
    if base is None:
        agree = "per-key skipped"
    elif keys_n != n:
        agree = "not compared: loaded at different sizes"
    else:
        agree = str(same)
    print(
        "self-check: "
        + ("ok" if ok else "FAILED")
        + f" (pulled replicas hold every loaded block and match the writer; "
        f"encodings agree: {agree})"
    )
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
