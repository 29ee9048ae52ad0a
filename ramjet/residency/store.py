"""Storage behind the residency tables: the `ResidencyStore` contract and `MemoryStore`.

Both tables have one shape: (table, engine, prefix key) -> `Entry` (tier, when it was
last confirmed, when it expires, and whether an engine's signed report stands behind
it ("exact") or only the router's own routing ("approximate")). The facade in
`tables.py` decides what to write; a store only keeps entries, expires them and bounds
their number.

Eviction rule of `MemoryStore` (stated, tested): a table holds at most `caps[table]`
entries. Inserting a new entry into a full table first evicts an approximate entry,
the least recently confirmed one across engines; only when the table holds no
approximate entry does it evict the least recently confirmed exact entry. Refreshing
an entry moves it to the most recently confirmed end. `expire(now)` drops entries from
the least recently confirmed end while they are expired; an expired entry that sits
behind a live one (its TTL was shorter) is never returned by `get` and leaves at its
turn or under cap pressure, so memory stays bounded by the cap either way.

Snapshots without a stall. `stage_exact(table, engine, now)` returns an `ExactStaging`:
the engine's new exact content is built off to the side in pieces (`add(keys, tier,
expires_at)`, one C-level dict update per piece, so a caller can yield to the event loop
between pieces) while reads keep seeing the old content, then `commit()` swaps it in
at once: one engine's view is never half old, half new. `replace_exact` is the same in
one call. A store that cannot stage (the Redis store) says so: its `stage_exact`
returns None, and it is driven through `replace_exact` instead
(`ramjet.residency.tables.SnapshotStaging`).

Capabilities are on the contract, never found out by the store's type: `stage_exact`
(None: no staging) and `shared()` (the `SharedStore` face of a store several router
replicas share, None for a store of this process only).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from itertools import repeat
from operator import attrgetter
from typing import NamedTuple, Protocol

from ramjet.residency.config import RedisSettings
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

    def size(self, table: Table) -> int:
        """Entries held in `table`, live or not yet swept."""
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


class ExactStager(Protocol):
    """A staged exact content (`ResidencyStore.stage_exact`): `add` pieces, `commit` once."""

    def add(self, keys: Sequence[PrefixKey], tier: Tier, expires_at: float) -> None: ...

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
_EXPIRES = attrgetter("expires_at")
_INF = float("inf")


class MemoryStore:
    """In-process `ResidencyStore`: per (table, source, engine) an OrderedDict in
    confirmation order. See the module docstring for the eviction rule."""

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

    def _evict_one(self, table: Table) -> None:
        for exact in (False, True):
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
                return

    def _set(self, table: Table, m: _Map, key: PrefixKey, entry: Entry) -> None:
        if key in m:
            m[key] = entry
            m.move_to_end(key)
            return
        if self._sizes[table] >= self._caps[table]:
            self._evict_one(table)
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
        staging = self.stage_exact(table, engine, now)
        for key, tier, expires_at in entries:
            staging.add((key,), tier, expires_at)
        staging.commit()

    def stage_exact(self, table: Table, engine: EngineId, now: float) -> ExactStaging:
        """Build the engine's new exact content of `table` off to the side; see the
        module docstring."""
        return ExactStaging(self, table, engine, now)

    def shared(self) -> None:
        """In this process only."""
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

    def size(self, table: Table) -> int:
        return self._sizes[table]


class ExactStaging:
    """One engine's next exact content of one table, built off the live map
    (`MemoryStore.stage_exact`). Keys added twice keep their first position and their
    last tier and expiry, as in `replace_exact`."""

    __slots__ = ("_done", "_engine", "_map", "_now", "_shared", "_store", "_table")

    def __init__(self, store: MemoryStore, table: Table, engine: EngineId, now: float) -> None:
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

    def __len__(self) -> int:
        return len(self._map)

    def commit(self) -> None:
        """Swap the staged content in (once); evicts by the store's rule if over the cap."""
        if self._done:
            raise RuntimeError("staging already committed")
        self._done = True
        self._store._swap_exact(self._table, self._engine, self._map)
