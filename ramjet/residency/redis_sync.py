"""`RedisSync`: the background sync between one replica's mirror and Redis.

The store (`ramjet.residency.redis_store`) queues its writes here as batches
(`ramjet.residency.redis_ops`); `run` (or `sync_once` in tests) flushes the queue with the
`APPLY` script, then tails each engine's change log (`TAIL`) and replays every entry on
the mirror (its own included, so all mirrors replay one order and converge).

- The queue is bounded (`max_pending_writes` batches); the oldest are dropped and counted
  when Redis is away too long (engine snapshots heal exact state, approximate entries age
  out). Unsequenced writes to one engine coalesce into the queue's last batch.
- A gap in the log's `gen` counter (trimmed log, Redis restarted) or a first start
  triggers a full pull of the engine (index zsets + MGET), which is how a restarted
  replica starts warm. When Redis answers `missing` (it holds no copy of an engine: it
  restarted empty), the replica seeds it from its mirror; the first seed wins and the
  other replicas pull.
- A batch Redis refuses as `stale` was already applied to the mirror: the engine is
  pulled again to undo it.
- A batch of more than `snapshot_chunk_entries` entries (a large snapshot, a seed) goes as
  chunks, one script call each, in queue order (`redis_ops.split_ops`); the log is read
  in small pages. So every call fits `timeout_ms` and later writes stay behind.
- What this replica reads is checked before it is applied (`redis_ops.Sealer`, MACs from
  the shared secret; `redis_ops.decode_ops`): a log entry or stored entry that fails is
  skipped, never retried, and counted (`ramjet_redis_rejected_total{reason}`); a stored
  epoch in the future is not trusted. An error reply (`RedisCommandError`: OOM, script
  error) is a failure: the batch is retried, and dropped after `max_batch_attempts`.
- Fail open: every Redis call goes through `RedisLink` (short timeout, breaker). While
  Redis is unreachable the mirror keeps serving and taking writes; when the breaker
  closes again every engine is pulled in full (`ramjet_redis_resyncs_total`).

The mirror is touched only on the event loop; one round runs at a time (a lock).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

from ramjet.metric_catalogue import counter, gauge
from ramjet.residency.redis_link import (
    RedisCommandError,
    RedisLink,
    RedisSettings,
    RedisUnavailable,
)
from ramjet.residency.redis_ops import (
    CODE_TABLE,
    REJECT_REASONS,
    Batch,
    Chunker,
    Clocks,
    InvalidEntry,
    Sealer,
    Staged,
    discard,
    fields,
    json_steps,
    put_op,
    replay,
    split_ops,
    text,
    weight,
)
from ramjet.residency.redis_scripts import (
    APPLY,
    APPLY_PACKED,
    KINDS,
    PACKED_RECORD,
    TAIL,
    EngineKeys,
)
from ramjet.residency.store import Entry, IndexStaging, MemoryStore, Table
from ramjet.types import EngineId, PrefixKey, Tier

log = logging.getLogger(__name__)
T = TypeVar("T")

TAIL_COUNT = 16
TAIL_BYTES = 64 * 1024
"""A change-log page's most bytes of field values past its first entry (`TAIL`): the
loop takes a reply in, and redis-py parses it, in one turn each, so a page is bounded
in bytes, not only in entries. Sixteen logged chunks of a snapshot (28 KB each at 500
entries) were a 450 KB reply: a 56.4 ms socket read in one turn, traced at 20M blocks."""
_RECORD = struct.Struct(">HIBHIHI8s")  # redis_scripts.APPLY_PACKED's 27-byte entry
_TIERS = frozenset(int(t) for t in Tier)


async def _stepped(steps: Generator[None, None, T]) -> T:
    """Run a stepped computation, the event loop getting a turn at each step; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        await asyncio.sleep(0)


def _group_order(item: tuple[tuple[int, Tier, int], list[PrefixKey]]) -> tuple[int, int, int]:
    """A pulled group's place: by confirmation, then tier and expiry (a stable order)."""
    (confirmed_ms, tier, exp_ms), _ = item
    return confirmed_ms, int(tier), exp_ms


PULL_PAGE = 2000
PULL_STEP = 1024
"""Rows a full pull checks (or frees), or exact global blocks it stages, between yields
to the event loop (a step is a few ms of pure Python)."""


@dataclass
class Tail:
    """Where this replica's mirror stands in one engine's log."""

    last_id: str = ""
    gen: int = 0
    synced: bool = False


class StoreMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.resyncs = counter(registry, "ramjet_redis_resyncs_total")
        self.recoveries = counter(registry, "ramjet_redis_recoveries_total")
        self.pending = gauge(registry, "ramjet_redis_pending_batches")
        self.dropped = counter(registry, "ramjet_redis_dropped_batches_total")
        self.batches = counter(registry, "ramjet_redis_batches_total")
        self.applied = counter(registry, "ramjet_redis_log_entries_applied_total")
        self.rejected = counter(registry, "ramjet_redis_rejected_total")
        for reason in REJECT_REASONS:  # every reason exported from the start (alerts)
            self.rejected.labels(reason)


def _grouped_puts(
    clocks: Clocks, table: Table, exact: bool, piece: list[tuple[PrefixKey, Entry]]
) -> list[list[Any]]:
    """A piece of the mirror's entries as puts, one per (tier, confirmation, expiry)."""
    groups: dict[tuple[Tier, float, float], list[PrefixKey]] = {}
    for key, e in piece:
        group = groups.get((e.tier, e.confirmed_at, e.expires_at))
        if group is None:
            groups[(e.tier, e.confirmed_at, e.expires_at)] = [key]
        else:
            group.append(key)
    return [
        put_op(clocks, table, exact, tier, conf, exp, keys)
        for (tier, conf, exp), keys in groups.items()
    ]


class RedisSync:
    """Moves queued batches to Redis and the engines' change logs into the mirror."""

    def __init__(
        self,
        link: RedisLink,
        local: MemoryStore,
        retention_ms: int,
        clocks: Clocks,
        metrics: StoreMetrics,
        origin: str,
        sealer: Sealer | None = None,
    ) -> None:
        self.link = link
        self.settings: RedisSettings = link.settings
        self.local = local
        self.retention_ms = retention_ms
        self.clocks = clocks
        self.metrics = metrics
        self.origin = origin
        self.sealer = sealer if sealer is not None else Sealer(link.settings.secret())
        if not self.sealer.authenticated:
            log.warning(
                "store.shared_secret_file is not set: residency shared through Redis is not "
                "authenticated (only its structure is checked); see docs/redis.md"
            )
        self.chunk = self.settings.snapshot_chunk_entries
        self.packed = self.settings.encoding == "packed"
        self.apply_script = APPLY_PACKED if self.packed else APPLY
        self.skew_ms = int(self.settings.max_clock_skew_s * 1000)
        self.log_age_ms = int(self.settings.log_max_age_s * 1000)
        self.keys: dict[EngineId, EngineKeys] = {}
        self.tails: dict[EngineId, Tail] = {}
        self.cursor: dict[EngineId, tuple[int, int]] = {}
        """(epoch, seq) of each engine's last report this replica knows applied."""
        self.outbox: deque[Batch] = deque()
        self.staged: Staged = {}
        """Chunked replaces being replayed, swapped in when their last chunk arrives."""
        self._seeding: dict[EngineId, deque[Batch]] = {}
        """Chunks of a seed this replica won that Redis has not taken yet."""
        self._seed_gens: dict[EngineId, int] = {}
        """The log `gen` a seed this replica won ends at when nothing else was written
        (its chunk count); 0: pull after it whatever the log shows."""
        self.wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._recovered = False
        self._stopping = False
        self._caps = (
            f"{self.settings.max_global_entries_per_engine},"
            f"{self.settings.max_swa_entries_per_engine},{self.settings.log_max_entries}"
        )

    def track(self, engine: EngineId) -> EngineKeys:
        keys = self.keys.get(engine)
        if keys is None:
            keys = self.keys[engine] = EngineKeys(self.settings.key_prefix, engine)
            self.tails[engine] = Tail()
        return keys

    # -- the queue ----------------------------------------------------------------------

    def enqueue(self, batch: Batch) -> None:
        """Queue a batch; one over `snapshot_chunk_entries` entries goes as chunks, each
        one script call, in order: later batches stay behind all of them."""
        self.enqueue_parts(self._chunks(batch))

    def enqueue_parts(self, parts: list[Batch]) -> None:
        """Queue a batch already cut in chunks as `enqueue` cuts it (`RedisStaging` cuts
        a staged replace as its pieces come, so its commit only queues them)."""
        self.outbox.extend(parts)
        while len(self.outbox) > self.settings.max_pending_writes:
            self.outbox.popleft()
            self.metrics.dropped.inc()
        self.metrics.pending.set(len(self.outbox))
        self.wake.set()

    def queue_free(self, engine: EngineId, op: list[Any]) -> None:
        """Queue one unsequenced operation, coalesced into the queue's last batch when
        that is one for `engine`."""
        last = self.outbox[-1] if self.outbox else None
        if (
            last is not None
            and last.mode == "free"
            and not last.status  # not in flight: its ops are sealed as they stand
            and last.engine == engine
            and sum(map(weight, last.ops)) + weight(op) <= self.chunk
        ):
            last.ops.append(op)  # coalesce: the queue's tail is not in flight
            self.wake.set()
            return
        self.enqueue(Batch(engine, "free", ops=[op]))

    def _chunks(self, batch: Batch) -> list[Batch]:
        parts = split_ops(batch.ops, self.chunk)
        if len(parts) <= 1:
            return [batch]
        lead = Batch(batch.engine, batch.mode, batch.epoch, batch.seq, parts[0])
        return [lead] + [Batch(batch.engine, "free", ops=p, lead=lead) for p in parts[1:]]

    def note_cursor(self, engine: EngineId, epoch: int, seq: int) -> None:
        if epoch > self.clocks.wall() * 1000 + self.skew_ms:
            self.metrics.rejected.labels("epoch").inc()
            return  # a future epoch read from Redis: not a replica's, never trusted
        cur = self.cursor.get(engine)
        if cur is None or (epoch, seq) > cur:
            self.cursor[engine] = (epoch, seq)

    def on_recover(self) -> None:
        self._recovered = True
        self.metrics.recoveries.inc()
        self.wake.set()

    # -- the rounds --------------------------------------------------------------------

    async def run(self) -> None:
        """Sync until cancelled: on every write, and at least every `sync_interval_ms`."""
        interval = self.settings.sync_interval_ms / 1000
        # the flag, not only cancellation, ends the loop: on Python 3.11 a cancel that
        # races with wait_for's own timeout can be swallowed, and the loop would go on
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self.wake.wait()
            self.wake.clear()
            try:
                await self.sync_once()
            except RedisUnavailable:
                pass  # fail open; the breaker paces the retries
            except Exception:  # never let the sync task die: routing depends on it
                log.exception("residency sync round failed")
                await asyncio.sleep(interval)

    async def sync_once(self) -> None:
        """Flush queued writes, then bring the mirror up to Redis. Raises
        `RedisUnavailable` when Redis is away (the mirror keeps serving)."""
        async with self._lock:
            for engine in list(self._seeding):
                await self._finish_seed(engine)
            if self._recovered:
                self._recovered = False
                await self._flush()
                for engine in list(self.keys):
                    await self._pull(engine, "recovery")
                return
            await self._flush()
            for engine in list(self.keys):
                await self._tail(engine)

    async def _flush(self) -> None:
        stale: set[EngineId] = set()
        while self.outbox:
            batch = self.outbox[0]
            if batch.lead is not None and batch.lead.status != "ok":
                status = "skipped"  # Redis refused the first chunk: drop the rest
            else:
                # in flight from here (`queue_free` leaves it alone): a write coalesced
                # into it once sealed, or while its script call was out, never reached
                # Redis (the queue's only batch is also its tail)
                batch.status = "sending"
                try:
                    status = await self._apply(batch)
                    if status == "missing":
                        await self._seed(batch.engine)
                        status = await self._apply(batch)
                except RedisCommandError:
                    batch.attempts += 1
                    if batch.attempts < self.settings.max_batch_attempts:
                        raise  # counted by the link; the next round tries again
                    status = "refused"  # a poison batch must not block the queue
                    self.metrics.dropped.inc()
                    stale.add(batch.engine)
            batch.status = status
            self.metrics.batches.labels(status).inc()
            if status == "stale":
                stale.add(batch.engine)  # the mirror took a change Redis refused: undo it
            if self.outbox and self.outbox[0] is batch:
                self.outbox.popleft()
            self.metrics.pending.set(len(self.outbox))
        for engine in stale:
            await self._pull(engine, "stale_write")

    async def _apply(self, batch: Batch) -> str:
        keys = self.keys[batch.engine]
        # sealed, then spelled in JSON, a few hundred records a turn (`SEAL_STEP`): a
        # chunk done whole was a turn of 21.5-27.5 ms (traced, 20M blocks), and a chunk
        # may be 100,000 entries (`snapshot_chunk_entries`)
        sealed = await _stepped(self.sealer.seal_steps(batch.engine, batch.ops))
        ops = await _stepped(json_steps(sealed))
        res = await self.link.script(
            self.apply_script,
            [keys.st, keys.log],
            [
                batch.mode,
                batch.epoch,
                batch.seq,
                self.retention_ms,
                ops,
                self._caps,
                self.origin,
                self.sealer.batch_mac(batch.engine, batch.mode, batch.epoch, batch.seq, ops),
                self.skew_ms,
                self.log_age_ms,
            ],
        )
        return text(res[0])

    async def _seed(self, engine: EngineId) -> None:
        """Redis holds no copy of `engine`: offer it this mirror's (first seed wins). The
        copy is read in pieces, yielding to the loop every `PULL_STEP` entries (a large
        mirror is seconds of CPU), and cut into chunks as `_chunks` cuts it: a put per
        group of a piece's entries alike in tier, confirmation and expiry (a run of the
        index; one per entry was a 6-item list and an array per block, gigabytes for a
        20M-block mirror and young collections that walked them),
        `snapshot_chunk_entries` entries to a chunk. A write made
        meanwhile is in the queue behind the seed, so Redis ends with it either way.

        A seed this replica won leaves Redis holding this mirror, so the mirror is not
        pulled back (`_finish_seed`): that pull, of everything the engine had so far,
        came after every engine's first write (Redis answers `missing` for an engine it
        never held) and stalled the loop mid-load (issue 33). A seed another replica won
        (`dup`) is pulled, as is one whose log shows anything but this seed."""
        chunker = Chunker(self.chunk)
        chunker.add(["P"])
        since = 0
        over_cap = False
        for table in Table:
            cap = (
                self.settings.max_global_entries_per_engine
                if table is Table.GLOBAL
                else self.settings.max_swa_entries_per_engine
            )
            for exact in (True, False):
                count = 0
                for piece in self.local.entry_steps(table, engine, exact):
                    count += len(piece)
                    for op in _grouped_puts(self.clocks, table, exact, piece):
                        chunker.add(op)
                    since += len(piece)
                    if since >= PULL_STEP:
                        since = 0
                        await asyncio.sleep(0)
                over_cap |= count > cap  # the script evicts: the mirror must learn which
        chunks = chunker.done()
        epoch, seq = self.cursor.get(engine, (-1, -1))
        lead = Batch(engine, "seed", epoch, seq, chunks[0])
        parts = [lead] + [Batch(engine, "free", ops=c, lead=lead) for c in chunks[1:]]
        # re-read from Redis unless `_finish_seed` finds the log holds this seed alone
        self.tails[engine] = Tail()
        status = await self._apply(parts[0])
        self.metrics.batches.labels(f"seed_{status}").inc()
        if status == "ok":  # this replica's seed won: the rest of it follows, in chunks
            self._seeding[engine] = deque(parts[1:])
            self._seed_gens[engine] = 0 if over_cap else len(parts)
            await self._finish_seed(engine)
            self.metrics.resyncs.labels("push", "redis_empty").inc()

    async def _finish_seed(self, engine: EngineId) -> None:
        """Send the rest of a seed this replica won, in order; what a timeout leaves is
        sent first thing next round (before any pull could read a half seed). Then, if
        the engine's log holds nothing but the seed's chunks (its `gen` is their count:
        the lead found no `gen`, so it wrote 1, and nobody wrote between or since),
        Redis holds exactly what this mirror held when the seed read it, and the writes
        made since are queued behind it: the mirror tails from there instead of pulling
        everything back. Otherwise (another replica's write came between, a chunk was
        resent after a timeout, the script evicted over a cap) the tail stays unsynced
        and the engine is pulled."""
        rest = self._seeding.get(engine)
        while rest:
            self.metrics.batches.labels(f"seed_{await self._apply(rest[0])}").inc()
            rest.popleft()
        self._seeding.pop(engine, None)
        want = self._seed_gens.pop(engine, 0)
        if want <= 0:
            return
        gen, epoch, seq, last_id = await self._head(self.keys[engine])
        if gen == want and last_id:
            discard(self.staged, engine)  # a replayed replace's chunks: not in Redis now
            self.tails[engine] = Tail(last_id=last_id, gen=gen, synced=True)
            if epoch >= 0:
                self.note_cursor(engine, epoch, seq)

    async def _tail(self, engine: EngineId) -> None:
        keys = self.keys[engine]
        tail = self.tails[engine]
        if not tail.synced:
            await self._pull(engine, "start")
            return
        while await self._tail_page(engine, keys, tail):
            pass  # a full page: more may follow (pages are small: `TAIL_BYTES`)

    async def _tail_page(self, engine: EngineId, keys: EngineKeys, tail: Tail) -> bool:
        """Read and apply one page of the engine's log; True when the page was full."""
        res = await self.link.script(
            TAIL, [keys.st, keys.log], [tail.last_id, TAIL_COUNT, TAIL_BYTES]
        )
        gen, epoch, seq, entries = int(res[0]), int(res[1]), int(res[2]), res[3]
        more = len(res) > 5 and int(res[5]) == 1  # the page stopped at its byte bound
        if gen < 0:  # Redis lost this engine (restart, expiry): seed it, then pull
            if self.local.holds(engine) or engine in self.cursor:
                await self._seed(engine)
                if not self.tails[engine].synced:  # another replica's seed, or a mixed log
                    await self._pull(engine, "redis_empty")
            return False
        if not entries:
            if gen != tail.gen:
                await self._pull(engine, "gap")
            return False
        try:
            first_gen = int(fields(entries[0][1])["gen"])
        except (KeyError, ValueError):
            first_gen = -1  # not an entry a replica wrote: pull what Redis holds
        if first_gen != tail.gen + 1:
            await self._pull(engine, "gap")
            return False
        for entry_id, raw in entries:
            try:
                self._apply_entry(engine, fields(raw))
            except InvalidEntry as exc:
                # skipped and counted, never retried: one bad entry must not halt the sync
                self.metrics.rejected.labels(exc.reason).inc()
                log.warning("skipped change-log entry %s of %s: %s", text(entry_id), engine, exc)
            tail.last_id = text(entry_id)
            tail.gen += 1
            await asyncio.sleep(0)  # an entry is a chunk (a few ms): a page is up to 16
        if len(entries) < TAIL_COUNT and not more:
            if epoch >= 0:
                self.note_cursor(engine, epoch, seq)
            return False
        return True

    def _apply_entry(self, engine: EngineId, f: dict[str, str]) -> None:
        """Replay one logged batch on the mirror."""
        replay(self.local, engine, f, self.clocks, self.sealer, self.staged)
        self.metrics.applied.inc()

    async def _pull(self, engine: EngineId, reason: str) -> None:
        """Replace the mirror's copy of `engine` with Redis's (index zsets + MGET)."""
        keys = self.keys[engine]
        gen, epoch, seq, last_id = await self._head(keys)
        if gen < 0:  # nothing in Redis for this engine
            if self.local.holds(engine) or engine in self.cursor:
                await self._seed(engine)
                if self.tails[engine].synced:  # Redis holds this mirror: nothing to pull
                    return
                gen, epoch, seq, last_id = await self._head(keys)
            if gen < 0:
                self.tails[engine] = Tail(synced=True, last_id="0-0", gen=0)
                return
        discard(self.staged, engine)
        loaded: list[tuple[str, list[tuple[str, int, bytes | None]]]] = []
        dump = self._dump_packed if self.packed else self._dump
        for kind in KINDS:
            loaded.append((kind, await dump(keys, kind)))
        now_local, now_wall = self.clocks.clock(), self.clocks.wall()
        # checked and grouped off the mirror, yielding to the loop every `PULL_STEP` rows
        # (a pull of millions of blocks is seconds of CPU): entries one report confirmed
        # together share tier, confirmation and expiry, and are put as one group each
        # (one run of the compact index, not one per block), the least recently
        # confirmed first
        pulled: list[tuple[Table, bool, list[tuple[tuple[int, Tier, int], list[PrefixKey]]]]] = []
        step = 0
        for kind, rows in loaded:
            table, exact = CODE_TABLE[kind[0]], kind[1] == "x"
            groups: dict[tuple[int, Tier, int], list[PrefixKey]] = {}
            for k, exp_ms, value in rows:
                step += 1
                if step % PULL_STEP == 0:
                    await asyncio.sleep(0)
                if value is None:
                    continue  # expired between ZRANGE and MGET
                rec = self._record(engine, kind, k, exp_ms, text(value))
                if rec is None:
                    continue
                tier, confirmed_ms = rec
                group = groups.get((confirmed_ms, tier, exp_ms))
                if group is None:
                    group = groups[(confirmed_ms, tier, exp_ms)] = []
                group.append(PrefixKey(int(k, 16)))
            pulled.append((table, exact, sorted(groups.items(), key=_group_order)))
            while rows:  # freeing millions of rows is a stall of its own: in steps too
                del rows[-PULL_STEP:]
                await asyncio.sleep(0)
        # the exact global entries (nearly all of a large engine) are staged into a new
        # index in steps, off the mirror, and swapped in at once below: the mirror never
        # shows half a pull
        staging = IndexStaging(self.local, engine, now_local)
        for table, exact, groups_in_order in pulled:
            if table is not Table.GLOBAL or not exact:
                continue
            staging.reserve(sum(len(ks) for _, ks in groups_in_order))
            for (confirmed_ms, tier, exp_ms), block_keys in groups_in_order:
                confirmed = now_local + (confirmed_ms / 1000 - now_wall)
                expires = now_local + (exp_ms / 1000 - now_wall)
                for i in range(0, len(block_keys), PULL_STEP):
                    staging.add(block_keys[i : i + PULL_STEP], tier, expires, confirmed)
                    await asyncio.sleep(0)
        self.local.purge(engine)
        if len(staging):
            staging.commit()
        # the approximate and SWA entries after the swap, `PULL_STEP` at a time with a
        # turn for the loop between (a replica's own routing can leave hundreds of
        # thousands): in the pulled order, so the result is that of one stretch; a write
        # made meanwhile reaches this mirror again through the log, after the pull
        done = 0
        for table, exact, groups_in_order in pulled:
            if table is Table.GLOBAL and exact:
                continue
            for (confirmed_ms, tier, exp_ms), block_keys in groups_in_order:
                confirmed = now_local + (confirmed_ms / 1000 - now_wall)
                expires = now_local + (exp_ms / 1000 - now_wall)
                for i in range(0, len(block_keys), PULL_STEP):
                    piece = block_keys[i : i + PULL_STEP]
                    if done + len(piece) > PULL_STEP:
                        done = 0
                        await asyncio.sleep(0)
                    self.local.put(table, engine, piece, tier, confirmed, expires, exact)
                    done += len(piece)
        self.tails[engine] = Tail(last_id=last_id or "0-0", gen=gen, synced=True)
        if epoch >= 0:
            self.note_cursor(engine, epoch, seq)
        self.metrics.resyncs.labels("pull", reason).inc()

    def _record(
        self, engine: EngineId, kind: str, k16: str, exp_ms: int, value: str
    ) -> tuple[Tier, int] | None:
        """One stored entry, checked (shape, tier, MAC); None (counted) if it fails."""
        parts = value.split(",")
        try:
            if len(parts) not in (2, 3) or len(k16) != 16:
                raise ValueError(value)
            int(k16, 16)
            tier_i, confirmed_ms = int(parts[0]), int(parts[1])
        except ValueError:
            self.metrics.rejected.labels("malformed").inc()
            return None
        if tier_i not in _TIERS:
            self.metrics.rejected.labels("tier").inc()
            return None
        mac = parts[2] if len(parts) == 3 else ""
        if not self.sealer.check_record(mac, engine, kind, k16, tier_i, confirmed_ms, exp_ms):
            self.metrics.rejected.labels("mac").inc()
            return None
        return Tier(tier_i), confirmed_ms

    async def _head(self, keys: EngineKeys) -> tuple[int, int, int, str]:
        """(gen, epoch, seq, last log id) of one engine in Redis; gen < 0: none there."""
        res = await self.link.script(TAIL, [keys.st, keys.log], ["", 0])
        return int(res[0]), int(res[1]), int(res[2]), text(res[4])

    async def _dump_packed(
        self, keys: EngineKeys, kind: str
    ) -> list[tuple[str, int, bytes | None]]:
        """One kind's live entries from the packed hash (HSCAN pages), in the same
        (key16, expiry ms, "tier,confirmed,mac") rows as `_dump`."""
        name = keys.packed(kind)
        out: list[tuple[str, int, bytes | None]] = []
        cursor: int = 0
        now_ms = int(self.clocks.wall() * 1000)
        count = PULL_PAGE // 16  # buckets a page asks for; sized below by what they hold
        since = 0
        while True:
            cursor, page = await self.link.call(
                lambda c, cur=cursor, n=count: c.hscan(name, cur, count=n)  # type: ignore[misc]
            )
            records = 0
            for field, value in page.items():
                b = text(field)
                if len(b) != 4 or len(value) % PACKED_RECORD:
                    self.metrics.rejected.labels("malformed").inc()
                    continue
                records += len(value) // PACKED_RECORD
                for hi16, hi32, tier, c_hi, c_lo, e_hi, e_lo, mac in _RECORD.iter_unpack(value):
                    # a bucket holds ~300 records at 20M blocks, a page tens of thousands
                    # (tens of ms to unpack): the loop gets a turn every `PULL_STEP`
                    since += 1
                    if since >= PULL_STEP:
                        since = 0
                        await asyncio.sleep(0)
                    exp_ms = (e_hi << 32) | e_lo
                    if exp_ms <= now_ms:
                        continue  # expired, not swept yet
                    conf_ms = (c_hi << 32) | c_lo
                    rec = f"{tier},{conf_ms},{mac.hex() if any(mac) else ''}".encode()
                    out.append((f"{hi16:04x}{hi32:08x}{b}", exp_ms, rec))
            if cursor == 0:
                return out
            if page:  # about `PULL_PAGE` records a page, however full the buckets are
                count = max(1, min(PULL_PAGE // 16, PULL_PAGE * len(page) // max(1, records)))

    async def _dump(self, keys: EngineKeys, kind: str) -> list[tuple[str, int, bytes | None]]:
        idx = keys.index(kind)
        out: list[tuple[str, int, bytes | None]] = []
        start = 0
        while True:
            page: list[tuple[bytes, float]] = await self.link.call(
                lambda c, s=start: c.zrange(idx, s, s + PULL_PAGE - 1, withscores=True)  # type: ignore[misc]
            )
            if not page:
                return out
            names = [keys.entry(kind, text(m)) for m, _ in page]
            values: list[bytes | None] = await self.link.call(lambda c, n=names: c.mget(n))  # type: ignore[misc]
            out.extend((text(m), int(score), v) for (m, score), v in zip(page, values, strict=True))
            if len(page) < PULL_PAGE:
                return out
            start += PULL_PAGE

    def stop(self) -> None:
        """Make `run` return at its next turn."""
        self._stopping = True
        self.wake.set()

    async def close(self) -> None:
        """Try once to flush queued writes (bounded by the link's timeout)."""
        with contextlib.suppress(RedisUnavailable):
            async with self._lock:
                await self._flush()
