"""Shared report verification: two replicas, one Redis, real Ed25519 frames."""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers"))
from redis_server import RedisProcess, redis_server

from ramjet.reports.bodies import DeltaBuilder, LoadBody, encode_body
from ramjet.reports.envelope import Envelope, sign
from ramjet.reports.keys import KeyRing
from ramjet.reports.processor import ReportProcessor
from ramjet.reports.redis_cursors import SharedReports
from ramjet.reports.verify import Accepted, Reason, Rejected
from ramjet.residency.config import ResidencyConfig
from ramjet.residency.redis_link import RedisLink, RedisSettings
from ramjet.residency.redis_store import RedisStore
from ramjet.residency.store import Table
from ramjet.residency.tables import ResidencyTables, ViewMode
from ramjet.types import EngineId, PrefixKey, Tier, TrustGrade

pytestmark = pytest.mark.redis
E0 = EngineId("e0")
PRIV = Ed25519PrivateKey.generate()
RING = KeyRing({"k0": (E0, PRIV.public_key())})


@dataclass
class Replica:
    store: RedisStore
    tables: ResidencyTables
    processor: ReportProcessor
    shared: SharedReports
    registry: CollectorRegistry

    async def sync(self) -> None:
        await self.store.sync_once()
        await self.shared.sync_once()

    def rejected(self, reason: Reason) -> float:
        v = self.registry.get_sample_value(
            "ramjet_reports_rejected_total", {"engine": "e0", "reason": reason.value}
        )
        return v or 0.0


def replica(server: RedisProcess) -> Replica:
    reg = CollectorRegistry()
    cfg = ResidencyConfig()
    link = RedisLink(RedisSettings(url=server.url, timeout_ms=150, breaker_open_ms=50), reg)
    store = RedisStore(link, cfg, engines=(E0,), registry=reg)
    tables = ResidencyTables(cfg, store)
    processor = ReportProcessor(RING, tables, registry=reg)
    return Replica(store, tables, processor, SharedReports(processor, store, (E0,), reg), reg)


@pytest.fixture
def server() -> Iterator[RedisProcess]:
    with redis_server() as s:
        yield s


@pytest.fixture
async def pair(server: RedisProcess) -> AsyncIterator[tuple[Replica, Replica]]:
    a, b = replica(server), replica(server)
    try:
        yield a, b
    finally:
        for r in (a, b):
            await r.store.link.close()


def frame(epoch: int, seq: int, kind: str = "delta", keys: tuple[int, ...] = ()) -> bytes:
    if kind == "delta":
        d = DeltaBuilder()
        for k in keys:
            d.stored(PrefixKey(k), Tier.HOST)
        body = encode_body(d.build())
    else:
        body = encode_body(
            LoadBody(
                queued_prompt_tokens=7, running_requests=1, waiting_requests=0, kv_utilization=0.5
            )
        )
    env = Envelope(E0, "k0", epoch, seq, int(time.time() * 1000), kind, body)  # type: ignore[arg-type]
    return sign(env, PRIV)


async def test_a_report_is_applied_once_and_refused_by_the_other_replica(
    pair: tuple[Replica, Replica],
) -> None:
    a, b = pair
    f1 = frame(1, 1, keys=(11, 12))
    assert isinstance(await a.shared.submit(f1, E0), Accepted)
    out = await b.shared.submit(f1, E0)  # the same report reaching the other replica
    assert isinstance(out, Rejected) and out.reason is Reason.REPLAYED
    assert b.rejected(Reason.REPLAYED) == 1
    await a.sync()
    await b.sync()
    # b learnt the report from Redis: residency, cursor, trust and view mode match a's
    assert b.store.get(Table.GLOBAL, E0, PrefixKey(12), b.tables.clock(), False) is not None
    assert b.processor.cursor(E0) == a.processor.cursor(E0)
    assert b.processor.trust(E0) is TrustGrade.EXACT is a.processor.trust(E0)
    assert b.tables.mode(E0) is ViewMode.REPORTED
    # the next report lands on b; a replay of it to a is refused, and so is one to b
    f2 = frame(1, 2, keys=(13,))
    assert isinstance(await b.shared.submit(f2, E0), Accepted)
    for r in (a, b):
        again = await r.shared.submit(f2, E0)
        assert isinstance(again, Rejected) and again.reason is Reason.REPLAYED
    # a load report applied on a reaches b's processor
    assert isinstance(await a.shared.submit(frame(1, 3, "load"), E0), Accepted)
    await b.sync()
    load = b.processor.load(E0)
    assert load is not None and load.queued_prompt_tokens == 7
    # a restart (epoch 2) purges everywhere; a report of epoch 1 is then refused by both
    assert isinstance(await b.shared.submit(frame(2, 1, keys=(21,)), E0), Accepted)
    for r in (a, b, a, b):
        await r.sync()
    for r in (a, b):
        now = r.tables.clock()
        assert r.store.get(Table.GLOBAL, E0, PrefixKey(12), now, False) is None
        assert r.store.get(Table.GLOBAL, E0, PrefixKey(21), now, False) is not None
        old = await r.shared.submit(frame(1, 9, keys=(99,)), E0)
        assert isinstance(old, Rejected) and old.reason is Reason.EPOCH_OLD
        assert r.store.get(Table.GLOBAL, E0, PrefixKey(99), now, False) is None


async def test_a_gap_marks_both_replicas_degraded(pair: tuple[Replica, Replica]) -> None:
    a, b = pair
    assert isinstance(await a.shared.submit(frame(1, 1, keys=(1,)), E0), Accepted)
    assert isinstance(await a.shared.submit(frame(1, 5, keys=(2,)), E0), Accepted)  # 2-4 lost
    await b.sync()
    assert a.processor.trust(E0) is TrustGrade.DEGRADED
    assert b.processor.trust(E0) is TrustGrade.DEGRADED
    assert b.processor.snapshot_needed(E0)


async def test_redis_away_fails_open_and_the_batch_is_deduplicated_later(
    server: RedisProcess,
) -> None:
    a, b = replica(server), replica(server)
    try:
        f1 = frame(1, 1, keys=(5,))
        assert isinstance(await a.shared.submit(f1, E0), Accepted)
        await a.sync()
        server.pause()
        try:
            f2 = frame(1, 2, keys=(6,))
            t0 = time.perf_counter()
            assert isinstance(await a.shared.submit(f2, E0), Accepted)  # fail open
            assert time.perf_counter() - t0 < 1.0
            assert (
                a.registry.get_sample_value("ramjet_reports_unclaimed_total", {"engine": "e0"}) == 1
            )
            again = await a.shared.submit(f2, E0)  # the local cursor still refuses a replay
            assert isinstance(again, Rejected) and again.reason is Reason.REPLAYED
        finally:
            server.resume()
        deadline = time.monotonic() + 5
        while a.store.pending or a.store.degraded:
            assert time.monotonic() < deadline
            try:
                await a.store.sync_once()
            except Exception:
                import asyncio

                await asyncio.sleep(0.05)
        await b.sync()
        assert b.store.get(Table.GLOBAL, E0, PrefixKey(6), b.tables.clock(), False) is not None
    finally:
        for r in (a, b):
            await r.store.link.close()


async def test_shared_claim_takes_a_lower_epoch_only_after_silence(server: RedisProcess) -> None:
    """Issue 29: an engine restarted under a clock stepped back (a lower epoch) was refused
    by the shared claim forever; it is taken once the current epoch has been silent for
    `stale_after_s` and the report is issued after the last accepted one."""
    from ramjet.reports.config import ReportsConfig

    def fresh() -> Replica:
        reg = CollectorRegistry()
        cfg = ResidencyConfig()
        link = RedisLink(RedisSettings(url=server.url, timeout_ms=150, breaker_open_ms=50), reg)
        store = RedisStore(link, cfg, engines=(E0,), registry=reg)
        tables = ResidencyTables(cfg, store)
        proc = ReportProcessor(RING, tables, ReportsConfig(stale_after_s=0.3), registry=reg)
        return Replica(store, tables, proc, SharedReports(proc, store, (E0,), reg), reg)

    a, c, d = fresh(), fresh(), fresh()
    try:
        old = frame(5, 1, keys=(1,))
        assert isinstance(await a.shared.submit(old, E0), Accepted)
        # c has no local state: only the shared claim can refuse; epoch 5 still reports
        early = await c.shared.submit(frame(4, 1, keys=(2,)), E0)
        assert isinstance(early, Rejected) and early.reason is Reason.EPOCH_OLD, early
        time.sleep(0.4)
        assert isinstance(await c.shared.submit(frame(4, 1, keys=(2,)), E0), Accepted)
        # the old process's frame, replayed to a replica that never saw epoch 4, is refused
        again = await d.shared.submit(old, E0)
        assert isinstance(again, Rejected) and again.reason is Reason.REPLAYED, again
    finally:
        for r in (a, c, d):
            await r.store.link.close()


async def test_revoking_a_key_drops_the_shared_cursor_it_moved(
    pair: tuple[Replica, Replica],
) -> None:
    """Issue 29: a revoked key's last word must not hold the engine back on any replica:
    the purge drops the engine's shared cursor too, so the engine's real key starts over
    at any epoch."""
    import asyncio

    a, _b = pair
    assert isinstance(await a.shared.submit(frame(50, 3, keys=(1,)), E0), Accepted)
    vc = a.shared._keys[E0].vc
    assert await a.store.link.call(lambda c: c.exists(vc)) == 1
    other = Ed25519PrivateKey.generate()
    out = a.processor.replace_keyring(KeyRing({"k1": (E0, other.public_key())}))
    assert out == {"revoked": ["k0"], "purged": ["e0"]}
    for _ in range(50):
        if await a.store.link.call(lambda c: c.exists(vc)) == 0:
            break
        await asyncio.sleep(0.02)
    assert await a.store.link.call(lambda c: c.exists(vc)) == 0
    env = Envelope(
        E0, "k1", 2, 1, int(time.time() * 1000), "delta", encode_body(DeltaBuilder().build())
    )
    assert isinstance(await a.shared.submit(sign(env, other), E0), Accepted)
