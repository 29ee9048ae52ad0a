"""Cache events: what the engine's caches did, in router keys, for the signed reports.

Contract. The global-KV store and the SWA pool call `CacheEvents.emit` synchronously,
from whichever thread changed them (the scheduler's worker thread, or the event loop's
expiry sweep), while holding their own lock, so events of one cache arrive in the order
the changes happened. Listeners must be quick and must not call back into the caches;
the reports publisher appends to its delta buffer and returns.

Kinds (`EventKind`):
- `stored`: a global-KV block entered a tier (`tier`), expiring at `expires_at`.
- `moved`: a block moved from `from_tier` to `tier` (demotion under pressure, or
  promotion on use).
- `evicted`: a block left the engine (`reason`: "capacity" or "expired"); `tier` is
  where it was.
- `swa_created`: SWA state for the prefix ending at boundary key `key` was pooled.
- `swa_expired`: it left the pool (`reason`: "ttl", "capacity" or "replaced").
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from ramjet.types import PrefixKey, Tier

EventKind = Literal["stored", "moved", "evicted", "swa_created", "swa_expired"]


@dataclass(frozen=True, slots=True)
class CacheEvent:
    kind: EventKind
    key: PrefixKey
    at: float
    """Wall-clock time (unix seconds) of the change."""
    tier: Tier | None = None
    from_tier: Tier | None = None
    n_tokens: int = 0
    expires_at: float | None = None
    """Wall-clock expiry of the entry (stored, moved, swa_created)."""
    reason: str = ""

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"kind": self.kind, "key": int(self.key), "at": self.at}
        if self.tier is not None:
            out["tier"] = self.tier.label
        if self.from_tier is not None:
            out["from_tier"] = self.from_tier.label
        if self.n_tokens:
            out["n_tokens"] = self.n_tokens
        if self.expires_at is not None:
            out["expires_at"] = self.expires_at
        if self.reason:
            out["reason"] = self.reason
        return out


Listener = Callable[[CacheEvent], None]
BlockDescriber = Callable[[Sequence[PrefixKey], Sequence[int], str | None], None]
"""Told a prompt's block keys (in order), its tokens and its `cache_salt` (None: none)
before the blocks are stored."""


class CacheEvents:
    """A fan-out of cache events to listeners (the reports publisher, metrics, tests)."""

    def __init__(self) -> None:
        self._listeners: list[Listener] = []
        self._describers: list[BlockDescriber] = []
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}

    def subscribe(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def emit(self, event: CacheEvent) -> None:
        with self._lock:
            listeners = list(self._listeners)
            self.counts[event.kind] = self.counts.get(event.kind, 0) + 1
        for listener in listeners:
            listener(event)

    def subscribe_blocks(self, describer: BlockDescriber) -> None:
        """Listeners that publish token ids (the vLLM-format publisher) learn here which
        tokens make up each block key."""
        with self._lock:
            self._describers.append(describer)

    def describe(
        self, keys: Sequence[PrefixKey], tokens: Sequence[int], salt: str | None = None
    ) -> None:
        with self._lock:
            describers = list(self._describers)
        for d in describers:
            d(keys, tokens, salt)
