"""RedisStore against a real redis-server: sharing, idempotent reports, TTLs, recovery."""

from __future__ import annotations

import asyncio
import gc
import random
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any, TypeVar

import pytest
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers"))
from redis_server import RedisProcess, redis_server

from ramjet.residency.config import ResidencyConfig
from ramjet.residency.index import SHARDS
from ramjet.residency.redis_link import RedisLink, RedisSettings, RedisUnavailable
from ramjet.residency.redis_ops import Batch, _spelled, weight
from ramjet.residency.redis_store import RedisStore
from ramjet.residency.redis_sync import PULL_STEP
from ramjet.residency.store import Table
from ramjet.residency.tables import ResidencyTables
from ramjet.types import EngineId, PrefixKey, Tier

T = TypeVar("T")

pytestmark = pytest.mark.redis
E0, E1 = EngineId("e0"), EngineId("e1")
CFG = ResidencyConfig()


@pytest.fixture
def server() -> Iterator[RedisProcess]:
    with redis_server() as s:
        yield s


async def turns_during(work: Awaitable[None], sample: Callable[[], T]) -> list[T]:
    """`sample()` at each event-loop turn that a coroutine beside `work` gets while `work`
    runs (the first before `work` starts)."""
    seen: list[T] = []
    done = False

    async def beside() -> None:
        while not done:
            seen.append(sample())
            await asyncio.sleep(0)

    task = asyncio.create_task(beside())
    await asyncio.sleep(0)
    try:
        await work
    finally:
        done = True
        await task
    return seen


def make(server: RedisProcess, **kw: object) -> tuple[RedisStore, CollectorRegistry]:
    reg = CollectorRegistry()
    # a timeout well over a loaded CI host's slowest reply (a 20k-key pull timed out at
    # 200 ms there); the tests of timeouts set their own
    opts: dict[str, object] = {"timeout_ms": 2_000, "breaker_open_ms": 50, **kw}
    settings = RedisSettings(url=server.url, **opts)  # type: ignore[arg-type]
    link = RedisLink(settings, reg)
    return RedisStore(link, CFG, engines=(E0, E1), registry=reg), reg


@pytest.fixture
async def pair(server: RedisProcess) -> AsyncIterator[tuple[RedisStore, RedisStore]]:
    a, _ = make(server)
    b, _ = make(server)
    try:
        yield a, b
    finally:
        for s in (a, b):
            await s.close()
            await s.link.close()


def keys(*ks: int) -> list[PrefixKey]:
    return [PrefixKey(k) for k in ks]


async def sync(*stores: RedisStore) -> None:
    for _ in range(2):
        for s in stores:
            await s.sync_once()


def metric(reg: CollectorRegistry, name: str, **labels: str) -> float:
    v = reg.get_sample_value(name, labels)
    return 0.0 if v is None else v


async def test_a_write_on_one_replica_is_seen_by_the_other(
    pair: tuple[RedisStore, RedisStore],
) -> None:
    a, b = pair
    ta, tb = ResidencyTables(CFG, a), ResidencyTables(CFG, b)
    now_a, now_b = ta.clock(), tb.clock()
    with a.report(E0, 1, 1):
        ta.store_global(E0, keys(1, 2, 3), Tier.HOST, now_a)
        ta.store_swa(E0, keys(9), now_a)
    await sync(a, b)
    got = b.get(Table.GLOBAL, E0, PrefixKey(2), now_b, approximate=False)
    assert got is not None and got.tier is Tier.HOST and got.exact
    assert b.get(Table.SWA, E0, PrefixKey(9), now_b, approximate=False) is not None
    assert b.get(Table.GLOBAL, E1, PrefixKey(2), now_b, approximate=True) is None
    # expiry carried over (72 h from the policy) within clock conversion slack
    assert abs((got.expires_at - now_b) - CFG.global_ttl_s) < 5
    ta.evict_global(E0, keys(2))
    await sync(a, b)
    assert b.get(Table.GLOBAL, E0, PrefixKey(2), tb.clock(), approximate=False) is None
    assert b.cursor(E0) == (1, 1)


async def test_the_same_report_applied_by_both_replicas_counts_once(
    server: RedisProcess,
) -> None:
    a, ra = make(server)
    b, rb = make(server)
    try:
        a.put(Table.GLOBAL, E0, keys(4), Tier.HBM, a.clock(), a.clock() + 60, False)
        await a.sync_once()  # Redis now holds a copy of e0 (seeded by a)
        ok0 = metric(ra, "ramjet_redis_batches_total", result="ok")
        for s in (a, b):  # both replicas ingest the same report, in either order
            with s.report(E0, 3, 7):
                s.put(Table.GLOBAL, E0, keys(5), Tier.HBM, s.clock(), s.clock() + 60, True)
        await b.sync_once()
        await a.sync_once()
        assert (
            metric(ra, "ramjet_redis_batches_total", result="ok")
            + metric(rb, "ramjet_redis_batches_total", result="ok")
            == ok0 + 1
        )
        assert metric(ra, "ramjet_redis_batches_total", result="dup") == 1
        # an older epoch is refused and changes nothing in Redis
        with a.report(E0, 2, 99):
            a.purge(E0)
        await a.sync_once()
        assert metric(ra, "ramjet_redis_batches_total", result="stale") == 1
        await sync(a, b)
        for s in (a, b):
            assert s.get(Table.GLOBAL, E0, PrefixKey(5), s.clock(), False) is not None
    finally:
        for s in (a, b):
            await s.link.close()


async def test_approximate_never_overrides_exact_in_redis_either(
    pair: tuple[RedisStore, RedisStore],
) -> None:
    a, b = pair
    now = a.clock()
    with a.report(E1, 1, 1):
        a.put(Table.GLOBAL, E1, keys(7), Tier.SSD, now, now + 600, True)
    await sync(a)
    b.put(Table.GLOBAL, E1, keys(7, 8), Tier.HBM, b.clock(), b.clock() + 60, False)
    await sync(b, a)
    fresh, _ = make_from(a)
    try:
        await fresh.sync_once()  # pulls Redis's copy: the exact SSD entry survived
        e = fresh.get(Table.GLOBAL, E1, PrefixKey(7), fresh.clock(), approximate=True)
        assert e is not None and e.exact and e.tier is Tier.SSD
        e8 = fresh.get(Table.GLOBAL, E1, PrefixKey(8), fresh.clock(), approximate=True)
        assert e8 is not None and not e8.exact
    finally:
        await fresh.link.close()


async def settle(*stores: RedisStore, within_s: float = 5.0) -> None:
    """Sync until every store's breaker is closed and a clean round passed everywhere."""
    deadline = time.monotonic() + within_s
    while True:
        clean = True
        for s in stores:
            try:
                await s.sync_once()
            except RedisUnavailable:
                clean = False
        if clean and not any(s.degraded for s in stores):
            await sync(*stores)
            return
        assert time.monotonic() < deadline, "stores did not recover"
        await asyncio.sleep(0.02)


def make_from(other: RedisStore) -> tuple[RedisStore, CollectorRegistry]:
    reg = CollectorRegistry()
    return RedisStore(RedisLink(other.settings, reg), CFG, (E0, E1), reg), reg


async def test_every_key_has_a_ttl_and_caps_bound_redis(server: RedisProcess) -> None:
    a, _reg = make(
        server, max_global_entries_per_engine=50, max_swa_entries_per_engine=5, encoding="keys"
    )
    try:
        now = a.clock()
        for r in range(4):
            with a.report(E0, 1, r + 1):
                a.put(
                    Table.GLOBAL,
                    E0,
                    keys(*range(r * 40, r * 40 + 40)),
                    Tier.HBM,
                    now,
                    now + 3600,
                    True,
                )
                a.put(Table.SWA, E0, keys(*range(r * 4, r * 4 + 4)), Tier.HBM, now, now + 60, True)
        a.put(Table.GLOBAL, E1, keys(1), Tier.HBM, now, now + 60, False)
        await a.sync_once()
        client = a.link.client
        names = [k async for k in client.scan_iter(count=1000)]
        assert names
        for name in names:
            assert await client.pttl(name) > 0, name
        assert await client.zcard("{ramjet:e0}:i:gx") == 50
        assert await client.zcard("{ramjet:e0}:i:sx") == 5
        # evicted entries' keys are gone too: only the capped number of entry keys remain
        assert len([n for n in names if b":gx:" in n]) == 50
    finally:
        await a.link.close()


async def test_every_key_has_a_ttl_and_caps_bound_redis_packed(server: RedisProcess) -> None:
    """The packed encoding: the same caps, counted in `st`, and the mirrors follow."""
    a, _reg = make(server, max_global_entries_per_engine=50, max_swa_entries_per_engine=5)
    b, _ = make(server)
    try:
        now = a.clock()
        for r in range(4):
            with a.report(E0, 1, r + 1):
                a.put(
                    Table.GLOBAL,
                    E0,
                    keys(*range(r * 40, r * 40 + 40)),
                    Tier.HBM,
                    now,
                    now + 3600,
                    True,
                )
                a.put(Table.SWA, E0, keys(*range(r * 4, r * 4 + 4)), Tier.HBM, now, now + 60, True)
        a.put(Table.GLOBAL, E1, keys(1), Tier.HBM, now, now + 60, False)
        await sync(a, b)
        client = a.link.client
        names = [k async for k in client.scan_iter(count=1000)]
        assert names
        for name in names:
            assert await client.pttl(name) > 0, name
        st = await client.hgetall("{ramjet:e0}:st")
        assert (st[b"n:gx"], st[b"n:sx"]) == (b"50", b"5")
        records = sum(len(v) for v in (await client.hgetall("{ramjet:e0}:b:gx")).values())
        assert records == 50 * 27
        for s in (a, b):  # the evictions reached both mirrors through the log
            got = [s.get(Table.GLOBAL, E0, PrefixKey(k), s.clock(), False) for k in range(160)]
            assert sum(e is not None for e in got) == 50
    finally:
        await a.link.close()
        await b.link.close()


async def test_script_flush_is_recovered(pair: tuple[RedisStore, RedisStore]) -> None:
    a, b = pair
    a.put(Table.GLOBAL, E0, keys(1), Tier.HBM, a.clock(), a.clock() + 60, False)
    await sync(a, b)
    await a.link.client.script_flush()
    a.put(Table.GLOBAL, E0, keys(2), Tier.HBM, a.clock(), a.clock() + 60, False)
    await sync(a, b)
    assert b.get(Table.GLOBAL, E0, PrefixKey(2), b.clock(), True) is not None
    assert a.link.metrics.script_reloads._value.get() >= 2  # first load + after the flush
    assert not a.degraded


async def test_redis_restarted_empty_is_reseeded_and_the_other_replica_converges(
    server: RedisProcess,
) -> None:
    a, reg = make(server)
    b, _ = make(server)
    try:
        now = a.clock()
        with a.report(E0, 1, 1):
            a.put(Table.GLOBAL, E0, keys(1, 2), Tier.HOST, now, now + 600, True)
        await sync(a, b)
        server.kill()
        # Redis is gone: writes keep landing locally, the breaker opens, nothing raises
        with a.report(E0, 1, 2):
            a.put(Table.GLOBAL, E0, keys(3), Tier.HBM, a.clock(), a.clock() + 600, True)
        for _ in range(5):
            with pytest.raises(RedisUnavailable):  # fail open: the caller keeps routing
                await a.sync_once()
        assert a.degraded
        assert metric(reg, "ramjet_redis_degraded") == 1
        assert a.get(Table.GLOBAL, E0, PrefixKey(3), a.clock(), False) is not None
        server.start()
        await settle(a, b)
        assert not a.degraded
        assert metric(reg, "ramjet_redis_degraded") == 0
        assert (
            metric(reg, "ramjet_redis_resyncs_total", direction="push", reason="redis_empty")
            + metric(reg, "ramjet_redis_resyncs_total", direction="pull", reason="recovery")
            >= 1
        )
        for k in (1, 2, 3):
            assert b.get(Table.GLOBAL, E0, PrefixKey(k), b.clock(), False) is not None, k
        assert b.cursor(E0) == (1, 2)
    finally:
        for s in (a, b):
            await s.link.close()


async def test_a_loop_of_calls_ends_on_its_first_cancel_and_a_paused_redis_still_times_out(
    server: RedisProcess,
) -> None:
    """A background loop of link calls (a report pull's shape) against a live Redis ends on
    the one cancel its stop sends, wherever in a call the cancel lands: redis-py's own
    socket timeout wrapped each send in 3.11's `wait_for`, which lost more than half of
    them. Without it the link's deadline alone bounds a call to a hung server."""
    settings = RedisSettings(url=server.url, timeout_ms=200, breaker_failures=100)
    link = RedisLink(settings, CollectorRegistry())

    async def pull_loop() -> None:
        while True:
            await link.call(lambda c: c.ping())

    rng = random.Random(7)
    lost = 0
    try:
        for _ in range(200):
            task = asyncio.create_task(pull_loop())
            await asyncio.sleep(rng.uniform(0.001, 0.005))  # mid-call, a different point each time
            task.cancel()
            await asyncio.wait((task,), timeout=1.0)
            if not task.done():
                lost += 1
                while not task.done():  # stop it for real before the next trial
                    task.cancel()
                    await asyncio.wait((task,), timeout=0.1)
        assert lost == 0, f"{lost} of 200 single cancels were lost"
        assert not link.degraded  # a cancel is no Redis failure

        server.pause()
        try:
            t0 = time.monotonic()
            with pytest.raises(RedisUnavailable):
                await link.call(lambda c: c.ping())
            assert time.monotonic() - t0 < 1.0  # the 200 ms deadline, not a socket's
        finally:
            server.resume()
        assert await link.call(lambda c: c.ping())
    finally:
        await link.close()


@pytest.mark.parametrize("encoding", ["packed", "keys"])
async def test_a_fresh_replica_pulls_a_snapshot_as_its_groups(
    server: RedisProcess, encoding: str
) -> None:
    """A full pull puts the entries one report confirmed together (tier, confirmation,
    expiry) as one group: the mirror's compact index holds them in one run each, not
    one run per block, and answers as the writer does."""
    a, _ = make(server, encoding=encoding)
    rng = random.Random(11)
    ks = [PrefixKey(rng.getrandbits(64)) for _ in range(3_000)]
    now = a.clock()
    entries = [(k, Tier.HOST if i < 2_000 else Tier.SSD, now + 3_600) for i, k in enumerate(ks)]
    a.replace_exact(Table.GLOBAL, E0, entries, now)
    fresh, _ = make_from(a)
    try:
        while a.pending:
            await a.sync_once()
        await fresh.sync_once()  # a full pull
        t = fresh.clock()
        got = fresh.local.get_many(Table.GLOBAL, E0, ks, t, False)
        assert [e.tier if e else None for e in got] == [Tier.HOST] * 2_000 + [Tier.SSD] * 1_000
        ix = fresh.local._exact[E0]
        # one run per group, not one per block (3,000); a group may come back as two
        # runs where the wall-to-local conversion of its expiry (redis_ops.Clocks, one
        # pair of clock reads per conversion) moved by a tick between its entries
        runs = sum(1 for r in ix.refs if r > 0)
        assert 2 <= runs <= 6, runs
    finally:
        await a.close()
        await a.link.close()
        await fresh.link.close()


async def test_a_full_pull_yields_to_the_loop_and_never_shows_half_a_pull(
    server: RedisProcess,
) -> None:
    """A pull of a large engine (a restarted replica starting warm: millions of blocks,
    seconds of CPU) checks, groups and stages what Redis returned in steps of
    `PULL_STEP`, letting the event loop run between them, and swaps it in at once: a
    coroutine running beside it gets turns after the last Redis call, and every turn
    sees the mirror empty or whole."""
    a, _ = make(server)
    rng = random.Random(5)
    n = 6 * PULL_STEP
    ks = [PrefixKey(rng.getrandbits(64)) for _ in range(n)]
    now = a.clock()
    a.replace_exact(Table.GLOBAL, E0, [(k, Tier.HOST, now + 3_600) for k in ks], now)
    fresh = RedisStore(RedisLink(a.settings, CollectorRegistry()), CFG, (E0,))  # one pull
    calls = 0
    link_call = fresh.link.call

    async def counted(fn: Any, timeout_s: float | None = None) -> Any:
        nonlocal calls
        try:
            return await link_call(fn, timeout_s)
        finally:
            calls += 1

    fresh.link.call = counted  # type: ignore[method-assign]
    try:
        while a.pending:
            await a.sync_once()
        # (Redis calls done, mirror size) at each turn of a full pull
        seen = await turns_during(
            fresh.sync_once(), lambda: (calls, fresh.local.size(Table.GLOBAL))
        )
        assert fresh.local.size(Table.GLOBAL) == n
        # the pull's last Redis call is the round's last: in one step, no turn followed it
        after_last_call = [size for c, size in seen if c == calls]
        assert len(after_last_call) >= 6, seen[-10:]
        assert {size for _, size in seen} <= {0, n}  # never half a pull
    finally:
        await a.close()
        await a.link.close()
        await fresh.link.close()


async def test_a_seed_of_a_large_mirror_yields_to_the_loop(server: RedisProcess) -> None:
    """Redis restarted empty: the replica seeds it from its mirror, read in pieces with
    turns for the loop between them (between the APPLY answered `missing` and the
    seed's first call), and the other replica pulls every entry back."""
    a, reg = make(server)
    b, _ = make(server)
    rng = random.Random(6)
    n = 6 * PULL_STEP
    ks = [PrefixKey(rng.getrandbits(64)) for _ in range(n)]
    in_flight = started = 0
    link_call = a.link.call

    async def counted(fn: Any, timeout_s: float | None = None) -> Any:
        nonlocal in_flight, started
        in_flight += 1
        started += 1
        try:
            return await link_call(fn, timeout_s)
        finally:
            in_flight -= 1

    a.link.call = counted  # type: ignore[method-assign]
    idle_turns = 0
    done = False

    async def beside() -> None:
        nonlocal idle_turns
        while not done:
            idle_turns += in_flight == 0 and started == 1  # after the first call
            await asyncio.sleep(0)

    try:
        now = a.clock()
        with a.report(E0, 1, 1):
            a.put(Table.GLOBAL, E0, ks, Tier.HOST, now, now + 600, True)
        while a.pending:
            await a.sync_once()
        await a.link.client.flushall()  # Redis lost everything
        with a.report(E0, 1, 2):
            a.put(Table.GLOBAL, E0, keys(7), Tier.HBM, a.clock(), a.clock() + 600, True)
        task = asyncio.create_task(beside())
        await asyncio.sleep(0)
        idle_turns = started = 0
        try:
            await a.sync_once()  # APPLY says missing: seed, then the batch
        finally:
            done = True
            await task
        assert metric(reg, "ramjet_redis_resyncs_total", direction="push", reason="redis_empty")
        assert idle_turns >= 5, idle_turns
        await sync(a, b)
        got = b.local.get_many(Table.GLOBAL, E0, [*ks, PrefixKey(7)], b.clock(), False)
        assert all(e is not None for e in got)
    finally:
        for s in (a, b):
            await s.link.close()


async def test_a_full_pull_puts_swa_and_approximate_entries_in_steps(
    server: RedisProcess,
) -> None:
    """A full pull puts the engine's SWA and approximate entries (a replica's own routing
    can leave hundreds of thousands) `PULL_STEP` at a time with a turn for the loop
    between, as it stages the exact ones: a coroutine beside it never sees more than
    `PULL_STEP` of them arrive in one turn, and the mirror ends with every one."""
    # a timeout for a loaded machine: this test is about the loop, not Redis's latency
    settings = RedisSettings(url=server.url, timeout_ms=5_000)
    a = RedisStore(RedisLink(settings, CollectorRegistry()), CFG, (E0,))
    rng = random.Random(9)
    n = 3 * PULL_STEP
    swa = [PrefixKey(rng.getrandbits(64)) for _ in range(n)]
    guessed = [PrefixKey(rng.getrandbits(64)) for _ in range(n)]
    now = a.clock()
    with a.report(E0, 1, 1):
        a.put(Table.SWA, E0, swa, Tier.HBM, now, now + 600, True)
    a.put(Table.GLOBAL, E0, guessed, Tier.HBM, now, now + 600, False)
    fresh = RedisStore(RedisLink(a.settings, CollectorRegistry()), CFG, (E0,))  # one pull

    def sizes() -> tuple[int, int]:  # (SWA entries, global entries)
        return fresh.local.size(Table.SWA), fresh.local.size(Table.GLOBAL)

    try:
        while a.pending:
            await a.sync_once()
        seen = await turns_during(fresh.sync_once(), sizes)  # at each turn of a full pull
        seen.append(sizes())
        assert seen[-1] == (n, n)
        for i in (0, 1):
            grew = max(b[i] - s[i] for s, b in pairwise(seen))
            assert 0 < grew <= PULL_STEP, (i, grew)
        t = fresh.clock()
        assert None not in fresh.local.get_many(Table.SWA, E0, swa, t, False)
        assert None not in fresh.local.get_many(Table.GLOBAL, E0, guessed, t, True)
    finally:
        await a.close()
        await a.link.close()
        await fresh.link.close()


async def test_a_staged_snapshot_holds_no_gc_tracked_object_per_key(server: RedisProcess) -> None:
    """A one-part snapshot staged over Redis (`RedisStaging`) keeps its replace entries
    until the commit: they must not stay tracked by the cyclic GC (a list per key did),
    since every gen-2 collection walks what is tracked and, at hundreds of thousands
    of keys, was the longest loop stall of the apply (135 ms CPU at 450k keys)."""
    a, _ = make(server)
    try:
        rng = random.Random(3)
        n = 20_000
        now = a.clock()
        gc.collect()
        before = len(gc.get_objects())
        staging = a.stage_exact(Table.GLOBAL, E0, now)
        for _ in range(n // 1_000):
            piece = [PrefixKey(rng.getrandbits(64)) for _k in range(1_000)]
            staging.add(piece, Tier.HOST, now + 3_600)
        gc.collect()
        tracked = len(gc.get_objects()) - before
        # the mirror's staged index: a shard object and its two arrays per shard touched
        # (bounded by SHARDS, whatever the snapshot's size), nothing per key
        assert tracked < 3 * SHARDS + n // 10, tracked
        staging.commit()
        while a.pending:
            await a.sync_once()
        assert a.size(Table.GLOBAL) == n
    finally:
        await a.link.close()


def gc_visits(roots: list[Any]) -> int:
    """Items a cyclic collection visits in the GC-tracked containers reachable from
    `roots` (what `tp_traverse` hands it: an untracked tuple in a list is visited, not
    entered); classes are not entered (every instance refers to its class)."""
    seen: set[int] = set()
    stack = [r for r in roots if gc.is_tracked(r)]
    visits = 0
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        refs = gc.get_referents(o)
        visits += len(refs)
        stack.extend(r for r in refs if gc.is_tracked(r) and not isinstance(r, type))
    return visits


async def test_a_queued_staged_replace_gives_the_gc_nothing_per_key(
    server: RedisProcess,
) -> None:
    """The replace a one-part snapshot staged over Redis stays queued until Redis took
    its last chunk (seconds at 450k keys): its entries must give a cyclic collection
    nothing to visit per key (a tuple per key in the chunks' lists: 6.5 ms of a young
    pass in the commit's turn at 450k keys, as much per gen-2 pass). Redis still gets
    every entry with its tier and expiry."""
    a, _ = make(server)
    b, _ = make(server)
    try:
        rng = random.Random(5)
        n = 20_000
        now = a.clock()
        staging = a.stage_exact(Table.GLOBAL, E0, now)
        pieces = [
            [PrefixKey(rng.getrandbits(64)) for _k in range(1_000)] for _ in range(n // 1_000)
        ]
        for i, piece in enumerate(pieces):
            staging.add(piece, (Tier.HBM, Tier.HOST, Tier.SSD)[i % 3], now + 600 + 60 * (i % 2))
        staging.commit()
        gc.collect()
        queued = list(a.sync.outbox)
        assert sum(len(op[3]) for batch in queued for op in batch.ops if op[0] in "RE") == n
        assert gc_visits(queued) < n // 10, gc_visits(queued)
        while a.pending:
            await a.sync_once()
        await b.sync_once()  # a fresh replica pulls what Redis holds
        for i, piece in enumerate(pieces):
            for k in piece[::97]:
                e = b.get(Table.GLOBAL, E0, k, now, False)
                assert e is not None and e.tier == (Tier.HBM, Tier.HOST, Tier.SSD)[i % 3]
                assert abs(e.expires_at - (now + 600 + 60 * (i % 2))) < 0.01
        assert b.size(Table.GLOBAL) == n
    finally:
        await a.link.close()
        await b.link.close()


async def test_a_staged_replace_is_queued_as_the_sync_chunks_a_whole_one(
    server: RedisProcess,
) -> None:
    """`RedisStaging` cuts its replace into chunks as the pieces come (its commit only
    queues them); what it queues is what `RedisSync` makes of the same replace queued
    whole: the same ops in the same chunks, the later chunks led by the first."""
    a, _ = make(server)
    try:
        rng = random.Random(8)
        limit = a.settings.snapshot_chunk_entries
        now = a.clock()
        staging = a.stage_exact(Table.GLOBAL, E0, now)
        for i in range(5):  # pieces that do not fall on chunk bounds
            piece = [PrefixKey(rng.getrandbits(64)) for _ in range(limit * 2 // 3 + 7)]
            staging.add(piece, (Tier.HBM, Tier.SSD)[i % 2], now + 600 + i)
        whole = staging._entries  # type: ignore[attr-defined]  # the seam under test
        staging.commit()
        queued = list(a.sync.outbox)
        conf_ms = a._clocks.to_wall_ms(now)
        expected = a.sync._chunks(Batch(E0, "free", ops=[["R", "g", conf_ms, whole]]))
        assert len(queued) == len(expected) > 2
        for got, want in zip(queued, expected, strict=True):
            assert (got.engine, got.mode, got.epoch, got.seq) == (
                want.engine, want.mode, want.epoch, want.seq,
            )  # fmt: skip
            assert [_spelled(op) for op in got.ops] == [_spelled(op) for op in want.ops]
        assert queued[0].lead is None and all(b.lead is queued[0] for b in queued[1:])
    finally:
        await a.link.close()


async def test_a_replayed_snapshot_keeps_its_groups_as_runs(server: RedisProcess) -> None:
    """A replica that tails a chunked snapshot from the log stages each group as one run
    of its compact index (one per chunk at most), not a run per key (`Clocks.to_local` per key moved by a tick
    between keys: an array per key, which gen-2 GC passes walked, 100+ ms at 450k)."""
    a, _ = make(server)
    b, _ = make(server)
    try:
        await b.sync_once()  # b is synced: what follows reaches it through the log
        rng = random.Random(4)
        ks = [PrefixKey(rng.getrandbits(64)) for _ in range(3_000)]
        now = a.clock()
        a.replace_exact(Table.GLOBAL, E0, [(k, Tier.HOST, now + 3_600) for k in ks], now)
        while a.pending:
            await a.sync_once()
        await b.sync_once()
        assert b.size(Table.GLOBAL) == len(ks)
        runs = sum(1 for r in b.local._exact[E0].refs if r > 0)
        assert runs <= len(ks) // 500, runs  # at most one per log entry (a chunk)
    finally:
        for s in (a, b):
            await s.link.close()


async def test_a_replica_frees_a_replaced_index_in_steps_not_in_one_turn(
    pair: tuple[RedisStore, RedisStore],
) -> None:
    """Over Redis the tables' expiry steps as in process (`ResidencyStore.expire_step`):
    the index a replayed snapshot replaced on a replica's mirror is freed about
    `release_bytes` a step, not with the mirror's whole sweep in one call (one loop
    turn)."""
    a, b = pair
    rng = random.Random(33)
    now = time.monotonic()
    keys = [PrefixKey(rng.getrandbits(64)) for _ in range(20_000)]
    a.put(Table.GLOBAL, E0, keys, Tier.HOST, now, now + 600.0, exact=True)
    await a.sync_once()
    await b.sync_once()  # b's mirror holds e0's index
    assert b.local.size(Table.GLOBAL) == len(keys)
    a.replace_exact(Table.GLOBAL, E0, [(k, Tier.SSD, now + 600.0) for k in keys[:100]], now)
    await a.sync_once()
    await b.sync_once()  # b replays the replace: its old index is dropped, to be freed
    assert b.local.size(Table.GLOBAL) == 100
    b.local.release_bytes = 64 << 10
    (old,) = b.local._retired
    held = old.nbytes()
    tables = ResidencyTables(CFG, b, clock=lambda: now)
    steps = 0
    while tables.expire_step(budget_s=0.0):  # one store step a call
        steps += 1
        assert steps < 1_000
    assert held > 8 * b.local.release_bytes and steps >= 8
    assert not b.sweeping(now) and old.nbytes() == 0
    assert b.local.size(Table.GLOBAL) == 100


async def test_queued_writes_give_the_cyclic_gc_no_item_per_key(
    pair: tuple[RedisStore, RedisStore],
) -> None:
    """A large put waits in the write queue as a typed array, spelled per chunk when
    sent: a list of a string per key there was walked item by item by every young
    collection that found it (13-20 ms passes while a 524k-key part was queued)."""
    a, b = pair

    def items_the_gc_walks() -> int:
        # type(o), not isinstance: isinstance falls back to o.__class__, which some
        # objects of other libraries in the process (torch's deprecated reduce_op) warn on
        return sum(len(o) for o in gc.get_objects() if issubclass(type(o), list | tuple | dict))

    rng = random.Random(7)
    keys = [PrefixKey(rng.getrandbits(64)) for _ in range(50_000)]
    now = time.monotonic()
    gc.collect()
    before = items_the_gc_walks()
    a.put(Table.GLOBAL, E0, keys, Tier.HOST, now, now + 600.0, exact=True)
    a.remove(Table.GLOBAL, E0, keys[:20_000])
    queued = items_the_gc_walks() - before
    assert a.pending >= 100  # queued in chunks of 500 entries
    assert queued < 10_000, queued  # a few items per chunk, none per key
    await a.sync_once()
    await b.sync_once()  # what Redis took is the same
    assert b.local.size(Table.GLOBAL) == 30_000
    assert sorted(k for k, _ in b.local.entries(Table.GLOBAL, E0, True)) == sorted(keys[20_000:])


def pulls(reg: CollectorRegistry) -> float:
    """Full pulls of any engine, whatever the reason."""
    return sum(
        s.value
        for fam in reg.collect()
        for s in fam.samples
        if s.name == "ramjet_redis_resyncs_total" and s.labels["direction"] == "pull"
    )


async def test_an_engines_first_write_seeds_redis_without_pulling_it_back(
    server: RedisProcess,
) -> None:
    """An engine Redis never held: its first batch is answered `missing`, and the replica
    seeds Redis from its mirror. The seed it won leaves Redis holding that mirror, so the
    mirror is not pulled back (that pull of everything, mid-load, was the longest loop
    stall over Redis at 2M and 20M blocks: issue 33); the next writes tail as usual and
    the other replica pulls every entry."""
    a, reg = make(server)
    b, _ = make(server)
    rng = random.Random(33)
    ks = [PrefixKey(rng.getrandbits(64)) for _ in range(3 * PULL_STEP)]
    try:
        await a.sync_once()  # Redis holds nothing of e0: nothing to pull
        now = a.clock()
        with a.report(E0, 1, 1):
            a.put(Table.GLOBAL, E0, ks, Tier.HOST, now, now + 600, True)
        a.put(Table.SWA, E0, keys(77), Tier.HBM, now, now + 600, False)
        while a.pending:
            await a.sync_once()
        assert metric(reg, "ramjet_redis_batches_total", result="seed_ok") >= 1  # missing
        assert pulls(reg) == 0
        with a.report(E0, 1, 2):
            a.put(Table.GLOBAL, E0, keys(5), Tier.HBM, a.clock(), a.clock() + 600, True)
        await sync(a, b)
        assert pulls(reg) == 0  # the tail goes on from the seed
        assert a.cursor(E0) == b.cursor(E0) == (1, 2)
        for s in (a, b):
            got = s.local.get_many(Table.GLOBAL, E0, [*ks, PrefixKey(5)], s.clock(), False)
            assert all(e is not None for e in got)
            assert s.get(Table.SWA, E0, PrefixKey(77), s.clock(), True) is not None
    finally:
        for s in (a, b):
            await s.link.close()


async def test_a_seed_sends_a_put_per_group_of_alike_entries_not_per_key(
    server: RedisProcess,
) -> None:
    """A seed reads the mirror a piece (an index shard) at a time and sends one put per
    group of entries alike in tier, confirmation and expiry, cut into chunks of
    `snapshot_chunk_entries`: a single-key put per entry was a list and an array per
    block, gigabytes for a 20M-block mirror (a Redis restart). What Redis ends with is
    the mirror: the other replica pulls every entry with its tier."""
    a, reg = make(server)
    b, _ = make(server)
    sent: list[Any] = []
    apply = a.sync._apply

    async def spy(batch: Any) -> str:
        sent.append(batch)
        return await apply(batch)

    a.sync._apply = spy  # type: ignore[method-assign]
    # 6,000 keys of one index shard (the same low 12 bits), in two runs of two tiers
    host = [PrefixKey(i << 12 | 7) for i in range(1, 3_001)]
    ssd = [PrefixKey(i << 12 | 7) for i in range(3_001, 6_001)]
    try:
        now = a.clock()
        with a.report(E0, 1, 1):
            a.put(Table.GLOBAL, E0, host, Tier.HOST, now, now + 600, True)
            a.put(Table.GLOBAL, E0, ssd, Tier.SSD, now, now + 900, True)
        while a.pending:
            await a.sync_once()
        assert metric(reg, "ramjet_redis_batches_total", result="seed_ok") >= 1
        seed = [
            x for x in sent if x.mode == "seed" or (x.lead is not None and x.lead.mode == "seed")
        ]
        puts = [op for x in seed for op in x.ops if op[0] == "p"]
        chunk = a.settings.snapshot_chunk_entries
        assert sum(len(op[5]) for op in puts) == len(host) + len(ssd)
        assert len(puts) <= 2 * (len(host) // chunk + 1)  # a put per chunk of a group
        assert all(sum(weight(op) for op in x.ops) <= chunk for x in seed)
        await sync(a, b)
        for s in (a, b):
            for ks, tier in ((host, Tier.HOST), (ssd, Tier.SSD)):
                got = s.local.get_many(Table.GLOBAL, E0, ks, s.clock(), False)
                assert all(e is not None and e.tier is tier for e in got)
    finally:
        for s in (a, b):
            await s.link.close()


async def test_a_seed_with_another_replicas_write_between_its_chunks_is_pulled(
    server: RedisProcess,
) -> None:
    """The seed's log is not this mirror alone when another replica wrote between its
    chunks: the replica pulls the engine and ends with both writes."""
    a, reg = make(server, snapshot_chunk_entries=100)
    b, _ = make(server)
    ks = [PrefixKey(k) for k in range(1000, 1300)]
    script = a.link.script
    calls = 0

    async def between(s: Any, keys_: list[str], args: list[Any]) -> Any:
        nonlocal calls
        res = await script(s, keys_, args)
        calls += args[0] == "seed"
        if calls == 1 and args[0] == "seed":  # the seed's lead went in: b writes
            calls += 1
            b.put(Table.GLOBAL, E0, keys(9), Tier.SSD, b.clock(), b.clock() + 600, False)
            await b.sync_once()
        return res

    a.link.script = between  # type: ignore[method-assign]
    try:
        await a.sync_once()
        now = a.clock()
        with a.report(E0, 1, 1):
            a.put(Table.GLOBAL, E0, ks, Tier.HOST, now, now + 600, True)
        while a.pending:
            await a.sync_once()
        await a.sync_once()
        assert metric(reg, "ramjet_redis_batches_total", result="seed_ok") >= 2  # chunks
        assert pulls(reg) == 1
        got = a.local.get_many(Table.GLOBAL, E0, [*ks, PrefixKey(9)], a.clock(), True)
        assert all(e is not None for e in got)
    finally:
        for s in (a, b):
            await s.link.close()


async def test_a_packed_pull_unpacks_a_full_bucket_in_steps(server: RedisProcess) -> None:
    """At 20M blocks a packed bucket (hash field) holds ~300 records, so one HSCAN page
    is tens of thousands of them: the pull unpacks a page with a turn for the loop every
    `PULL_STEP` records (it was one stretch per page). Here every key is in one bucket:
    between the global table's HSCAN and the next one, the loop gets turns."""
    a, _ = make(server)  # packed, the default
    rng = random.Random(12)
    n = 6 * PULL_STEP
    ks = [PrefixKey((rng.getrandbits(48) << 16) | 0x1234) for _ in range(n)]  # one bucket
    now = a.clock()
    a.replace_exact(Table.GLOBAL, E0, [(k, Tier.HOST, now + 3_600) for k in ks], now)
    fresh, _ = make_from(a)
    names: list[str] = []
    in_flight = 0
    hscan = fresh.link.client.hscan

    async def traced(name: str, *args: Any, **kw: Any) -> Any:
        nonlocal in_flight
        names.append(name)
        in_flight += 1
        try:
            return await hscan(name, *args, **kw)
        finally:
            in_flight -= 1

    fresh.link.client.hscan = traced  # type: ignore[method-assign]
    try:
        while a.pending:
            await a.sync_once()
        seen = await turns_during(fresh.sync_once(), lambda: (len(names), in_flight))
        assert names[0].endswith(":b:gx") and len(names) >= 4  # the other kinds follow
        unpacking = sum(1 for s in seen if s == (1, 0))  # gx's page read, none in flight
        assert unpacking >= n // PULL_STEP - 1, unpacking
        got = fresh.local.get_many(Table.GLOBAL, E0, ks, fresh.clock(), False)
        assert all(e is not None and e.tier is Tier.HOST for e in got)
    finally:
        await a.close()
        await a.link.close()
        await fresh.link.close()
