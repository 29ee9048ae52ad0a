"""Everything the router runs for reports, built from the policy file in one call.

    rt = ReportsRuntime.build(config.reports, config.keys, tables, registry,
                              engine_urls={e.id: e.url for e in config.engines},
                              base_dir=policy_path.parent)
    await rt.start()          # pull loops + staleness/expiry tick (1 s, or
                              #   stale_after_s / 4 when that is shorter), and the
                              #   push listener when reports.push.port is set
    rt.push_url               # its POST /ramjet/reports (never on the client port)
    rt.processor.trust(engine), .load(engine), .profile(engine)
    await rt.stop()

The router's wiring builds it (`ramjet.app.wiring`).

Shared verification: when the tables sit over a store several replicas share
(`ResidencyStore.shared()` is not None: the `RedisStore` of `store.kind: redis`), the runtime wraps the processor in `SharedReports`
(`ramjet.reports.redis_cursors`): pulled and pushed frames go through
`SharedReports.submit`, which claims each report against the cursor all replicas share,
so a report is applied by one replica only and a replay is refused by all; `start()`
also runs `SharedReports.run()`, which moves this replica's report state (cursor, gap,
load, profile, last report time) forward to what the others accepted. Over any other
store nothing of this exists and frames go to `ReportProcessor.submit_async`.

Pull targets: `reports.engines` when it is set; otherwise every engine of the policy
file that has an active key (an engine with a key is a reporting engine; it serves
`/ramjet/reports` next to its API).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry

from ramjet.reports.config import KeysConfig, ReportsConfig
from ramjet.reports.ingest import ReportIngest
from ramjet.reports.keys import KeyError_, KeyRing
from ramjet.reports.processor import ReportProcessor
from ramjet.reports.redis_cursors import SharedReports
from ramjet.residency.tables import ResidencyTables
from ramjet.runtime.tasks import cancel_and_wait
from ramjet.types import EngineId


def pull_targets(
    reports: ReportsConfig, ring: KeyRing, engine_urls: Mapping[str, str]
) -> dict[EngineId, str]:
    if reports.engines:
        return {EngineId(e): url for e, url in reports.engines.items()}
    keyed = ring.engines()
    return {EngineId(e): url for e, url in engine_urls.items() if e in keyed}


def read_pull_token(reports: ReportsConfig, base_dir: Path | None) -> str | None:
    """The token of `reports.pull_token_file` (None when unset); raises `KeyError_`."""
    path = reports.pull_token_file
    if path is None:
        return None
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise KeyError_(f"reports.pull_token_file: cannot read {path}: {exc.strerror}") from None
    if not token or any(c.isspace() for c in token):
        raise KeyError_(f"reports.pull_token_file: {path} holds no token (one word)")
    return token


@dataclass
class ReportsRuntime:
    processor: ReportProcessor
    ingest: ReportIngest
    shared: SharedReports | None = None
    """Set when the tables are shared through Redis (see the module docstring)."""
    _sync: asyncio.Task[None] | None = field(default=None, repr=False)

    @classmethod
    def build(
        cls,
        reports: ReportsConfig,
        keys: KeysConfig,
        tables: ResidencyTables,
        registry: CollectorRegistry,
        engine_urls: Mapping[str, str] | None = None,
        base_dir: Path | None = None,
    ) -> ReportsRuntime:
        """Raises `ramjet.reports.keys.KeyError_` when a configured key does not load."""
        ring = KeyRing.from_config(keys, base_dir)
        token = read_pull_token(reports, base_dir)
        processor = ReportProcessor(ring, tables, reports, registry)
        targets = pull_targets(reports, ring, engine_urls or {})
        # the tick applies staleness: run it often enough that a silent engine stops
        # steering within a fraction of the TTL
        tick_s = min(1.0, reports.stale_after_s / 4)
        store = tables.store.shared()
        if store is None:
            ingest = ReportIngest(
                processor, targets, tick_interval_s=tick_s, registry=registry, pull_token=token
            )
            return cls(processor, ingest)
        shared = SharedReports(processor, store, targets, registry)
        ingest = ReportIngest(
            processor,
            targets,
            tick_interval_s=tick_s,
            submit=shared.submit,
            registry=registry,
            pull_token=token,
        )
        return cls(processor, ingest, shared)

    @property
    def push_url(self) -> str:
        """The push listener's `POST /ramjet/reports` URL (`reports.push`, started)."""
        return self.ingest.push_url

    async def start(self) -> None:
        if self.shared is not None and self._sync is None:
            self._sync = asyncio.create_task(self.shared.run(), name="ramjet-reports-sync")
        await self.ingest.start()

    async def stop(self) -> None:
        await self.ingest.stop()
        if self._sync is not None and self.shared is not None:
            self.shared.stop()
            await cancel_and_wait((self._sync,), timeout_s=2.0)
            self._sync = None
