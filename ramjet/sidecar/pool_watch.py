"""A shared pool's holdings as the pool's own signed reports (issue 30/31, protocol
section 9): the pool is a reporting identity, and this is its reporter.

`PoolWatcher` lists a `kvpool` directory (the pool that reference engines and our vLLM
connector publish KV blocks into), maps each pool key to a router prefix key, and feeds
a `ReportPublisher` whose engine id is the pool's id: a delta of what was stored and
evicted since its last scan, and, on request, a snapshot of the whole pool. Routers pull
the pool's reports like any engine's (`reports.engines.<pool id>`), verify them with the
pool's keys and keep the pool's residency once, under its id
(`ramjet.fleet.views`, `EngineView.pools`).

Keys. A pool key is a hex string. `router_key_of` maps it to the router's `PrefixKey`:
for the reference engine, whose token blocks are the router's key blocks, the pool key is
the 16-hex-digit router key itself (`hex_router_key`); for vLLM, whose pool keys are its
block hashes (SHA-256, hex), `VllmPoolKeys` reads the metadata our connector publishes
beside each block (parent hash, token ids), checks that they hash to the key, and
chains the router's token-block keys from them, as the sidecar does from KV events. A
key that does not map is skipped and counted (`unmapped`), never guessed.

SWA pools (`tier="swa"`): each file is an SWA state at a boundary key, live `swa_ttl_s`
after its last use (the file's mtime, touched by every read and re-publish). A state is
reported `swa_created` with the TTL left when it appears or is used again, and
`swa_expired` when it is gone or idle past the TTL.

Freshness: a scan that finds nothing new still publishes an empty delta once
`heartbeat_s` has passed since the last report, so routers keep the pool's trust EXACT
(`reports.stale_after_s`) while it is quiet.

Scans run in a thread (`asyncio.to_thread`): listing a pool of millions of blocks is a
directory walk, kept off the event loop. Publishing is thread-safe.

`ramjet pool-reporter` (`ramjet.commands.pool_reporter`) runs one watcher and serves its
reports over HTTP; `KEY_MAPS` names the key maps it offers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Literal

from kvpool import Pool
from ramjet.keys.tokens import chain_keys, token_key_seed
from ramjet.reports.bodies import MAX_KEYS_PER_LIST, DeltaBuilder, SwaStates, TierKeys
from ramjet.reports.publisher import ReportPublisher
from ramjet.runtime.tasks import cancel_and_wait
from ramjet.sidecar.engine_hashes import (
    HASH_FUNCTIONS,
    VLLM_DEFAULT_NONE_HASH_SEED,
    VllmHashAlgo,
    vllm_none_hash,
)
from ramjet.types import PrefixKey, Tier

log = logging.getLogger(__name__)

KeyMap = Callable[[str], PrefixKey | None]


def hex_router_key(key: str) -> PrefixKey | None:
    """A pool key that is a router key written as 16 hex digits (the reference engine's)."""
    if len(key) != 16:
        return None
    try:
        return PrefixKey(int(key, 16))
    except ValueError:
        return None


class VllmPoolKeys:
    """The key map of a pool that vLLM engines write through our connector
    (`connectors/vllm_pool`): pool key = vLLM block hash (hex digest), and beside each
    block `meta/<key>` = {"parent": parent hash hex or null, "tokens": [...], "extra":
    bool} (`vllm_pool.connector.block_meta`).

    A key maps to the router's token-block key of its tokens, chained from its parent's
    router key (from `token_key_seed(model)` for a first block), so it equals the key
    the router computes for the same prompt and the key the sidecar reports for the
    engine's own copy. It maps only when the metadata proves it: the key must equal
    vLLM's hash of (parent hash or NONE_HASH, tokens, no extra keys) with `algo` (the
    engines' `--prefix-caching-hash-algo`) and `none_hash_seed` (PYTHONHASHSEED when the
    engines set it, else vLLM's fixed default). Skipped and counted, in `stats` (per
    scan): `no_meta` (no metadata: written without, or evicted since the listing),
    `bad_meta`, `hash_mismatch`, `extra_keys` (LoRA, multimodal, prompt embeddings,
    cache salt: keys the router cannot compute), `unknown_parent` (the parent left the
    pool before this map saw it, or did not map), `block_size` (tokens other than
    `block_tokens`).

    Mappings are kept across scans for keys still held (a block whose parent was
    evicted since keeps its key); `begin_scan` (called by `PoolWatcher.scan`) drops
    those of keys the last scan no longer saw and resets `stats`.
    """

    def __init__(
        self,
        pool: Pool,
        model: str,
        block_tokens: int,
        algo: VllmHashAlgo = "sha256_cbor",
        none_hash_seed: str = VLLM_DEFAULT_NONE_HASH_SEED,
    ) -> None:
        if block_tokens <= 0:
            raise ValueError("block_tokens must be positive")
        if algo not in ("sha256", "sha256_cbor"):
            raise ValueError(
                f"a shared vLLM pool needs a cryptographic hash (sha256, sha256_cbor), not {algo!r}"
            )
        self.pool = pool
        self.block_tokens = block_tokens
        self._hash = HASH_FUNCTIONS[algo]
        self._none_hash = vllm_none_hash(algo, none_hash_seed)
        self._seed = token_key_seed(model)
        self._keys: dict[str, PrefixKey] = {}
        self._seen: set[str] = set()
        self.stats: Counter[str] = Counter()

    def begin_scan(self) -> None:
        self._keys = {k: v for k, v in self._keys.items() if k in self._seen}
        self._seen = set()
        self.stats = Counter()

    def __call__(self, key: str) -> PrefixKey | None:
        self._seen.add(key)
        out, why = self._resolve(key)
        if out is None:
            self.stats[why] += 1
        return out

    def _resolve(self, key: str) -> tuple[PrefixKey | None, str]:
        """(router key, "") or (None, why); walks up unmapped parents iteratively."""
        chain: list[tuple[str, list[int]]] = []  # (key, tokens) from `key` up
        parent_key: int | None = None
        k: str | None = key
        while k is not None:
            known = self._keys.get(k)
            if known is not None:
                parent_key = known
                break
            raw = self.pool.meta(k)
            if raw is None:
                return None, "no_meta" if k == key else "unknown_parent"
            parsed = _parse_meta(raw)
            if parsed is None:
                return None, "bad_meta" if k == key else "unknown_parent"
            parent, tokens, extra = parsed
            if extra:
                return None, "extra_keys" if k == key else "unknown_parent"
            if len(tokens) != self.block_tokens:
                return None, "block_size" if k == key else "unknown_parent"
            prev = self._none_hash if parent is None else bytes.fromhex(parent)
            if self._hash((prev, tuple(tokens), None)).hex() != k:
                return None, "hash_mismatch" if k == key else "unknown_parent"
            chain.append((k, tokens))
            if parent is None:
                parent_key = self._seed
            k = parent
        assert parent_key is not None
        out = PrefixKey(parent_key)
        for k, tokens in reversed(chain):
            out = chain_keys(tokens, out, self.block_tokens)[0]
            self._keys[k] = out
            self._seen.add(k)
        return out, ""


def _parse_meta(raw: bytes) -> tuple[str | None, list[int], bool] | None:
    try:
        m = json.loads(raw)
        parent, tokens, extra = m["parent"], m["tokens"], m["extra"]
    except (ValueError, KeyError, TypeError):
        return None
    if parent is not None and not (isinstance(parent, str) and _is_hex(parent)):
        return None
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in tokens
    ):
        return None
    if not isinstance(extra, bool):
        return None
    return parent, tokens, extra


def _is_hex(s: str) -> bool:
    try:
        bytes.fromhex(s)
    except ValueError:
        return False
    return len(s) % 2 == 0 and s == s.lower()


KEY_MAPS: dict[str, KeyMap] = {"hex": hex_router_key}
"""Key maps by name (`ramjet pool-reporter --key-map`): another engine's pool registers
its own here, or passes a `KeyMap` to `PoolWatcher` directly. A vLLM pool's map needs
the pool and the model (`VllmPoolKeys`): the reporter builds it (`--key-map vllm`)."""


class PoolWatcher:
    """The reporter of one pool (module docstring). `tier`: the pool's tier as reported
    (host or SSD), or "swa" for a pool of SWA states (live `swa_ttl_s` after last use)."""

    def __init__(
        self,
        pool: Pool,
        publisher: ReportPublisher,
        tier: Tier | Literal["swa"],
        router_key_of: KeyMap = hex_router_key,
        interval_s: float = 0.5,
        *,
        swa_ttl_s: float = 60.0,
        heartbeat_s: float = 2.0,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if tier not in (Tier.HOST, Tier.SSD, "swa"):
            raise ValueError("a pool of global KV is reported as host or ssd, an SWA pool as swa")
        if not interval_s > 0:
            raise ValueError("interval_s must be > 0")
        if not swa_ttl_s > 0 or not heartbeat_s > 0:
            raise ValueError("swa_ttl_s and heartbeat_s must be > 0")
        self.pool = pool
        self.publisher = publisher
        self.tier = tier
        self.router_key_of = router_key_of
        self.interval_s = interval_s
        self.swa_ttl_s = swa_ttl_s
        self.heartbeat_s = heartbeat_s
        self._wall = wall_clock
        self._held: dict[PrefixKey, float] = {}
        """Router key -> the block's last use (mtime; SWA pools only, else 0)."""
        self._lock = threading.Lock()
        self._last_publish = float("-inf")
        self.unmapped = 0
        """Pool keys seen that map to no router key (skipped)."""
        self.scans = 0
        self._task: asyncio.Task[None] | None = None

    def held(self) -> frozenset[PrefixKey]:
        """The router keys of the pool's blocks (live SWA states) as of the last scan."""
        with self._lock:
            return frozenset(self._held)

    def _list(self) -> tuple[dict[PrefixKey, float], int]:
        now: dict[PrefixKey, float] = {}
        unmapped = 0
        if self.tier == "swa":
            wall = self._wall()
            for info in self.pool.listing():
                k = self.router_key_of(info.key)
                if k is None:
                    unmapped += 1
                elif wall - info.last_used < self.swa_ttl_s:
                    now[k] = info.last_used
        else:
            for key in self.pool.held_keys():
                k = self.router_key_of(key)
                if k is None:
                    unmapped += 1
                else:
                    now[k] = 0.0
        return now, unmapped

    def scan(self) -> int:
        """List the pool once and publish what changed since the last scan as deltas
        (in lists of at most `MAX_KEYS_PER_LIST` keys); returns the keys changed."""
        begin = getattr(self.router_key_of, "begin_scan", None)
        if begin is not None:  # a key map that keeps state between scans (VllmPoolKeys)
            begin()
        now, unmapped = self._list()
        with self._lock:
            stored = sorted(k for k, used in now.items() if self._held.get(k) != used)
            evicted = sorted(k for k in self._held if k not in now)
            self._held = now
            self.unmapped = unmapped
            self.scans += 1
        wall = self._wall()
        step = MAX_KEYS_PER_LIST // 2
        for i in range(0, max(len(stored), len(evicted)), step):
            delta = DeltaBuilder()
            for k in stored[i : i + step]:
                if self.tier == "swa":
                    left = self.swa_ttl_s - (wall - now[k])
                    delta.swa_created(k, max(1, int(left * 1000)))
                else:
                    delta.stored(k, self.tier)
            for k in evicted[i : i + step]:
                if self.tier == "swa":
                    delta.swa_expired(k)
                else:
                    delta.evicted(k)
            self.publisher.publish_delta(delta.build())
            self._last_publish = time.monotonic()
        if not stored and not evicted and time.monotonic() - self._last_publish >= self.heartbeat_s:
            self.publisher.publish_delta(DeltaBuilder().build())  # still here, nothing new
            self._last_publish = time.monotonic()
        return len(stored) + len(evicted)

    def snapshot(self) -> tuple[Sequence[TierKeys], Sequence[SwaStates]]:
        """The publisher's snapshot source: the pool as of the last scan."""
        with self._lock:
            held = dict(self._held)
        keys = sorted(held)
        if self.tier == "swa":
            wall = self._wall()
            groups: dict[int, list[PrefixKey]] = {}
            for k in keys:
                left_ms = max(1, int((self.swa_ttl_s - (wall - held[k])) * 1000))
                groups.setdefault(-(-left_ms // 1000) * 1000, []).append(k)
            swa = [
                SwaStates(keys=tuple(ks[i : i + MAX_KEYS_PER_LIST]), ttl_ms=ttl)
                for ttl, ks in sorted(groups.items())
                for i in range(0, len(ks), MAX_KEYS_PER_LIST)
            ]
            return [], swa
        lists = [
            TierKeys(tier=self.tier.label, keys=tuple(keys[i : i + MAX_KEYS_PER_LIST]))
            for i in range(0, len(keys), MAX_KEYS_PER_LIST)
        ]
        return lists, []

    async def start(self) -> None:
        await asyncio.to_thread(self.scan)
        self._task = asyncio.create_task(self._loop(), name="pool-watch")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            with contextlib.suppress(OSError):  # a pool directory being replaced: next scan
                await asyncio.to_thread(self.scan)
