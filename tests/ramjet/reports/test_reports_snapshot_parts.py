"""Snapshots sent in parts (`SnapshotBody.part/parts`, `split_snapshot`): the parts of one
snapshot, applied in order, give what the whole snapshot gives; a gap, a part out of
order, a new part 0 or a report between parts abandons the incomplete snapshot without
removing anything the previous state vouched for (counted); a forged part changes
nothing; a large delta is applied in steps, in order with the reports after it."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from pydantic import ValidationError
from reports_fixtures import E0, Rig, frame, rig, stored

from ramjet.reports.bodies import (
    MAX_SNAPSHOT_PARTS,
    BodyError,
    DeltaBody,
    SnapshotBody,
    SwaStates,
    TierKeys,
    encode_body,
    parse_body,
    split_snapshot,
)
from ramjet.residency.store import MemoryStore, Table
from ramjet.types import EngineId, PrefixKey, Tier, TrustGrade

TIERS = ("hbm", "host", "ssd")


def content(r: Rig) -> tuple[dict[PrefixKey, Tier], set[PrefixKey]]:
    store = r.tables.store
    assert isinstance(store, MemoryStore)
    glob = {k: e.tier for k, e in store.entries(Table.GLOBAL, E0, exact=True)}
    swa = {k for k, _ in store.entries(Table.SWA, E0, exact=True)}
    return glob, swa


def abandoned(r: Rig, reason: str) -> float:
    v = r.registry.get_sample_value(
        "ramjet_reports_snapshots_abandoned_total", {"engine": "e0", "reason": reason}
    )
    return v or 0.0


def send(r: Rig, bodies: list[SnapshotBody], *, ms: int, stride: int = 1) -> None:
    """Submit snapshot bodies (as cut), each signed at its own seq, issue times rising."""
    for i, b in enumerate(bodies):
        out = r.processor.submit(frame(b, seq=b.seq, issued_at_ms=ms + i * stride))
        assert not hasattr(out, "reason"), out


def residency(keys: list[int], swa: list[int]) -> tuple[list[TierKeys], list[SwaStates]]:
    groups = [
        TierKeys(tier=TIERS[i % 3], keys=tuple(PrefixKey(k) for k in keys[i::3]), ttl_ms=None)  # type: ignore[arg-type]
        for i in range(3)
    ]
    return groups, [SwaStates(keys=tuple(PrefixKey(k) for k in swa), ttl_ms=60_000)]


def test_split_cuts_in_bounded_consecutive_parts_and_keeps_whole_bytes() -> None:
    res, swa = residency(list(range(100)), [1000, 1001, 1002])
    whole = split_snapshot(5, res, swa, max_keys=103)
    assert len(whole) == 1 and whole[0].parts == 1
    # a whole snapshot's bytes carry no part fields: as before parts existed
    assert b"part" not in encode_body(whole[0])
    assert encode_body(whole[0]) == encode_body(SnapshotBody(seq=5, residency=res, swa=swa))
    bodies = split_snapshot(5, res, swa, max_keys=10)
    assert [b.part for b in bodies] == list(range(11))
    assert {b.parts for b in bodies} == {11}
    assert [b.seq for b in bodies] == list(range(5, 16))
    assert all(b.key_count() <= 10 for b in bodies)
    cut = [k for b in bodies for g in b.residency for k in g.keys]
    assert cut == [k for g in res for k in g.keys]
    assert [k for b in bodies for w in b.swa for k in w.keys] == list(swa[0].keys)
    # parts survive the wire
    again = parse_body("snapshot", encode_body(bodies[3]))
    assert isinstance(again, SnapshotBody) and (again.part, again.parts) == (3, 11)


def test_bad_part_numbers_are_refused_clearly() -> None:
    with pytest.raises(ValidationError, match="part must be < parts"):
        SnapshotBody(seq=1, part=2, parts=2)
    with pytest.raises(ValidationError):
        SnapshotBody(seq=1, part=0, parts=MAX_SNAPSHOT_PARTS + 1)
    with pytest.raises(BodyError, match="part must be < parts"):
        parse_body("snapshot", b'{"seq":1,"residency":[],"swa":[],"part":3,"parts":3}')
    res, swa = residency(list(range(50)), [])
    with pytest.raises(BodyError, match="more than 4096"):
        split_snapshot(1, res * 100, swa, max_keys=1)


@pytest.mark.parametrize("seed", range(6))
def test_parts_give_what_the_whole_snapshot_gives(seed: int) -> None:
    rnd = random.Random(seed)
    keys = rnd.sample(range(1, 5000), rnd.randrange(60, 400))
    swa_keys = rnd.sample(range(6000, 7000), rnd.randrange(0, 30))
    before = rnd.sample(range(1, 5000), 200)  # an older complete state, partly overlapping
    res, swa = residency(keys, swa_keys)
    whole, parted = rig(), rig()
    for r in (whole, parted):
        r.processor.submit(frame(stored(*before), seq=1))
        r.processor.submit(frame(stored(*before[:50], tier="ssd"), seq=2))
    send(whole, split_snapshot(2, res, swa), ms=1_800_000_000_500)
    bodies = split_snapshot(2, res, swa, max_keys=rnd.randrange(1, 60))
    assert len(bodies) > 1
    send(parted, bodies, ms=1_800_000_000_500)
    assert content(parted) == content(whole)
    assert content(parted)[0] == {PrefixKey(k): Tier.parse(TIERS[keys.index(k) % 3]) for k in keys}
    assert parted.processor.trust(E0) is TrustGrade.EXACT
    assert sum(abandoned(parted, why) for why in ("gap", "out_of_order", "restarted")) == 0
    # the deltas after the last part apply as usual
    last = bodies[-1].seq
    parted.processor.submit(frame(DeltaBody(evicted=(PrefixKey(keys[0]),)), seq=last + 1))
    assert PrefixKey(keys[0]) not in content(parted)[0]


OLD = list(range(1, 41))
NEW = list(range(100, 130))


def started(stride: int = 1) -> tuple[Rig, list[SnapshotBody]]:
    """An engine with OLD complete (a whole snapshot), then part 0 of a 3-part snapshot
    of NEW applied."""
    r = rig()
    r.processor.submit(frame(stored(*OLD), seq=1))
    res, swa = residency(NEW, [])
    bodies = split_snapshot(1, res, swa, max_keys=10)
    assert len(bodies) == 3
    send(r, bodies[:1], ms=1_800_000_000_200)
    return r, bodies


def keys_of(bodies: list[SnapshotBody]) -> set[int]:
    return {int(k) for b in bodies for g in b.residency for k in g.keys}


def held(r: Rig) -> set[int]:
    return {int(k) for k in content(r)[0]}


def test_parts_add_as_they_come_and_replace_only_at_the_last() -> None:
    r, bodies = started()
    assert held(r) == set(OLD) | keys_of(bodies[:1])  # additive: nothing removed yet
    assert r.processor.trust(E0) is TrustGrade.DEGRADED
    send(r, bodies[1:2], ms=1_800_000_000_210)
    assert held(r) == set(OLD) | keys_of(bodies[:2])
    send(r, bodies[2:], ms=1_800_000_000_220)
    assert held(r) == set(NEW)
    assert r.processor.trust(E0) is TrustGrade.EXACT


@pytest.mark.parametrize(
    ("case", "reason"),
    [("gap", "gap"), ("out_of_order", "out_of_order"), ("restart", "restarted"),
     ("delta", "interrupted"), ("whole", "restarted")],
)  # fmt: skip
def test_an_incomplete_snapshot_is_abandoned_without_removing_anything(
    case: str, reason: str
) -> None:
    r, bodies = started()
    ms = 1_800_000_001_000
    p = r.processor
    if case == "gap":  # part 2 at its seq: part 1 never came
        p.submit(frame(bodies[2], seq=bodies[2].seq, issued_at_ms=ms))
    elif case == "out_of_order":  # part 2's keys under part 1's seq
        moved = bodies[2].model_copy(update={"seq": bodies[1].seq})
        p.submit(frame(moved, seq=moved.seq, issued_at_ms=ms))
    elif case == "restart":  # a new part 0 (at the publisher's seq: 3), never finished
        res, swa = residency(list(range(900, 930)), [])
        send(r, split_snapshot(bodies[2].seq, res, swa, max_keys=10)[:1], ms=ms)
    elif case == "delta":
        p.submit(frame(stored(7777), seq=2, issued_at_ms=ms))
    elif case == "whole":  # a whole snapshot replaces it: its replace applies, not the parts'
        p.submit(
            frame(SnapshotBody(seq=1, residency=residency(OLD, [])[0]), seq=1, issued_at_ms=ms)
        )
    assert abandoned(r, reason) == 1
    if case == "whole":
        assert held(r) == set(OLD)
        return
    # everything the previous complete state vouched for is still there
    assert set(OLD) <= held(r)
    # what completes it no more: the later parts do not replace anything
    for b in bodies[1:]:
        p.submit(frame(b, seq=b.seq, issued_at_ms=ms + 50 + b.part))
    assert set(OLD) <= held(r)
    assert p.trust(E0) is TrustGrade.DEGRADED
    if case != "restart":  # a restart waits for its own parts; the others need a snapshot
        assert p.snapshot_needed(E0)


def test_a_forged_or_foreign_part_changes_nothing() -> None:
    r, bodies = started()
    before = held(r)
    p = r.processor
    ms = 1_800_000_001_000
    forged = [
        frame(bodies[1], seq=bodies[1].seq, issued_at_ms=ms, signer="stranger"),  # bad signature
        frame(bodies[1], seq=bodies[1].seq, issued_at_ms=ms, key_id="e1-a"),  # another's key
        frame(bodies[1], seq=bodies[1].seq, issued_at_ms=ms)[:-64] + bytes(64),  # no signature
    ]
    for f in forged:
        out = p.submit(f)
        assert hasattr(out, "reason")
    assert held(r) == before
    assert sum(abandoned(r, why) for why in ("gap", "out_of_order", "restarted")) == 0
    # the genuine parts still complete it
    send(r, bodies[1:], ms=ms + 1)
    assert held(r) == set(NEW)


def test_a_large_delta_applies_in_steps_in_order_with_later_reports() -> None:
    async def run() -> tuple[set[int], int]:
        r = rig()
        p = r.processor
        p.snapshot_chunk_keys = 500
        pauses = 0

        async def pause() -> None:
            nonlocal pauses
            pauses += 1
            await asyncio.sleep(0)

        p.piece_pause = pause
        big = asyncio.create_task(p.submit_async(frame(stored(*range(1, 5001)), seq=1)))
        await asyncio.sleep(0)  # the big delta is being applied in steps
        assert 0 < len(held(r)) < 5000
        # accepted meanwhile: it evicts keys the big delta has not reached yet
        small = p.submit_async(
            frame(DeltaBody(evicted=tuple(map(PrefixKey, range(4000, 4100)))), seq=2)
        )
        await asyncio.gather(big, small)
        return held(r), pauses

    keys, pauses = asyncio.run(run())
    assert keys == set(range(1, 4000)) | set(range(4100, 5001))
    assert pauses >= 9


@pytest.mark.parametrize("kind", ["memory", "dict"])
def test_stores_list_their_exact_keys_in_batches(kind: str) -> None:
    from ramjet.residency.store import DictStore

    caps = {Table.GLOBAL: 100_000, Table.SWA: 100}
    store = MemoryStore(caps) if kind == "memory" else DictStore(caps)
    exact = [PrefixKey(k) for k in range(1, 9000)]
    store.put(Table.GLOBAL, E0, exact, Tier.HOST, 0.0, 1e9, exact=True)
    store.put(Table.GLOBAL, E0, [PrefixKey(10**6)], Tier.HBM, 0.0, 1e9, exact=False)
    store.put(Table.SWA, E0, [PrefixKey(5)], Tier.HBM, 0.0, 1e9, exact=True)
    batches = list(store.exact_keys(Table.GLOBAL, E0))
    assert len(batches) > 1 and all(0 < len(b) <= 4096 for b in batches)
    assert sorted(k for b in batches for k in b) == exact  # exact ones only
    assert [k for b in store.exact_keys(Table.SWA, E0) for k in b] == [PrefixKey(5)]
    assert list(store.exact_keys(Table.GLOBAL, EngineId("nobody"))) == []


def test_the_ring_keeps_the_newest_snapshots_parts_beyond_its_caps() -> None:
    """A puller reads parts 1.. from the ring after part 0: a ring smaller than the
    snapshot keeps them anyway (its caps grow by one snapshot's parts, no more)."""
    from reports_fixtures import KEYS

    from ramjet.reports.publisher import ReportPublisher

    keys = tuple(PrefixKey(k) for k in range(1, 101))
    pub = ReportPublisher(
        E0,
        KEYS["e0-a"],
        "e0-a",
        epoch=3,
        snapshot=lambda: ([TierKeys(tier="hbm", keys=keys)], []),
        ring_size=2,
        ring_bytes=2048,
        snapshot_part_keys=10,
    )
    pub.publish_delta(stored(1))
    frames = pub.snapshot_frames()
    assert len(frames) == 10 and pub.seq == 10  # part 0 at seq 1, parts 1-9 at 2-10
    assert pub.frames_after(1, limit=100) == frames[1:]
    for _ in range(30):  # later reports push the parts out: the ring stays bounded
        pub.publish_delta(stored(2))
    assert len(pub.frames_after(0, limit=100)) <= 2 + 9


def test_pieces_shrink_after_a_slow_step_and_grow_back() -> None:
    """An apply in steps cuts its pieces by their cost (`_Pacer`): a piece that took over
    `STEP_BUDGET_S` of CPU halves the next ones (not below `MIN_PIECE_KEYS`), quick ones
    double them back up to `snapshot_chunk_keys`; the slices cover every key in order."""
    from ramjet.reports.processor import MIN_PIECE_KEYS, STEP_BUDGET_S, _Pacer

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    pacer = _Pacer(1024)
    keys = tuple(map(PrefixKey, range(20_000)))
    seen: list[int] = []
    sizes: list[int] = []
    for i, piece in enumerate(pacer.slices(keys)):
        sizes.append(len(piece))
        seen += piece
        pacer.start()
        spin(STEP_BUDGET_S * 1.5 if i < 6 else 0.0)
        pacer.stop()
    assert seen == list(keys)
    assert sizes[:6] == [1024, 512, 256, 128, MIN_PIECE_KEYS, MIN_PIECE_KEYS]
    assert max(sizes[6:]) == 1024  # back to the most once steps are quick again
