"""What a replica reads from Redis is checked before it is applied (issue 29), against a
real redis-server: forged, unreadable or future-dated data changes nothing, is counted,
and never halts the sync; error replies (OOM) are counted failures; a large snapshot goes
in chunks that each fit the deadline, with later writes ordered after it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers"))
from redis_server import RedisProcess, redis_server

from ramjet.residency.config import ResidencyConfig
from ramjet.residency.redis_link import RedisLink, RedisSettings, RedisUnavailable
from ramjet.residency.redis_ops import Sealer
from ramjet.residency.redis_store import RedisStore
from ramjet.residency.store import Table
from ramjet.residency.tables import ResidencyTables
from ramjet.types import EngineId, PrefixKey, Tier

pytestmark = pytest.mark.redis
E0 = EngineId("e0")
CFG = ResidencyConfig()
SECRET = "correct horse battery staple 0123"
LOG, ST = "{ramjet:e0}:log", "{ramjet:e0}:st"


@pytest.fixture
def server() -> Iterator[RedisProcess]:
    with redis_server() as s:
        yield s


def make(
    server: RedisProcess, secret: str | None = SECRET, **kw: object
) -> tuple[RedisStore, CollectorRegistry]:
    reg = CollectorRegistry()
    opts: dict[str, object] = {"timeout_ms": 300, "breaker_open_ms": 50, **kw}
    settings = RedisSettings(url=server.url, shared_secret=secret, **opts)  # type: ignore[arg-type]
    return RedisStore(RedisLink(settings, reg), CFG, engines=(E0,), registry=reg), reg


@pytest.fixture
async def stores(server: RedisProcess) -> AsyncIterator[list[RedisStore]]:
    made: list[RedisStore] = []
    yield made
    for s in made:
        await s.link.close()


def metric(reg: CollectorRegistry, name: str, **labels: str) -> float:
    return reg.get_sample_value(name, labels) or 0.0


def held(store: RedisStore, *ks: int, exact: bool = True) -> list[bool]:
    now = store.clock()
    return [store.get(Table.GLOBAL, E0, PrefixKey(k), now, not exact) is not None for k in ks]


async def forge(store: RedisStore, ops: list[object], mac: str = "", **extra: str) -> None:
    """Append a log entry as an attacker (or an unknown newer replica) could: the next
    `gen`, so a tailing replica takes it as the next batch."""
    c = store.link.client
    gen = await c.hincrby(ST, "gen", 1)
    body = {"gen": gen, "m": "free", "e": -1, "s": -1, "ops": json.dumps(ops), "x": "[]"}
    body.update({"o": "forger", "mac": mac, **extra})
    await c.xadd(LOG, body)  # type: ignore[arg-type]


def put(exp_ms: int, *ks: int, tier: int = 1) -> list[object]:
    return ["p", "gx", tier, int(time.time() * 1000), exp_ms, [f"{k:016x}" for k in ks]]


async def test_forged_unknown_and_future_log_entries_change_nothing_and_sync_goes_on(
    server: RedisProcess, stores: list[RedisStore]
) -> None:
    a, _ = make(server)
    b, reg = make(server)
    stores += [a, b]
    ta = ResidencyTables(CFG, a)
    ta.store_global(E0, [PrefixKey(1)], Tier.HOST, ta.clock())
    await a.sync_once()
    await b.sync_once()  # b: first pull
    assert held(b, 1) == [True]
    exp = int(time.time() * 1000) + 600_000
    sealer = Sealer(SECRET.encode())

    def signed(ops: list[object]) -> str:
        return sealer.batch_mac(E0, "free", -1, -1, json.dumps(ops))

    await forge(b, [put(exp, 66)])  # no MAC: anyone who can write to Redis
    await forge(b, [put(exp, 67)], mac="0" * 64)  # a wrong MAC
    # validly signed (a newer replica in a rolling upgrade), but not readable here
    await forge(b, [["Z", "gx", [f"{68:016x}"]]], mac=signed([["Z", "gx", [f"{68:016x}"]]]))
    bad_tier = [put(exp, 69, tier=7)]
    await forge(b, bad_tier, mac=signed(bad_tier))
    bad_kind = [["p", "qx", 1, 0, exp, [f"{70:016x}"]]]
    await forge(b, bad_kind, mac=signed(bad_kind))
    # half good, half bad: nothing of it applies
    mixed = [put(exp, 71), ["p", "gx", 1, 0, exp, ["nothex"]]]
    await forge(b, mixed, mac=signed(mixed))
    ta.store_global(E0, [PrefixKey(2)], Tier.HOST, ta.clock())  # then a real write
    await a.sync_once()
    await b.sync_once()  # one round: skipped entries are never retried
    assert held(b, 66, 67, 68, 69, 70, 71) == [False] * 6
    assert held(b, 2) == [True], "the sync stopped at a bad entry"
    assert metric(reg, "ramjet_redis_rejected_total", reason="mac") == 2
    assert metric(reg, "ramjet_redis_rejected_total", reason="op") == 1
    assert metric(reg, "ramjet_redis_rejected_total", reason="tier") == 1
    assert metric(reg, "ramjet_redis_rejected_total", reason="kind") == 1
    assert metric(reg, "ramjet_redis_rejected_total", reason="malformed") == 1
    # a replica without the secret (unauthenticated) still checks shape and codes
    c, creg = make(server, secret=None)
    stores.append(c)
    await c.sync_once()
    await forge(c, [["Z"]])
    ta.store_global(E0, [PrefixKey(3)], Tier.HOST, ta.clock())
    await a.sync_once()
    await c.sync_once()
    assert held(c, 3) == [True]
    assert metric(creg, "ramjet_redis_rejected_total", reason="op") == 1


@pytest.mark.parametrize("encoding", ["packed", "keys"])
async def test_a_forged_stored_entry_is_not_pulled(
    server: RedisProcess, stores: list[RedisStore], encoding: str
) -> None:
    a, _ = make(server, encoding=encoding)
    stores.append(a)
    ta = ResidencyTables(CFG, a)
    ta.store_global(E0, [PrefixKey(1)], Tier.HOST, ta.clock())
    await a.sync_once()
    c = a.link.client
    exp = int(time.time() * 1000) + 600_000
    if encoding == "keys":
        await c.set(f"{{ramjet:e0}}:gx:{5:016x}", "0,1", pxat=exp)
        await c.zadd("{ramjet:e0}:i:gx", {f"{5:016x}": exp})
        await c.set(f"{{ramjet:e0}}:gx:{6:016x}", "0,1," + "ab" * 8, pxat=exp)
        await c.zadd("{ramjet:e0}:i:gx", {f"{6:016x}": exp})
    else:  # records beside the real one in its bucket: no MAC, a wrong MAC
        bucket = "{ramjet:e0}:b:gx"
        held_now = await c.hget(bucket, "0001")  # key 1's bucket: its low 16 bits
        assert held_now is not None and len(held_now) == 27

        def rec(k: int, mac: bytes) -> bytes:
            return struct.pack(">HIBHIHI8s", 0, k, 0, 0, 1, exp >> 32, exp & 0xFFFFFFFF, mac)

        # keys 5 << 16 | 1 and 6 << 16 | 1: the record holds a key's high 48 bits
        await c.hset(bucket, "0001", held_now + rec(5, bytes(8)) + rec(6, b"\xab" * 8))
    b, reg = make(server, encoding=encoding)  # a new replica starts warm from Redis: a pull
    stores.append(b)
    await b.sync_once()
    forged = (5, 6) if encoding == "keys" else (5 << 16 | 1, 6 << 16 | 1)
    assert held(b, 1, *forged) == [True, False, False]
    assert metric(reg, "ramjet_redis_rejected_total", reason="mac") == 2


async def test_a_future_epoch_in_redis_does_not_freeze_an_engines_reports(
    server: RedisProcess, stores: list[RedisStore]
) -> None:
    a, _ = make(server)
    b, reg = make(server)
    stores += [a, b]
    ta = ResidencyTables(CFG, a)
    epoch = int(time.time() * 1000)
    with a.report(E0, epoch, 1):
        ta.store_global(E0, [PrefixKey(1)], Tier.HOST, ta.clock())
    await a.sync_once()
    await b.sync_once()
    future = epoch + 10 * 365 * 86_400_000
    await a.link.client.hset(ST, mapping={"epoch": future, "seq": 99})
    with a.report(E0, epoch, 2):
        ta.store_global(E0, [PrefixKey(2)], Tier.HOST, ta.clock())
    await a.sync_once()
    assert metric(reg, "ramjet_redis_batches_total", result="stale") == 0
    await b.sync_once()
    assert held(b, 1, 2) == [True, True]
    assert a.cursor(E0) == (epoch, 2)
    assert b.cursor(E0) == (epoch, 2)
    assert await a.link.client.hget(ST, "epoch") == str(epoch).encode()


async def test_an_error_reply_is_a_counted_failure_and_a_poison_batch_is_dropped(
    server: RedisProcess, stores: list[RedisStore]
) -> None:
    a, reg = make(server, max_batch_attempts=2, breaker_failures=100)
    stores.append(a)
    await a.sync_once()
    c = a.link.client
    await c.config_set("maxmemory", "1")  # every write now answers OOM
    ta = ResidencyTables(CFG, a)
    ta.store_global(E0, [PrefixKey(1)], Tier.HOST, ta.clock())
    with pytest.raises(RedisUnavailable):
        await a.sync_once()
    assert metric(reg, "ramjet_redis_command_errors_total") == 1
    assert metric(reg, "ramjet_redis_errors_total", kind="oom") == 1
    assert a.pending == 1  # kept for the next round, which fails again: then dropped
    with pytest.raises(RedisUnavailable):  # and the pull that follows finds Redis still full
        await a.sync_once()
    assert a.pending == 0
    assert metric(reg, "ramjet_redis_batches_total", result="refused") == 1
    assert metric(reg, "ramjet_redis_dropped_batches_total") == 1
    assert metric(reg, "ramjet_redis_command_errors_total") >= 2
    assert metric(reg, "ramjet_redis_batches_total", result="ok") == 0
    await c.config_set("maxmemory", "0")
    await a.sync_once()  # Redis has room again: the mirror seeds it
    b, _ = make(server)
    stores.append(b)
    await b.sync_once()
    assert held(b, 1) == [True]


async def test_a_large_snapshot_goes_in_chunks_within_the_deadline_and_deltas_follow(
    server: RedisProcess, stores: list[RedisStore]
) -> None:
    n = 50_000
    a, reg = make(server, timeout_ms=100, breaker_failures=1000)
    b, _ = make(server, timeout_ms=1000)
    stores += [a, b]
    ta = ResidencyTables(CFG, a)
    now = ta.clock()
    ta.store_global(E0, [PrefixKey(n + 7)], Tier.HOST, now)  # an old exact entry
    await a.sync_once()
    entries = [(PrefixKey(k), Tier.HOST, now + 3600) for k in range(1, n + 1)]
    a.replace_exact(Table.GLOBAL, E0, entries, now)
    a.remove(Table.GLOBAL, E0, [PrefixKey(5), PrefixKey(6)])  # a delta after it
    for _ in range(10):  # each chunk's call must fit 100 ms (before: one call, never did)
        with contextlib.suppress(RedisUnavailable):  # a rare late reply on a loaded box
            await a.sync_once()
        if a.pending == 0:
            break
    assert a.pending == 0
    assert metric(reg, "ramjet_redis_errors_total", kind="timeout") <= 3
    assert metric(reg, "ramjet_redis_batches_total", result="ok") >= n // 500
    await b.sync_once()
    assert b.local.size(Table.GLOBAL) == n - 2
    assert held(b, 1, n, 5, 6, n + 7) == [True, True, False, False, False]
    assert await a.link.client.hget(ST, "n:gx") == str(n - 2).encode()  # Redis's own count


async def test_a_large_seed_goes_in_chunks_and_a_fresh_replica_pulls_all_of_it(
    server: RedisProcess, stores: list[RedisStore]
) -> None:
    a, reg = make(server, snapshot_chunk_entries=16)
    stores.append(a)
    ta = ResidencyTables(CFG, a)
    ta.store_global(E0, [PrefixKey(k) for k in range(1, 101)], Tier.SSD, ta.clock())
    await a.sync_once()
    server.restart()  # Redis comes back empty: the next write is answered `missing`
    ta.store_global(E0, [PrefixKey(500)], Tier.SSD, ta.clock())
    for _ in range(20):  # reconnect through the breaker, then seed
        with contextlib.suppress(RedisUnavailable):
            await a.sync_once()
        if a.pending == 0 and not a.sync._seeding:
            break
        await asyncio.sleep(0.06)
    assert metric(reg, "ramjet_redis_batches_total", result="seed_ok") >= 101 // 16
    b, _ = make(server)
    stores.append(b)
    await b.sync_once()
    assert all(held(b, *range(1, 101), 500))


def test_the_shared_secret_settings_refuse_bad_input(tmp_path: Path) -> None:
    good = tmp_path / "secret"
    good.write_bytes(b"  0123456789abcdef0123  \n")
    assert RedisSettings(shared_secret_file=str(good)).secret() == b"0123456789abcdef0123"
    assert RedisSettings().secret() is None
    with pytest.raises(ValueError, match="not both"):
        RedisSettings(shared_secret="0123456789abcdef", shared_secret_file=str(good))
    with pytest.raises(ValueError, match="at least 16"):
        RedisSettings(shared_secret="short")
    short = tmp_path / "short"
    short.write_bytes(b"tiny\n")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        RedisSettings(shared_secret_file=str(short)).secret()
    with pytest.raises(ValueError, match="shared_secret_file"):
        RedisSettings(shared_secret_file=str(tmp_path / "missing")).secret()
    # a replica with another secret skips everything the first one wrote (counted)
    assert Sealer(b"a" * 16).batch_mac("e0", "free", -1, -1, "[]") != Sealer(b"b" * 16).batch_mac(
        "e0", "free", -1, -1, "[]"
    )


async def test_another_replica_swaps_a_chunked_snapshot_in_whole(
    server: RedisProcess, stores: list[RedisStore]
) -> None:
    a, _ = make(server, snapshot_chunk_entries=16)
    b, _ = make(server)
    stores += [a, b]
    ta = ResidencyTables(CFG, a)
    now = ta.clock()
    ta.store_global(E0, [PrefixKey(1000)], Tier.HOST, now)  # the old content
    await a.sync_once()
    await b.sync_once()
    a.replace_exact(
        Table.GLOBAL, E0, [(PrefixKey(k), Tier.SSD, now + 600) for k in range(1, 101)], now
    )
    assert a.pending == 7  # R + 6 E chunks of 16
    for _ in range(3):  # Redis takes the first chunks only (a slow writer, say)
        batch = a.sync.outbox[0]
        assert await a.sync._apply(batch) == "ok"
        batch.status = "ok"
        a.sync.outbox.popleft()
    await b.sync_once()
    # b keeps the old content whole rather than showing 48 of the 100 new blocks
    assert held(b, 1000, 1, 48) == [True, False, False]
    await a.sync_once()
    await b.sync_once()
    assert held(b, 1000) == [False]
    assert all(held(b, *range(1, 101)))
    c, _ = make(server)  # and a fresh replica pulls the same
    stores.append(c)
    await c.sync_once()
    assert held(c, 1000) == [False] and all(held(c, *range(1, 101)))
