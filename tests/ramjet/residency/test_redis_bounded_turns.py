"""Issue 33, over Redis: the sync's work on one large write stays in short turns. A
change-log page is bounded in bytes, not only in entries (a reply is taken in and parsed
in one turn), and a chunk is sealed and spelled in JSON a step of records at a time,
the loop getting a turn between; what Redis receives, and what a replica verifies, is
the same whatever the steps."""

from __future__ import annotations

import asyncio
import json
import random
import sys
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers"))
from redis_server import RedisProcess, redis_server

from ramjet.residency.config import ResidencyConfig
from ramjet.residency.redis_link import RedisLink, RedisSettings
from ramjet.residency.redis_ops import (
    SEAL_STEP,
    Clocks,
    InvalidEntry,
    Sealer,
    StagedEntries,
    drain,
    json_steps,
    put_op,
    replay,
)
from ramjet.residency.redis_scripts import TAIL, EngineKeys, key16
from ramjet.residency.redis_store import RedisStore
from ramjet.residency.redis_sync import TAIL_BYTES, TAIL_COUNT
from ramjet.residency.store import MemoryStore, Table
from ramjet.types import EngineId, PrefixKey, Tier

E0 = EngineId("e0")
CFG = ResidencyConfig()
SECRET = "correct horse battery staple 0123"


@pytest.fixture
def server() -> Iterator[RedisProcess]:
    with redis_server() as s:
        yield s


def make(server: RedisProcess, **kw: object) -> RedisStore:
    opts: dict[str, object] = {"timeout_ms": 2_000, "breaker_open_ms": 50, **kw}
    settings = RedisSettings(url=server.url, shared_secret=SECRET, **opts)
    return RedisStore(RedisLink(settings, CollectorRegistry()), CFG, engines=(E0,))


def _bytes(entry: Any) -> int:
    """A log entry's id and field values, in bytes (what `TAIL` bounds)."""
    entry_id, flat = entry
    return len(entry_id) + sum(len(v) for v in flat)


def _staged(rng: random.Random, n: int) -> StagedEntries:
    entries = StagedEntries()
    for i in range(0, n, 100):
        keys = array("Q", (rng.getrandbits(64) for _ in range(min(100, n - i))))
        entries.add(
            cast(Sequence[PrefixKey], keys),
            rng.randrange(3),
            1_800_000_000_000 + rng.randrange(3) * 60_000,
        )
    return entries


@pytest.mark.redis
async def test_a_change_log_page_is_bounded_in_bytes_and_the_tail_reads_on(
    server: RedisProcess,
) -> None:
    """A 16-chunk snapshot (28 KB a logged chunk: 450 KB as one page before) is read in
    pages of at most `TAIL_BYTES` past their first entry; a page cut short by its bytes
    is not the log's end, so a replica tailing it swaps the whole snapshot in within one
    round."""
    a, b = make(server), make(server)
    try:
        await a.sync_once()
        await b.sync_once()
        limit = a.settings.snapshot_chunk_entries
        n = TAIL_COUNT * limit
        rng = random.Random(3)
        now = a.clock()
        staging = a.stage_exact(Table.GLOBAL, E0, now)
        keys = [PrefixKey(rng.getrandbits(64)) for _ in range(n)]
        for i in range(0, n, 1_000):
            staging.add(keys[i : i + 1_000], Tier.HOST, now + 600)
        staging.commit()
        pages: list[list[Any]] = []
        script = b.link.script

        async def spy(s: Any, k: Any, args: Any) -> Any:
            res = await script(s, k, args)
            if s is TAIL and args[0]:
                pages.append(list(res[3]))
            return res

        b.link.script = spy  # type: ignore[method-assign,assignment]
        await a.sync_once()
        await b.sync_once()  # one round: every page, though most are short of 16 entries
        assert b.size(Table.GLOBAL) == n
        got = b.get_many(Table.GLOBAL, E0, keys, now, False)
        assert all(e is not None and e.tier is Tier.HOST for e in got)
        read = [e for page in pages for e in page]
        gens = [int(dict(zip(f[::2], f[1::2], strict=True))[b"gen"]) for _, f in read]
        assert gens == list(range(1, len(gens) + 1)) and len(gens) > TAIL_COUNT  # all, once
        assert sum(map(_bytes, read)) > 4 * TAIL_BYTES  # the whole was many budgets
        for page in pages:
            assert sum(map(_bytes, page[1:])) <= TAIL_BYTES
            assert sum(map(_bytes, page)) <= TAIL_BYTES or len(page) == 1
        # the script as called without a bound reads `count` entries, as before
        keys_ = EngineKeys(a.settings.key_prefix, E0)
        res = await a.link.script(TAIL, [keys_.st, keys_.log], ["0-0", TAIL_COUNT])
        assert len(res[3]) == TAIL_COUNT and int(res[5]) == 0
    finally:
        await a.link.close()
        await b.link.close()


@pytest.mark.redis
async def test_a_chunk_is_sealed_in_steps_with_turns_for_the_loop_between(
    server: RedisProcess,
) -> None:
    """A 4,000-entry chunk (sealed whole, one turn before) gives the loop a turn every
    `SEAL_STEP` records before its script call; a fresh replica verifies and pulls it."""
    n = 4_000
    a, b = make(server, snapshot_chunk_entries=n), make(server, snapshot_chunk_entries=n)
    try:
        await a.sync_once()
        rng = random.Random(4)
        now = a.clock()
        keys = [PrefixKey(rng.getrandbits(64)) for _ in range(n)]
        a.replace_exact(Table.GLOBAL, E0, [(k, Tier.SSD, now + 900) for k in keys], now)
        turns = 0
        at_call: list[int] = []
        done = False

        async def beside() -> None:
            nonlocal turns
            while not done:
                turns += 1
                await asyncio.sleep(0)

        script = a.link.script

        async def spy(s: Any, k: Any, args: Any) -> Any:
            at_call.append(turns)
            return await script(s, k, args)

        a.link.script = spy  # type: ignore[method-assign,assignment]
        task = asyncio.create_task(beside())
        await asyncio.sleep(0)
        start = turns
        try:
            await a.sync_once()
        finally:
            done = True
            await task
        # the first call is the chunk's APPLY: the turns before it were the sealing's
        assert at_call[0] - start >= 2 * (n // SEAL_STEP) - 2
        await b.sync_once()
        assert b.size(Table.GLOBAL) == n
        got = b.get_many(Table.GLOBAL, E0, keys, now, False)
        assert all(e is not None and e.tier is Tier.SSD for e in got)
    finally:
        await a.link.close()
        await b.link.close()


def _ops(rng: random.Random) -> list[list[Any]]:
    clocks = Clocks()
    now = clocks.clock()
    keys = [PrefixKey(rng.getrandbits(64)) for _ in range(700)]
    return [
        put_op(clocks, Table.GLOBAL, True, Tier.HOST, now, now + 60, keys[:300]),
        put_op(clocks, Table.SWA, False, Tier.HBM, now, now + 5, keys[300:303]),
        ["r", "g", array("Q", keys[303:600])],
        ["R", "g", 1_700_000_000_000, _staged(rng, 450), 2],
        ["E", "g", 1_700_000_000_000, _staged(rng, 1)],
        ["E", "g", 1_700_000_000_000, [[key16(k), 1, 1_800_000_000_000] for k in keys[600:]]],
        ["P"],
    ]


@pytest.mark.parametrize("secret", [SECRET.encode(), None])
def test_sealed_in_steps_is_the_same_whatever_the_step(secret: bytes | None) -> None:
    """Every step size gives the same sealed ops and the same JSON (`json.dumps`'s),
    each record's MAC is `Sealer.record`'s, and a step pauses the work where asked."""
    sealer = Sealer(secret)
    ops = _ops(random.Random(5))
    whole = drain(sealer.seal_steps("e0", ops, step=10**9))
    text = json.dumps(whole, separators=(",", ":"))
    for step in (1, 7, SEAL_STEP, 500):
        steps = sealer.seal_steps("e0", ops, step=step)
        pauses = 0
        try:
            while True:
                next(steps)
                pauses += 1
        except StopIteration as done:
            assert done.value == whole
        # 854 records sealed (the remove has none); a pause after at least `step` of
        # them, and before a slice that would take them past twice that
        assert 854 // (2 * step) <= pauses <= 854 // step
        assert drain(json_steps(whole, step)) == text
    if secret is None:
        assert all(len(op) != 7 for op in whole if op[0] == "p")
        return
    for _code, k, tier, conf, exp, ks, macs in (op for op in whole if op[0] == "p"):
        assert macs == [sealer.record("e0", k, k16, tier, conf, exp) for k16 in ks]
    for op in (op for op in whole if op[0] in "RE"):
        for k16, tier, exp, mac in op[3]:
            assert mac == sealer.record("e0", op[1] + "x", k16, tier, op[2], exp)


def test_a_chunk_sealed_in_steps_verifies_and_a_tampered_one_is_rejected() -> None:
    """The batch MAC covers the JSON the steps made: a replica takes it as it is, and
    rejects it with one record changed."""
    sealer = Sealer(SECRET.encode())
    ops = [["R", "g", 1_700_000_000_000, _staged(random.Random(6), 600)]]
    raw = drain(json_steps(drain(sealer.seal_steps("e0", ops, step=7)), 7))
    mac = sealer.batch_mac("e0", "free", -1, -1, raw)
    f = {"ops": raw, "mac": mac, "m": "free", "e": "-1", "s": "-1", "gen": "1"}
    mirror = MemoryStore({Table.GLOBAL: 10_000, Table.SWA: 10_000})
    replay(mirror, E0, f, Clocks(), sealer)
    assert mirror.size(Table.GLOBAL) == 600
    sealed = json.loads(raw)
    sealed[0][3][300][1] = (sealed[0][3][300][1] + 1) % 3  # another tier for one record
    forged = dict(f, ops=json.dumps(sealed, separators=(",", ":")))
    with pytest.raises(InvalidEntry) as err:
        replay(MemoryStore({Table.GLOBAL: 10_000, Table.SWA: 10_000}), E0, forged, Clocks(), sealer)
    assert err.value.reason == "mac"


@pytest.mark.redis
async def test_a_write_queued_while_its_batch_is_being_sent_is_not_lost(
    server: RedisProcess,
) -> None:
    """An unsequenced write queued while the queue's only batch (of the same engine) is
    on its way to Redis goes in a batch of its own: coalesced into the batch in flight
    (already sealed, or sealed up to where its steps had got) it never reached Redis."""
    a, b = make(server), make(server)
    try:
        now = a.clock()
        a.put(Table.GLOBAL, E0, [PrefixKey(7_777)], Tier.HBM, now, now + 600, True)
        await a.sync_once()  # Redis holds the engine (seeded): later batches are applied
        first = [PrefixKey(k) for k in range(1, 300)]
        a.put(Table.GLOBAL, E0, first, Tier.HOST, now, now + 600, True)
        late = [PrefixKey(k) for k in range(1_000, 1_003)]
        script = a.link.script
        sent = False

        async def spy(s: Any, k: Any, args: Any) -> Any:
            nonlocal sent
            if not sent and len(args) > 5:  # the batch's APPLY, sealed: a write comes
                sent = True
                a.put(Table.GLOBAL, E0, late, Tier.SSD, now, now + 600, True)
            return await script(s, k, args)

        a.link.script = spy  # type: ignore[method-assign,assignment]
        for _ in range(3):
            await a.sync_once()
        assert sent and not a.pending
        await b.sync_once()
        for k in first + late:
            assert b.get(Table.GLOBAL, E0, k, now, False) is not None, k
    finally:
        await a.link.close()
        await b.link.close()
