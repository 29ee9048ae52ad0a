"""An engine's caches: tiered global KV (HBM → host → SSD → gone) and the SWA pool.

Global KV. Capacities are in tokens (bytes available / bytes per token, see `plan`). A
block is charged its full block size. Each tier is an LRU (OrderedDict, oldest first).
`touch(keys)` makes a request's blocks most recent in HBM, promoting any held lower
(the restore), walking the keys from last to first so that a prefix's earlier blocks are
always at least as recent as its later ones: eviction then takes a prefix's tail first,
tiers stay ordered along positions (HBM, then host, then SSD), and a resident block
implies its predecessors. An HBM overflow demotes the least recent block to host, a
host overflow to SSD, an SSD overflow evicts it. The 72 h expiry is longer than any
trace and is not modelled.

SWA pool: key → expiry time, LRU by insertion; capped in sequences (byte cap / bytes
per sequence); an entry lives `ttl_s` after it was stored or last used.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from ramjet.types import PrefixKey

HBM, HOST, SSD = 0, 1, 2


class TieredCache:
    """Global-KV blocks of one engine (or, for the oracle, of the whole fleet)."""

    __slots__ = ("block", "capacity", "demotions", "evictions", "lru", "where")

    def __init__(
        self, hbm_tokens: int, host_tokens: int, ssd_tokens: int, block_tokens: int
    ) -> None:
        if block_tokens <= 0:
            raise ValueError("block_tokens must be positive")
        self.block = block_tokens
        # capacity in blocks per tier
        self.capacity = [max(0, t // block_tokens) for t in (hbm_tokens, host_tokens, ssd_tokens)]
        self.lru: list[OrderedDict[PrefixKey, None]] = [OrderedDict(), OrderedDict(), OrderedDict()]
        self.where: dict[PrefixKey, int] = {}
        self.demotions = 0
        self.evictions = 0

    def match(self, keys: Sequence[PrefixKey], tokens: Sequence[int]) -> tuple[int, int, int]:
        """Longest resident prefix in tokens by tier (hbm, host, ssd)."""
        where = self.where
        counts = [0, 0, 0]
        for i, k in enumerate(keys):
            t = where.get(k)
            if t is None:
                break
            counts[t] += tokens[i]
        return counts[0], counts[1], counts[2]

    def matched_blocks(self, keys: Sequence[PrefixKey]) -> int:
        where = self.where
        n = 0
        for k in keys:
            if k not in where:
                break
            n += 1
        return n

    def touch(self, keys: Sequence[PrefixKey]) -> None:
        """Make `keys` most recent in HBM (promoting restored blocks), then rebalance."""
        where = self.where
        lru = self.lru
        hbm = lru[HBM]
        for k in reversed(keys):
            t = where.get(k)
            if t is None or t != HBM:
                if t is not None:
                    del lru[t][k]
                where[k] = HBM
                hbm[k] = None
            hbm.move_to_end(k, last=False)
        self._rebalance()

    def _rebalance(self) -> None:
        # touch() put the newest keys at the *front* (first = most recent) of HBM;
        # the least recent entries therefore sit at the end of each tier.
        lru, cap, where = self.lru, self.capacity, self.where
        for tier in (HBM, HOST, SSD):
            od = lru[tier]
            while len(od) > cap[tier]:
                k, _ = od.popitem(last=True)
                if tier == SSD:
                    del where[k]
                    self.evictions += 1
                else:
                    where[k] = tier + 1
                    lru[tier + 1][k] = None
                    lru[tier + 1].move_to_end(k, last=False)
                    self.demotions += 1

    def used_blocks(self, tier: int) -> int:
        return len(self.lru[tier])

    def utilization(self) -> float:
        cap = self.capacity[HBM]
        return len(self.lru[HBM]) / cap if cap else 1.0


class SwaPool:
    """Live SWA states: key → expiry, capped in sequences, refreshed on use."""

    __slots__ = ("capacity", "entries", "evictions", "ttl_s")

    def __init__(self, capacity_sequences: int, ttl_s: float) -> None:
        self.capacity = max(0, capacity_sequences)
        self.ttl_s = ttl_s
        self.entries: OrderedDict[PrefixKey, float] = OrderedDict()
        self.evictions = 0

    def live(self, key: PrefixKey, now: float) -> bool:
        exp = self.entries.get(key)
        return exp is not None and exp > now

    def match(self, boundaries: Sequence[tuple[int, PrefixKey]], now: float) -> int:
        """Offset of the furthest boundary with live SWA state, else 0."""
        entries = self.entries
        for off, k in reversed(boundaries):
            exp = entries.get(k)
            if exp is not None and exp > now:
                return off
        return 0

    def match_upto(
        self, boundaries: Sequence[tuple[int, PrefixKey]], now: float, limit: int
    ) -> int:
        """Offset of the furthest boundary at or before `limit` tokens with live SWA
        state, else 0: the state an engine can resume from when it holds the global
        prefix only up to `limit` (a state further out needs KV it does not have)."""
        entries = self.entries
        for off, k in reversed(boundaries):
            if off > limit:
                continue
            exp = entries.get(k)
            if exp is not None and exp > now:
                return off
        return 0

    def store(self, key: PrefixKey, now: float) -> None:
        entries = self.entries
        entries[key] = now + self.ttl_s
        entries.move_to_end(key)
        # expired entries first (they are oldest), then the byte cap
        while entries:
            k, exp = next(iter(entries.items()))
            if exp > now and len(entries) <= self.capacity:
                break
            del entries[k]
            if exp > now:
                self.evictions += 1
