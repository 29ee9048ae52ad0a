"""The compact store (`MemoryStore`, a `BlockIndex` per engine) answers as the dict store
(`DictStore`, the reference) does, over random workloads; the block index itself."""

from __future__ import annotations

import random
from itertools import pairwise

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ramjet.residency.config import ResidencyConfig
from ramjet.residency.index import ARRAY_BYTES, OBJECT_BYTES, SHARDS, BlockIndex
from ramjet.residency.store import DictStore, MemoryStore, ResidencyStore, Table
from ramjet.residency.tables import ResidencyTables, ViewMode
from ramjet.types import EngineId, PrefixKey, Tier

ENGINES = (EngineId("e0"), EngineId("e1"))
# small keys (sequential shards) and large ones (uniform, as xxhash gives)
UNIVERSE = [PrefixKey(1000 + i) for i in range(12)] + [
    PrefixKey(random.Random(i).getrandbits(64)) for i in range(12)
]
TOKENS = [256] * len(UNIVERSE)

keys_st = st.lists(st.sampled_from(UNIVERSE), max_size=10)
engine_st = st.sampled_from(ENGINES)
tier_st = st.sampled_from(list(Tier))
table_st = st.sampled_from(list(Table))
ttl_st = st.sampled_from([1.0, 5.0, 30.0, 1e9])

op_st = st.one_of(
    st.tuples(st.just("put"), table_st, engine_st, keys_st, tier_st, ttl_st, st.booleans()),
    st.tuples(st.just("remove"), table_st, engine_st, keys_st),
    st.tuples(st.just("advance"), st.sampled_from([0.5, 2.0, 10.0])),
    st.tuples(st.just("expire")),
    st.tuples(
        st.just("snapshot"),
        table_st,
        engine_st,
        st.lists(st.tuples(keys_st, tier_st, ttl_st), max_size=4),
    ),
    st.tuples(st.just("purge"), engine_st),
    st.tuples(
        st.just("mode"), engine_st, st.sampled_from([ViewMode.APPROXIMATE, ViewMode.REPORTED])
    ),
)


def _apply(tables: ResidencyTables, op: tuple[object, ...], now: float, use_expire: bool) -> None:
    store = tables.store
    kind = op[0]
    if kind == "put":
        _, table, engine, keys, tier, ttl, exact = op
        store.put(table, engine, keys, tier, now, now + ttl, exact)  # type: ignore[arg-type]
    elif kind == "remove":
        _, table, engine, keys = op
        store.remove(table, engine, keys)  # type: ignore[arg-type]
    elif kind == "expire" and use_expire:
        tables.expire(now)
    elif kind == "snapshot":
        _, table, engine, groups = op
        staging = store.stage_exact(table, engine, now)  # type: ignore[arg-type]
        assert staging is not None
        for keys, tier, ttl in groups:  # type: ignore[attr-defined]
            staging.add(keys, tier, now + ttl)
        staging.commit()
    elif kind == "parts":  # as the processor applies a snapshot in parts: live + staged
        _, engine, groups = op
        parts = tables.stage_snapshot(engine, now, additive=True)  # type: ignore[arg-type]
        parts.reserve_global(8)
        for keys, tier, ttl in groups:  # type: ignore[attr-defined]
            if tier is None:
                tables.store_swa(engine, keys, now, ttl)  # type: ignore[arg-type]
                parts.add_swa(keys, ttl)
            else:
                tables.store_global(engine, keys, tier, now, ttl)  # type: ignore[arg-type]
                parts.add_global(keys, tier, ttl)
        parts.commit()
    elif kind == "purge":
        tables.purge_engine(op[1])  # type: ignore[arg-type]
    elif kind == "mode":
        tables.set_mode(op[1], op[2])  # type: ignore[arg-type]


def _answers(tables: ResidencyTables, now: float, orders: list[list[PrefixKey]]) -> list[object]:
    out: list[object] = []
    store: ResidencyStore = tables.store
    for engine in ENGINES:
        view = tables.view(engine, now)
        for keys in orders:
            out.append(view.global_match(keys, TOKENS[: len(keys)]))
            out.append(view.swa_match([(i * 256, k) for i, k in enumerate(keys)]))
        for table in Table:
            for approx in (True, False):
                out.append(store.get_many(table, engine, UNIVERSE, now, approx))
    return out


def _pair(caps: int) -> tuple[ResidencyTables, ResidencyTables]:
    cfg = ResidencyConfig(max_global_entries=caps, max_swa_entries=caps)
    old = ResidencyTables(cfg, DictStore({Table.GLOBAL: caps, Table.SWA: caps}))
    new = ResidencyTables(cfg)
    assert isinstance(new.store, MemoryStore)
    return old, new


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op_st, max_size=40), seed=st.integers(0, 1 << 16))
def test_compact_store_answers_as_the_dict_store(ops: list[tuple[object, ...]], seed: int) -> None:
    """Below the caps: every global_match, swa_match and get_many alike after each of
    random puts (exact and approximate), removals, expiries, snapshots and purges."""
    old, new = _pair(10_000)
    rng = random.Random(seed)
    orders = [UNIVERSE[:12], UNIVERSE[12:], rng.sample(UNIVERSE, len(UNIVERSE))]
    now = 1000.0
    for op in ops:
        if op[0] == "advance":
            now += op[1]  # type: ignore[operator]
            continue
        _apply(old, op, now, True)
        _apply(new, op, now, True)
        assert _answers(new, now, orders) == _answers(old, now, orders), op


parts_st = st.tuples(
    st.just("parts"),
    engine_st,
    st.lists(st.tuples(keys_st, st.one_of(st.none(), tier_st), ttl_st), max_size=4),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.one_of(op_st, parts_st), max_size=30), seed=st.integers(0, 1 << 16))
def test_a_snapshot_in_parts_marked_answers_as_one_staged(
    ops: list[tuple[object, ...]], seed: int
) -> None:
    """A snapshot in parts: the compact store marks its live index and drops what no part
    named (`MemoryStore.mark_exact`), the dict store stages a copy; the same answers."""
    old, new = _pair(10_000)
    orders = [UNIVERSE[:12], UNIVERSE[12:], random.Random(seed).sample(UNIVERSE, len(UNIVERSE))]
    now = 1000.0
    for op in ops:
        if op[0] == "advance":
            now += op[1]  # type: ignore[operator]
            continue
        _apply(old, op, now, True)
        _apply(new, op, now, True)
        assert _answers(new, now, orders) == _answers(old, now, orders), op


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op_st, max_size=40), cap=st.integers(1, 12))
@example(  # CI found it: an empty put made e0's map first, and the tie evicted e0
    ops=[
        ("put", Table.GLOBAL, ENGINES[0], [], Tier.HBM, 1.0, False),
        ("snapshot", Table.GLOBAL, ENGINES[1], [([UNIVERSE[0]], Tier.HBM, 1.0)]),
        ("put", Table.GLOBAL, ENGINES[0], UNIVERSE[:2], Tier.HBM, 1.0, True),
    ],
    cap=2,
)
def test_compact_store_evicts_by_the_same_rule_under_a_cap(
    ops: list[tuple[object, ...]], cap: int
) -> None:
    """At a small cap the eviction rule is the same (approximate first, then the least
    recently confirmed exact entry), so the answers and sizes stay alike. Keys are
    de-duplicated within a put and sweeps left out: the dict store's expiry keeps
    expired entries behind live ones, which then count against its cap. The clock moves
    on by a microsecond between operations, as the router's does: two confirmations at
    one instant have no order, and each store breaks that tie its own way (the dict
    store by which engine's map it made first)."""
    old, new = _pair(cap)
    orders = [UNIVERSE[:12], UNIVERSE[12:]]
    now = 1000.0
    for op in ops:
        now += 1e-6
        if op[0] == "advance":
            now += op[1]  # type: ignore[operator]
            continue
        if op[0] == "put":
            op = (*op[:3], list(dict.fromkeys(op[3])), *op[4:])  # type: ignore[call-overload]
        if op[0] == "snapshot":
            seen: set[PrefixKey] = set()
            groups = []
            for keys, tier, ttl in op[3]:  # type: ignore[attr-defined]
                fresh = [k for k in dict.fromkeys(keys) if k not in seen]
                seen.update(fresh)
                groups.append((fresh, tier, ttl))
            op = (*op[:3], groups)
        _apply(old, op, now, False)
        _apply(new, op, now, False)
        assert _answers(new, now, orders) == _answers(old, now, orders), op
        for table in Table:
            assert new.size(table) == old.size(table)


def test_block_index_holds_random_blocks_and_sweeps_them_in_steps() -> None:
    rng = random.Random(1)
    ix = BlockIndex()
    keys = [rng.getrandbits(64) for _ in range(200_000)]
    early = ix.new_run(0.0, 10.0)
    late = ix.new_run(0.0, 100.0)
    for i, k in enumerate(keys):
        assert ix.put(k, early if i % 2 else late, i % 3)
    assert ix.count == len(set(keys))
    assert all(ix.lookup(k) & 3 == i % 3 for i, k in enumerate(keys[:1000]))
    assert ix.live(keys[1], 10.0) == 0 and ix.live(keys[0], 10.0) != 0
    # one bounded step at a time: a few shards each, until every shard is swept
    start, dropped, steps = 0, 0, 0
    while start < SHARDS:
        n, start = ix.sweep(10.0, start, 64)
        dropped += n
        steps += 1
    assert steps == SHARDS // 64 and dropped == len(keys) // 2
    ix.close_run(early)
    ix.close_run(late)
    assert ix.count == len(keys) - dropped and ix.refs[early] == 0
    assert ix.next_expiry() == 100.0
    assert all(ix.lookup(k) == 0 for k in keys[1:2000:2])
    assert all(ix.lookup(k) != 0 for k in keys[0:2000:2])
    for k in keys[0::2]:
        assert ix.remove(k)
    assert ix.count == 0 and all(sh is None for sh in ix.shards)


def _store_with_every_piece(rng: random.Random) -> MemoryStore:
    """A store with each piece of expiry work left: a purged engine's index to free
    (`_retired`), a removed run's key list (`garbage`), and blocks expired at 11."""
    store = MemoryStore({Table.GLOBAL: 1 << 20, Table.SWA: 10})
    store.release_bytes = 32 << 10
    e0, e1 = ENGINES
    gone = [PrefixKey(rng.getrandbits(64)) for _ in range(10_000)]
    store.put(Table.GLOBAL, e0, gone, Tier.HOST, 0.0, 1e9, True)
    store.remove(Table.GLOBAL, e0, gone)  # its run's 80 KB key list: garbage
    for _ in range(20):  # 20k blocks expiring at 10, a run of 1,000 per report
        keys = [PrefixKey(rng.getrandbits(64)) for _ in range(1_000)]
        store.put(Table.GLOBAL, e0, keys, Tier.SSD, 0.0, 10.0, True)
    kept = [PrefixKey(rng.getrandbits(64)) for _ in range(100)]
    store.put(Table.GLOBAL, e0, kept, Tier.HBM, 0.0, 1e9, True)
    store.put(
        Table.GLOBAL,
        e1,
        [PrefixKey(rng.getrandbits(64)) for _ in range(20_000)],
        Tier.HOST,
        0.0,
        1e9,
        True,
    )
    store.purge(e1)  # its index: retired, freed by the steps
    return store


def test_an_expiry_step_does_one_piece_of_work() -> None:
    """`MemoryStore.expire_step` does one piece a call: it frees a dropped index's
    arrays, else a run's key list of `garbage`, else sweeps a shard; never two in one
    call (the tables' budget is checked between calls: a step that did all three ran
    past it by their sum, a 9.3 ms step of a Redis mirror at 10M blocks). The steps
    together drop what one `expire` does."""
    store = _store_with_every_piece(random.Random(12))
    ref = _store_with_every_piece(random.Random(12))
    ix = store._exact[ENGINES[0]]
    assert store._retired and ix.garbage and ix.expiry_due(11.0)

    def state() -> tuple[int, int, int]:
        retired = sum(old.nbytes() for old in store._retired)
        garbage = [8 * len(k) for k in ix.garbage if k is not None]
        return retired, sum(garbage), store.size(Table.GLOBAL)

    done = [0, 0, 0]
    dropped = 0
    while store.sweeping(11.0):
        r0, g0, n0 = state()
        dropped += store.expire_step(11.0)
        r1, g1, n1 = state()
        did = (r1 < r0, g1 < g0, n1 < n0)
        assert sum(did) <= 1, did
        if did[1] or did[2]:
            assert r0 == 0  # a dropped index is freed first
        if did[2]:
            assert g0 == 0  # then the garbage, then the sweep
        done = [d + int(x) for d, x in zip(done, did, strict=True)]
    assert all(done) and not store._retired and not ix.garbage
    assert dropped == ref.expire(11.0) == 20_000
    assert store.size(Table.GLOBAL) == ref.size(Table.GLOBAL) == 100
    probe = [k for k, _ in ref.entries(Table.GLOBAL, ENGINES[0], True)]
    assert store.get_many(Table.GLOBAL, ENGINES[0], probe, 11.0, False) == ref.get_many(
        Table.GLOBAL, ENGINES[0], probe, 11.0, False
    )


def test_the_small_key_lists_a_sweep_empties_are_freed_a_bounded_number_a_step() -> None:
    """A sweep's pass empties its expired runs together in its last shards: a Redis
    mirror at 20M blocks holds tens of thousands of small runs (a report piece each, and
    its replay), thousands of which die in one shard. Each key list is left in
    `garbage`, small ones too (freed where they died, 4 us each: a 21.9 ms step), and a
    step frees at most `release_bytes / ARRAY_BYTES` of them. Same result as
    `expire`."""
    rng = random.Random(5)

    def build() -> MemoryStore:
        store = MemoryStore({Table.GLOBAL: 1 << 20, Table.SWA: 10})
        for _ in range(3_000):  # runs of 16 keys expiring at 10: every shard has a few
            keys = [PrefixKey(rng.getrandbits(64)) for _ in range(16)]
            store.put(Table.GLOBAL, ENGINES[0], keys, Tier.SSD, 0.0, 10.0, True)
        keep = [PrefixKey(rng.getrandbits(64)) for _ in range(50)]
        store.put(Table.GLOBAL, ENGINES[0], keep, Tier.HBM, 0.0, 1e9, True)
        return store

    store = build()
    store.release_bytes = 8 * ARRAY_BYTES
    store.sweep_shards = SHARDS  # one sweep step empties every run at once
    ix = store._exact[ENGINES[0]]
    most = 0
    while store.sweeping(11.0):
        before = len(ix.garbage)
        store.expire_step(11.0)
        most = max(most, len(ix.garbage))
        assert before - len(ix.garbage) <= 8  # freed: at most release_bytes / ARRAY_BYTES
    assert most == 3_000  # the small lists went to the garbage, not freed in the sweep
    assert not ix.garbage and store.size(Table.GLOBAL) == 50
    rng = random.Random(5)
    assert build().expire(11.0) == 48_000


def test_expiry_runs_in_bounded_steps_and_ends() -> None:
    """`expire_step` sweeps a few shards a step (budget 0: one store step), says whether
    work is left, and the steps together drop exactly what `expire` would."""
    rng = random.Random(3)
    tables = ResidencyTables(ResidencyConfig(global_ttl_s=100.0))
    store = tables.store
    assert isinstance(store, MemoryStore)
    keys = [PrefixKey(rng.getrandbits(64)) for _ in range(20_000)]
    tables.store_global(ENGINES[0], keys[:10_000], Tier.HOST, 0.0, ttl_s=10.0)
    tables.store_global(ENGINES[0], keys[10_000:], Tier.SSD, 0.0)
    assert tables.expire_step(5.0, budget_s=0.0) is False  # nothing expired yet
    assert tables.size(Table.GLOBAL) == 20_000
    steps = 0
    while tables.expire_step(50.0, budget_s=0.0):
        steps += 1
        assert 10_000 <= tables.size(Table.GLOBAL) < 20_000
    assert steps >= SHARDS // store.sweep_shards - 1
    assert tables.size(Table.GLOBAL) == 10_000
    assert store.get_many(Table.GLOBAL, ENGINES[0], keys, 50.0, False) == [None] * 10_000 + [
        store.get(Table.GLOBAL, ENGINES[0], k, 50.0, False) for k in keys[10_000:]
    ]
    assert all(
        e is not None for e in store.get_many(Table.GLOBAL, ENGINES[0], keys[10_000:], 50.0, False)
    )


def test_a_reserved_index_holds_what_a_growing_one_does() -> None:
    """`reserve` (a staged snapshot knows its size) changes how shards grow, never what
    the index holds: the same blocks, duplicates and re-owned keys included, and growth
    by doubling again once the staging is committed."""
    rng = random.Random(9)
    keys = [rng.getrandbits(64) for _ in range(60_000)]
    keys += keys[:500]  # put twice within the run
    grown, reserved = BlockIndex(), BlockIndex()
    reserved.reserve(len(keys))
    assert reserved.grow_slots > 8
    for ix in (grown, reserved):
        a = ix.new_run(0.0, 10.0)
        for i in range(0, len(keys), 1024):
            ix.put_many(keys[i : i + 1024], a, i % 3)
        b = ix.new_run(1.0, 20.0)
        assert ix.put_many(keys[100:200], b, 2) == 0  # re-owned by a newer run
        ix.close_run(a)
        ix.close_run(b)
    assert sorted(grown.items()) == sorted(reserved.items())
    assert grown.count == reserved.count == 60_000
    for ix in (grown, reserved):
        assert len(ix.run_keys[1] or ()) == 60_000  # each key once in its first run
        assert ix.refs[1] == 60_000 - 100 and ix.refs[2] == 100
    reserved.reserve(0)
    assert reserved.grow_slots == 8


def test_a_reserved_index_grows_its_shards_by_bounded_steps() -> None:
    """Toward a large reserved size a shard grows by at most 8x a rehash (its 4,096
    shards cross their load together: a jump from 8 slots to the share put every shard's
    new arrays into the same few pieces), and still reaches the reserved share, so the
    puts do not go back to rehashing at every doubling."""
    ix = BlockIndex()
    ix.reserve(20_000_000)
    share = ix.grow_slots
    assert share > 8 * 8 * 8
    rng = random.Random(3)
    s = 5
    keys = [(rng.getrandbits(52) << 12) | s for _ in range(share // 2)]  # all in shard 5
    run = ix.new_run(0.0, 10.0)
    sizes = [0]
    for k in keys:
        ix.put_many([k], run, 0)
        sh = ix.shards[s]
        assert sh is not None
        if len(sh.words) != sizes[-1]:
            sizes.append(len(sh.words))
    steps = list(pairwise(sizes[1:]))
    assert steps and all(new <= 8 * old for old, new in steps)
    assert sizes[-1] >= share
    assert len(sizes) - 1 <= 6  # 8 -> 64 -> 512 -> 4096 -> the share: not a doubling each


def test_a_long_snapshot_through_the_store_matches_the_dict_store() -> None:
    """A staged snapshot large enough to reserve, then deltas over it: the compact store
    answers as the dict store does."""
    rng = random.Random(4)
    keys = [PrefixKey(rng.getrandbits(64)) for _ in range(50_000)]
    old, new = _pair(1_000_000)
    for tables in (old, new):
        staging = tables.stage_snapshot(ENGINES[0], 10.0)
        staging.reserve_global(len(keys))
        staging.add_global(keys[:30_000], Tier.HBM, None)
        staging.add_global(keys[30_000:], Tier.SSD, 60.0)
        staging.commit()
        tables.store_global(ENGINES[0], keys[:100], Tier.HOST, 20.0)
        tables.evict_global(ENGINES[0], keys[100:200])
    for now in (30.0, 100.0):
        assert new.store.get_many(Table.GLOBAL, ENGINES[0], keys, now, False) == (
            old.store.get_many(Table.GLOBAL, ENGINES[0], keys, now, False)
        )
    assert new.size(Table.GLOBAL) == old.size(Table.GLOBAL) == 49_900


def test_a_mark_drops_only_what_older_runs_still_hold_and_stops_there() -> None:
    """`BlockIndex.blocks_before` bounds what a mark's drop can find: a snapshot in parts
    into an empty index drops without walking the shards (2 steps, not one per shard),
    and over an older content it drops exactly the blocks no part named."""
    rng = random.Random(4)
    store = MemoryStore({Table.GLOBAL: 100_000, Table.SWA: 10})
    e = ENGINES[0]
    new = [PrefixKey(rng.getrandbits(64)) for _ in range(5_000)]
    mark = store.mark_exact(Table.GLOBAL, e)
    assert mark is not None
    store.put(Table.GLOBAL, e, new, Tier.HOST, 0.0, 100.0, True)
    assert len(list(mark.drop_steps())) == 2
    assert store.size(Table.GLOBAL) == len(new)
    again = store.mark_exact(Table.GLOBAL, e)
    assert again is not None
    store.put(Table.GLOBAL, e, new[:1_000], Tier.SSD, 1.0, 100.0, True)
    assert store._exact[e].blocks_before(store._exact[e].mark()) == 1_000 + 4_000
    steps = list(again.drop_steps())
    assert len(steps) > 2 and store.size(Table.GLOBAL) == 1_000
    got = store.get_many(Table.GLOBAL, e, new, 1.0, False)
    assert [x is not None for x in got] == [True] * 1_000 + [False] * 4_000


def test_runs_freed_together_leave_the_expiry_heap_in_bounded_steps() -> None:
    """A sweep's pass frees its expired runs together (in its last shards): whether more
    expiry is due is answered dropping a bounded number of their heap entries a call
    (a burst of ~10k at 20M blocks was a 5-10 ms stall), True meanwhile, never False
    while a live run is expired; the sweep then ends with what `expire` leaves."""
    from ramjet.residency.index import _DUE_POPS

    rng = random.Random(8)
    ix = BlockIndex()
    for _ in range(3 * _DUE_POPS):
        run = ix.new_run(0.0, 10.0)
        ix.put(rng.getrandbits(64), run, 0)
        ix.close_run(run)
    keep = ix.new_run(0.0, 100.0)
    ix.put(rng.getrandbits(64), keep, 1)
    ix.close_run(keep)
    start = 0
    while start < SHARDS:
        _, start = ix.sweep(20.0, start, 512)
    assert ix.count == 1 and len(ix._expiry) == 3 * _DUE_POPS + 1
    answers = []
    while ix.expiry_due(20.0):
        answers.append(len(ix._expiry))
    # True twice (its bound reached, dead entries left), then False: every dead entry
    # dropped and the live run expires at 100
    assert answers == [2 * _DUE_POPS + 1, _DUE_POPS + 1] and len(ix._expiry) == 1
    assert ix.next_expiry() == 100.0 and ix.expiry_due(100.0)


def test_a_replaced_or_purged_index_is_freed_in_bounded_steps() -> None:
    """The index a snapshot replaces (or a purge drops) is not freed in the turn that
    drops it (a 10-20M-block index: 8,192 shard arrays, ~800 MB, 10-15 ms of one loop
    turn), but by the expiry's steps, about `release_bytes` a step (one shard's arrays
    over at most), a long run's key array cut from its end, while reads see only the
    new content; `expire` frees it whole."""
    rng = random.Random(9)
    store = MemoryStore({Table.GLOBAL: 1 << 20, Table.SWA: 10})
    store.release_bytes = 32 << 10
    e0, e1 = EngineId("e0"), EngineId("e1")
    old_keys = [PrefixKey(rng.getrandbits(64)) for _ in range(40_000)]
    for i in range(0, 30_000, 1_000):  # a run (and its key array) per report
        store.put(Table.GLOBAL, e0, old_keys[i : i + 1_000], Tier.HOST, 0.0, 1e9, True)
    # one long run: 10k keys, 80 KB of keys, more than a step frees
    store.put(Table.GLOBAL, e0, old_keys[30_000:], Tier.HOST, 0.0, 1e9, True)
    store.put(Table.GLOBAL, e1, old_keys[:5_000], Tier.SSD, 0.0, 1e9, True)
    old = store._exact[e0]
    shards = sum(1 for sh in old.shards if sh is not None)
    assert shards == SHARDS
    widest = max(8 * len(sh.keys) + 4 * len(sh.words) for sh in old.shards if sh is not None)
    new_keys = [PrefixKey(rng.getrandbits(64)) for _ in range(100)]
    store.replace_exact(Table.GLOBAL, e0, [(k, Tier.HBM, 1e9) for k in new_keys], 1.0)
    store.purge(e1)
    # dropped, not freed: what reads see is the new content only
    assert len([s for s in old.shards if s is not None]) == SHARDS
    assert store.size(Table.GLOBAL) == 100
    assert store.get(Table.GLOBAL, e0, old_keys[0], 2.0, False) is None
    assert store.get(Table.GLOBAL, e1, old_keys[0], 2.0, False) is None
    e = store.get(Table.GLOBAL, e0, new_keys[0], 2.0, False)
    assert e is not None and e.tier is Tier.HBM
    before = old.nbytes()
    steps = 0
    cuts = 0
    while store.sweeping(2.0):
        held = old.nbytes()
        long_run = old.run_keys[-1] if old.run_keys else None
        store.expire_step(2.0)
        steps += 1
        assert held - old.nbytes() <= store.release_bytes + widest
        if long_run is not None and old.run_keys and old.run_keys[-1] is long_run:
            cuts += 1  # the long run's array was cut, not freed whole
    assert not old.shards and not old.run_keys
    assert cuts >= 2 and steps >= before // (store.release_bytes + widest)
    assert store.size(Table.GLOBAL) == 100 and not store._retired
    # `expire` in one call frees what is left whole
    store.replace_exact(Table.GLOBAL, e0, [], 3.0)
    store.expire(4.0)
    assert not store._retired and store.size(Table.GLOBAL) == 0


def test_a_dropped_index_frees_its_run_heaps_in_steps() -> None:
    """A run per report piece makes ~100k runs at 20M blocks: their heaps' tuples and
    the free list are Python objects, 35 ms of one loop turn to free at once with the
    index (the Redis benchmark's snapshot + sweep phase). `release` cuts them by the
    same byte budget (`OBJECT_BYTES` an entry) before it reports the index freed."""
    rng = random.Random(5)
    ix = BlockIndex()
    n = 6_000
    for _ in range(n):  # a run per one-key report, each released (its id on the free list)
        run = ix.new_run(0.0, 1e9)
        ix.put(rng.getrandbits(64), run, 1)
        ix.close_run(run)
    assert len(ix._order) == len(ix._expiry) == n
    widest = max(8 * len(sh.keys) + 4 * len(sh.words) for sh in ix.shards if sh is not None)
    budget = 8 << 10  # 64 entries a step
    most, steps, left = 0, 0, 0
    while left <= 0:
        objects = len(ix._order) + len(ix._expiry) + len(ix._free)
        held = ix.nbytes()
        left = ix.release(budget)
        most = max(most, objects - (len(ix._order) + len(ix._expiry) + len(ix._free)))
        assert held - ix.nbytes() <= budget + widest
        steps += 1
    assert not ix._order and not ix._expiry and not ix._free and ix.nbytes() == 0
    assert most <= budget // OBJECT_BYTES
    assert steps >= 2 * n // (budget // OBJECT_BYTES)


def test_a_dropped_index_releases_its_arrays_by_bytes() -> None:
    """`BlockIndex.release(budget)`: frees about `budget` bytes a call (one shard's
    arrays over at most), shards first, then run key lists, a list longer than the
    budget cut from its end; returns a positive budget once nothing large is left."""
    rng = random.Random(4)
    ix = BlockIndex()
    run = ix.new_run(0.0, 1e9)
    ix.put_many([rng.getrandbits(64) for _ in range(30_000)], run, 1)
    ix.close_run(run)
    widest = max(8 * len(sh.keys) + 4 * len(sh.words) for sh in ix.shards if sh is not None)
    total = ix.nbytes()
    assert total > 8 * 30_000
    freed: list[int] = []
    left = 0
    while left <= 0:
        before = ix.nbytes()
        left = ix.release(16 << 10)
        freed.append(before - ix.nbytes())
    assert ix.nbytes() == 0 and not ix.shards and not ix.run_keys
    assert sum(freed) == total and max(freed) <= (16 << 10) + widest
    # the run's 240 KB key list went in cuts of 16 KB, not at once
    assert sum(1 for f in freed if f == 16 << 10) >= 10


def test_the_key_lists_of_runs_a_sweep_empties_are_freed_in_bounded_steps() -> None:
    """A sweep's pass empties its expired runs together in its last shards (at 20M
    blocks a few dozen key lists of 4 MB: 6-10 ms freed at once); the long lists are
    left in the index's `garbage` and freed about `release_bytes` a step, while
    `sweeping` says so. Reads never see the expired blocks meanwhile."""
    rng = random.Random(12)
    store = MemoryStore({Table.GLOBAL: 1 << 20, Table.SWA: 10})
    store.release_bytes = 32 << 10
    e0 = EngineId("e0")
    runs = [[PrefixKey(rng.getrandbits(64)) for _ in range(20_000)] for _ in range(3)]
    for keys in runs:  # three runs of 160 KB of keys each, expiring at 10
        store.put(Table.GLOBAL, e0, keys, Tier.HOST, 0.0, 10.0, True)
    kept = [PrefixKey(rng.getrandbits(64)) for _ in range(100)]
    store.put(Table.GLOBAL, e0, kept, Tier.HBM, 0.0, 1e9, True)
    ix = store._exact[e0]
    garbage_seen = 0
    steps = 0
    while store.sweeping(11.0):
        before = sum(8 * len(k) for k in ix.garbage)
        store.expire_step(11.0)
        steps += 1
        after = sum(8 * len(k) for k in ix.garbage)
        garbage_seen = max(garbage_seen, after)
        # what one step frees of the garbage is bounded (the sweep may add to it)
        assert before - min(before, after) <= store.release_bytes
        assert store.get(Table.GLOBAL, e0, runs[0][0], 11.0, False) is None
    assert garbage_seen >= 3 * 8 * 20_000 - store.release_bytes
    assert not ix.garbage and store.size(Table.GLOBAL) == len(kept)
    assert steps >= 3 * 8 * 20_000 // store.release_bytes
