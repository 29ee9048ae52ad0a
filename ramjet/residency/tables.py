"""`ResidencyTables`: the router's global-KV residency and SWA session tables.

Writers:
- the report processor (`ramjet.reports.processor`), from verified engine reports:
  `store_global` / `evict_global` / `store_swa` / `expire_swa` for deltas,
  `replace_engine` (or, in pieces, `stage_snapshot`) for snapshots, `purge_engine` for
  a new epoch. These are exact.
- the router, after it dispatches a request: `record_routed(engine, keys, now)`. These
  entries are approximate (HBM assumed, `approximate_ttl_s`), never override an exact
  entry, and are only written and read for engines in `ViewMode.APPROXIMATE`.
- the router, as it forwards a request: `add_pending(engine, keys, now)`, then
  `settle_pending(ticket, engine_or_none, now)` when the forward ends. A short-lived
  overlay (`ramjet.residency.pending`, `pending_ttl_s`) holds the request's blocks as
  HBM and its last boundary as live SWA on that engine until a report confirms them,
  the TTL passes, or the request fails. It is kept beside the store, never in it.

Readers: `view(engine)` returns a `ResidencyView` (see `ramjet.policy.base`) fixed at
the current time. How an engine's view reads the tables is its `ViewMode`, which the
report processor sets from the engine's trust:
- APPROXIMATE (default, no reports): exact, approximate, then pending entries;
- REPORTED (the engine reports; trust exact or degraded): exact, then pending entries;
- SILENT (reports stopped for longer than the staleness TTL): nothing steers.
A pending hold counts only where no live exact (or, when read, approximate) entry
exists; `GlobalMatch.pending` says how many of the matched HBM tokens are pending.

Longest match. A block key names a whole prefix, so on an engine a resident block
implies its predecessors are resident. `global_match` binary-searches for the first
non-resident block (`ramjet.keys.prefix.longest_prefix`, O(log n) lookups), then reads the
matched blocks once in C-level passes (`ResidencyStore.get_many`, `map`/`compress`, no
Python loop per block) to split the tokens by tier, stopping at the first hole should
the table break monotonicity (a lost eviction, a shorter TTL): the result is exactly the
linear scan's. A 4 MB prompt (16k blocks) costs about a millisecond per engine.

One lookup per request and engine. A view is built per request and answers for that
instant; it keeps its last `global_match` and `swa_match` answers keyed by the identity
of the keys passed (`RequestView.block_keys`, `boundary_keys`), so the incumbent, the
candidate and the router's in-flight figure (`uncached_prompt_tokens`) read one lookup.
Do not keep a view across store writes: it answers for the instant it was built.

Clocks: every method takes `now` in seconds of the tables' monotonic clock (`clock`,
injected); `view` reads it once.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import compress, repeat
from operator import eq, gt, is_, is_not, itemgetter, not_, or_
from typing import Final

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ramjet.keys.prefix import PrefixKeys, longest_prefix
from ramjet.metric_catalogue import counter, family
from ramjet.policy.base import GlobalMatch, ResidencyView
from ramjet.residency.config import ResidencyConfig
from ramjet.residency.index import RELEASE_BYTES, BlockIndex
from ramjet.residency.pending import PendingOverlay, PendingTicket
from ramjet.residency.store import (
    Entry,
    ExactMark,
    ExactStager,
    MemoryStore,
    ResidencyStore,
    Table,
)
from ramjet.types import EngineId, PrefixKey, Tier

Clock = Callable[[], float]
_DROP_SLICE: Final = 1024
"""Keys checked per step of a snapshot-in-parts commit over a store that cannot mark."""
_MARK_RUN_KEYS: Final = 65_536
"""Keys of a snapshot's marks per run of their index (a run keeps its keys in one array):
one run of every key named was an array grown to 8 bytes a key by reallocation, each
growth a copy of the whole array while it was a heap chunk (up to ~32 MB: a 15.6 MB copy
was an 11 ms turn at 5M blocks, the once-a-run long turn of the parts at 20M)."""
EXPIRE_STEP_S = 0.002
"""Wall seconds (`perf_counter`) one `expire_step` sweeps for, checked between the
store's steps, so a pass ends after the store step that crossed it (one shard in process).
The apply of a report in steps takes as much a turn (`ramjet.reports.processor.
STEP_BUDGET_S`): both may run in one loop iteration, so they add up (5 ms here made
7-8 ms iterations, 10.6 ms at worst, while a snapshot was applied beside a sweep at
20M blocks). The ingest's tick steps again the next turn while a sweep is left."""
_TIER = itemgetter(0)  # Entry.tier
_KEY = itemgetter(1)  # the key of a (offset, key) boundary
_INF = float("inf")


class ViewMode(enum.Enum):
    APPROXIMATE = "approximate"
    REPORTED = "reported"
    SILENT = "silent"


class EngineResidencyView:
    """One engine's residency at one instant; implements `ResidencyView`. Built per
    request (`ResidencyTables.view`): it keeps its last answer per keys object, so every
    policy and the router's in-flight figure share one lookup (see `global_match`)."""

    __slots__ = (
        "_approx",
        "_engine",
        "_gmemo",
        "_now",
        "_pending",
        "_steer",
        "_store",
        "_swamemo",
    )

    def __init__(
        self,
        store: ResidencyStore,
        engine: EngineId,
        now: float,
        mode: ViewMode,
        pending: PendingOverlay | None = None,
    ) -> None:
        """`pending`: the overlay, already expired to `now` (None: no pending holds)."""
        self._store = store
        self._engine = engine
        self._now = now
        self._approx = mode is ViewMode.APPROXIMATE
        self._steer = mode is not ViewMode.SILENT
        self._pending = pending
        self._gmemo: tuple[Sequence[PrefixKey], Sequence[int], GlobalMatch] | None = None
        self._swamemo: tuple[Sequence[tuple[int, PrefixKey]], int] | None = None

    def global_match(
        self, block_keys: Sequence[PrefixKey], block_tokens: Sequence[int]
    ) -> GlobalMatch:
        if not self._steer or not block_keys:
            return GlobalMatch()
        memo = self._gmemo
        if memo is not None and memo[0] is block_keys and memo[1] is block_tokens:
            return memo[2]
        match = self._global_match(block_keys, block_tokens)
        self._gmemo = (block_keys, block_tokens, match)
        return match

    def _global_match(
        self, block_keys: Sequence[PrefixKey], block_tokens: Sequence[int]
    ) -> GlobalMatch:
        get, engine, now, approx = self._store.get, self._engine, self._now, self._approx
        held = self._pending.holds(Table.GLOBAL, engine) if self._pending is not None else None
        if held is None:
            bound = longest_prefix(
                block_keys, lambda k: get(Table.GLOBAL, engine, k, now, approx) is not None
            )
        else:
            bound = longest_prefix(
                block_keys,
                lambda k: k in held or get(Table.GLOBAL, engine, k, now, approx) is not None,
            )
        if bound == 0:
            return GlobalMatch(blocks=0)
        # The matched blocks once, in C-level passes: their entries, the first hole (a
        # block neither stored nor pending, should the table break monotonicity), the
        # pending tokens, the tokens by tier. Exactly the linear scan's answer.
        keys = block_keys[:bound]
        tokens = block_tokens[:bound]
        entries = self._store.get_many(Table.GLOBAL, engine, keys, now, approx)
        pending = 0
        if None in entries:
            missing = list(map(is_, entries, repeat(None)))
            holes = (
                missing if held is None else list(map(gt, missing, map(held.__contains__, keys)))
            )
            if True in holes:
                bound = holes.index(True)
                del entries[bound:], missing[bound:]
                tokens = tokens[:bound]
            pending = sum(compress(tokens, missing))
            tokens = list(compress(tokens, map(not_, missing)))
        live: Iterable[Entry] = filter(None, entries)  # all of them when none is missing
        total = sum(tokens)
        tiers = list(map(_TIER, live))
        if tiers.count(Tier.HBM) == len(tiers):
            host = ssd = 0
        else:
            host = sum(compress(tokens, map(eq, tiers, repeat(Tier.HOST))))
            ssd = sum(compress(tokens, map(eq, tiers, repeat(Tier.SSD))))
        return GlobalMatch(total - host - ssd + pending, host, ssd, pending, bound)

    def swa_match(self, boundary_keys: Sequence[tuple[int, PrefixKey]]) -> int:
        if not self._steer or not boundary_keys:
            return 0
        memo = self._swamemo
        if memo is not None and memo[0] is boundary_keys:
            return memo[1]
        engine = self._engine
        held = self._pending.holds(Table.SWA, engine) if self._pending is not None else None
        keys = list(map(_KEY, boundary_keys))
        entries = self._store.get_many(Table.SWA, engine, keys, self._now, self._approx)
        live: Iterable[bool] = map(is_not, entries, repeat(None))
        if held is not None:
            live = map(or_, live, map(held.__contains__, keys))
        hits = list(compress(range(len(keys)), live))
        offset = boundary_keys[hits[-1]][0] if hits else 0
        self._swamemo = (boundary_keys, offset)
        return offset


class ResidencyTables:
    """The two tables behind one store, with per-engine view modes. Single-threaded
    (the router's event loop)."""

    def __init__(
        self,
        config: ResidencyConfig | None = None,
        store: ResidencyStore | None = None,
        clock: Clock = time.monotonic,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config or ResidencyConfig()
        own = None
        if store is None:
            own = MemoryStore(
                {
                    Table.GLOBAL: self.config.max_global_entries,
                    Table.SWA: self.config.max_swa_entries,
                }
            )
        self.store: ResidencyStore = store or own  # type: ignore[assignment]
        self._own: MemoryStore | None = own
        """The in-process store these tables made (None: one was given, e.g. Redis): its
        global cap is sized from the fleet (`set_capacity`), its expiry runs in steps."""
        self._capacity: dict[EngineId, int] = {}
        self.clock = clock
        self.pending = PendingOverlay(self.config.pending_ttl_s, self.config.max_pending_entries)
        """Requests sent and not yet reported (see `add_pending`); never in the store."""
        self._modes: dict[EngineId, ViewMode] = {}
        self._evictions = None
        """The cap-eviction counter: every reporting engine's series exists from its first
        report (0 until the cap evicts), so the alert has data whatever the store."""
        if registry is not None:
            registry.register(_SizeCollector(self))
            evictions = self._evictions = counter(registry, "ramjet_residency_cap_evictions_total")
            if own is not None:
                own.on_cap_evict = lambda engine: evictions.labels(engine).inc()

    # -- reading ----------------------------------------------------------------------

    def mode(self, engine: EngineId) -> ViewMode:
        return self._modes.get(engine, ViewMode.APPROXIMATE)

    def set_mode(self, engine: EngineId, mode: ViewMode) -> None:
        if engine not in self._modes and self._evictions is not None:
            self._evictions.labels(engine)  # the engine's series, at 0
        self._modes[engine] = mode

    def view(self, engine: EngineId, now: float | None = None) -> ResidencyView:
        t = self.clock() if now is None else now
        self.pending.expire(t)
        return EngineResidencyView(self.store, engine, t, self.mode(engine), self.pending)

    def size(self, table: Table) -> int:
        return self.store.size(table)

    # -- approximate: what the router itself routed --------------------------------------

    def record_routed(self, engine: EngineId, keys: PrefixKeys, now: float) -> None:
        """The router sent a prompt with these keys to `engine`: assume its blocks are in
        HBM there and its SWA state sits at the prompt's last message boundary."""
        if self.mode(engine) is not ViewMode.APPROXIMATE:
            return
        ttl = self.config.approximate_ttl_s
        self.store.put(Table.GLOBAL, engine, keys.blocks, Tier.HBM, now, now + ttl, exact=False)
        if keys.boundaries:
            swa_ttl = min(ttl, self.config.swa_ttl_s)
            last = keys.boundaries[-1][1]
            self.store.put(Table.SWA, engine, (last,), Tier.HBM, now, now + swa_ttl, exact=False)

    # -- pending: sent, not yet reported ----------------------------------------------

    def add_pending(self, engine: EngineId, keys: PrefixKeys, now: float) -> PendingTicket:
        """The router is forwarding a prompt with these keys to `engine`: hold its blocks
        (HBM) and its last message boundary (live SWA) there as pending until a report
        confirms them, `pending_ttl_s` passes, or `settle_pending` releases them."""
        last = keys.boundaries[-1][1] if keys.boundaries else None
        return self.pending.add(engine, keys.blocks, last, now)

    def settle_pending(
        self, ticket: PendingTicket | None, engine: EngineId | None, now: float
    ) -> None:
        """The forward ended: `engine` is where it succeeded, None if it failed. A success
        on the ticket's engine keeps the holds (until a report or the TTL); a failure
        releases them; a success elsewhere (a retry) moves them there."""
        if ticket is None or engine == ticket.engine:
            return
        self.pending.release(ticket)
        if engine is not None:
            self.pending.add(engine, ticket.blocks, ticket.swa_key, now)

    # -- exact: from verified reports ---------------------------------------------------

    def _global_expiry(self, now: float, ttl_s: float | None) -> float:
        ttl = self.config.global_ttl_s if ttl_s is None else min(ttl_s, self.config.global_ttl_s)
        return now + ttl

    def _swa_expiry(self, now: float, ttl_s: float | None) -> float:
        ttl = self.config.swa_ttl_s if ttl_s is None else min(ttl_s, self.config.swa_max_ttl_s)
        return now + ttl

    def store_global(
        self,
        engine: EngineId,
        keys: Iterable[PrefixKey],
        tier: Tier,
        now: float,
        ttl_s: float | None = None,
    ) -> None:
        """Blocks entered (or moved to) `tier`; expiry is min(ttl_s, global_ttl_s)."""
        expires = self._global_expiry(now, ttl_s)
        keys = self._confirm(Table.GLOBAL, engine, keys)
        self.store.put(Table.GLOBAL, engine, keys, tier, now, expires, exact=True)

    def evict_global(self, engine: EngineId, keys: Iterable[PrefixKey]) -> None:
        self.store.remove(Table.GLOBAL, engine, self._confirm(Table.GLOBAL, engine, keys))

    def store_swa(
        self, engine: EngineId, keys: Iterable[PrefixKey], now: float, ttl_s: float | None = None
    ) -> None:
        """SWA state pooled at these boundary keys; expiry min(ttl_s, swa_max_ttl_s)."""
        expires = self._swa_expiry(now, ttl_s)
        keys = self._confirm(Table.SWA, engine, keys)
        self.store.put(Table.SWA, engine, keys, Tier.HBM, now, expires, exact=True)

    def expire_swa(self, engine: EngineId, keys: Iterable[PrefixKey]) -> None:
        self.store.remove(Table.SWA, engine, self._confirm(Table.SWA, engine, keys))

    def _confirm(
        self, table: Table, engine: EngineId, keys: Iterable[PrefixKey]
    ) -> Iterable[PrefixKey]:
        """A report names these keys: end their pending holds (the report speaks for them
        now). Returns the keys, materialized if they were a one-shot iterator."""
        if self.pending.holds(table, engine) is None:
            return keys
        if not isinstance(keys, Sequence):
            keys = list(keys)
        self.pending.confirm(table, engine, keys)
        return keys

    def replace_engine(
        self,
        engine: EngineId,
        global_entries: Iterable[tuple[PrefixKey, Tier, float | None]],
        swa_entries: Iterable[tuple[PrefixKey, float | None]],
        now: float,
    ) -> None:
        """A snapshot: (key, tier, ttl_s) and (key, ttl_s) become the engine's whole
        exact content of each table."""
        staging = self.stage_snapshot(engine, now)
        for k, t, ttl in global_entries:
            staging.add_global((k,), t, ttl)
        for k, ttl in swa_entries:
            staging.add_swa((k,), ttl)
        staging.commit()

    def stage_snapshot(
        self, engine: EngineId, now: float, additive: bool = False
    ) -> SnapshotStaging:
        """A snapshot applied in pieces: `add_global`/`add_swa` key groups (the caller may
        yield to the event loop between them; reads keep seeing the old content), then
        `commit()` makes them the engine's whole exact content of both tables at once.

        `additive`: the caller also writes every piece to the live tables as it goes (a
        snapshot in parts). Over a store that can mark its live global table
        (`ResidencyStore.mark_exact`: the `MemoryStore`) the global pieces are not
        copied: the commit drops, in steps (`commit_steps`), the engine's exact global
        entries written before the staging and not since (SWA is staged). Over a shared
        store that cannot mark (Redis) the pieces are only marked (a compact key set),
        and the commit drops, in steps, the engine's exact entries no piece named,
        instead of sending the whole content again. Not additive, over Redis, each
        piece is staged in the mirror and in the replace sent to Redis as it comes
        (`RedisStore.stage_exact`): the commit is a swap and a queued replace."""
        return SnapshotStaging(self, engine, now, additive)

    def purge_engine(self, engine: EngineId) -> None:
        """Forget all the engine's residency (it restarted: a new epoch)."""
        self.store.purge(engine)
        self.pending.purge(engine)

    def expire(self, now: float | None = None) -> int:
        """Drop every expired entry now (in one call: see `expire_step`)."""
        return self.store.expire(self.clock() if now is None else now)

    def expire_step(self, now: float | None = None, budget_s: float = EXPIRE_STEP_S) -> bool:
        """Expire in bounded steps for the event loop: sweep for at most about `budget_s`
        seconds of CPU, resuming where the last call stopped. True while expired
        entries are left to sweep (call again after yielding). Any store: its own
        `expire_step` is the bounded step (over Redis, the mirror's)."""
        t = self.clock() if now is None else now
        store = self.store
        stop = time.perf_counter() + budget_s
        store.expire_step(t)
        while store.sweeping(t):
            if time.perf_counter() >= stop:
                return True
            store.expire_step(t)
        return False

    # -- caps from the fleet -----------------------------------------------------------

    def set_capacity(self, engine: EngineId, blocks: int | None) -> None:
        """The engine's reported capacity in global-KV blocks (all tiers; None: not
        reported). The in-process global table's cap becomes `capacity_headroom` x the
        fleet's reported total, never below `max_global_entries` (the cap when nothing
        is reported) nor above `max_global_entries_ceiling`."""
        if blocks is None or blocks <= 0:
            self._capacity.pop(engine, None)
        else:
            self._capacity[engine] = blocks
        if self._own is not None:
            self._own.set_cap(Table.GLOBAL, self.global_cap())

    def global_cap(self) -> int:
        """The global table's cap now (see `set_capacity`)."""
        cfg = self.config
        fleet = int(cfg.capacity_headroom * sum(self._capacity.values()))
        return min(cfg.max_global_entries_ceiling, max(cfg.max_global_entries, fleet))

    def capped(self, engine: EngineId) -> bool:
        """Whether the cap evicted an exact entry of the engine since its last snapshot:
        a match on it may be missing blocks the engine holds."""
        return self._own is not None and engine in self._own.capped

    def capped_engines(self) -> frozenset[EngineId]:
        return frozenset(self._own.capped) if self._own is not None else frozenset()


class SnapshotStaging:
    """See `ResidencyTables.stage_snapshot`. Over a store that can stage
    (`ResidencyStore.stage_exact`: the in-process stores, Redis's) each piece goes into
    a staged map at once; over any other the pieces are collected and handed to `replace_exact` at
    commit."""

    def __init__(
        self, tables: ResidencyTables, engine: EngineId, now: float, additive: bool = False
    ) -> None:
        self._tables = tables
        self._engine = engine
        self._now = now
        store = tables.store
        self._collected: dict[Table, list[tuple[PrefixKey, Tier, float]]] = {t: [] for t in Table}
        # additive over a store that can mark its live global table: no staged copy of
        # it (the live writes are the new content), the unnamed entries dropped at commit
        self._mark: ExactMark | None = store.mark_exact(Table.GLOBAL, engine) if additive else None
        to_stage = [t for t in Table if t is not Table.GLOBAL or self._mark is None]
        staged: dict[Table, ExactStager] = {}
        # additive over a shared store that cannot mark (Redis): the parts are already
        # written, so no staged copy (its commit would send the whole content again):
        # marks instead (below)
        marks_only = additive and self._mark is None and store.shared() is not None
        for t in [] if marks_only else to_stage:
            stager = store.stage_exact(t, engine, now)
            if stager is None:  # the store cannot stage: collect for replace_exact
                break
            staged[t] = stager
        self._staged = None if marks_only or len(staged) < len(to_stage) else staged
        if self._staged is None:
            self._mark = None
        self._marks: BlockIndex | None = None
        """Additive over a store that cannot stage: the global keys named so far."""
        self._swa_marks: set[PrefixKey] = set()
        self._mark_run = 0
        if self._staged is None and additive:
            self._marks = BlockIndex()
            self._mark_run = self._marks.new_run(now, _INF)
        self._expiry: dict[tuple[Table, float | None], float] = {}
        self.keys = 0
        """Keys added so far."""

    def _add(self, table: Table, keys: Sequence[PrefixKey], tier: Tier, expires: float) -> None:
        self.keys += len(keys)
        if table is Table.GLOBAL and self._mark is not None:
            return  # the live write is the new content
        if self._marks is not None:
            if table is Table.GLOBAL:
                marks = self._marks
                if marks.refs[self._mark_run] >= _MARK_RUN_KEYS:
                    self._mark_run = marks.new_run(self._now, _INF)
                marks.put_many(keys, self._mark_run, 0)
            else:
                self._swa_marks.update(keys)
        elif self._staged is not None:
            self._staged[table].add(keys, tier, expires)
        else:
            self._collected[table].extend(zip(keys, repeat(tier), repeat(expires)))

    def _expires(self, table: Table, ttl_s: float | None) -> float:
        # few distinct TTLs per snapshot: compute each expiry once
        e = self._expiry.get((table, ttl_s))
        if e is None:
            t = self._tables
            now = self._now
            e = t._global_expiry(now, ttl_s) if table is Table.GLOBAL else t._swa_expiry(now, ttl_s)
            self._expiry[(table, ttl_s)] = e
        return e

    def reserve_global(self, keys: int) -> None:
        """A size hint: about `keys` global keys will be added (a store that stages
        sizes its staged copy once instead of growing it piece by piece)."""
        if self._mark is not None:
            self._mark.reserve(keys)
        elif self._staged is not None:
            self._staged[Table.GLOBAL].reserve(keys)
        elif self._marks is not None:
            self._marks.reserve(keys)

    def add_global(self, keys: Sequence[PrefixKey], tier: Tier, ttl_s: float | None) -> None:
        self._add(Table.GLOBAL, keys, tier, self._expires(Table.GLOBAL, ttl_s))

    def add_swa(self, keys: Sequence[PrefixKey], ttl_s: float | None) -> None:
        self._add(Table.SWA, keys, Tier.HBM, self._expires(Table.SWA, ttl_s))

    def commit_steps(self) -> Iterator[int]:
        """`commit` in bounded steps (yields the keys each step looked at): one step but
        for an additive staging, whose drop of the entries no piece named goes a few
        index shards (a store that marks) or a batch of the store's keys at a time."""
        mark = self._mark
        if mark is not None:
            self._mark = None
            yield from mark.drop_steps()
            self.commit()  # the staged SWA content
            yield 0
            return
        marks = self._marks
        if marks is None:
            self.commit()
            yield 0
            return
        store, engine = self._tables.store, self._engine
        for shard in store.exact_keys(Table.GLOBAL, engine):
            # a shard at a time, checked in slices: a 20M-block index's shard (~5k
            # keys) was a 3.7 ms step, a slice of `_DROP_SLICE` is under a millisecond
            for i in range(0, len(shard), _DROP_SLICE):
                keys = shard[i : i + _DROP_SLICE]
                gone = marks.missing(keys)
                if gone:
                    store.remove(Table.GLOBAL, engine, gone)  # type: ignore[arg-type]
                yield len(keys)
        vouched = self._swa_marks
        for shard in store.exact_keys(Table.SWA, engine):
            for i in range(0, len(shard), _DROP_SLICE):
                unvouched = [k for k in shard[i : i + _DROP_SLICE] if k not in vouched]
                if unvouched:
                    store.remove(Table.SWA, engine, unvouched)
                yield min(_DROP_SLICE, len(shard) - i)
        self._marks = None
        while marks.release(RELEASE_BYTES) <= 0:
            yield 0  # the marks (every key the parts named: 20M, ~600 MB) freed in steps
        self._confirm_pending()

    def commit(self) -> None:
        if self._marks is not None or self._mark is not None:
            deque(self.commit_steps(), maxlen=0)  # every step, now
            return
        tables, engine, now = self._tables, self._engine, self._now
        if self._staged is not None:
            for staging in self._staged.values():
                staging.commit()
        else:
            for table, entries in self._collected.items():
                tables.store.replace_exact(table, engine, entries, now)
        self._confirm_pending()

    def _confirm_pending(self) -> None:
        tables, engine, now = self._tables, self._engine, self._now
        # holds on keys the snapshot lists are confirmed; the others wait for a delta
        get = tables.store.get
        tables.pending.confirm_present(
            engine, lambda table, key: get(table, engine, key, now, False) is not None
        )


class _SizeCollector(Collector):
    """`ramjet_residency_entries{table}` read from the store at scrape time."""

    def __init__(self, tables: ResidencyTables) -> None:
        self._tables = tables

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fam = family("ramjet_residency_entries")
        for table in Table:
            fam.add_metric([table.value], float(self._tables.size(table)))
        yield fam
        yield family("ramjet_residency_pending_entries", float(self._tables.pending.size()))
        own = self._tables._own
        if own is not None:
            yield family("ramjet_residency_global_cap_entries", float(own.cap(Table.GLOBAL)))
            capped = family("ramjet_residency_capped")
            for engine in sorted(own.capped):
                capped.add_metric([engine], 1.0)
            yield capped
