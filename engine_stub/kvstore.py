"""The global-KV store: block-aligned global state, keyed by the router's prefix keys, in
three real tiers.

Each entry is the model's serialized global state for one block of `block_tokens` tokens
(`MiniV4.export_global(state, start, start + block_tokens)`), keyed by the chained block
key of `ramjet.keys.prefix.compute_keys` for the same bytes (the tokenizer is byte-level, so a
token block is a key block).

Tiers (`ramjet.types.Tier`), each with a capacity in tokens:
- HBM: a `torch.uint8` tensor per block on the model's device (GPU memory on CUDA).
- HOST: a `bytes` copy in process memory (reading it back really copies it).
- SSD: a file per block under `cache_dir/<fingerprint>/`, written with fsync and
  dropped from the page cache (`posix_fadvise DONTNEED`) so a restore really reads it.

Placement. `put` and promotion insert at HBM. When a tier is over capacity its least
recently used block is demoted to the next tier; past SSD (or with no SSD tier) it is
evicted. `fetch` copies blocks out of whichever tier holds them, then promotes them to
HBM. Blocks of one prompt are touched deepest-first, so the LRU order evicts a prompt's
tail before its head and a resident block's predecessors tend to stay resident (lookups
stop at the first missing block anyway).

Expiry. Every entry expires `ttl_s` after it was last stored or used (default 72 h);
expired entries are dropped by `lookup` and by `sweep`.

Restart. Volatile tiers start empty. The SSD tier survives: at start, files under
`cache_dir/<fingerprint>/` (the fingerprint names model, config and seed, so state from
another model is never read) are re-indexed by their headers; expired or malformed files
are deleted. Re-indexed blocks are announced as `stored` events at SSD.

Thread safety: every public method takes one lock; events are emitted under it.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine_stub.events import CacheEvent, CacheEvents
from ramjet.types import PrefixKey, Tier

DEFAULT_TTL_S = 72 * 3600.0
_MAGIC = b"RJKV1\x00"
_HEADER = struct.Struct("<6sQdI")  # magic, key, expires_at (unix s), n_tokens


@dataclass(slots=True)
class _Entry:
    key: PrefixKey
    tier: Tier
    nbytes: int
    expires_at: float
    payload: torch.Tensor | bytes | Path | None


@dataclass(frozen=True, slots=True)
class Restored:
    """Blocks copied out of the store, in key order, and where they came from."""

    blobs: list[bytes]
    tiers: list[Tier]
    tokens_by_tier: tuple[int, int, int]
    """(hbm, host, ssd) tokens restored."""
    seconds_by_tier: tuple[float, float, float]
    """Wall time spent copying out of each tier."""
    nbytes: int


@dataclass(slots=True)
class TierStats:
    bytes_moved: dict[str, int] = field(default_factory=dict)
    seconds_moved: dict[str, float] = field(default_factory=dict)

    def add(self, label: str, nbytes: int, seconds: float) -> None:
        self.bytes_moved[label] = self.bytes_moved.get(label, 0) + nbytes
        self.seconds_moved[label] = self.seconds_moved.get(label, 0.0) + seconds


def _drop_page_cache(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def write_block_file(path: Path, key: int, expires_at: float, n_tokens: int, blob: bytes) -> None:
    """Write one SSD block (header + payload) durably and drop it from the page cache."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(_HEADER.pack(_MAGIC, key, expires_at, n_tokens))
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
        _drop_page_cache(f.fileno())
    os.replace(tmp, path)


def read_block_file(path: Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(_HEADER.size)
        return f.read()


class GlobalKVStore:
    """Three-tier LRU store of global-KV blocks. See the module docstring."""

    def __init__(
        self,
        *,
        block_tokens: int,
        capacity_tokens: tuple[int, int, int],
        cache_dir: Path | None,
        fingerprint: str,
        device: str | torch.device = "cpu",
        ttl_s: float = DEFAULT_TTL_S,
        events: CacheEvents | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if block_tokens <= 0:
            raise ValueError("block_tokens must be positive")
        if any(c < 0 for c in capacity_tokens):
            raise ValueError("tier capacities must be >= 0 tokens")
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self.block_tokens = block_tokens
        self.capacity_blocks = tuple(c // block_tokens for c in capacity_tokens)
        if cache_dir is None:
            self.capacity_blocks = (*self.capacity_blocks[:2], 0)
        self.ttl_s = ttl_s
        self.device = torch.device(device)
        self.events = events or CacheEvents()
        self.clock = clock
        self.stats = TierStats()
        self._lock = threading.RLock()
        # One LRU per tier: key -> entry, oldest first.
        self._tiers: list[OrderedDict[PrefixKey, _Entry]] = [OrderedDict() for _ in Tier]
        self._where: dict[PrefixKey, Tier] = {}
        self._dir: Path | None = None
        if cache_dir is not None and self.capacity_blocks[Tier.SSD] > 0:
            self._dir = Path(cache_dir) / fingerprint
            self._dir.mkdir(parents=True, exist_ok=True)
            self._reindex_disk()

    # -- queries -------------------------------------------------------------------

    def lookup(self, keys: Sequence[PrefixKey]) -> list[Tier]:
        """Tiers of the longest resident prefix of `keys` (stops at the first miss)."""
        with self._lock:
            now = self.clock()
            out: list[Tier] = []
            for key in keys:
                tier = self._where.get(key)
                if tier is None:
                    break
                entry = self._tiers[tier][key]
                if entry.expires_at <= now:
                    self._evict(entry, "expired")
                    break
                out.append(tier)
            return out

    def tier_of(self, key: PrefixKey) -> Tier | None:
        with self._lock:
            return self._where.get(key)

    def resident_tokens(self) -> tuple[int, int, int]:
        with self._lock:
            b = self.block_tokens
            return (len(self._tiers[0]) * b, len(self._tiers[1]) * b, len(self._tiers[2]) * b)

    def resident_bytes(self) -> tuple[int, int, int]:
        with self._lock:
            hbm, host, ssd = (sum(e.nbytes for e in t.values()) for t in self._tiers)
            return (hbm, host, ssd)

    def snapshot(self) -> list[tuple[PrefixKey, Tier, float]]:
        """(key, tier, expires_at) of every resident block."""
        with self._lock:
            return [(e.key, e.tier, e.expires_at) for t in self._tiers for e in t.values()]

    # -- changes -------------------------------------------------------------------

    def put(self, key: PrefixKey, blob: bytes) -> None:
        """Store (or refresh) one block at HBM; demotes others under pressure."""
        with self._lock:
            if key in self._where:
                self._touch([key])
                return
            self._insert(key, blob, Tier.HBM, from_tier=None)

    def put_many(self, items: Sequence[tuple[PrefixKey, bytes]]) -> None:
        """Store a prompt's new blocks; inserted deepest-first so its head stays MRU."""
        with self._lock:
            for key, blob in reversed(items):
                self.put(key, blob)

    def fetch(self, keys: Sequence[PrefixKey]) -> Restored:
        """Copy the blocks of `keys` out of their tiers (all must be resident), then
        promote them to HBM. Raises KeyError, changing nothing, if one is missing."""
        with self._lock:
            entries = []
            for key in keys:
                tier = self._where.get(key)
                if tier is None:
                    raise KeyError(f"block {key:#018x} is not resident")
                entries.append(self._tiers[tier][key])
            blobs: list[bytes] = []
            tiers: list[Tier] = []
            tokens = [0, 0, 0]
            seconds = [0.0, 0.0, 0.0]
            for entry in entries:
                t0 = time.perf_counter()
                blobs.append(self._read(entry))
                dt = time.perf_counter() - t0
                tiers.append(entry.tier)
                tokens[entry.tier] += self.block_tokens
                seconds[entry.tier] += dt
                self.stats.add(entry.tier.label + "_read", entry.nbytes, dt)
            top = self._first_open_tier(Tier.HBM)
            for entry, blob in zip(reversed(entries), reversed(blobs), strict=True):
                if entry.key not in self._where:  # demoted out by an earlier promotion
                    continue
                entry = self._tiers[self._where[entry.key]][entry.key]
                if top is not None and entry.tier > top:
                    self._remove(entry)
                    self._insert(entry.key, blob, Tier.HBM, from_tier=entry.tier)
                else:
                    self._touch([entry.key])
            return Restored(
                blobs,
                tiers,
                (tokens[0], tokens[1], tokens[2]),
                (seconds[0], seconds[1], seconds[2]),
                sum(len(b) for b in blobs),
            )

    def demote(self, key: PrefixKey) -> Tier | None:
        """Move one block a tier down now (an operator/test hook); returns its new tier."""
        with self._lock:
            tier = self._where.get(key)
            if tier is None:
                return None
            self._demote(self._tiers[tier][key])
            return self._where.get(key)

    def sweep(self) -> int:
        """Drop expired blocks; returns how many."""
        with self._lock:
            now = self.clock()
            dead = [e for t in self._tiers for e in t.values() if e.expires_at <= now]
            for entry in dead:
                self._evict(entry, "expired")
            return len(dead)

    def clear_volatile(self) -> None:
        """Forget HBM and host tiers without events (used only at shutdown)."""
        with self._lock:
            for tier in (Tier.HBM, Tier.HOST):
                for key in list(self._tiers[tier]):
                    del self._where[key]
                self._tiers[tier].clear()

    # -- internals (lock held) -----------------------------------------------------

    def _touch(self, keys: Sequence[PrefixKey]) -> None:
        exp = self.clock() + self.ttl_s
        for key in reversed(keys):
            tier = self._where[key]
            entry = self._tiers[tier][key]
            entry.expires_at = exp
            self._tiers[tier].move_to_end(key)

    def _insert(self, key: PrefixKey, blob: bytes, tier: Tier, from_tier: Tier | None) -> None:
        open_tier = self._first_open_tier(tier)
        now = self.clock()
        if open_tier is None:
            if from_tier is not None:
                self.events.emit(CacheEvent("evicted", key, now, tier=from_tier, reason="capacity"))
            return
        tier = open_tier
        expires_at = now + self.ttl_s
        entry = _Entry(key, tier, len(blob), expires_at, None)
        t0 = time.perf_counter()
        entry.payload = self._write(entry, blob)
        self.stats.add(tier.label + "_write", len(blob), time.perf_counter() - t0)
        self._tiers[tier][key] = entry
        self._where[key] = tier
        if from_tier is None:
            self.events.emit(
                CacheEvent(
                    "stored", key, now, tier=tier, n_tokens=self.block_tokens, expires_at=expires_at
                )
            )
        else:
            self.events.emit(
                CacheEvent("moved", key, now, tier=tier, from_tier=from_tier, expires_at=expires_at)
            )
        self._relieve(tier)

    def _first_open_tier(self, tier: Tier) -> Tier | None:
        for t in Tier:
            if t >= tier and self.capacity_blocks[t] > 0:
                return t
        return None

    def _relieve(self, tier: Tier) -> None:
        lru = self._tiers[tier]
        while len(lru) > self.capacity_blocks[tier]:
            oldest = next(iter(lru.values()))
            self._demote(oldest)

    def _demote(self, entry: _Entry) -> None:
        blob = self._read(entry)
        self._remove(entry)
        if entry.tier == Tier.SSD:
            self.events.emit(
                CacheEvent("evicted", entry.key, self.clock(), tier=entry.tier, reason="capacity")
            )
            return
        nxt = Tier(entry.tier + 1)
        self._insert(entry.key, blob, nxt, from_tier=entry.tier)

    def _evict(self, entry: _Entry, reason: str) -> None:
        self._remove(entry)
        self.events.emit(
            CacheEvent("evicted", entry.key, self.clock(), tier=entry.tier, reason=reason)
        )

    def _remove(self, entry: _Entry) -> None:
        del self._tiers[entry.tier][entry.key]
        del self._where[entry.key]
        if isinstance(entry.payload, Path):
            entry.payload.unlink(missing_ok=True)
        entry.payload = None

    def _write(self, entry: _Entry, blob: bytes) -> torch.Tensor | bytes | Path:
        if entry.tier == Tier.HBM:
            t = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
            return t.to(self.device) if self.device.type != "cpu" else t
        if entry.tier == Tier.HOST:
            return bytes(blob)
        assert self._dir is not None
        path = self._dir / f"{int(entry.key):016x}.kv"
        write_block_file(path, int(entry.key), entry.expires_at, self.block_tokens, blob)
        return path

    def _read(self, entry: _Entry) -> bytes:
        payload = entry.payload
        if isinstance(payload, torch.Tensor):
            return payload.cpu().numpy().tobytes()
        if isinstance(payload, bytes):
            return bytes(bytearray(payload))  # a real copy, as a host->device restore is
        assert isinstance(payload, Path)
        return read_block_file(payload)

    def _reindex_disk(self) -> None:
        assert self._dir is not None
        now = self.clock()
        found: list[tuple[float, _Entry]] = []
        for path in self._dir.glob("*.tmp"):
            path.unlink(missing_ok=True)
        for path in self._dir.glob("*.kv"):
            try:
                with open(path, "rb") as f:
                    magic, key, expires_at, n_tokens = _HEADER.unpack(f.read(_HEADER.size))
                size = path.stat().st_size - _HEADER.size
            except (OSError, struct.error):
                path.unlink(missing_ok=True)
                continue
            if magic != _MAGIC or n_tokens != self.block_tokens or expires_at <= now or size <= 0:
                path.unlink(missing_ok=True)
                continue
            found.append(
                (path.stat().st_mtime, _Entry(PrefixKey(key), Tier.SSD, size, expires_at, path))
            )
        found.sort(key=lambda x: x[0])
        for _, entry in found:
            self._tiers[Tier.SSD][entry.key] = entry
            self._where[entry.key] = Tier.SSD
            self.events.emit(
                CacheEvent(
                    "stored",
                    entry.key,
                    now,
                    tier=Tier.SSD,
                    n_tokens=self.block_tokens,
                    expires_at=entry.expires_at,
                )
            )
        self._relieve(Tier.SSD)
