"""Large snapshots applied in pieces (`ReportProcessor.submit_async`) over a staged copy of
the tables (`ResidencyTables.stage_snapshot`): the loop keeps running, readers see the
old whole view until the swap, reports accepted meanwhile survive the swap, a new epoch
abandons the apply, and the result equals the one-step apply."""

from __future__ import annotations

import asyncio
import time

from reports_fixtures import E0, Clocks, frame, rig, stored

from ramjet.reports.bodies import DeltaBody, SnapshotBody, SwaStates, TierKeys
from ramjet.residency.store import MemoryStore, Table
from ramjet.residency.tables import ResidencyTables
from ramjet.types import PrefixKey, Tier, TrustGrade

N = 40_000
OLD = [PrefixKey(1_000_000 + i) for i in range(50)]
NEW = [PrefixKey(i) for i in range(N)]


def big_snapshot(seq: int, keys: list[PrefixKey] = NEW) -> SnapshotBody:
    half = len(keys) // 2
    return SnapshotBody(
        seq=seq,
        residency=[
            TierKeys(tier="hbm", keys=tuple(keys[:half])),
            TierKeys(tier="ssd", keys=tuple(keys[half:]), ttl_ms=3_600_000),
        ],
        swa=[SwaStates(keys=(PrefixKey(77),), ttl_ms=60_000)],
    )


def tiers(tables: ResidencyTables, table: Table = Table.GLOBAL) -> dict[PrefixKey, Tier]:
    assert isinstance(tables.store, MemoryStore)
    return {k: e.tier for k, e in tables.store.entries(table, E0, exact=True)}


def test_staging_is_invisible_until_commit_then_replaces_whole() -> None:
    clocks = Clocks()
    tables = ResidencyTables(clock=clocks.clock)
    tables.store_global(E0, OLD, Tier.HBM, clocks.mono)
    keys = tuple(PrefixKey(i) for i in range(10))
    tables.store.put(Table.GLOBAL, E0, keys[:3], Tier.HBM, clocks.mono, 1e9, exact=False)
    staging = tables.stage_snapshot(E0, clocks.mono)
    staging.add_global(keys, Tier.HOST, None)
    view = tables.view(E0)
    assert view.global_match(OLD[:5], [256] * 5).hbm == 5 * 256  # the old view, whole
    assert view.global_match(keys[:5], [256] * 5).host == 0  # staged at HOST: not yet seen
    staging.commit()
    after = tables.view(E0)
    assert after.global_match(OLD[:5], [256] * 5).total == 0
    assert after.global_match(keys, [256] * 10).host == 10 * 256
    # the snapshot's keys left the approximate map: no double count, size is exact
    assert tables.store.entries(Table.GLOBAL, E0, exact=False) == []
    assert tables.size(Table.GLOBAL) == 10


def test_commit_over_the_cap_evicts_by_the_stated_rule() -> None:
    store = MemoryStore({Table.GLOBAL: 8, Table.SWA: 8})
    store.put(Table.GLOBAL, E0, [PrefixKey(900)], Tier.HBM, 0.0, 1e9, exact=False)
    store.put(Table.GLOBAL, E0, [PrefixKey(901)], Tier.HBM, 1.0, 1e9, exact=True)
    other = "e1"
    store.put(Table.GLOBAL, other, [PrefixKey(5)], Tier.HBM, 2.0, 1e9, exact=True)  # type: ignore[arg-type]
    staging = store.stage_exact(Table.GLOBAL, E0, 10.0)
    staging.add([PrefixKey(i) for i in range(7)], Tier.HBM, 1e9)
    staging.commit()
    assert store.size(Table.GLOBAL) == 8
    # e0's old exact entry is replaced; the approximate one goes first, then nothing more
    assert store.get(Table.GLOBAL, other, PrefixKey(5), 3.0, False) is not None  # type: ignore[arg-type]
    assert store.get(Table.GLOBAL, E0, PrefixKey(900), 3.0, True) is None
    assert len(store.entries(Table.GLOBAL, E0, exact=True)) == 7


def test_piecewise_apply_equals_one_step_apply() -> None:
    async def run() -> tuple[dict[PrefixKey, Tier], dict[PrefixKey, Tier]]:
        a, b = rig(), rig()
        b.processor.snapshot_chunk_keys = 1000
        for r in (a, b):
            assert not hasattr(r.processor.submit(frame(stored(*OLD), seq=1)), "reason")
        f = frame(big_snapshot(1), issued_at_ms=int(a.clocks.wall * 1000) + 1)
        assert not hasattr(a.processor.submit(f), "reason")
        assert not hasattr(await b.processor.submit_async(f), "reason")
        return tiers(a.tables), tiers(b.tables)

    one, pieces = asyncio.run(run())
    assert len(one) == N and one == pieces
    assert not set(OLD) & set(pieces)


async def test_loop_keeps_running_and_readers_never_see_half_a_snapshot() -> None:
    r = rig()
    r.processor.snapshot_chunk_keys = 2000
    r.processor.submit(frame(stored(*OLD), seq=1))
    f = frame(big_snapshot(1), issued_at_ms=int(r.clocks.wall * 1000) + 1)
    seen: list[tuple[int, int]] = []
    gaps: list[float] = []
    trusts: set[TrustGrade] = set()
    done = asyncio.Event()

    async def reader() -> None:
        last = time.perf_counter()
        while not done.is_set():
            v = r.tables.view(E0)
            seen.append(
                (
                    v.global_match(OLD, [1] * len(OLD)).total,
                    v.global_match(NEW[:10], [1] * 10).total,
                )
            )
            trusts.add(r.processor.trust(E0))
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(reader())
    await asyncio.sleep(0)
    await r.processor.submit_async(f)
    done.set()
    await task
    # the reader ran during the apply, and every read saw all-old or all-new
    assert len(seen) > N // 2000
    assert set(seen) <= {(len(OLD), 0), (0, 10)}
    assert seen[0] == (len(OLD), 0)
    assert r.tables.view(E0).global_match(NEW[:10], [1] * 10).total == 10
    assert TrustGrade.DEGRADED in trusts  # while applying
    assert r.processor.trust(E0) is TrustGrade.EXACT
    # one piece of 2000 keys is ~1 ms; a one-step apply of 40k keys is tens of ms
    assert max(gaps) < 0.5  # generous on a shared machine; the benchmark measures it


async def test_reports_accepted_during_the_apply_survive_the_swap() -> None:
    r = rig()
    r.processor.snapshot_chunk_keys = 1000
    wall_ms = int(r.clocks.wall * 1000)
    snap = frame(big_snapshot(0), seq=0, issued_at_ms=wall_ms)
    later = [
        frame(DeltaBody(evicted=(NEW[0],)), seq=1, issued_at_ms=wall_ms + 1),
        frame(stored(5_000_000, tier="host"), seq=2, issued_at_ms=wall_ms + 2),
    ]

    async def pusher() -> None:
        await asyncio.sleep(0)
        for f in later:  # arrive while the snapshot is being applied (a push)
            assert not hasattr(await r.processor.submit_async(f), "reason")

    await asyncio.gather(r.processor.submit_async(snap), pusher())
    got = tiers(r.tables)
    assert NEW[0] not in got
    assert got[PrefixKey(5_000_000)] is Tier.HOST
    assert len(got) == N  # N - 1 evicted + 1 stored
    assert r.processor.cursor(E0).seq == 2  # type: ignore[union-attr]


async def test_a_new_epoch_abandons_the_apply() -> None:
    r = rig()
    r.processor.snapshot_chunk_keys = 1000
    wall_ms = int(r.clocks.wall * 1000)
    snap = frame(big_snapshot(0), seq=0, epoch=7, issued_at_ms=wall_ms)
    restart = frame(stored(42), seq=1, epoch=8, issued_at_ms=wall_ms + 5)

    async def restarted() -> None:
        await asyncio.sleep(0)
        assert not hasattr(await r.processor.submit_async(restart), "reason")

    await asyncio.gather(r.processor.submit_async(snap), restarted())
    assert tiers(r.tables) == {PrefixKey(42): Tier.HBM}  # nothing of epoch 7 swapped in
    assert r.processor.trust(E0) is TrustGrade.EXACT


async def test_cancelled_apply_asks_for_a_snapshot_again() -> None:
    r = rig()
    r.processor.snapshot_chunk_keys = 100
    r.processor.submit(frame(stored(*OLD), seq=1))
    f = frame(big_snapshot(1), issued_at_ms=int(r.clocks.wall * 1000) + 1)
    task = asyncio.create_task(r.processor.submit_async(f))
    for _ in range(5):
        await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert set(tiers(r.tables)) == set(OLD)  # the old view, whole
    assert r.processor.snapshot_needed(E0)
    assert r.processor.trust(E0) is TrustGrade.DEGRADED
