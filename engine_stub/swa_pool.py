"""The SWA pool: minute-scale sliding-window state, keyed by message-boundary keys.

A sequence's SWA state (the window rings of every layer, plus the part of its global
state past the last full block, which no block key covers) is what lets the next turn of
a conversation resume exactly where the last prompt ended. It is not persisted with the
global KV: the pool keeps it in host memory under

- a byte cap (default 10% of host memory), enforced by evicting the least recently used
  entries ("capacity");
- an idle TTL (default 60 s): an entry not used for `ttl_s` expires ("ttl").

Entries are keyed by the boundary key (`ramjet.keys.prefix.compute_keys(...).boundaries`) of the
prompt's end, so the router's SWA table and the engine agree on names. A later request
whose rendering passes through that boundary resumes from it without replay.

Thread safety: every public method takes one lock; events are emitted under it.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from engine_stub.events import CacheEvent, CacheEvents
from ramjet.types import PrefixKey

DEFAULT_TTL_S = 60.0


def default_cap_bytes() -> int:
    """10% of this machine's physical memory."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 8 << 30
    return total // 10


@dataclass(slots=True)
class SWAEntry:
    key: PrefixKey
    n_tokens: int
    """Tokens of the prefix this state ends at."""
    tail: bytes
    """The model's serialized tail (`export_tail`)."""
    last_used: float
    created: float

    @property
    def nbytes(self) -> int:
        return len(self.tail)


class SWAPool:
    """Byte-capped, idle-TTL, LRU pool of SWA states. See the module docstring."""

    def __init__(
        self,
        *,
        cap_bytes: int | None = None,
        ttl_s: float = DEFAULT_TTL_S,
        events: CacheEvents | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        cap = default_cap_bytes() if cap_bytes is None else cap_bytes
        if cap <= 0:
            raise ValueError("SWA pool cap must be positive bytes")
        if ttl_s <= 0:
            raise ValueError("SWA TTL must be positive seconds")
        self.cap_bytes = cap
        self.ttl_s = ttl_s
        self.events = events or CacheEvents()
        self.clock = clock
        self._lock = threading.Lock()
        self._lru: OrderedDict[PrefixKey, SWAEntry] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._lru)

    @property
    def bytes_used(self) -> int:
        with self._lock:
            return self._bytes

    def get(self, key: PrefixKey) -> SWAEntry | None:
        """The live entry for `key` (refreshing its TTL and LRU place), or None."""
        with self._lock:
            entry = self._lru.get(key)
            if entry is None:
                return None
            now = self.clock()
            if now - entry.last_used >= self.ttl_s:
                self._drop(entry, "ttl")
                return None
            entry.last_used = now
            self._lru.move_to_end(key)
            return entry

    def put(self, key: PrefixKey, n_tokens: int, tail: bytes) -> bool:
        """Pool a state; False (and nothing changes) if it alone exceeds the cap."""
        if len(tail) > self.cap_bytes:
            return False
        with self._lock:
            now = self.clock()
            old = self._lru.get(key)
            if old is not None:
                self._drop(old, "replaced")
            entry = SWAEntry(key, n_tokens, bytes(tail), now, now)
            self._lru[key] = entry
            self._bytes += entry.nbytes
            self.events.emit(
                CacheEvent("swa_created", key, now, n_tokens=n_tokens, expires_at=now + self.ttl_s)
            )
            while self._bytes > self.cap_bytes:
                self._drop(next(iter(self._lru.values())), "capacity")
            return True

    def sweep(self) -> int:
        """Expire idle entries; returns how many."""
        with self._lock:
            now = self.clock()
            dead = [e for e in self._lru.values() if now - e.last_used >= self.ttl_s]
            for entry in dead:
                self._drop(entry, "ttl")
            return len(dead)

    def snapshot(self) -> list[tuple[PrefixKey, int, float]]:
        """(key, n_tokens, expires_at) of every live entry."""
        with self._lock:
            return [(e.key, e.n_tokens, e.last_used + self.ttl_s) for e in self._lru.values()]

    def _drop(self, entry: SWAEntry, reason: str) -> None:
        del self._lru[entry.key]
        self._bytes -= entry.nbytes
        self.events.emit(CacheEvent("swa_expired", entry.key, self.clock(), reason=reason))
