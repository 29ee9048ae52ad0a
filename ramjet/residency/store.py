"""Storage behind the residency tables: the `ResidencyStore` contract, `MemoryStore` (the
in-process store: a compact `BlockIndex` per engine for the exact global entries) and
`DictStore` (the dict store it replaced, kept as the reference it is tested against).

Both tables have one shape: (table, engine, prefix key) -> `Entry` (tier, when it was
last confirmed, when it expires, and whether an engine's signed report stands behind
it ("exact") or only the router's own routing ("approximate")). The facade in
`tables.py` decides what to write; a store only keeps entries, expires them and bounds
their number.

Eviction rule of both in-process stores (stated, tested alike): a table holds at most `caps[table]`
entries. Inserting a new entry into a full table first evicts an approximate entry,
the least recently confirmed one across engines; only when the table holds no
approximate entry does it evict the least recently confirmed exact entry, and only for
an exact entry: an approximate entry that finds the table full of exact ones is not
stored (the router's guess never displaces what a signed report says). Refreshing
an entry moves it to the most recently confirmed end. `expire(now)` drops entries from
the least recently confirmed end while they are expired; an expired entry that sits
behind a live one (its TTL was shorter) is never returned by `get` and leaves at its
turn or under cap pressure, so memory stays bounded by the cap either way (`DictStore`;
`MemoryStore` sweeps every expired entry, in bounded steps: see the class).

Snapshots without a stall. `stage_exact(table, engine, now)` returns an `ExactStaging`:
the engine's new exact content is built off to the side in pieces (`add(keys, tier,
expires_at)`, one C-level dict update per piece, so a caller can yield to the event loop
between pieces) while reads keep seeing the old content, then `commit()` swaps it in
at once: one engine's view is never half old, half new. `replace_exact` is the same in
one call. A store that cannot stage says so: its `stage_exact` returns None, and it
is driven through `replace_exact` instead (`ramjet.residency.tables.SnapshotStaging`).
The Redis store stages in its mirror and in the replace it sends
(`ramjet.residency.redis_store.RedisStaging`).

Capabilities are on the contract, never found out by the store's type: `stage_exact`
(None: no staging), `mark_exact` (a snapshot in parts written to the live table, the
entries no part named dropped at the end in steps; None: cannot mark) and `shared()` (the `SharedStore` face of a store several router
replicas share, None for a store of this process only).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from itertools import repeat
from operator import attrgetter
from typing import NamedTuple, Protocol

from ramjet.residency.config import RedisSettings
from ramjet.residency.index import RELEASE_BYTES, SHARDS, BlockIndex
from ramjet.residency.redis_link import RedisLink
from ramjet.types import EngineId, PrefixKey, Tier


class Table(enum.StrEnum):
    GLOBAL = "global"
    """Global-KV residency: prefix block key -> tier on each engine."""
    SWA = "swa"
    """SWA sessions: message-boundary key -> engines holding live SWA state there."""


class Entry(NamedTuple):
    tier: Tier
    """Where the block is (always HBM for SWA entries)."""
    confirmed_at: float
    """Store-clock seconds of the last report (or routing) that confirmed it."""
    expires_at: float
    """Store-clock seconds after which the entry is gone."""
    exact: bool
    """True when a verified engine report stands behind it."""


class ResidencyStore(Protocol):
    """Keeps (table, engine, key) -> Entry. The contract every store implements.

    - Times are seconds on the caller's clock (the facade passes a monotonic `now`);
      the store never reads a clock itself, so tests and a Redis store can share it.
    - All methods are synchronous and must not block on I/O: they run on the router's
      event loop inside the request path. A shared (Redis) store keeps a local mirror
      that these methods read and write, and syncs it in the background; when Redis is
      unreachable it keeps serving the local state (fail open).
    - `put(..., exact=False)` never overrides a live exact entry of the same engine and
      key; `put(..., exact=True)` replaces an approximate one.
    - `get` never returns an entry whose `expires_at <= now`; approximate entries only
      when asked for.
    - Memory is bounded: each table holds at most its cap; the eviction rule is the
      implementation's to state (see `MemoryStore`).
    - Not thread-safe: one thread (the event loop) calls it.
    """

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
        """Insert or refresh entries; see the rule on exact and approximate above."""
        ...

    def remove(self, table: Table, engine: EngineId, keys: Iterable[PrefixKey]) -> None:
        """Drop entries (exact and approximate) the engine no longer holds."""
        ...

    def get(
        self, table: Table, engine: EngineId, key: PrefixKey, now: float, approximate: bool
    ) -> Entry | None:
        """The live entry, exact first, approximate only if `approximate`."""
        ...

    def get_many(
        self,
        table: Table,
        engine: EngineId,
        keys: Sequence[PrefixKey],
        now: float,
        approximate: bool,
    ) -> list[Entry | None]:
        """`get` of each key, in order. On the request path (a prompt's matched blocks):
        an implementation answers in C-level passes, not one Python call per key."""
        ...

    def replace_exact(
        self,
        table: Table,
        engine: EngineId,
        entries: Iterable[tuple[PrefixKey, Tier, float]],
        now: float,
    ) -> None:
        """Make (key, tier, expires_at) the engine's whole exact content of `table`
        (a snapshot). Approximate entries are left alone."""
        ...

    def purge(self, engine: EngineId) -> None:
        """Forget everything about the engine in both tables (new epoch, removal)."""
        ...

    def expire(self, now: float) -> int:
        """Drop expired entries (see the implementation's rule); return how many."""
        ...

    def expire_step(self, now: float) -> int:
        """One bounded step of `expire` (and of freeing what a replace or purge dropped),
        for the event loop: call again while `sweeping(now)`; return how many dropped."""
        ...

    def sweeping(self, now: float) -> bool:
        """Whether `expire_step` has work left at `now`."""
        ...

    def size(self, table: Table) -> int:
        """Entries held in `table`, live or not yet swept."""
        ...

    def exact_keys(self, table: Table, engine: EngineId) -> Iterator[list[PrefixKey]]:
        """The engine's exact keys of `table` (live or not yet swept) in batches of a few
        thousand at most, each a copy: the caller may remove keys between batches (a
        snapshot in parts drops what it did not vouch for, in bounded steps)."""
        ...

    def stage_exact(self, table: Table, engine: EngineId, now: float) -> ExactStager | None:
        """Capability: build the engine's next exact content of `table` in pieces off to
        the side, then swap it in at once (see the module docstring). None: this store
        cannot stage; the caller collects the pieces and calls `replace_exact`."""
        ...

    def shared(self) -> SharedStore | None:
        """Capability: the store is shared by several router replicas; what they share
        beyond residency (report cursors). None: this process's store only."""
        ...

    def mark_exact(self, table: Table, engine: EngineId) -> ExactMark | None:
        """Capability: mark the engine's exact content of `table` now, for a snapshot in
        parts written to the live table as the parts come; the mark's `drop_steps()`
        later removes, in bounded steps, the entries written before the mark and not
        since. None: this store cannot mark (the caller stages or keeps its own marks)."""
        ...


class ExactMark(Protocol):
    """See `ResidencyStore.mark_exact`."""

    def reserve(self, keys: int) -> None:
        """A size hint: about `keys` keys will be written after the mark."""
        ...

    def drop_steps(self) -> Iterator[int]:
        """Remove the entries no put named since the mark, in steps (each yields how many
        entries or slots it looked at); the last evicts by the store's rule if over the
        cap."""
        ...


class ExactStager(Protocol):
    """A staged exact content (`ResidencyStore.stage_exact`): `add` pieces, `commit` once."""

    def add(self, keys: Sequence[PrefixKey], tier: Tier, expires_at: float) -> None: ...

    def reserve(self, keys: int) -> None:
        """A size hint: about `keys` keys will be added (a snapshot knows its size)."""
        ...

    def commit(self) -> None: ...


class SharedStore(Protocol):
    """A residency store several replicas share through Redis (`RedisStore`): what the
    shared report cursors (`ramjet.reports.redis_cursors.SharedReports`) use of it."""

    link: RedisLink
    settings: RedisSettings
    retention_ms: int
    """How long bookkeeping keys live in Redis."""

    def report(self, engine: EngineId, epoch: int, seq: int) -> AbstractContextManager[None]:
        """Group the writes made inside into one batch applied once per report."""
        ...


_Map = OrderedDict[PrefixKey, Entry]
_KEY_BATCH = 4096
_EXPIRES = attrgetter("expires_at")
_INF = float("inf")


def _sequence(keys: Iterable[PrefixKey]) -> Sequence[PrefixKey]:
    """`keys` as a sequence, made a list only when it is not one: a list or a tuple (the
    request path's keys) is taken as it is without the `Sequence` ABC's check."""
    if isinstance(keys, (list, tuple, Sequence)):  # the builtins first: no ABC check
        return keys
    return list(keys)


def _replace_by_staging(
    staging: ExactStager, entries: Iterable[tuple[PrefixKey, Tier, float]]
) -> None:
    """`replace_exact` of either store: the entries staged, then swapped in whole."""
    for key, tier, expires_at in entries:
        staging.add((key,), tier, expires_at)
    staging.commit()


class DictStore:
    """In-process `ResidencyStore`: per (table, source, engine) an OrderedDict in
    confirmation order (about 130 bytes per entry). See the module docstring for the
    eviction rule. `MemoryStore` keeps the exact global entries in a compact index and
    the rest here; this one whole is the reference its answers are tested against."""

    def __init__(self, caps: dict[Table, int]) -> None:
        for table in Table:
            if caps.get(table, 0) < 1:
                raise ValueError(f"cap for table {table.value!r} must be at least 1")
        self._caps = dict(caps)
        # [table][exact] -> engine -> OrderedDict
        self._maps: dict[Table, dict[bool, dict[EngineId, _Map]]] = {
            t: {True: {}, False: {}} for t in Table
        }
        self._sizes: dict[Table, int] = dict.fromkeys(Table, 0)

    # -- helpers ------------------------------------------------------------------

    def _map(self, table: Table, exact: bool, engine: EngineId) -> _Map:
        by_engine = self._maps[table][exact]
        m = by_engine.get(engine)
        if m is None:
            m = by_engine[engine] = OrderedDict()
        return m

    def _evict_one(self, table: Table, approximate_only: bool = False) -> bool:
        """Evict by the rule; False when there was nothing it may evict."""
        for exact in (False,) if approximate_only else (False, True):
            oldest: _Map | None = None
            oldest_at = float("inf")
            for m in self._maps[table][exact].values():
                if m:
                    head = next(iter(m.values()))
                    if head.confirmed_at < oldest_at:
                        oldest, oldest_at = m, head.confirmed_at
            if oldest is not None:
                oldest.popitem(last=False)
                self._sizes[table] -= 1
                return True
        return False

    def _set(self, table: Table, m: _Map, key: PrefixKey, entry: Entry) -> None:
        if key in m:
            m[key] = entry
            m.move_to_end(key)
            return
        if self._sizes[table] >= self._caps[table] and not self._evict_one(
            table, approximate_only=not entry.exact
        ):
            return  # an approximate entry never displaces an exact one
        m[key] = entry
        self._sizes[table] += 1

    def _pop(self, table: Table, m: _Map | None, key: PrefixKey) -> None:
        if m is not None and m.pop(key, None) is not None:
            self._sizes[table] -= 1

    # -- the contract ---------------------------------------------------------------

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
        entry = Entry(tier, now, expires_at, exact)
        exact_map = self._map(table, True, engine)
        if exact:
            approx_map = self._maps[table][False].get(engine)
            for key in keys:
                self._pop(table, approx_map, key)
                self._set(table, exact_map, key, entry)
            return
        approx = self._map(table, False, engine)
        for key in keys:
            held = exact_map.get(key)
            if held is not None and held.expires_at > now:
                continue  # never override what a signed report says
            self._set(table, approx, key, entry)

    def remove(self, table: Table, engine: EngineId, keys: Iterable[PrefixKey]) -> None:
        exact_map = self._maps[table][True].get(engine)
        approx_map = self._maps[table][False].get(engine)
        for key in keys:
            self._pop(table, exact_map, key)
            self._pop(table, approx_map, key)

    def get(
        self, table: Table, engine: EngineId, key: PrefixKey, now: float, approximate: bool
    ) -> Entry | None:
        m = self._maps[table][True].get(engine)
        entry = m.get(key) if m is not None else None
        if entry is not None and entry.expires_at > now:
            return entry
        if approximate:
            m = self._maps[table][False].get(engine)
            entry = m.get(key) if m is not None else None
            if entry is not None and entry.expires_at > now:
                return entry
        return None

    def get_many(
        self,
        table: Table,
        engine: EngineId,
        keys: Sequence[PrefixKey],
        now: float,
        approximate: bool,
    ) -> list[Entry | None]:
        # One kind of entry for the engine (the usual case: an engine's view reads exact
        # entries or, without reports, approximate ones): one dict lookup per key in C,
        # one C pass for the earliest expiry. Both kinds, or an expired entry found: key
        # by key, with `get`'s precedence.
        ex = self._maps[table][True].get(engine)
        ap = self._maps[table][False].get(engine) if approximate else None
        if ex and ap:
            return [self.get(table, engine, k, now, approximate) for k in keys]
        m = ex or ap
        if not m:
            return [None] * len(keys)
        found = list(map(m.get, keys))
        if min(map(_EXPIRES, filter(None, found)), default=_INF) > now:
            return found
        return [e if e is not None and e.expires_at > now else None for e in found]

    def replace_exact(
        self,
        table: Table,
        engine: EngineId,
        entries: Iterable[tuple[PrefixKey, Tier, float]],
        now: float,
    ) -> None:
        _replace_by_staging(self.stage_exact(table, engine, now), entries)

    def stage_exact(self, table: Table, engine: EngineId, now: float) -> ExactStaging:
        """Build the engine's new exact content of `table` off to the side; see the
        module docstring."""
        return ExactStaging(self, table, engine, now)

    def exact_keys(self, table: Table, engine: EngineId) -> Iterator[list[PrefixKey]]:
        m = self._maps[table][True].get(engine)
        keys = list(m) if m else []
        for i in range(0, len(keys), _KEY_BATCH):
            yield keys[i : i + _KEY_BATCH]

    def shared(self) -> None:
        """In this process only."""
        return None

    def mark_exact(self, table: Table, engine: EngineId) -> None:
        """Cannot mark: it stages (`stage_exact`)."""
        return None

    def entries(self, table: Table, engine: EngineId, exact: bool) -> list[tuple[PrefixKey, Entry]]:
        """The engine's entries of one kind in `table`, live or not yet swept (for
        inspection and tests; a copy)."""
        m = self._maps[table][exact].get(engine)
        return list(m.items()) if m else []

    def holds(self, engine: EngineId) -> bool:
        """Whether the engine has any entry (live or not yet swept) in either table."""
        return any(self._maps[t][x].get(engine) for t in Table for x in (True, False))

    def _swap_exact(self, table: Table, engine: EngineId, new: _Map) -> None:
        by_engine = self._maps[table][True]
        old = by_engine.pop(engine, None)
        if old is not None:
            self._sizes[table] -= len(old)
        approx_map = self._maps[table][False].get(engine)
        if approx_map:
            for key in [k for k in approx_map if k in new]:
                del approx_map[key]
                self._sizes[table] -= 1
        by_engine[engine] = new
        self._sizes[table] += len(new)
        # the new entries are the most recently confirmed: the rule evicts others first
        for _ in range(self._sizes[table] - self._caps[table]):
            self._evict_one(table)

    def purge(self, engine: EngineId) -> None:
        for table in Table:
            for exact in (True, False):
                m = self._maps[table][exact].pop(engine, None)
                if m is not None:
                    self._sizes[table] -= len(m)

    def expire(self, now: float) -> int:
        dropped = 0
        for table in Table:
            for by_engine in self._maps[table].values():
                for m in by_engine.values():
                    while m:
                        key, entry = next(iter(m.items()))
                        if entry.expires_at > now:
                            break
                        del m[key]
                        dropped += 1
                        self._sizes[table] -= 1
        return dropped

    def expire_step(self, now: float) -> int:
        """The whole `expire` (it pops from each map's oldest end: the router's own
        routing, a few entries)."""
        return self.expire(now)

    def sweeping(self, now: float) -> bool:
        """Never: `expire_step` sweeps everything."""
        return False

    def size(self, table: Table) -> int:
        return self._sizes[table]


class ExactStaging:
    """One engine's next exact content of one table, built off the live map
    (`DictStore.stage_exact`). Keys added twice keep their first position and their
    last tier and expiry, as in `replace_exact`."""

    __slots__ = ("_done", "_engine", "_map", "_now", "_shared", "_store", "_table")

    def __init__(self, store: DictStore, table: Table, engine: EngineId, now: float) -> None:
        self._store = store
        self._table = table
        self._engine = engine
        self._now = now
        self._map: _Map = OrderedDict()
        # a snapshot's keys come in groups sharing tier and expiry: share their Entry too
        self._shared: dict[tuple[Tier, float], Entry] = {}
        self._done = False

    def add(self, keys: Sequence[PrefixKey], tier: Tier, expires_at: float) -> None:
        entry = self._shared.get((tier, expires_at))
        if entry is None:
            entry = self._shared[(tier, expires_at)] = Entry(tier, self._now, expires_at, True)
        self._map.update(zip(keys, repeat(entry)))

    def reserve(self, keys: int) -> None:
        """A dict sizes itself."""

    def __len__(self) -> int:
        return len(self._map)

    def commit(self) -> None:
        """Swap the staged content in (once); evicts by the store's rule if over the cap."""
        if self._done:
            raise RuntimeError("staging already committed")
        self._done = True
        self._store._swap_exact(self._table, self._engine, self._map)


_TIERS = tuple(Tier)


class MemoryStore:
    """In-process `ResidencyStore`: the exact global entries of each engine in a
    `BlockIndex` (typed arrays, about 25 bytes a block; `ramjet.residency.index`), the
    approximate global entries and the SWA table in a `DictStore` beside it (the router's
    own routing and SWA sessions: few). Same answers as `DictStore` whole (property
    tested), and the same eviction rule (module docstring) over the same caps, with
    these differences:

    - the global table's cap may be changed (`set_cap`: sized from the fleet's reported
      capacity by `ResidencyTables`); an exact entry that leaves under it is counted by
      engine (`cap_evictions`) and the engine is `capped` until a snapshot of it fits;
    - `expire(now)` sweeps the index in bounded steps (`sweep_shards` shards a call, a
      few ms), resuming where it stopped; an expired entry is never returned meanwhile;
    - `entries(GLOBAL, engine, True)` lists the index by shard, not by confirmation.
    """

    sweep_shards: int = 1
    """Index shards (of `SHARDS`) swept per `expire_step` (and dropped per step of a
    mark): at 20M blocks an engine's shard holds ~5k blocks in ~8k slots, so a step is
    about 0.7 ms compiled (2 shards a step measured 1.3 ms, 5.5 ms at worst, on the
    shared 2-core machine)."""

    release_bytes: int = RELEASE_BYTES
    """Bytes of a replaced or purged index's arrays freed per `expire_step`
    (`release_step`, `BlockIndex.release`). Counted in bytes, not arrays: a 20M-block
    index is 4,096 shards of two arrays (~100 KB each) and a key array per run, and a
    snapshot's run holds a whole part (4 MB at 524k keys) or more."""

    def __init__(self, caps: dict[Table, int]) -> None:
        for table in Table:
            if caps.get(table, 0) < 1:
                raise ValueError(f"cap for table {table.value!r} must be at least 1")
        self._cap = caps[Table.GLOBAL]
        # the approximate global entries and the SWA table; the global cap is kept here
        self._rest = DictStore({Table.GLOBAL: 1 << 62, Table.SWA: caps[Table.SWA]})
        self._exact: dict[EngineId, BlockIndex] = {}
        self._exact_count = 0
        self._entries: dict[tuple[int, int], Entry] = {}
        """Entry by (id of the index, word): rebuilt when a run id is recycled."""
        self.cap_evictions: dict[EngineId, int] = {}
        """Exact global entries evicted under the cap, by engine (since start)."""
        self.capped: set[EngineId] = set()
        """Engines that lost an exact global entry to the cap since their last snapshot."""
        self.on_cap_evict: Callable[[EngineId], None] | None = None
        """Called with the engine of each exact global entry evicted under the cap."""
        self._sweep_at: tuple[int, int] = (0, 0)
        """Where the expiry sweep resumes: (engine number, shard)."""
        self._retired: list[BlockIndex] = []
        """Indexes a snapshot replaced or a purge dropped, no longer read: freed about
        `release_bytes` at a time by `expire_step` (`release_step`), not in the turn that
        dropped them."""

    # -- caps -------------------------------------------------------------------------

    def set_cap(self, table: Table, cap: int) -> None:
        """Change the global table's cap (the SWA cap is fixed). Takes effect at the next
        insert: nothing is evicted here."""
        if table is not Table.GLOBAL:
            raise ValueError("only the global table's cap can change")
        if cap < 1:
            raise ValueError("cap must be at least 1")
        self._cap = cap

    def cap(self, table: Table) -> int:
        return self._cap if table is Table.GLOBAL else self._rest._caps[Table.SWA]

    def _global_size(self) -> int:
        return self._exact_count + self._rest.size(Table.GLOBAL)

    def _evict_one(self, now: float, approximate_only: bool = False) -> bool:
        """The stated rule: the least recently confirmed approximate entry, else (not for
        an approximate entry) the least recently confirmed exact one across engines.
        False when there was nothing it may evict."""
        rest = self._rest
        if rest.size(Table.GLOBAL) and rest._evict_one(Table.GLOBAL, approximate_only=True):
            return True
        if approximate_only:
            return False
        oldest: BlockIndex | None = None
        oldest_engine: EngineId | None = None
        oldest_at = _INF
        for engine, ix in self._exact.items():
            if ix.count:
                at, _ = ix.oldest()
                if at < oldest_at:
                    oldest, oldest_engine, oldest_at = ix, engine, at
        if oldest is not None and oldest_engine is not None and oldest.evict_oldest():
            self._exact_count -= 1
            self.cap_evictions[oldest_engine] = self.cap_evictions.get(oldest_engine, 0) + 1
            self.capped.add(oldest_engine)
            if self.on_cap_evict is not None:
                self.on_cap_evict(oldest_engine)
            return True
        return False

    # -- reading ----------------------------------------------------------------------

    def _entry(self, ix: BlockIndex, word: int) -> Entry:
        memo = (id(ix), word)
        e = self._entries.get(memo)
        run = word >> 2
        if e is None or e.confirmed_at != ix.conf[run] or e.expires_at != ix.exp[run]:
            if len(self._entries) >= 65536:
                self._entries.clear()
            e = Entry(_TIERS[word & 3], ix.conf[run], ix.exp[run], True)
            self._entries[memo] = e
        return e

    def get(
        self, table: Table, engine: EngineId, key: PrefixKey, now: float, approximate: bool
    ) -> Entry | None:
        if table is Table.GLOBAL:
            ix = self._exact.get(engine)
            if ix is not None:
                w = ix.live(key, now)
                if w:
                    return self._entry(ix, w)
            if not approximate:
                return None
        return self._rest.get(table, engine, key, now, approximate)

    def get_many(
        self,
        table: Table,
        engine: EngineId,
        keys: Sequence[PrefixKey],
        now: float,
        approximate: bool,
    ) -> list[Entry | None]:
        if table is not Table.GLOBAL:
            return self._rest.get_many(table, engine, keys, now, approximate)
        ix = self._exact.get(engine)
        if ix is None:
            if approximate:
                return self._rest.get_many(table, engine, keys, now, True)
            return [None] * len(keys)
        words = ix.words(keys, now)
        out: list[Entry | None] = []
        missing = False
        last_w, last_e = 0, None
        for w in words:
            if w == last_w:
                out.append(last_e)  # runs of blocks share a word: one Entry
                if w == 0:
                    missing = True
            elif w:
                last_w, last_e = w, self._entry(ix, w)
                out.append(last_e)
            else:
                last_w, last_e = 0, None
                out.append(None)
                missing = True
        if missing and approximate and self._rest.holds(engine):
            approx = self._rest.get_many(table, engine, keys, now, True)
            out = [e if e is not None else a for e, a in zip(out, approx, strict=True)]
        return out

    # -- writing ----------------------------------------------------------------------

    def _index(self, engine: EngineId) -> BlockIndex:
        ix = self._exact.get(engine)
        if ix is None:
            ix = self._exact[engine] = BlockIndex()
        return ix

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
        if table is not Table.GLOBAL:
            self._rest.put(table, engine, keys, tier, now, expires_at, exact)
            return
        keys = _sequence(keys)
        if exact:
            if self._rest.holds(engine):
                self._rest.remove(table, engine, keys)
            ix = self._index(engine)
            run = ix.new_run(now, expires_at)
            t = int(tier)
            full_at = self._cap - self._rest.size(table)
            if self._exact_count + len(keys) <= full_at:  # room for all: one batch
                self._exact_count += ix.put_many(keys, run, t)
                ix.close_run(run)
                return
            for key in keys:
                if self._exact_count >= full_at and not ix.lookup(key):
                    self._evict_one(now)
                    full_at = self._cap - self._rest.size(table)
                if ix.put(key, run, t):
                    self._exact_count += 1
            ix.close_run(run)
            return
        ix2 = self._exact.get(engine)
        rest = self._rest
        for key in keys:
            if ix2 is not None and ix2.live(key, now):
                continue  # never override what a signed report says
            if (
                self._global_size() >= self._cap
                and rest.get(table, engine, key, -_INF, True) is None
                and not self._evict_one(now, approximate_only=True)
            ):
                continue  # full of exact entries: a guess never displaces them
            rest.put(table, engine, (key,), tier, now, expires_at, False)

    def remove(self, table: Table, engine: EngineId, keys: Iterable[PrefixKey]) -> None:
        if table is Table.GLOBAL:
            ix = self._exact.get(engine)
            if ix is not None:
                keys = _sequence(keys)
                for key in keys:
                    if ix.remove(key):
                        self._exact_count -= 1
        self._rest.remove(table, engine, keys)

    def replace_exact(
        self,
        table: Table,
        engine: EngineId,
        entries: Iterable[tuple[PrefixKey, Tier, float]],
        now: float,
    ) -> None:
        _replace_by_staging(self.stage_exact(table, engine, now), entries)

    def stage_exact(self, table: Table, engine: EngineId, now: float) -> ExactStager:
        if table is not Table.GLOBAL:
            return self._rest.stage_exact(table, engine, now)
        return IndexStaging(self, engine, now)

    def exact_keys(self, table: Table, engine: EngineId) -> Iterator[list[PrefixKey]]:
        """By shard of the engine's index (about 5k keys a shard at 20M blocks)."""
        if table is not Table.GLOBAL:
            yield from self._rest.exact_keys(table, engine)
            return
        for s in range(SHARDS):
            ix = self._exact.get(engine)
            if ix is None:
                return
            keys = ix.shard_keys(s)
            if keys:
                yield keys  # type: ignore[misc]

    def _swap_index(self, engine: EngineId, new: BlockIndex, now: float) -> None:
        old = self._exact.pop(engine, None)
        if old is not None:
            self._exact_count -= old.count
            self._retired.append(old)
        rest = self._rest
        if rest.holds(engine):
            approx = [k for k, _ in rest.entries(Table.GLOBAL, engine, False) if new.lookup(k)]
            rest.remove(Table.GLOBAL, engine, approx)
        self._exact[engine] = new
        self._exact_count += new.count
        before = self.cap_evictions.get(engine, 0)
        for _ in range(self._global_size() - self._cap):
            self._evict_one(now)
        if self.cap_evictions.get(engine, 0) == before:
            self.capped.discard(engine)

    def shared(self) -> None:
        """In this process only."""
        return None

    def mark_exact(self, table: Table, engine: EngineId) -> IndexMark | None:
        """The global table: the engine's index marks by run (`BlockIndex.mark`). The
        SWA table cannot mark (it stages)."""
        if table is not Table.GLOBAL:
            return None
        return IndexMark(self, engine, self._index(engine))

    def entries(self, table: Table, engine: EngineId, exact: bool) -> list[tuple[PrefixKey, Entry]]:
        """The engine's entries of one kind in `table`, live or not yet swept (for
        inspection and tests; a copy; exact global ones in the index's order)."""
        if table is Table.GLOBAL and exact:
            ix = self._exact.get(engine)
            if ix is None:
                return []
            return [(PrefixKey(k), self._entry(ix, w)) for k, w in ix.items()]
        return self._rest.entries(table, engine, exact)

    def entry_steps(
        self, table: Table, engine: EngineId, exact: bool
    ) -> Iterator[list[tuple[PrefixKey, Entry]]]:
        """`entries` in pieces, for a caller that yields to the event loop between them:
        the exact global ones by shard of the engine's index (read again for each
        piece: none after a purge), the others in batches of a copy."""
        if table is Table.GLOBAL and exact:
            for s in range(SHARDS):
                ix = self._exact.get(engine)
                if ix is None:
                    return
                items = ix.shard_items(s)
                if items:
                    yield [(PrefixKey(k), self._entry(ix, w)) for k, w in items]
            return
        rest = self._rest.entries(table, engine, exact)
        for i in range(0, len(rest), _KEY_BATCH):
            yield rest[i : i + _KEY_BATCH]

    def holds(self, engine: EngineId) -> bool:
        ix = self._exact.get(engine)
        return (ix is not None and ix.count > 0) or self._rest.holds(engine)

    def purge(self, engine: EngineId) -> None:
        ix = self._exact.pop(engine, None)
        if ix is not None:
            self._exact_count -= ix.count
            self._retired.append(ix)
        self.capped.discard(engine)
        self._rest.purge(engine)

    def release_step(self) -> bool:
        """Free about `release_bytes` of the arrays of the indexes a snapshot replaced
        or a purge dropped (`BlockIndex.release`); True while some are left."""
        budget = self.release_bytes
        retired = self._retired
        while retired and budget > 0:
            budget = retired[-1].release(budget)
            if budget > 0:
                retired.pop()  # what is left of it is a few small arrays
        return bool(retired)

    def expire(self, now: float) -> int:
        """Drop expired entries: every step of `expire_step` until none is left (one
        call walks every index with an expired block: the event loop uses the steps)."""
        dropped = self.expire_step(now)
        while self.sweeping(now):
            dropped += self.expire_step(now)
        return dropped

    def expire_step(self, now: float) -> int:
        """One bounded step of the expiry: the approximate and SWA entries as `DictStore`
        expires them (a few: the router's own routing), then one piece of work, the first
        of these with any left: a `release_step` while a dropped index is left to free;
        else about `release_bytes` of one index's `garbage` (the key lists of runs the
        sweep or removals emptied); else `sweep_shards` shards of one index holding an
        expired block, resuming where the last step stopped. One piece a call, not all
        three: the tables' budget (`tables.EXPIRE_STEP_S`) is checked between calls, so
        a call that did each piece ran past it by their sum (a 9.3 ms step of a Redis
        mirror's sweep at 10M blocks). `sweeping` is True while any piece is left."""
        dropped = self._rest.expire(now)
        if self._retired:
            self.release_step()
            return dropped
        for ix in self._exact.values():
            if ix.has_garbage():
                ix.release_garbage(self.release_bytes)
                return dropped
        engines = list(self._exact)
        if not engines:
            return dropped
        e, shard = self._sweep_at
        for _ in range(len(engines) + 1):
            if e >= len(engines):
                e, shard = 0, 0
            ix = self._exact[engines[e]]
            if ix.count == 0 or not ix.expiry_due(now):
                e, shard = e + 1, 0
                continue
            n, shard = ix.sweep(now, shard, self.sweep_shards)
            self._exact_count -= n
            dropped += n
            if shard >= SHARDS:
                e, shard = e + 1, 0
            break
        self._sweep_at = (e, shard)
        return dropped

    def sweeping(self, now: float) -> bool:
        """Whether an index holds a block expired at `now` (the sweep has work left); for
        a few calls after a pass freed many runs, True while their entries are dropped
        from the expiry heap a bounded number a call (`BlockIndex.expiry_due`); True
        while a dropped index (`release_step`) or a freed run's key list
        (`BlockIndex.garbage`) is left to free."""
        if self._retired:
            return True  # a dropped index left to free (`release_step`)
        return any(
            ix.has_garbage() or (ix.count and ix.expiry_due(now)) for ix in self._exact.values()
        )

    def size(self, table: Table) -> int:
        if table is Table.GLOBAL:
            return self._global_size()
        return self._rest.size(table)


class IndexStaging:
    """One engine's next exact global content, built in a new `BlockIndex` off the live
    one (`MemoryStore.stage_exact`). Consecutive keys of one expiry share a run."""

    __slots__ = ("_done", "_engine", "_index", "_last", "_now", "_runs", "_store")

    def __init__(self, store: MemoryStore, engine: EngineId, now: float) -> None:
        self._store = store
        self._engine = engine
        self._now = now
        self._index = BlockIndex()
        self._runs: list[int] = []
        self._last: tuple[float, int, float] | None = None
        """What the last run was opened for: (expiry, tier or -1, confirmation or -1)."""
        self._done = False

    def add(
        self,
        keys: Sequence[PrefixKey],
        tier: Tier,
        expires_at: float,
        confirmed_at: float | None = None,
    ) -> None:
        """Add a piece. Consecutive pieces of one expiry share a run (held open until the
        commit); a new expiry starts a new one, so the runs keep the order the keys came
        in. With `confirmed_at` (a full pull from Redis: groups confirmed at different
        times, each a run as `put` makes it) the run is confirmed then, and shared only
        by consecutive pieces of the same tier, confirmation and expiry."""
        ix = self._index
        group = (
            (expires_at, -1, -1.0)
            if confirmed_at is None
            else (expires_at, int(tier), confirmed_at)
        )
        last = self._runs[-1] if self._runs else None
        if last is not None and self._last == group:
            run = last
        else:
            run = ix.new_run(self._now if confirmed_at is None else confirmed_at, expires_at)
            self._runs.append(run)
            self._last = group
        ix.put_many(keys, run, int(tier))

    def reserve(self, keys: int) -> None:
        """Size the new index's shards for `keys` blocks (`BlockIndex.reserve`): the
        pieces then insert without rehashing, about twice as fast."""
        self._index.reserve(keys)

    def __len__(self) -> int:
        return self._index.count

    def commit(self) -> None:
        """Swap the staged content in (once); evicts by the store's rule if over the cap."""
        if self._done:
            raise RuntimeError("staging already committed")
        self._done = True
        for run in self._runs:
            self._index.close_run(run)
        self._index.reserve(0)  # later shards grow from the smallest again
        self._store._swap_index(self._engine, self._index, self._now)


class IndexMark:
    """`MemoryStore.mark_exact` of the global table: the runs of the engine's index made
    from now on are what a snapshot in parts named; `drop_steps` drops the blocks of
    older runs, `MemoryStore.sweep_shards` shards a step."""

    __slots__ = ("_before", "_engine", "_index", "_mark", "_store")

    def __init__(self, store: MemoryStore, engine: EngineId, ix: BlockIndex) -> None:
        self._store = store
        self._engine = engine
        self._index = ix
        self._mark = ix.mark()
        self._before = store.cap_evictions.get(engine, 0)

    def reserve(self, keys: int) -> None:
        """Size the index's shards for its content and `keys` more (`BlockIndex.reserve`):
        they grow once, not at every doubling all together (a loop stall)."""
        self._index.reserve(self._index.count + keys)

    def drop_steps(self) -> Iterator[int]:
        store, engine, ix = self._store, self._engine, self._index
        # the blocks older runs still hold, at most: the walk over the shards stops once
        # it dropped that many (none, for a snapshot into an empty index: no walk)
        left = ix.blocks_before(self._mark)
        yield 0
        shard = 0
        while shard < SHARDS and left > 0:
            if store._exact.get(engine) is not ix:
                return  # purged or replaced meanwhile: nothing of the mark is left
            n, looked, shard = ix.drop_before(self._mark, shard, store.sweep_shards)
            store._exact_count -= n
            left -= n
            yield looked
        ix.reserve(0)  # later shards grow from the smallest again
        for _ in range(store._global_size() - store._cap):
            store._evict_one(0.0)  # the rule reads no clock
        if store.cap_evictions.get(engine, 0) == self._before:
            store.capped.discard(engine)
        yield 0
