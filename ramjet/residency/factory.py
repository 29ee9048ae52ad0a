"""Build the residency tables a router runs with, from the policy file's `store:` section.

`store.kind: memory` gives `ResidencyTables` over a `MemoryStore`; `store.kind: redis`
gives them over a `RedisStore` plus its background sync task. `ResidencyRuntime.start()`
first tries one sync (so a restarted replica starts warm from Redis), bounded by the
link's timeout and never fatal: a router whose Redis is down still starts and routes from
local state (fail open). `stop()` flushes what it can and closes the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from ramjet.config import PolicyConfig
from ramjet.residency.redis_link import RedisLink, RedisUnavailable
from ramjet.residency.redis_store import RedisStore
from ramjet.residency.tables import ResidencyTables
from ramjet.runtime.tasks import cancel_and_wait
from ramjet.types import EngineId


@dataclass
class ResidencyRuntime:
    tables: ResidencyTables
    store: RedisStore | None = None
    link: RedisLink | None = None
    _task: asyncio.Task[None] | None = field(default=None, repr=False)

    async def start(self) -> None:
        if self.store is None or self._task is not None:
            return
        with contextlib.suppress(RedisUnavailable):
            await self.store.sync_once()  # warm start; a dead Redis is not fatal
        self._task = asyncio.create_task(self.store.run(), name="ramjet-residency-sync")

    async def stop(self) -> None:
        if self._task is not None and self.store is not None:
            self.store.stop()
            await cancel_and_wait((self._task,), timeout_s=2.0)
            self._task = None
        if self.store is not None:
            await self.store.close()
        if self.link is not None:
            await self.link.close()


def build_residency(
    config: PolicyConfig,
    registry: CollectorRegistry | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> ResidencyRuntime:
    reg = registry if registry is not None else CollectorRegistry()
    if config.store.kind == "memory":
        return ResidencyRuntime(ResidencyTables(config.residency, clock=clock, registry=reg))
    link = RedisLink(config.store, reg)
    store = RedisStore(
        link,
        config.residency,
        engines=[EngineId(e.id) for e in config.engines],
        registry=reg,
        clock=clock,
    )
    tables = ResidencyTables(config.residency, store, clock=clock, registry=reg)
    return ResidencyRuntime(tables, store, link)
