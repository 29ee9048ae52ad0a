"""Resuming a prompt from the caches, and storing what its prefill produced.

Restore (before prefill), for a prompt of L tokens with block keys k_0..k_{n-1} and
message-boundary keys (b_j, key_j), block size T (= the router's 256-byte blocks):

1. G = the resident global-KV blocks: the longest prefix k_0..k_{G-1} in any tier,
   capped so that at least one prompt token is left to prefill (the first output needs
   the last position's logits): G <= (L - 1) // T.
2. S = the longest message boundary b < L whose SWA state is pooled and whose blocks
   below it (b // T of them) are resident.
3. Choose:
   - SWA resume at S: fetch blocks 0..S//T-1, rebuild the state from them
     (`state_from_global`), import the pooled tail (`import_tail`): exact, no replay.
   - Bounded replay at G*T: fetch G blocks, rebuild, replay the last window of tokens
     before G*T (`replay`): approximate window, costs a replay of `window` tokens.
   The SWA resume wins unless the replay path skips more than a window's worth of
   prefill (G*T - S > window); the replay floor is about a window of prefill.
   - Neither: a fresh state, full prefill.

Shared pools (`engine_stub.shared_pool`, ARCHITECTURE 5b). With a shared global-KV pool,
G extends past the engine's own blocks by the blocks the pool holds next (read from the
pool, then kept in HBM); with a shared SWA pool, S may be a state another engine pooled.
What came from a pool is counted apart (`pool_tokens`, `pool_swa_tokens`, `pool_io_ms`,
`pools`).

Store (after the whole prompt is prefilled): export every full block the store lacks
(`export_global`) and pool the SWA tail at the prompt's end boundary key; with shared
pools, both are also written through to them at once (in the background).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from engine_stub.kvstore import GlobalKVStore
from engine_stub.shared_pool import SharedKV, SharedSWA
from engine_stub.swa_pool import SWAPool
from ramjet.decisions.prompt_work import PromptWork
from ramjet.keys.prefix import PrefixKeys


class CacheableModel(Protocol):
    """The part of `engine_stub.model.MiniV4` the caches use."""

    def new_state(self) -> Any: ...
    def export_global(self, state: Any, start: int, end: int) -> bytes: ...
    def state_from_global(self, blobs: list[bytes], n_tokens: int) -> Any: ...
    def export_tail(self, state: Any) -> bytes: ...
    def import_tail(self, state: Any, tail: bytes) -> None: ...
    def replay(self, state: Any, ids: list[int]) -> Any: ...


class PromptCache:
    def __init__(
        self,
        model: CacheableModel,
        kv: GlobalKVStore,
        swa: SWAPool,
        *,
        window: int,
        shared_kv: SharedKV | None = None,
        shared_swa: SharedSWA | None = None,
    ) -> None:
        self.model = model
        self.kv = kv
        self.swa = swa
        self.window = window
        self.block = kv.block_tokens
        self.shared_kv = shared_kv
        self.shared_swa = shared_swa

    def restore(self, ids: list[int], keys: PrefixKeys, work: PromptWork) -> tuple[Any, int]:
        """A model state holding the longest reusable prefix of `ids`, and its length.
        Fills `work`'s tier, pool, SWA, replay and restore-time fields."""
        t0 = time.perf_counter()
        length = len(ids)
        cap = max(0, (length - 1) // self.block)
        tiers = self.kv.lookup(keys.blocks[:cap])
        own = len(tiers)
        pulled: list[bytes] = []
        if self.shared_kv is not None and own < cap:
            got = self.shared_kv.read_prefix(keys.blocks[own:cap], first_depth=own)
            pulled = got.blobs
            if pulled:
                self._pool_read(work, self.shared_kv.pool_id, 0, got.nbytes, got.seconds)
        g = own + len(pulled)
        swa_at, swa_tail, from_pool = 0, b"", False
        for off, bkey in reversed(keys.boundaries):
            if off >= length or off // self.block > g or off <= 0:
                continue
            entry = self.swa.get(bkey)
            if entry is not None and entry.n_tokens == off:
                swa_at, swa_tail = off, entry.tail
                break
            if self.shared_swa is not None:
                hit = self.shared_swa.get(bkey, off)
                if hit is not None:
                    swa_at, swa_tail, from_pool = off, hit[0], True
                    self._pool_read(work, self.shared_swa.pool_id, off, len(hit[0]), hit[1])
                    break
        state: Any
        if swa_tail and g * self.block - swa_at <= self.window:
            nb = swa_at // self.block
            state = self._from_blocks(keys, nb, own, pulled, work)
            self.model.import_tail(state, swa_tail)
            work.swa_tokens = swa_at - nb * self.block
            work.pool_swa_tokens = swa_at if from_pool else 0
            start = swa_at
        elif g > 0:
            start = g * self.block
            state = self._from_blocks(keys, g, own, pulled, work)
            lo = max(0, start - self.window)
            self.model.replay(state, ids[lo:start])
            work.replayed_tokens = start - lo
        else:
            state, start = self.model.new_state(), 0
        if self.shared_swa is not None and self.shared_swa.pool_id in work.pools:
            work.pools[self.shared_swa.pool_id]["tokens"] = work.pool_swa_tokens  # 0: unused
        work.restore_ms = (time.perf_counter() - t0) * 1e3
        return state, start

    @staticmethod
    def _pool_read(work: PromptWork, pool: str, tokens: int, nbytes: int, seconds: float) -> None:
        ms = seconds * 1e3
        work.pools[pool] = {"tokens": tokens, "bytes": nbytes, "ms": round(ms, 4)}
        work.pool_io_ms += ms
        work.restore_io_ms += ms

    def _from_blocks(
        self, keys: PrefixKeys, n_blocks: int, own: int, pulled: list[bytes], work: PromptWork
    ) -> Any:
        """The state of the first `n_blocks` blocks: the engine's own `own` blocks from
        its tiers, the rest from `pulled` (read from the shared pool), which are then kept
        in the engine's tiers as blocks it computed would be."""
        if n_blocks == 0:
            return self.model.new_state()
        local = min(n_blocks, own)
        blobs: list[bytes] = []
        if local:
            got = self.kv.fetch(keys.blocks[:local])
            work.hbm_tokens, work.host_tokens, work.ssd_tokens = got.tokens_by_tier
            work.restore_io_ms += sum(got.seconds_by_tier) * 1e3
            blobs = got.blobs
        extra = pulled[: n_blocks - local]
        if extra:
            work.pool_tokens = len(extra) * self.block
            if self.shared_kv is not None:
                work.pools[self.shared_kv.pool_id]["tokens"] = work.pool_tokens
            self.kv.put_many(list(zip(keys.blocks[local:n_blocks], extra, strict=True)))
        return self.model.state_from_global(blobs + extra, n_blocks * self.block)

    def store(self, state: Any, ids: list[int], keys: PrefixKeys) -> None:
        """Export the prompt's new full blocks and pool its end-of-prompt SWA state."""
        items = []
        for i, key in enumerate(keys.blocks):
            if self.kv.tier_of(key) is None:
                blob = self.model.export_global(state, i * self.block, (i + 1) * self.block)
                items.append((key, blob))
        self.kv.put_many(items)
        if self.shared_kv is not None and keys.blocks:  # a use of the chain, new or not
            self.shared_kv.publish(items, chain=keys.blocks)
        if keys.boundaries:
            off, bkey = keys.boundaries[-1]
            if off == len(ids):
                tail = self.model.export_tail(state)
                self.swa.put(bkey, off, tail)
                if self.shared_swa is not None:
                    self.shared_swa.publish(bkey, off, tail)
