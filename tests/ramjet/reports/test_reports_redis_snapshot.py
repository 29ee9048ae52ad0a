"""Snapshots through the shared claim (`SharedReports.submit`): applied in pieces when
large (routing reads the old, whole view meanwhile; a delta accepted during the apply is
live at once and survives the swap), and in every case the snapshot's content reaches the
other replica through Redis, also when its seq equals the last delta's (the usual case:
an engine's snapshot carries its current seq)."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers"))
from redis_server import RedisProcess, redis_server

from ramjet.reports.bodies import DeltaBody, SnapshotBody, TierKeys, encode_body, split_snapshot
from ramjet.reports.envelope import Envelope, sign
from ramjet.reports.keys import KeyRing
from ramjet.reports.processor import ReportProcessor
from ramjet.reports.redis_cursors import SharedReports
from ramjet.reports.verify import Accepted, Reason, Rejected
from ramjet.residency.config import ResidencyConfig
from ramjet.residency.index import RELEASE_BYTES
from ramjet.residency.redis_link import RedisLink, RedisSettings
from ramjet.residency.redis_store import RedisStore
from ramjet.residency.store import Table
from ramjet.residency.tables import ResidencyTables
from ramjet.types import EngineId, PrefixKey, Tier, TrustGrade

pytestmark = pytest.mark.redis
E0 = EngineId("e0")
PRIV = Ed25519PrivateKey.from_private_bytes(bytes(range(64, 96)))
RING = KeyRing({"k0": (E0, PRIV.public_key())})
SNAP = [PrefixKey(10_000 + i) for i in range(4000)]


def replica(
    server: RedisProcess, chunk: int, timeout_ms: int = 150
) -> tuple[RedisStore, ReportProcessor, SharedReports]:
    reg = CollectorRegistry()
    cfg = ResidencyConfig()
    link = RedisLink(RedisSettings(url=server.url, timeout_ms=timeout_ms), reg)
    store = RedisStore(link, cfg, engines=(E0,), registry=reg)
    processor = ReportProcessor(
        RING, ResidencyTables(cfg, store), registry=reg, snapshot_chunk_keys=chunk
    )
    return store, processor, SharedReports(processor, store, (E0,), reg)


@pytest.fixture
def server() -> Iterator[RedisProcess]:
    with redis_server() as s:
        yield s


def signed(seq: int, kind: str, body: bytes) -> bytes:
    env = Envelope(E0, "k0", 1, seq, int(time.time() * 1000), kind, body)  # type: ignore[arg-type]
    return sign(env, PRIV)


def delta(seq: int, keys: list[PrefixKey]) -> bytes:
    return signed(seq, "delta", encode_body(DeltaBody(stored=[TierKeys(tier="hbm", keys=keys)])))


def snapshot(seq: int) -> bytes:
    body = SnapshotBody(seq=seq, residency=[TierKeys(tier="ssd", keys=SNAP)], swa=[])
    return signed(seq, "snapshot", encode_body(body))


def held(store: RedisStore, key: int) -> bool:
    return store.get(Table.GLOBAL, E0, PrefixKey(key), store.clock(), False) is not None


@pytest.fixture
async def links() -> AsyncIterator[list[RedisStore]]:
    stores: list[RedisStore] = []
    try:
        yield stores
    finally:
        for s in stores:
            await s.link.close()


@pytest.mark.parametrize("chunk", [16, 0], ids=["in_pieces", "one_step"])
async def test_a_snapshot_is_applied_once_and_reaches_the_other_replica(
    server: RedisProcess, links: list[RedisStore], chunk: int
) -> None:
    sa, pa, a = replica(server, chunk)
    sb, pb, b = replica(server, chunk)
    links += [sa, sb]
    assert isinstance(await a.submit(delta(1, [PrefixKey(1)]), E0), Accepted)
    for store in (sa, sb):  # steady state: Redis holds the delta's batch (epoch 1, seq 1)
        await store.sync_once()
    gate = asyncio.Event()

    async def hold() -> None:  # the apply waits after its first piece until the delta is in
        await asyncio.sleep(0)
        await gate.wait()

    pa.piece_pause = hold
    task = asyncio.create_task(a.submit(snapshot(1), E0))  # same seq as the delta, later
    if not chunk:
        gate.set()
    else:
        deadline = time.monotonic() + 5
        while pa.state(E0).applying is None:  # claimed; pieces begin
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0)
        # mid-apply: routing still reads the old, whole content; trust says so
        assert held(sa, 1) and not held(sa, SNAP[-1])
        assert pa.trust(E0) is TrustGrade.DEGRADED
        # a delta accepted meanwhile applies at once and survives the swap
        assert isinstance(await a.submit(delta(2, [PrefixKey(7)]), E0), Accepted)
        assert held(sa, 7) and not task.done()  # live at once, replayed at the swap
        gate.set()
    assert isinstance(await task, Accepted)
    if not chunk:
        assert isinstance(await a.submit(delta(2, [PrefixKey(7)]), E0), Accepted)
    assert all(held(sa, k) for k in SNAP) and held(sa, 7) and not held(sa, 1)
    assert pa.trust(E0) is TrustGrade.EXACT
    # the other replica refuses the same snapshot and learns it from Redis
    again = await b.submit(snapshot(1), E0)  # signed later, but older than delta 2
    assert isinstance(again, Rejected) and again.reason is Reason.REPLAYED
    for _ in range(3):
        await sa.sync_once()
        await sb.sync_once()
        await b.sync_once()
    assert all(held(sb, k) for k in SNAP) and held(sb, 7) and not held(sb, 1)
    assert pb.cursor(E0) == pa.cursor(E0)
    assert pb.trust(E0) is TrustGrade.EXACT


def parts(seq: int, keys: list[PrefixKey], max_keys: int) -> list[bytes]:
    """A snapshot of `keys` cut in parts, each signed at its seq, issue times rising."""
    out = []
    for b in split_snapshot(seq, [TierKeys(tier="host", keys=keys)], [], max_keys=max_keys):
        out.append(signed(b.seq, "snapshot", encode_body(b)))
        time.sleep(0.002)
    return out


async def test_a_snapshot_in_parts_replaces_once_complete_and_an_abandoned_one_removes_nothing(
    server: RedisProcess, links: list[RedisStore]
) -> None:
    sa, pa, a = replica(server, 16)
    sb, pb, b = replica(server, 16)
    links += [sa, sb]
    old = [PrefixKey(1 + i) for i in range(20)]
    new = [PrefixKey(500 + i) for i in range(90)]

    async def sync() -> None:
        for _ in range(3):
            for s in (sa, sb):
                await s.sync_once()
            await b.sync_once()

    assert isinstance(await a.submit(delta(1, old), E0), Accepted)
    # an incomplete snapshot: part 0 (40 keys) then a gap (part 2 comes without part 1)
    cut = parts(1, new, 40)
    assert isinstance(await a.submit(cut[0], E0), Accepted)
    assert isinstance(await a.submit(cut[2], E0), Accepted)
    await sync()
    for store in (sa, sb):  # the old state stays whole; the parts' keys are added
        assert all(held(store, k) for k in old) and held(store, new[0]) and held(store, new[-1])
    assert pa.snapshot_needed(E0)
    # a complete one, its later parts also pulled by the other replica (which passes them
    # over: the replica that applied part 0 applies them all)
    cut = parts(3, new, 40)
    assert isinstance(await a.submit(cut[0], E0), Accepted)
    for f in cut[1:]:
        assert isinstance(await b.submit(f, E0), Accepted)  # passed over, cursor moves
        assert isinstance(await a.submit(f, E0), Accepted)
    assert pa.trust(E0) is TrustGrade.EXACT
    await sync()
    for store in (sa, sb):
        assert not any(held(store, k) for k in old) and all(held(store, k) for k in new)
    assert pb.cursor(E0) == pa.cursor(E0)


async def test_a_large_one_part_snapshot_over_redis_is_staged_piece_by_piece(
    server: RedisProcess, links: list[RedisStore]
) -> None:
    """A snapshot in one part over Redis is staged a piece at a time, in the mirror and
    in the replace sent to Redis (`RedisStore.stage_exact`), so the turn that commits it
    is a swap and a queued replace, not the whole content at once (0.8 s of CPU at 180k
    keys): measured in CPU of the loop's thread, the commit's turn costs no more than a
    few pieces. The content reaches Redis whole: a fresh replica pulls exactly it."""
    sa, pa, a = replica(server, 1024, timeout_ms=5_000)  # about the loop, not Redis's latency
    links.append(sa)
    keys = [PrefixKey(1_000_000 + 7919 * i) for i in range(16 * 1024)]
    assert isinstance(await a.submit(delta(1, [PrefixKey(1)]), E0), Accepted)
    marks: list[tuple[float, float]] = []  # (CPU at a pause, CPU when the apply resumed)

    async def timed() -> None:
        t = time.thread_time()
        await asyncio.sleep(0)
        marks.append((t, time.thread_time()))

    pa.piece_pause = timed
    body = SnapshotBody(seq=1, residency=[TierKeys(tier="host", keys=keys)], swa=[])
    assert isinstance(await a.submit(signed(1, "snapshot", encode_body(body)), E0), Accepted)
    end = time.thread_time()
    assert len(marks) >= 12
    pieces = sorted(marks[i + 1][0] - marks[i][1] for i in range(len(marks) - 1))
    commit = end - marks[-1][1]
    assert commit <= 4 * max(pieces[len(pieces) // 2], 0.001), (commit, pieces[-3:])
    assert all(held(sa, k) for k in keys) and not held(sa, 1)
    while sa.pending:
        await sa.sync_once()
    fresh = RedisStore(RedisLink(sa.settings, CollectorRegistry()), ResidencyConfig(), (E0,))
    links.append(fresh)
    await fresh.sync_once()  # a full pull
    assert fresh.size(Table.GLOBAL) == len(keys) and all(held(fresh, k) for k in keys)


async def test_a_snapshot_in_parts_over_redis_frees_its_marks_in_steps(
    server: RedisProcess, links: list[RedisStore]
) -> None:
    """Over Redis a snapshot in parts marks every key its parts name (a `BlockIndex`:
    ~600 MB at 20M keys); the commit frees the marks a step at a time
    (`BlockIndex.release`, `RELEASE_BYTES` a step, one shard's arrays over at most),
    not in the turn that ends the commit (a 15 ms turn at 20M)."""
    sa, pa, _ = replica(server, 1024)
    links.append(sa)
    staging = pa.tables.stage_snapshot(E0, 0.0, additive=True)
    keys = [PrefixKey(1 + 7919 * i) for i in range(800_000)]
    for i in range(0, len(keys), 100_000):
        staging.add_global(keys[i : i + 100_000], Tier.HOST, None)
    marks = staging._marks
    assert marks is not None
    widest = max(8 * len(sh.keys) + 4 * len(sh.words) for sh in marks.shards if sh is not None)
    held_before = marks.nbytes()
    assert held_before > 2 * RELEASE_BYTES
    freed: list[int] = []
    for _ in staging.commit_steps():
        now_held = marks.nbytes()
        if now_held < held_before:
            freed.append(held_before - now_held)
        held_before = now_held
    assert marks.nbytes() == 0 and len(freed) >= 2
    assert max(freed) <= RELEASE_BYTES + widest
