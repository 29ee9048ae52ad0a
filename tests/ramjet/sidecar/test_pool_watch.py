"""The pool's reporter (`ramjet.sidecar.pool_watch`): what a kvpool directory holds
reaches a router signed by the pool's own key, and the router's pool residency equals
the directory's content through stores, evictions and a snapshot."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from reports_fixtures import KEYS, Clocks

from kvpool import Pool
from ramjet.reports.config import ReportsConfig
from ramjet.reports.keys import KeyRing
from ramjet.reports.processor import ReportProcessor
from ramjet.reports.publisher import ReportPublisher
from ramjet.reports.verify import Accepted
from ramjet.residency.tables import ResidencyTables
from ramjet.sidecar.pool_watch import PoolWatcher, hex_router_key
from ramjet.types import EngineId, PrefixKey, Tier

POOL = EngineId("host0")


def _router(clocks: Clocks) -> tuple[ReportProcessor, ResidencyTables]:
    tables = ResidencyTables(clock=clocks.clock)
    ring = KeyRing({"stranger": (POOL, KEYS["stranger"].public_key())})
    proc = ReportProcessor(
        ring, tables, ReportsConfig(), CollectorRegistry(), clocks.wall_clock, clocks.clock
    )
    return proc, tables


def _held(tables: ResidencyTables, keys: list[PrefixKey]) -> set[PrefixKey]:
    view = tables.view(POOL)
    return {k for k in keys if view.global_match([k], [256]).total}


def test_the_routers_pool_residency_is_the_directorys_content(tmp_path: Path) -> None:
    clocks = Clocks()
    pool = Pool(tmp_path / "pool", capacity_bytes=64 * 1024)
    watchers: list[PoolWatcher] = []  # the publisher's snapshot source is the watcher
    pub = ReportPublisher(
        POOL,
        KEYS["stranger"],
        "stranger",
        snapshot=lambda: watchers[0].snapshot(),
        wall_clock=clocks.wall_clock,
    )
    watcher = PoolWatcher(pool, pub, Tier.HOST)
    watchers.append(watcher)
    proc, tables = _router(clocks)
    keys = [PrefixKey(0x1000 + i) for i in range(40)]
    for k in keys[:30]:
        assert pool.put(f"{k:016x}", b"x" * 1024)
    assert pool.put("ab" * 10, b"y")  # a key no router key maps to: skipped, counted

    def pull() -> None:
        for frame in pub.frames_after(proc_seq[0]):
            assert isinstance(proc.submit(frame), Accepted)
        proc_seq[0] = pub.seq

    proc_seq = [0]
    assert watcher.scan() == 30 and watcher.unmapped == 1
    pull()
    assert _held(tables, keys) == set(keys[:30])
    pool.evict_to(10 * 1024 + 1)  # the pool's LRU owner evicts: 20 blocks go
    for k in keys[30:]:
        assert pool.put(f"{k:016x}", b"x" * 1024)
    watcher.scan()
    pull()
    on_disk = {hex_router_key(k) for k in pool.held_keys()} - {None}
    assert _held(tables, keys) == on_disk and len(on_disk) < 30
    # a router that starts now converges from one snapshot
    late, late_tables = _router(clocks)
    assert isinstance(late.submit(pub.snapshot_frame()), Accepted)
    assert _held(late_tables, keys) == on_disk


def test_bad_parameters_are_refused(tmp_path: Path) -> None:
    pool = Pool(tmp_path / "p", capacity_bytes=1024)
    pub = ReportPublisher(POOL, KEYS["stranger"], "stranger")
    with pytest.raises(ValueError, match="host or ssd"):
        PoolWatcher(pool, pub, Tier.HBM)
    with pytest.raises(ValueError, match="interval_s"):
        PoolWatcher(pool, pub, Tier.HOST, interval_s=0)
    assert hex_router_key("zz" * 8) is None and hex_router_key("ab") is None


def test_an_swa_pools_states_reach_the_router_live_and_expire_when_idle(tmp_path: Path) -> None:
    import os

    clocks = Clocks()
    pool = Pool(tmp_path / "swa", capacity_bytes=64 * 1024)
    watchers: list[PoolWatcher] = []
    pub = ReportPublisher(
        POOL,
        KEYS["stranger"],
        "stranger",
        snapshot=lambda: watchers[0].snapshot(),
        wall_clock=clocks.wall_clock,
    )
    watcher = PoolWatcher(
        pool, pub, "swa", swa_ttl_s=60.0, heartbeat_s=5.0, wall_clock=clocks.wall_clock
    )
    watchers.append(watcher)
    proc, tables = _router(clocks)
    seq = [0]

    def pull() -> None:
        for frame in pub.frames_after(seq[0]):
            assert isinstance(proc.submit(frame), Accepted)
        seq[0] = pub.seq

    def used(k: PrefixKey, age_s: float) -> None:  # the state's last use, age_s ago
        t = clocks.wall - age_s
        os.utime(pool.blocks / f"{k:016x}", (t, t))

    a, b = PrefixKey(0xA0), PrefixKey(0xB0)
    for k in (a, b):
        assert pool.put(f"{k:016x}", b"s" * 512)
    used(a, 0)
    used(b, 50)  # 10 s left
    assert watcher.scan() == 2
    pull()
    view = tables.view(POOL)
    assert view.swa_match([(300, a)]) == 300 and view.swa_match([(700, b)]) == 700
    assert view.global_match([a, b], [256, 256]).total == 0  # SWA states, not blocks
    # b idles past its TTL: reported expired; a is used again: its TTL restarts
    clocks.advance(20)
    used(a, 0)
    assert watcher.scan() == 2
    pull()
    view = tables.view(POOL)
    assert view.swa_match([(700, b)]) == 0 and view.swa_match([(300, a)]) == 300
    assert watcher.held() == {a}
    _, swa = watcher.snapshot()
    assert [s.keys for s in swa] == [(a,)] and swa[0].ttl_ms == 60_000
    # quiet: nothing to report, but an empty delta once heartbeat_s has passed
    before = pub.seq
    watcher._last_publish -= 10  # the last report was 10 s ago
    assert watcher.scan() == 0 and pub.seq == before + 1
    assert watcher.scan() == 0 and pub.seq == before + 1  # not again at once
    pull()
