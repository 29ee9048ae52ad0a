"""`RedisStore`: the residency tables shared by several router replicas through Redis.

The same `ResidencyStore` contract as `MemoryStore` (synchronous, no I/O on the request
path), built as a local mirror plus a background sync:

- Reads (`get`, `size`, and so every policy `pick`) are served from a local `MemoryStore`
  (the mirror). A lookup never waits on Redis, so a slow or dead Redis cannot slow a
  decision down; the price is that another replica's write is seen one sync interval
  (`sync_interval_ms`, 50 ms by default) later.
- Writes (`put`, `remove`, `replace_exact`, `purge`) change the mirror at once and queue
  the same operation for Redis. Writes made inside `with store.report(engine, epoch,
  seq):` form one batch applied by the `APPLY` script only if (epoch, seq) is newer than
  the engine's stored position (idempotent: a report applied by two replicas, in any
  order, counts once). Other writes (the router's approximate entries) are coalesced per
  engine into unsequenced batches. The queue is bounded (`max_pending_writes` batches; the
  oldest are dropped and counted when Redis is away too long: engine snapshots heal exact
  state, approximate entries age out).
- The sync task (`run`, or `sync_once` in tests) flushes the queue, then tails each
  engine's change log (`TAIL`) and applies every entry (its own included, so all mirrors
  replay one order and converge). A gap in the log's `gen` counter (trimmed log, Redis
  restarted) or a first start triggers a full pull of the engine (index zsets + MGET),
  which is how a restarted replica starts warm. When Redis answers `missing` (it holds no
  copy of an engine: it restarted empty), the replica seeds it from its mirror; the first
  seed wins and the other replicas pull.
- Fail open: every Redis call goes through `RedisLink` (short timeout, breaker). While
  Redis is unreachable the mirror keeps serving and taking writes; when the breaker
  closes again every engine is pulled in full (`ramjet_redis_resyncs_total`).

Pending residency (`ramjet.residency.pending`: blocks of requests this replica has sent
and no report has confirmed yet) is not a store entry and never reaches Redis: it lives
seconds and changes on every request, so sharing it would put a Redis write on the request
path or lag it by a sync interval comparable to its life, and a crashed replica would
leave orphan holds. Each replica knows its own in-flight requests; the others learn the
blocks from the engine's report, one report interval later.

Expiry is native in Redis (each entry key carries its PXAT expiry, the bookkeeping keys a
retention TTL); the mirror expires on its own clock. Store times are seconds of the
caller's monotonic clock; Redis holds Unix milliseconds; `_to_wall_ms` / `_to_local`
convert with the current offset between the two clocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from ramjet.redis_link import RedisLink, RedisSettings, RedisUnavailable
from ramjet.residency.config import ResidencyConfig
from ramjet.residency.redis_scripts import APPLY, KINDS, TAIL, EngineKeys, key16
from ramjet.residency.store import Entry, MemoryStore, Table
from ramjet.types import EngineId, PrefixKey, Tier

log = logging.getLogger(__name__)

_TABLE_CODE = {Table.GLOBAL: "g", Table.SWA: "s"}
_CODE_TABLE = {"g": Table.GLOBAL, "s": Table.SWA}
_TAIL_COUNT = 500
_PULL_PAGE = 2000


def _kind(table: Table, exact: bool) -> str:
    return _TABLE_CODE[table] + ("x" if exact else "a")


@dataclass
class _Batch:
    engine: EngineId
    mode: str  # "seq" | "free"
    epoch: int = -1
    seq: int = -1
    ops: list[list[Any]] = field(default_factory=list)


@dataclass
class _Tail:
    """Where this replica's mirror stands in one engine's log."""

    last_id: str = ""
    gen: int = 0
    synced: bool = False


class StoreMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.resyncs = Counter(
            "ramjet_redis_resyncs_total",
            "Full resyncs of one engine's residency: pull (mirror from Redis) or push (seed "
            "Redis from the mirror), by reason",
            ["direction", "reason"],
            registry=registry,
        )
        self.recoveries = Counter(
            "ramjet_redis_recoveries_total",
            "Times Redis came back after the breaker had opened",
            registry=registry,
        )
        self.pending = Gauge(
            "ramjet_redis_pending_batches",
            "Residency write batches waiting for Redis",
            registry=registry,
        )
        self.dropped = Counter(
            "ramjet_redis_dropped_batches_total",
            "Residency write batches dropped because the queue was full while Redis was away",
            registry=registry,
        )
        self.batches = Counter(
            "ramjet_redis_batches_total",
            "Residency write batches sent to Redis, by result (ok, dup, stale, missing)",
            ["result"],
            registry=registry,
        )
        self.applied = Counter(
            "ramjet_redis_log_entries_applied_total",
            "Change-log entries (any replica's) applied to this replica's mirror",
            registry=registry,
        )


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
        self._keys: dict[EngineId, EngineKeys] = {}
        self._tails: dict[EngineId, _Tail] = {}
        self._cursor: dict[EngineId, tuple[int, int]] = {}
        self._outbox: deque[_Batch] = deque()
        self._open: _Batch | None = None
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._recovered = False
        self._stopping = False
        self._caps = (
            f"{self.settings.max_global_entries_per_engine},"
            f"{self.settings.max_swa_entries_per_engine},{self.settings.log_max_entries}"
        )
        link.on_recover(self._on_recover)
        # lookups are the hot path (a 1M-token prompt is ~4k of them per engine): bind
        # the mirror's method directly instead of forwarding through `get` below
        self.get = self.local.get  # type: ignore[method-assign]
        self.get_many = self.local.get_many  # type: ignore[method-assign]
        for engine in engines:
            self._track(engine)

    # -- clocks ----------------------------------------------------------------------

    def _to_wall_ms(self, t: float) -> int:
        return int((self.wall() + (t - self.clock())) * 1000)

    def _to_local(self, ms: int) -> float:
        return self.clock() + (ms / 1000 - self.wall())

    def _track(self, engine: EngineId) -> EngineKeys:
        keys = self._keys.get(engine)
        if keys is None:
            keys = self._keys[engine] = EngineKeys(self.settings.key_prefix, engine)
            self._tails[engine] = _Tail()
        return keys

    # -- queueing writes ----------------------------------------------------------------

    @contextlib.contextmanager
    def report(self, engine: EngineId, epoch: int, seq: int) -> Iterator[None]:
        """Group the writes made inside into one batch applied once per (engine, epoch,
        seq) across all replicas."""
        if self._open is not None:
            raise RuntimeError("report batches do not nest")
        self._track(engine)
        batch = self._open = _Batch(engine, "seq", int(epoch), int(seq))
        try:
            yield
        finally:
            self._open = None
        self._note_cursor(engine, batch.epoch, batch.seq)
        self._enqueue(batch)

    def _op(self, engine: EngineId, op: list[Any]) -> None:
        self._track(engine)
        if self._open is not None and self._open.engine == engine:
            self._open.ops.append(op)
            return
        last = self._outbox[-1] if self._outbox else None
        if last is not None and last.mode == "free" and last.engine == engine:
            last.ops.append(op)  # coalesce: the queue's tail is never in flight
            self._wake.set()
            return
        self._enqueue(_Batch(engine, "free", ops=[op]))

    def _enqueue(self, batch: _Batch) -> None:
        self._outbox.append(batch)
        while len(self._outbox) > self.settings.max_pending_writes:
            self._outbox.popleft()
            self.metrics.dropped.inc()
        self.metrics.pending.set(len(self._outbox))
        self._wake.set()

    # -- the ResidencyStore contract (local, synchronous) --------------------------------

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
        self.local.put(table, engine, keys, tier, now, expires_at, exact)
        self._op(engine, self._put_op(table, exact, tier, now, expires_at, keys))

    def _put_op(
        self,
        table: Table,
        exact: bool,
        tier: Tier,
        confirmed_at: float,
        expires_at: float,
        keys: Iterable[PrefixKey],
    ) -> list[Any]:
        """The logged form of a `put` (times in wall ms, keys in `key16`)."""
        return [
            "p",
            _kind(table, exact),
            int(tier),
            self._to_wall_ms(confirmed_at),
            self._to_wall_ms(expires_at),
            [key16(k) for k in keys],
        ]

    def remove(self, table: Table, engine: EngineId, keys: Iterable[PrefixKey]) -> None:
        keys = list(keys)
        self.local.remove(table, engine, keys)
        self._op(engine, ["r", _TABLE_CODE[table], [key16(k) for k in keys]])

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
        self._op(
            engine,
            [
                "R",
                _TABLE_CODE[table],
                self._to_wall_ms(now),
                [[key16(k), int(t), self._to_wall_ms(exp)] for k, t, exp in entries],
            ],
        )

    def purge(self, engine: EngineId) -> None:
        self.local.purge(engine)
        self._op(engine, ["P"])

    def expire(self, now: float) -> int:
        return self.local.expire(now)  # Redis expires its copies itself (PXAT)

    def size(self, table: Table) -> int:
        return self.local.size(table)

    # -- state -------------------------------------------------------------------------

    @property
    def degraded(self) -> bool:
        return self.link.degraded

    @property
    def pending(self) -> int:
        return len(self._outbox)

    def cursor(self, engine: EngineId) -> tuple[int, int] | None:
        """(epoch, seq) of the engine's last report this replica knows applied."""
        return self._cursor.get(engine)

    def _on_recover(self) -> None:
        self._recovered = True
        self.metrics.recoveries.inc()
        self._wake.set()

    # -- the background sync --------------------------------------------------------------

    async def run(self) -> None:
        """Sync until cancelled: on every write, and at least every `sync_interval_ms`."""
        interval = self.settings.sync_interval_ms / 1000
        # the flag, not only cancellation, ends the loop: on Python 3.11 a cancel that
        # races with wait_for's own timeout can be swallowed, and the loop would go on
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._wake.wait()
            self._wake.clear()
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
            if self._recovered:
                self._recovered = False
                await self._flush()
                for engine in list(self._keys):
                    await self._pull(engine, "recovery")
                return
            await self._flush()
            for engine in list(self._keys):
                await self._tail(engine)

    async def _flush(self) -> None:
        stale: set[EngineId] = set()
        while self._outbox:
            batch = self._outbox[0]
            status = await self._apply(batch)
            if status == "missing":
                await self._seed(batch.engine)
                status = await self._apply(batch)
            self.metrics.batches.labels(status).inc()
            if status == "stale":
                stale.add(batch.engine)  # the mirror took a change Redis refused: undo it
            if self._outbox and self._outbox[0] is batch:
                self._outbox.popleft()
            self.metrics.pending.set(len(self._outbox))
        for engine in stale:
            await self._pull(engine, "stale_write")

    async def _apply(self, batch: _Batch) -> str:
        keys = self._keys[batch.engine]
        res = await self.link.script(
            APPLY,
            [keys.st, keys.log],
            [
                batch.mode,
                batch.epoch,
                batch.seq,
                self.retention_ms,
                json.dumps(batch.ops, separators=(",", ":")),
                self._caps,
                self.origin,
            ],
        )
        return _text(res[0])

    async def _seed(self, engine: EngineId) -> None:
        """Redis holds no copy of `engine`: offer it this mirror's (first seed wins)."""
        ops: list[list[Any]] = [["P"]]
        for table in Table:
            for exact in (True, False):
                for key, e in self.local.entries(table, engine, exact):
                    ops.append(
                        self._put_op(table, exact, e.tier, e.confirmed_at, e.expires_at, (key,))
                    )
        epoch, seq = self._cursor.get(engine, (-1, -1))
        seed = _Batch(engine, "seed", epoch, seq, ops)
        status = await self._apply(seed)
        self.metrics.batches.labels(f"seed_{status}").inc()
        if status == "ok":
            self.metrics.resyncs.labels("push", "redis_empty").inc()
        self._tails[engine] = _Tail()  # re-read from Redis, whoever seeded

    async def _tail(self, engine: EngineId) -> None:
        keys = self._keys[engine]
        tail = self._tails[engine]
        if not tail.synced:
            await self._pull(engine, "start")
            return
        res = await self.link.script(TAIL, [keys.st, keys.log], [tail.last_id, _TAIL_COUNT])
        gen, epoch, seq, entries = int(res[0]), int(res[1]), int(res[2]), res[3]
        if gen < 0:  # Redis lost this engine (restart, expiry): seed it, then pull
            if self.local.holds(engine) or engine in self._cursor:
                await self._seed(engine)
                await self._pull(engine, "redis_empty")
            return
        if not entries:
            if gen != tail.gen:
                await self._pull(engine, "gap")
            return
        first_gen = int(_fields(entries[0][1])["gen"])
        if first_gen != tail.gen + 1:
            await self._pull(engine, "gap")
            return
        for entry_id, raw in entries:
            self._apply_entry(engine, _fields(raw))
            tail.last_id = _text(entry_id)
            tail.gen += 1
        if len(entries) < _TAIL_COUNT and epoch >= 0:
            self._note_cursor(engine, epoch, seq)

    def _note_cursor(self, engine: EngineId, epoch: int, seq: int) -> None:
        cur = self._cursor.get(engine)
        if cur is None or (epoch, seq) > cur:
            self._cursor[engine] = (epoch, seq)

    def _apply_entry(self, engine: EngineId, f: dict[str, str]) -> None:
        """Replay one logged batch on the mirror."""
        local = self.local
        for op in json.loads(f["ops"]):
            code = op[0]
            if code == "p":
                kind = op[1]
                local.put(
                    _CODE_TABLE[kind[0]],
                    engine,
                    _keys_from16(op[5]),
                    Tier(op[2]),
                    self._to_local(op[3]),
                    self._to_local(op[4]),
                    kind[1] == "x",
                )
            elif code == "r":
                local.remove(_CODE_TABLE[op[1]], engine, _keys_from16(op[2]))
            elif code == "R":
                local.replace_exact(
                    _CODE_TABLE[op[1]],
                    engine,
                    [(PrefixKey(int(k, 16)), Tier(t), self._to_local(exp)) for k, t, exp in op[3]],
                    self._to_local(op[2]),
                )
            elif code == "P":
                local.purge(engine)
        for kind, evicted in json.loads(f.get("x", "[]")):
            local.remove(_CODE_TABLE[kind[0]], engine, _keys_from16(evicted))
        self.metrics.applied.inc()

    async def _pull(self, engine: EngineId, reason: str) -> None:
        """Replace the mirror's copy of `engine` with Redis's (index zsets + MGET)."""
        keys = self._keys[engine]
        gen, epoch, seq, last_id = await self._head(keys)
        if gen < 0:  # nothing in Redis for this engine
            if self.local.holds(engine) or engine in self._cursor:
                await self._seed(engine)
                gen, epoch, seq, last_id = await self._head(keys)
            if gen < 0:
                self._tails[engine] = _Tail(synced=True, last_id="0-0", gen=0)
                return
        loaded: list[tuple[str, list[tuple[str, int, bytes | None]]]] = []
        for kind in KINDS:
            loaded.append((kind, await self._dump(keys, kind)))
        self.local.purge(engine)
        now_local, now_wall = self.clock(), self.wall()
        for kind, rows in loaded:
            table, exact = _CODE_TABLE[kind[0]], kind[1] == "x"
            for k, exp_ms, value in rows:
                if value is None:
                    continue  # expired between ZRANGE and MGET
                tier_s, confirmed_s = _text(value).split(",")
                self.local.put(
                    table,
                    engine,
                    (PrefixKey(int(k, 16)),),
                    Tier(int(tier_s)),
                    now_local + (int(confirmed_s) / 1000 - now_wall),
                    now_local + (exp_ms / 1000 - now_wall),
                    exact,
                )
        self._tails[engine] = _Tail(last_id=last_id or "0-0", gen=gen, synced=True)
        if epoch >= 0:
            self._note_cursor(engine, epoch, seq)
        self.metrics.resyncs.labels("pull", reason).inc()

    async def _head(self, keys: EngineKeys) -> tuple[int, int, int, str]:
        """(gen, epoch, seq, last log id) of one engine in Redis; gen < 0: none there."""
        res = await self.link.script(TAIL, [keys.st, keys.log], ["", 0])
        return int(res[0]), int(res[1]), int(res[2]), _text(res[4])

    async def _dump(self, keys: EngineKeys, kind: str) -> list[tuple[str, int, bytes | None]]:
        idx = keys.index(kind)
        out: list[tuple[str, int, bytes | None]] = []
        start = 0
        while True:
            page: list[tuple[bytes, float]] = await self.link.call(
                lambda c, s=start: c.zrange(idx, s, s + _PULL_PAGE - 1, withscores=True)  # type: ignore[misc]
            )
            if not page:
                return out
            names = [keys.entry(kind, _text(m)) for m, _ in page]
            values: list[bytes | None] = await self.link.call(lambda c, n=names: c.mget(n))  # type: ignore[misc]
            out.extend(
                (_text(m), int(score), v) for (m, score), v in zip(page, values, strict=True)
            )
            if len(page) < _PULL_PAGE:
                return out
            start += _PULL_PAGE

    def stop(self) -> None:
        """Make `run` return at its next turn."""
        self._stopping = True
        self._wake.set()

    async def close(self) -> None:
        """Try once to flush queued writes (bounded by the link's timeout)."""
        with contextlib.suppress(RedisUnavailable):
            async with self._lock:
                await self._flush()


def _keys_from16(hex_keys: Iterable[str]) -> list[PrefixKey]:
    """Prefix keys from their `key16` spelling (16 hex digits) in Redis."""
    return [PrefixKey(int(k, 16)) for k in hex_keys]


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _fields(raw: Any) -> dict[str, str]:
    """A stream entry's field list (flat list from Lua, or a dict) as text."""
    if isinstance(raw, dict):
        return {_text(k): _text(v) for k, v in raw.items()}
    return {_text(raw[i]): _text(raw[i + 1]) for i in range(0, len(raw), 2)}
