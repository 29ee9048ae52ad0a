"""`RedisStore`: the residency tables shared by several router replicas through Redis.

The same `ResidencyStore` contract as `MemoryStore` (synchronous, no I/O on the request
path), built as a local mirror plus a background sync (`ramjet.residency.redis_sync`):

- Reads (`get`, `size`, and so every policy `pick`) are served from a local `MemoryStore`
  (the mirror). A lookup never waits on Redis, so a slow or dead Redis cannot slow a
  decision down; the price is that another replica's write is seen one sync interval
  (`sync_interval_ms`, 50 ms by default) later.
- Writes (`put`, `remove`, `replace_exact`, `purge`) change the mirror at once and queue
  the same operation for Redis (spelled as in `ramjet.residency.redis_ops`). Writes made
  inside `with store.report(engine, epoch, seq):` form one batch applied by the `APPLY`
  script only if (epoch, seq) is newer than the engine's stored position (idempotent: a
  report applied by two replicas, in any order, counts once). Other writes (the router's
  approximate entries) are coalesced per engine into unsequenced batches. The queue is
  bounded (`max_pending_writes` batches; the oldest are dropped and counted when Redis is
  away too long: engine snapshots heal exact state, approximate entries age out).
  A batch larger than `snapshot_chunk_entries` is queued as chunks, in order.
- Everything shared carries a MAC from the replicas' shared secret, and everything read
  back is checked before it is applied (see `ramjet.residency.redis_sync`, docs/redis.md).
- The sync task (`run`, or `sync_once` in tests) flushes the queue, then tails each
  engine's change log and applies every entry; a gap or a first start pulls the engine
  in full, which is how a restarted replica starts warm; a Redis that lost an engine is
  seeded from the mirror. It fails open: while Redis is unreachable the mirror keeps
  serving and taking writes.

Pending residency (`ramjet.residency.pending`: blocks of requests this replica has sent
and no report has confirmed yet) is not a store entry and never reaches Redis: it lives
seconds and changes on every request, so sharing it would put a Redis write on the request
path or lag it by a sync interval comparable to its life, and a crashed replica would
leave orphan holds. Each replica knows its own in-flight requests; the others learn the
blocks from the engine's report, one report interval later.

Expiry is native in Redis (each entry key carries its PXAT expiry, the bookkeeping keys a
retention TTL); the mirror expires on its own clock. Store times are seconds of the
caller's monotonic clock; Redis holds Unix milliseconds (`redis_ops.Clocks` converts).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from ramjet.residency.config import ResidencyConfig
from ramjet.residency.redis_link import RedisLink, RedisSettings
from ramjet.residency.redis_ops import (
    TABLE_CODE,
    Batch,
    Clocks,
    StagedEntries,
    put_op,
    remove_op,
    replace_op,
)
from ramjet.residency.redis_sync import RedisSync, StoreMetrics
from ramjet.residency.store import Entry, ExactStager, MemoryStore, Table
from ramjet.types import EngineId, PrefixKey, Tier


class RedisStore:
    """`ResidencyStore` shared through Redis; see the module docstring."""

    def __init__(
        self,
        link: RedisLink,
        residency: ResidencyConfig,
        engines: Iterable[EngineId] = (),
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.link = link
        self.settings: RedisSettings = link.settings
        self.local = MemoryStore(
            {Table.GLOBAL: residency.max_global_entries, Table.SWA: residency.max_swa_entries}
        )
        longest = max(residency.global_ttl_s, residency.swa_max_ttl_s, residency.approximate_ttl_s)
        self.retention_ms = int((longest + self.settings.retention_slack_s) * 1000)
        self.metrics = StoreMetrics(registry if registry is not None else CollectorRegistry())
        self.clock = clock
        self.wall = wall
        self.origin = f"{os.getpid()}-{id(self):x}"
        self._clocks = Clocks(clock, wall)
        self.sync = RedisSync(
            link, self.local, self.retention_ms, self._clocks, self.metrics, self.origin
        )
        self._open: Batch | None = None
        link.on_recover(self.sync.on_recover)
        # lookups are the hot path (a 1M-token prompt is ~4k of them per engine): bind
        # the mirror's method directly instead of forwarding through `get` below
        self.get = self.local.get  # type: ignore[method-assign]
        self.get_many = self.local.get_many  # type: ignore[method-assign]
        for engine in engines:
            self.sync.track(engine)

    # -- queueing writes ----------------------------------------------------------------

    @contextlib.contextmanager
    def report(self, engine: EngineId, epoch: int, seq: int) -> Iterator[None]:
        """Group the writes made inside into one batch applied once per (engine, epoch,
        seq) across all replicas."""
        if self._open is not None:
            raise RuntimeError("report batches do not nest")
        self.sync.track(engine)
        batch = self._open = Batch(engine, "seq", int(epoch), int(seq))
        try:
            yield
        finally:
            self._open = None
        self.sync.note_cursor(engine, batch.epoch, batch.seq)
        self.sync.enqueue(batch)

    def _op(self, engine: EngineId, op: list[Any]) -> None:
        self.sync.track(engine)
        if self._open is not None and self._open.engine == engine:
            self._open.ops.append(op)
            return
        self.sync.queue_free(engine, op)

    # -- the ResidencyStore contract (local, synchronous) --------------------------------

    def stage_exact(self, table: Table, engine: EngineId, now: float) -> RedisStaging:
        """A snapshot staged in pieces (`RedisStaging`): each piece goes into the
        mirror's own staging and into the replace sent to Redis, one bounded step each;
        the commit swaps the mirror and queues the replace (sent in chunks of
        `snapshot_chunk_entries`, each one script call), as `replace_exact` would."""
        return RedisStaging(self, table, engine, now)

    def exact_keys(self, table: Table, engine: EngineId) -> Iterator[list[PrefixKey]]:
        """The mirror's (what this replica's writes and the log made it)."""
        return self.local.exact_keys(table, engine)

    def shared(self) -> RedisStore:
        """Shared with the other replicas: report cursors live beside the residency."""
        return self

    def mark_exact(self, table: Table, engine: EngineId) -> None:
        """Cannot mark: the caller keeps its own marks (`SnapshotStaging`)."""
        return None

    def put(
        self,
        table: Table,
        engine: EngineId,
        keys: Iterable[PrefixKey],
        tier: Tier,
        now: float,
        expires_at: float,
        exact: bool,
    ) -> None:
        keys = list(keys)
        if not exact:
            # never override what a signed report says, here as the mirror does: a key
            # with a live exact entry is left out of the logged put too, so replaying the
            # batch on a mirror already past it (a later replace dropped the exact entry)
            # cannot store the guess after all
            get = self.local.get
            keys = [k for k in keys if get(table, engine, k, now, False) is None]
        self.local.put(table, engine, keys, tier, now, expires_at, exact)
        self._op(engine, put_op(self._clocks, table, exact, tier, now, expires_at, keys))

    def remove(self, table: Table, engine: EngineId, keys: Iterable[PrefixKey]) -> None:
        keys = list(keys)
        self.local.remove(table, engine, keys)
        self._op(engine, remove_op(table, keys))

    def get(
        self, table: Table, engine: EngineId, key: PrefixKey, now: float, approximate: bool
    ) -> Entry | None:
        return self.local.get(table, engine, key, now, approximate)

    def get_many(
        self,
        table: Table,
        engine: EngineId,
        keys: Sequence[PrefixKey],
        now: float,
        approximate: bool,
    ) -> list[Entry | None]:
        return self.local.get_many(table, engine, keys, now, approximate)

    def replace_exact(
        self,
        table: Table,
        engine: EngineId,
        entries: Iterable[tuple[PrefixKey, Tier, float]],
        now: float,
    ) -> None:
        entries = list(entries)
        self.local.replace_exact(table, engine, entries, now)
        self._op(engine, replace_op(self._clocks, table, entries, now))

    def purge(self, engine: EngineId) -> None:
        self.local.purge(engine)
        self._op(engine, ["P"])

    def expire(self, now: float) -> int:
        return self.local.expire(now)  # Redis expires its copies itself (see expire_step)

    def expire_step(self, now: float) -> int:
        """One bounded step of the mirror's expiry (`MemoryStore.expire_step`: one piece
        a call, the arrays of an index a full pull or a snapshot replaced freed, else a
        run's key-list garbage, else a few shards swept). Redis's side is bounded
        already: per-key entries expire by `PXAT`, packed records are dropped a few
        buckets per script call."""
        return self.local.expire_step(now)

    def sweeping(self, now: float) -> bool:
        return self.local.sweeping(now)

    def size(self, table: Table) -> int:
        return self.local.size(table)

    # -- state -------------------------------------------------------------------------

    @property
    def degraded(self) -> bool:
        return self.link.degraded

    @property
    def pending(self) -> int:
        return len(self.sync.outbox)

    def cursor(self, engine: EngineId) -> tuple[int, int] | None:
        """(epoch, seq) of the engine's last report this replica knows applied."""
        return self.sync.cursor.get(engine)

    # -- the background sync (`RedisSync`) ------------------------------------------------

    async def run(self) -> None:
        """Sync until cancelled: on every write, and at least every `sync_interval_ms`."""
        await self.sync.run()

    async def sync_once(self) -> None:
        """Flush queued writes, then bring the mirror up to Redis. Raises
        `RedisUnavailable` when Redis is away (the mirror keeps serving)."""
        await self.sync.sync_once()

    def stop(self) -> None:
        """Make `run` return at its next turn."""
        self.sync.stop()

    async def close(self) -> None:
        """Try once to flush queued writes (bounded by the link's timeout)."""
        await self.sync.close()


class RedisStaging:
    """`RedisStore.stage_exact`: the engine's next exact content of one table, built a
    piece at a time (the caller yields to the event loop between pieces): into the
    mirror's staging (`MemoryStore.stage_exact`: reads keep the old content) and into
    the entries of the replace op. `commit` swaps the mirror's copy in and queues the
    replace, which Redis takes in chunks: the same writes as `replace_exact` of every
    piece at once, without its one long stretch (0.8 s of CPU at 180k entries)."""

    __slots__ = (
        "_cut",
        "_done",
        "_engine",
        "_entries",
        "_local",
        "_now",
        "_parts",
        "_store",
        "_table",
    )

    def __init__(self, store: RedisStore, table: Table, engine: EngineId, now: float) -> None:
        self._store = store
        self._table = table
        self._engine = engine
        self._now = now
        self._local: ExactStager = store.local.stage_exact(table, engine, now)
        self._entries = StagedEntries()
        self._done = False
        self._parts: list[Batch] = []
        """The replace's `E` chunks cut so far, as `RedisSync.enqueue` would cut them."""
        self._cut = store.settings.snapshot_chunk_entries
        """Entries cut into chunks so far (the first chunk's are cut at the commit)."""

    def add(self, keys: Sequence[PrefixKey], tier: Tier, expires_at: float) -> None:
        self._local.add(keys, tier, expires_at)
        # typed arrays, not an object per key: entries held until Redis took the last
        # chunk must give the cyclic GC nothing to walk (a list per key: 135 ms CPU of
        # gen-2 passes at 450k keys; a tuple per key in a list: 6.5 ms; see StagedEntries)
        entries = self._entries
        entries.add(keys, int(tier), self._store._clocks.to_wall_ms(expires_at))
        # the chunks a piece completes, cut now (a view each): the commit's turn then
        # only queues them (cutting a 524k-entry replace there was 1,049 chunks at once)
        limit, code, engine = (
            self._store.settings.snapshot_chunk_entries,
            self._code(),
            self._engine,
        )
        while len(entries) >= self._cut + limit:
            op = ["E", code, 0, entries[self._cut : self._cut + limit]]  # time: at commit
            self._parts.append(Batch(engine, "free", ops=[op]))
            self._cut += limit

    def _code(self) -> str:
        return TABLE_CODE[self._table]

    def reserve(self, keys: int) -> None:
        self._local.reserve(keys)

    def commit(self) -> None:
        if self._done:
            raise RuntimeError("staging already committed")
        self._done = True
        store = self._store
        self._local.commit()
        entries, code, limit = self._entries, self._code(), store.settings.snapshot_chunk_entries
        conf_ms = store._clocks.to_wall_ms(self._now)
        open_batch = store._open is not None and store._open.engine == self._engine
        if len(entries) <= limit or open_batch:
            store._op(self._engine, ["R", code, conf_ms, entries])
            return
        # what `RedisSync.enqueue` makes of the whole replace: an `R` chunk with the
        # count of `E` chunks after it, then those, each sent only if Redis took the `R`
        parts = self._parts
        for part in parts:
            part.ops[0][2] = conf_ms
        if self._cut < len(entries):
            parts.append(
                Batch(self._engine, "free", ops=[["E", code, conf_ms, entries[self._cut :]]])
            )
        lead = Batch(self._engine, "free", ops=[["R", code, conf_ms, entries[:limit], len(parts)]])
        for part in parts:
            part.lead = lead
        store.sync.track(self._engine)
        store.sync.enqueue_parts([lead, *parts])
