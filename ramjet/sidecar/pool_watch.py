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
the 16-hex-digit router key itself (`hex_router_key`); a sidecar beside vLLM maps vLLM's
block hashes with the table it learns from the engine's KV events. A key that does not
map is skipped and counted (`unmapped`), never guessed.

Scans run in a thread (`asyncio.to_thread`): listing a pool of millions of blocks is a
directory walk, kept off the event loop. Publishing is thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Sequence

from kvpool import Pool
from ramjet.reports.bodies import MAX_KEYS_PER_LIST, DeltaBuilder, SwaStates, TierKeys
from ramjet.reports.publisher import ReportPublisher
from ramjet.runtime.tasks import cancel_and_wait
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


class PoolWatcher:
    """The reporter of one pool (module docstring). `tier`: the pool's tier as reported
    (host or SSD)."""

    def __init__(
        self,
        pool: Pool,
        publisher: ReportPublisher,
        tier: Tier,
        router_key_of: KeyMap = hex_router_key,
        interval_s: float = 0.5,
    ) -> None:
        if tier not in (Tier.HOST, Tier.SSD):
            raise ValueError("a pool of global KV is reported as host or ssd")
        if not interval_s > 0:
            raise ValueError("interval_s must be > 0")
        self.pool = pool
        self.publisher = publisher
        self.tier = tier
        self.router_key_of = router_key_of
        self.interval_s = interval_s
        self._held: set[PrefixKey] = set()
        self._lock = threading.Lock()
        self.unmapped = 0
        """Pool keys seen that map to no router key (skipped)."""
        self.scans = 0
        self._task: asyncio.Task[None] | None = None

    def held(self) -> frozenset[PrefixKey]:
        """The router keys of the pool's blocks as of the last scan."""
        with self._lock:
            return frozenset(self._held)

    def scan(self) -> int:
        """List the pool once and publish what changed since the last scan as deltas
        (in lists of at most `MAX_KEYS_PER_LIST` keys); returns the keys changed."""
        now: set[PrefixKey] = set()
        unmapped = 0
        for key in self.pool.held_keys():
            k = self.router_key_of(key)
            if k is None:
                unmapped += 1
            else:
                now.add(k)
        with self._lock:
            stored = sorted(now - self._held)
            evicted = sorted(self._held - now)
            self._held = now
            self.unmapped = unmapped
            self.scans += 1
        step = MAX_KEYS_PER_LIST // 2
        for i in range(0, max(len(stored), len(evicted)), step):
            delta = DeltaBuilder()
            for k in stored[i : i + step]:
                delta.stored(k, self.tier)
            for k in evicted[i : i + step]:
                delta.evicted(k)
            self.publisher.publish_delta(delta.build())
        return len(stored) + len(evicted)

    def snapshot(self) -> tuple[Sequence[TierKeys], Sequence[SwaStates]]:
        """The publisher's snapshot source: the pool as of the last scan."""
        held = sorted(self.held())
        lists = [
            TierKeys(tier=self.tier.label, keys=tuple(held[i : i + MAX_KEYS_PER_LIST]))
            for i in range(0, len(held), MAX_KEYS_PER_LIST)
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
