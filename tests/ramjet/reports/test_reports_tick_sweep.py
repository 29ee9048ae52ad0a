"""The ingest's tick sweeps expired residency in bounded steps (`ResidencyTables.
expire_step`, ~2 ms each) and, while a sweep is left, steps again the next loop turn
instead of one step per tick interval: a large pass ends in about its CPU time."""

from __future__ import annotations

import asyncio
import random
import time

from prometheus_client import CollectorRegistry
from reports_fixtures import E0, keyring

from ramjet.reports.config import ReportsConfig
from ramjet.reports.ingest import ReportIngest
from ramjet.reports.processor import ReportProcessor
from ramjet.residency.store import Table
from ramjet.residency.tables import ResidencyTables
from ramjet.types import PrefixKey, Tier


async def test_a_sweep_left_is_stepped_every_turn_not_every_tick() -> None:
    reg = CollectorRegistry()
    tables = ResidencyTables(registry=reg)
    proc = ReportProcessor(keyring(), tables, ReportsConfig(), reg)
    rng = random.Random(11)
    past = time.monotonic() - 100.0
    for _ in range(40):  # expired long ago: many steps of sweeping
        keys = [PrefixKey(rng.getrandbits(64)) for _k in range(5_000)]
        tables.store_global(E0, keys, Tier.HOST, past, ttl_s=1.0)
    assert tables.size(Table.GLOBAL) == 200_000
    assert tables.expire_step() is True  # one step does not sweep it all
    ingest = ReportIngest(proc, {}, tick_interval_s=60.0, registry=reg)
    await ingest.start()
    try:
        deadline = time.monotonic() + 10.0
        while tables.size(Table.GLOBAL) > 0:
            assert time.monotonic() < deadline, tables.size(Table.GLOBAL)
            await asyncio.sleep(0.01)
    finally:
        await ingest.stop()
    assert proc.tick() is False  # nothing left to sweep
