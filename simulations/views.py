"""Residency views over simulated state: what a router knows about each engine.

All implement `ramjet.policy.base.ResidencyView`, so the router's own policy objects run
on them unchanged.

- `ExactResidency`: the engine's caches as they are (what authenticated reports give).
- `LocalResidency`: shared fabric only, the engine's own HBM and queue, not the pools
  (a peer that knows no tiers).
- `HbmOnlyResidency`: only blocks in HBM, stopping at the first block that is not: an
  event feed that forgets a prefix once its GPU copy is evicted or demoted.
- `RoutedIndex`: the router's own routing, per engine: every block of a routed request
  is assumed resident there from the moment of routing, forgotten by LRU past
  `capacity_tokens` and/or `ttl_s` after it was last routed. It never learns of the
  engine's own evictions (the staleness that approximate modes live with).

Engine load is the router's own `EngineLoad` (`ramjet.policy.base`), built by the
simulator from engine state.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from ramjet.policy.base import GlobalMatch
from ramjet.types import PrefixKey
from simulations.cache import HBM, SwaPool, TieredCache
from simulations.fabric import FabricCache


class Clock:
    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0


_NONE = GlobalMatch()


class ExactResidency:
    """The caches, plus the blocks of requests queued on the engine (`pending`): they
    will be in HBM before a request routed now starts (FCFS), and the engine knows them."""

    __slots__ = ("cache", "clock", "pending", "swa")

    def __init__(
        self,
        cache: TieredCache | FabricCache,
        swa: SwaPool,
        clock: Clock,
        pending: dict[PrefixKey, int],
    ) -> None:
        self.cache, self.swa, self.clock, self.pending = cache, swa, clock, pending

    def global_match(
        self, block_keys: Sequence[PrefixKey], block_tokens: Sequence[int]
    ) -> GlobalMatch:
        where, pending = self.cache.where, self.pending
        counts = [0, 0, 0]
        for i, k in enumerate(block_keys):
            t = where.get(k)
            if t is None:
                if k not in pending:
                    break
                t = HBM
            counts[t] += block_tokens[i]
        if counts[0] == counts[1] == counts[2] == 0:
            return _NONE
        return GlobalMatch(counts[0], counts[1], counts[2])

    def swa_match(self, boundary_keys: Sequence[tuple[int, PrefixKey]]) -> int:
        return self.swa.match(boundary_keys, self.clock.now)


class LocalResidency:
    """Shared fabric, a peer that knows no tiers: the engine's own HBM and queue, not the
    pools (its engine still pulls from them on a miss)."""

    __slots__ = ("cache", "pending")

    def __init__(self, cache: FabricCache, pending: dict[PrefixKey, int]) -> None:
        self.cache, self.pending = cache, pending

    def global_match(
        self, block_keys: Sequence[PrefixKey], block_tokens: Sequence[int]
    ) -> GlobalMatch:
        hbm, pending = self.cache.hbm, self.pending
        n = 0
        for i, k in enumerate(block_keys):
            if k not in hbm and k not in pending:
                break
            n += block_tokens[i]
        return GlobalMatch(n) if n else _NONE

    def swa_match(self, boundary_keys: Sequence[tuple[int, PrefixKey]]) -> int:
        return 0


class HbmOnlyResidency:
    __slots__ = ("cache",)

    def __init__(self, cache: TieredCache | FabricCache) -> None:
        self.cache = cache

    def global_match(
        self, block_keys: Sequence[PrefixKey], block_tokens: Sequence[int]
    ) -> GlobalMatch:
        where = self.cache.where
        n = 0
        for i, k in enumerate(block_keys):
            if where.get(k) != HBM:
                break
            n += block_tokens[i]
        return GlobalMatch(n) if n else _NONE

    def swa_match(self, boundary_keys: Sequence[tuple[int, PrefixKey]]) -> int:
        return 0


class RoutedIndex:
    """Approximate residency from the router's own routing (see module docstring)."""

    __slots__ = ("block", "capacity", "clock", "entries", "max_match_tokens", "ttl_s")

    def __init__(
        self,
        clock: Clock,
        block_tokens: int,
        *,
        capacity_tokens: int | None = None,
        ttl_s: float | None = None,
        max_match_tokens: int | None = None,
    ) -> None:
        self.clock = clock
        self.block = block_tokens
        self.capacity = None if capacity_tokens is None else max(1, capacity_tokens // block_tokens)
        self.ttl_s = ttl_s
        self.max_match_tokens = max_match_tokens
        self.entries: OrderedDict[PrefixKey, float] = OrderedDict()

    def routed(self, block_keys: Sequence[PrefixKey]) -> None:
        entries, now = self.entries, self.clock.now
        for k in reversed(block_keys):
            entries[k] = now
            entries.move_to_end(k, last=False)
        cap = self.capacity
        if cap is not None:
            while len(entries) > cap:
                entries.popitem(last=True)

    def global_match(
        self, block_keys: Sequence[PrefixKey], block_tokens: Sequence[int]
    ) -> GlobalMatch:
        entries = self.entries
        oldest = -1.0 if self.ttl_s is None else self.clock.now - self.ttl_s
        limit = self.max_match_tokens
        n = 0
        for i, k in enumerate(block_keys):
            t = entries.get(k)
            if t is None or t < oldest:
                break
            n += block_tokens[i]
            if limit is not None and n >= limit:
                n = limit
                break
        return GlobalMatch(n) if n else _NONE

    def swa_match(self, boundary_keys: Sequence[tuple[int, PrefixKey]]) -> int:
        return 0
