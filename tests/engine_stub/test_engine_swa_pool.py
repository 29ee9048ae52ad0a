"""SWAPool: byte cap with LRU eviction, idle TTL, events."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from engine_stub.events import CacheEvent, CacheEvents
from engine_stub.swa_pool import SWAPool, default_cap_bytes
from ramjet.types import PrefixKey

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from manual_clock import ManualClock


def make(cap: int, ttl: float = 60.0):
    events = CacheEvents()
    seen: list[CacheEvent] = []
    events.subscribe(seen.append)
    clock = ManualClock(50.0)
    return SWAPool(cap_bytes=cap, ttl_s=ttl, events=events, clock=clock), seen, clock


def test_lru_eviction_under_byte_cap() -> None:
    pool, seen, _ = make(cap=250)
    for i in range(3):
        assert pool.put(PrefixKey(i), 10 * i, b"x" * 100)
    assert pool.get(PrefixKey(0)) is None  # oldest went
    assert pool.bytes_used == 200 and len(pool) == 2
    assert [(e.kind, e.reason) for e in seen if e.kind == "swa_expired"] == [
        ("swa_expired", "capacity")
    ]
    pool.get(PrefixKey(1))  # now 2 is LRU
    pool.put(PrefixKey(3), 1, b"y" * 100)
    assert pool.get(PrefixKey(2)) is None and pool.get(PrefixKey(1)) is not None


def test_idle_ttl_expires_and_use_refreshes() -> None:
    pool, seen, clock = make(cap=1000, ttl=60.0)
    pool.put(PrefixKey(7), 5, b"t" * 10)
    clock.t += 59
    entry = pool.get(PrefixKey(7))
    assert entry is not None and entry.tail == b"t" * 10 and entry.n_tokens == 5
    clock.t += 59
    assert pool.sweep() == 0
    clock.t += 1
    assert pool.sweep() == 1 and pool.get(PrefixKey(7)) is None
    assert seen[-1].kind == "swa_expired" and seen[-1].reason == "ttl"


def test_oversize_state_is_refused_and_changes_nothing() -> None:
    pool, seen, _ = make(cap=10)
    assert not pool.put(PrefixKey(1), 1, b"z" * 11)
    assert len(pool) == 0 and seen == []


def test_bad_settings_refused_and_default_cap_is_a_tenth_of_memory() -> None:
    with pytest.raises(ValueError):
        SWAPool(cap_bytes=0)
    with pytest.raises(ValueError):
        SWAPool(cap_bytes=10, ttl_s=0)
    assert default_cap_bytes() > 0
