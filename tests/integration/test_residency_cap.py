"""Caps from the fleet, through signed reports and a real router on loopback: an engine
whose reports confirm more blocks than the residency cap allows raises the cap metric in
`/metrics`, and the router's decisions say its match may be missing; no exact entry is
ever displaced by an approximate one."""

from __future__ import annotations

import time

import aiohttp
from fake_upstream import FakeUpstream
from prometheus_client import CollectorRegistry
from proxy_client import post
from reports_fixtures import E0, E1, frame, keyring
from router_rig import Records, router_config

from ramjet.app.server import RouterServer
from ramjet.reports.bodies import DeltaBody, LoadBody, SnapshotBody, TierKeys
from ramjet.reports.config import ReportsConfig
from ramjet.reports.processor import ReportProcessor
from ramjet.reports.verify import Accepted
from ramjet.residency.config import ResidencyConfig
from ramjet.residency.store import Table
from ramjet.residency.tables import ResidencyTables, ViewMode
from ramjet.types import PrefixKey, Tier

KEYS = [PrefixKey(0x9E3779B97F4A7C15 * (i + 1) % 2**64) for i in range(40)]


def _submit(p: ReportProcessor, body: object, seq: int, engine: str = "e0") -> None:
    key_id = "e0-a" if engine == "e0" else "e1-a"
    f = frame(body, seq=seq, wall=time.time(), engine=E0 if engine == "e0" else E1, key_id=key_id)  # type: ignore[arg-type]
    assert isinstance(p.submit(f), Accepted)


async def test_an_engine_over_its_cap_is_counted_shown_and_noted(
    upstreams: list[FakeUpstream],
) -> None:
    registry = CollectorRegistry()
    tables = ResidencyTables(
        ResidencyConfig(max_global_entries=4, capacity_headroom=1.0), registry=registry
    )
    proc = ReportProcessor(keyring(), tables, ReportsConfig(), registry, time.time, time.monotonic)

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    # a snapshot of 8 HBM blocks and a load at half the HBM in use: capacity 16 blocks,
    # above the configured floor of 4; the cap follows it
    _submit(proc, SnapshotBody(seq=1, residency=[TierKeys(tier="hbm", keys=tuple(KEYS[:8]))]), 1)
    assert tables.global_cap() == 8
    load = LoadBody(
        queued_prompt_tokens=0, running_requests=0, waiting_requests=0, kv_utilization=0.5
    )
    _submit(proc, load, 2)
    assert tables.global_cap() == 16 and sample("ramjet_residency_global_cap_entries") == 16
    _submit(proc, DeltaBody(stored=[TierKeys(tier="host", keys=tuple(KEYS[8:16]))]), 3)
    assert tables.size(Table.GLOBAL) == 16 and not tables.capped(E0)
    assert sample("ramjet_residency_cap_evictions_total", engine="e0") in (None, 0.0)

    # the engine confirms 4 more than its share: the 4 least recently confirmed leave
    _submit(proc, DeltaBody(stored=[TierKeys(tier="ssd", keys=tuple(KEYS[16:20]))]), 4)
    assert tables.size(Table.GLOBAL) == 16
    assert sample("ramjet_residency_cap_evictions_total", engine="e0") == 4
    assert sample("ramjet_residency_capped", engine="e0") == 1
    assert tables.capped(E0) and tables.capped_engines() == {E0}
    now = time.monotonic()
    held = tables.store.get_many(Table.GLOBAL, E0, KEYS[:20], now, False)
    assert [e is not None for e in held] == [False] * 4 + [True] * 16

    # approximate entries (another engine's routing, in APPROXIMATE mode) find the table
    # full of exact ones: they are dropped, and no exact entry leaves for them
    tables.set_mode(E1, ViewMode.APPROXIMATE)
    tables.store.put(Table.GLOBAL, E1, KEYS[20:30], Tier.HBM, now, now + 300, exact=False)
    # ... nor does an approximate entry of the same engine and key replace an exact one
    tables.store.put(Table.GLOBAL, E0, KEYS[4:20], Tier.HBM, now, now + 300, exact=False)
    after = tables.store.get_many(Table.GLOBAL, E0, KEYS[4:20], now, True)
    assert all(e is not None and e.exact for e in after)
    assert [e.tier for e in after if e is not None] == [Tier.HBM] * 4 + [Tier.HOST] * 8 + [
        Tier.SSD
    ] * 4
    assert tables.store.get_many(Table.GLOBAL, E1, KEYS[20:30], now, True) == [None] * 10
    assert sample("ramjet_residency_cap_evictions_total", engine="e0") == 4

    # a router over these tables: every pick of a request says e0's match may be missing,
    # and its /metrics shows the evictions
    records = Records()
    cfg = router_config([u.url for u in upstreams], incumbent={"name": "prefix_affinity"})
    server = RouterServer(cfg, registry=registry, residency=tables, sink=records)
    await server.start()
    try:
        reply = await post(
            server.url, body={"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        )
        assert reply.status == 200
        async with (
            aiohttp.ClientSession() as s,
            s.get(server.url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r,
        ):
            text = await r.text()
    finally:
        await server.stop(drain_s=0.2)
    assert 'ramjet_residency_cap_evictions_total{engine="e0"} 4.0' in text
    assert 'ramjet_residency_capped{engine="e0"} 1.0' in text
    (rec,) = records.records
    assert "residency_capped:e0" in rec.live.notes
    assert "residency_capped:e1" not in rec.live.notes

    # a snapshot that fits clears the flag (the cap stays at the largest capacity seen)
    _submit(proc, SnapshotBody(seq=5, residency=[TierKeys(tier="hbm", keys=tuple(KEYS[:10]))]), 5)
    assert not tables.capped(E0) and tables.capped_engines() == frozenset()
    assert sample("ramjet_residency_capped", engine="e0") is None
