"""GlobalKVStore: tiers, LRU demotion, promotion on use, expiry, disk re-index."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from engine_stub.events import CacheEvent, CacheEvents
from engine_stub.kvstore import GlobalKVStore
from ramjet.types import PrefixKey, Tier

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from manual_clock import ManualClock

B = 4  # tokens per block in these tests


def make(
    tmp_path: Path | None, caps: tuple[int, int, int], ttl: float = 100.0, start: float = 1000.0
):
    events = CacheEvents()
    seen: list[CacheEvent] = []
    events.subscribe(seen.append)
    clock = ManualClock(start)
    store = GlobalKVStore(
        block_tokens=B,
        capacity_tokens=caps,
        cache_dir=tmp_path,
        fingerprint="fp",
        ttl_s=ttl,
        events=events,
        clock=clock,
    )
    return store, seen, clock


def blob(i: int) -> bytes:
    return bytes([i % 256]) * (32 + i)


def k(i: int) -> PrefixKey:
    return PrefixKey(0x1000 + i)


def test_demotion_cascades_lru_to_host_then_ssd_then_evicts(tmp_path: Path) -> None:
    store, seen, _ = make(tmp_path, (2 * B, 2 * B, 2 * B))
    for i in range(7):
        store.put(k(i), blob(i))
    tiers = {key: tier for key, tier, _ in store.snapshot()}
    assert tiers == {
        k(6): Tier.HBM,
        k(5): Tier.HBM,
        k(4): Tier.HOST,
        k(3): Tier.HOST,
        k(2): Tier.SSD,
        k(1): Tier.SSD,
    }
    assert [e.kind for e in seen if e.key == k(0)] == ["stored", "moved", "moved", "evicted"]
    assert len(list((tmp_path / "fp").glob("*.kv"))) == 2


def test_fetch_copies_bytes_reports_tiers_and_promotes(tmp_path: Path) -> None:
    store, seen, _ = make(tmp_path, (2 * B, 2 * B, 4 * B))
    for i in range(5):
        store.put(k(i), blob(i))
    # 0 is on SSD, 1,2 on host, 3,4 in HBM
    assert store.lookup([k(0), k(1), k(3), k(99), k(4)]) == [Tier.SSD, Tier.HOST, Tier.HBM]
    got = store.fetch([k(0), k(1), k(3)])
    assert got.blobs == [blob(0), blob(1), blob(3)]
    assert got.tokens_by_tier == (B, B, B)
    assert got.seconds_by_tier[2] > 0
    assert store.tier_of(k(0)) == Tier.HBM  # promoted; head of the prompt is MRU
    assert any(
        e.kind == "moved" and e.key == k(0) and e.to_json()["from_tier"] == "ssd" for e in seen
    )


def test_fetch_of_missing_block_changes_nothing(tmp_path: Path) -> None:
    store, _, _ = make(tmp_path, (2 * B, 2 * B, 2 * B))
    store.put(k(1), blob(1))
    before = store.snapshot()
    with pytest.raises(KeyError):
        store.fetch([k(1), k(2)])
    assert store.snapshot() == before


def test_put_many_keeps_prompt_head_most_recent(tmp_path: Path) -> None:
    store, _, _ = make(tmp_path, (2 * B, 0, 0))
    store.put_many([(k(i), blob(i)) for i in range(3)])
    assert store.lookup([k(0), k(1), k(2)]) == [Tier.HBM, Tier.HBM]  # deepest evicted


def test_expiry_drops_blocks_and_reports_reason() -> None:
    store, seen, clock = make(None, (4 * B, 4 * B, 4 * B), ttl=10.0)
    store.put(k(0), blob(0))
    clock.t += 5
    store.fetch([k(0)])  # use refreshes the expiry
    clock.t += 9
    assert store.lookup([k(0)]) == [Tier.HBM]
    clock.t += 2
    assert store.sweep() == 1
    assert store.lookup([k(0)]) == []
    assert seen[-1].kind == "evicted" and seen[-1].reason == "expired"


def test_no_cache_dir_means_no_ssd_tier() -> None:
    store, seen, _ = make(None, (B, B, 100 * B))
    for i in range(3):
        store.put(k(i), blob(i))
    assert store.resident_tokens() == (B, B, 0)
    assert seen[-1].kind == "evicted"


def test_disk_tier_is_reindexed_after_restart(tmp_path: Path) -> None:
    store, _, _ = make(tmp_path, (B, 0, 4 * B), ttl=50.0)
    store.put(k(0), blob(0))
    store.put(k(1), blob(1))  # pushes 0 to SSD
    assert store.tier_of(k(0)) == Tier.SSD
    fresh, seen, _ = make(tmp_path, (B, 0, 4 * B), ttl=50.0)
    assert fresh.tier_of(k(0)) == Tier.SSD and fresh.tier_of(k(1)) is None
    assert [(e.kind, e.tier) for e in seen] == [("stored", Tier.SSD)]
    assert fresh.fetch([k(0)]).blobs == [blob(0)]
    # files past their expiry are discarded at start
    later, seen3, _ = make(tmp_path, (B, 0, 4 * B), ttl=50.0, start=1100.0)
    assert later.snapshot() == [] and seen3 == []
    assert list((tmp_path / "fp").glob("*.kv")) == []


def test_bad_capacities_are_refused() -> None:
    with pytest.raises(ValueError):
        GlobalKVStore(block_tokens=B, capacity_tokens=(-1, 0, 0), cache_dir=None, fingerprint="x")
    with pytest.raises(ValueError):
        GlobalKVStore(block_tokens=0, capacity_tokens=(1, 0, 0), cache_dir=None, fingerprint="x")
