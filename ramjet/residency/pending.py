"""`PendingOverlay`: residency of requests the router has sent but no report confirms yet.

Why. A report-fed (exact) view only learns of a prompt's blocks once the engine has
prefilled them and reported. A continuation that arrives while its parent still waits
or prefills on engine e would see nothing on e and be recomputed elsewhere; engines are
FIFO per request, so by the time the continuation starts on e the parent's blocks are in
HBM there. In simulation, without this overlay the `tier_aware` candidate lost to SMG by
27% at high load for exactly that reason (`simulations/views.py`, `ExactResidency`).

What. When the router forwards a request to engine e, `add(e, blocks, swa_key, now)`
holds its block keys (as HBM) and its final message-boundary key (as live SWA) on e, and
returns a `PendingTicket`. A hold disappears when:

- a report confirms or contradicts it: the engine reports the key stored, evicted or
  expired, a snapshot of the engine lists it, or the engine starts a new epoch
  (`confirm`, `confirm_present`, `purge`). From then on the exact tables alone say
  what the engine holds; a pending hold never resurrects a key a report evicted;
- its ticket expires (`ttl_s` after `add`; `expire(now)`, which the view calls);
- its request fails or moves to another engine (`release(ticket)`).

Several in-flight requests may hold one key (a parent and its continuation): a hold is
reference counted, so a failed parent leaves the continuation's hold in place.

Contract. Readers (`ramjet.residency.tables.EngineResidencyView`) consult a hold only
where the store has no live exact entry (approximate entries, for engines without
reports, keep their own precedence): pending never overrides exact, and it is reported
apart (`GlobalMatch.pending`, the policies' `pending_tokens`). Holds live only here:
never in the store, so never in a snapshot, an export, the Redis mirror or
`ramjet_residency_entries` (they have their own gauge). Memory is bounded: at most
`max_entries` (engine, key) holds across both tables; adding past it drops the oldest
tickets whole, and a single ticket larger than the cap keeps its first keys (a prefix is
what a match can use).

Local to a router replica (not shared through Redis): a hold lives for seconds and
changes on every request, so sharing it would put a Redis write on the request path or
lag it by a sync interval comparable to its life; a crashed replica would leave orphan
holds behind; and the other replicas do not see this replica's in-flight load either,
only the engines' reports, which carry the confirmed state within one report interval.

Not thread-safe: the router's event loop calls it. Times are seconds of the tables'
monotonic clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from ramjet.residency.store import Table
from ramjet.types import EngineId, PrefixKey


class _Hold:
    """One (table, engine, key) held by `count` live tickets."""

    __slots__ = ("count", "key")

    def __init__(self, key: PrefixKey) -> None:
        self.key = key
        self.count = 0


class PendingTicket:
    """One forwarded request's holds on one engine (see the module docstring)."""

    __slots__ = ("blocks", "engine", "expires_at", "holds", "swa_key")

    def __init__(
        self,
        engine: EngineId,
        blocks: tuple[PrefixKey, ...],
        swa_key: PrefixKey | None,
        expires_at: float,
    ) -> None:
        self.engine = engine
        self.blocks = blocks
        """The request's block keys (kept whole, so the request can move engines)."""
        self.swa_key = swa_key
        self.expires_at = expires_at
        self.holds: list[tuple[Table, _Hold]] = []
        """Empty once released or expired."""

    @property
    def live(self) -> bool:
        return bool(self.holds)


class PendingOverlay:
    """Reference-counted pending holds per (table, engine, key); see the module docstring."""

    def __init__(self, ttl_s: float, max_entries: int) -> None:
        if ttl_s <= 0:
            raise ValueError("pending ttl_s must be positive")
        if max_entries < 1:
            raise ValueError("pending max_entries must be at least 1")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._holds: dict[Table, dict[EngineId, dict[PrefixKey, _Hold]]] = {t: {} for t in Table}
        # tickets in the order they were added: with one TTL that is expiry order
        self._tickets: OrderedDict[int, PendingTicket] = OrderedDict()
        self._size = 0

    # -- writing ----------------------------------------------------------------------

    def add(
        self,
        engine: EngineId,
        blocks: Sequence[PrefixKey],
        swa_key: PrefixKey | None,
        now: float,
    ) -> PendingTicket:
        """Hold `blocks` (global, HBM) and `swa_key` (SWA) on `engine` until `now + ttl_s`."""
        self.expire(now)
        ticket = PendingTicket(engine, tuple(blocks), swa_key, now + self.ttl_s)
        room = self.max_entries
        keys: list[tuple[Table, PrefixKey]] = []
        if swa_key is not None:
            keys.append((Table.SWA, swa_key))
        keys.extend((Table.GLOBAL, k) for k in ticket.blocks)
        del keys[room:]  # a ticket over the whole cap keeps its SWA key and first blocks
        for table, key in keys:
            hold = self._holds[table].get(engine, {}).get(key)
            if hold is None:
                if self._size >= self.max_entries:
                    self._drop_oldest()  # may empty and drop this engine's map
                hold = self._holds[table].setdefault(engine, {})[key] = _Hold(key)
                self._size += 1
            hold.count += 1
            ticket.holds.append((table, hold))
        if ticket.holds:
            self._tickets[id(ticket)] = ticket
        return ticket

    def release(self, ticket: PendingTicket) -> None:
        """The ticket's request failed or left the engine: drop its holds (idempotent)."""
        self._tickets.pop(id(ticket), None)
        self._unhold(ticket)

    def confirm(self, table: Table, engine: EngineId, keys: Iterable[PrefixKey]) -> None:
        """A report names these keys on `engine` (stored, moved, evicted or expired): the
        exact tables speak for them from now on."""
        by_key = self._holds[table].get(engine)
        if not by_key:
            return
        for key in keys:
            hold = by_key.pop(key, None)
            if hold is not None:
                self._detach(hold)

    def confirm_present(
        self, engine: EngineId, present: Callable[[Table, PrefixKey], bool]
    ) -> None:
        """A snapshot was applied: drop the engine's holds on keys it now lists."""
        for table in Table:
            by_key = self._holds[table].get(engine)
            if by_key:
                self.confirm(table, engine, [k for k in by_key if present(table, k)])

    def purge(self, engine: EngineId) -> None:
        """The engine started a new epoch (or left): drop all its holds."""
        for table in Table:
            by_key = self._holds[table].pop(engine, None)
            if by_key:
                for hold in by_key.values():
                    self._detach(hold)

    def expire(self, now: float) -> int:
        """Release tickets whose TTL has passed; return how many."""
        n = 0
        tickets = self._tickets
        while tickets:
            ticket = next(iter(tickets.values()))
            if ticket.expires_at > now:
                break
            tickets.popitem(last=False)
            self._unhold(ticket)
            n += 1
        return n

    # -- reading ----------------------------------------------------------------------

    def holds(self, table: Table, engine: EngineId) -> dict[PrefixKey, _Hold] | None:
        """The engine's live holds in `table` (read-only to the caller), None if none.
        Call `expire(now)` first for an answer fixed at `now`."""
        return self._holds[table].get(engine) or None

    def size(self) -> int:
        """(table, engine, key) holds kept, across both tables."""
        return self._size

    def tickets(self) -> int:
        return len(self._tickets)

    # -- internals ----------------------------------------------------------------------

    def _detach(self, hold: _Hold) -> None:
        # the hold left its map; tickets that still point at it decrement it harmlessly
        hold.count = 0
        self._size -= 1

    def _unhold(self, ticket: PendingTicket) -> None:
        for table, hold in ticket.holds:
            if hold.count == 0:
                continue  # confirmed or purged already
            hold.count -= 1
            if hold.count == 0:
                by_key = self._holds[table].get(ticket.engine)
                if by_key is not None and by_key.get(hold.key) is hold:
                    del by_key[hold.key]
                    self._size -= 1
                    if not by_key:
                        del self._holds[table][ticket.engine]
        ticket.holds = []

    def _drop_oldest(self) -> None:
        """Make room for one hold: release the oldest tickets until a hold is freed."""
        target = self._size - 1
        while self._tickets and self._size > target:
            _, ticket = self._tickets.popitem(last=False)
            self._unhold(ticket)
