"""Residency tables: longest match by tier, SWA match, exact vs approximate, modes, caps."""

from __future__ import annotations

import random
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from ramjet.keys.prefix import PrefixKeys, compute_keys, key_seed, longest_prefix, render_chat
from ramjet.policy.base import GlobalMatch
from ramjet.residency.config import ResidencyConfig
from ramjet.residency.store import Table
from ramjet.residency.tables import ResidencyTables, ViewMode
from ramjet.types import EngineId, PrefixKey, Tier

E0 = EngineId("e0")
E1 = EngineId("e1")
KEYS = [PrefixKey(1000 + i) for i in range(20)]
TOKENS = [256] * 20


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(**cfg: object) -> tuple[ResidencyTables, Clock]:
    clock = Clock()
    return ResidencyTables(ResidencyConfig.model_validate(cfg), clock=clock), clock


def test_longest_prefix_bounds_the_first_hole_on_any_predicate() -> None:
    rng = random.Random(7)
    for _ in range(500):
        n = rng.randrange(0, 30)
        present = [rng.random() < 0.8 for _ in range(n)]
        bound = longest_prefix(range(n), present.__getitem__)
        first_hole = next((i for i, p in enumerate(present) if not p), n)
        assert bound == n or not present[bound]
        assert bound >= first_hole


def test_global_match_splits_by_tier_and_stops_at_first_hole() -> None:
    tables, clock = make()
    tables.set_mode(E0, ViewMode.REPORTED)
    tables.store_global(E0, KEYS[:5], Tier.HBM, clock.t)
    tables.store_global(E0, KEYS[5:8], Tier.HOST, clock.t)
    tables.store_global(E0, KEYS[8:10], Tier.SSD, clock.t)
    tables.store_global(E0, KEYS[11:15], Tier.HBM, clock.t)  # behind a hole: not matched
    m = tables.view(E0).global_match(KEYS, TOKENS)
    assert m == GlobalMatch(hbm=5 * 256, host=3 * 256, ssd=2 * 256)
    tables.evict_global(E0, [KEYS[2]])
    assert tables.view(E0).global_match(KEYS, TOKENS) == GlobalMatch(hbm=2 * 256)
    assert tables.view(E1).global_match(KEYS, TOKENS) == GlobalMatch()


def test_global_match_equals_linear_scan_on_random_tables() -> None:
    rng = random.Random(3)
    for _ in range(200):
        tables, clock = make()
        tables.set_mode(E0, ViewMode.REPORTED)
        held = {k: Tier(rng.randrange(3)) for k in KEYS if rng.random() < 0.9}
        for k, t in held.items():
            tables.store_global(E0, [k], t, clock.t)
        want = [0, 0, 0]
        for k, n in zip(KEYS, TOKENS, strict=True):
            if k not in held:
                break
            want[held[k]] += n
        assert tables.view(E0).global_match(KEYS, TOKENS).by_tier() == tuple(want)


def _linear_match(tables: ResidencyTables, mode: ViewMode, tokens: list[int]) -> GlobalMatch:
    """The reference: one `get` per block, stopping at the first block neither stored
    nor pending."""
    now, approx = tables.clock(), mode is ViewMode.APPROXIMATE
    held = tables.pending.holds(Table.GLOBAL, E0) or {}
    by_tier, pending = [0, 0, 0], 0
    for k, n in zip(KEYS, tokens, strict=True):
        entry = tables.store.get(Table.GLOBAL, E0, k, now, approx)
        if entry is None:
            if k not in held:
                break
            pending += n
        else:
            by_tier[entry.tier] += n
    return GlobalMatch(by_tier[0] + pending, by_tier[1], by_tier[2], pending)


@pytest.mark.parametrize("mode", [ViewMode.APPROXIMATE, ViewMode.REPORTED])
def test_global_match_equals_linear_scan_with_expiry_approximate_and_pending(
    mode: ViewMode,
) -> None:
    rng = random.Random(11)
    for _ in range(300):
        tables, clock = make(global_ttl_s=100.0)
        tables.set_mode(E0, mode)
        tokens = [rng.choice((255, 256)) for _ in KEYS]  # uneven, as with bytes_per_token != 1
        for k in KEYS:
            r = rng.random()
            if r < 0.5:
                ttl = rng.choice((5.0, 50.0, None))
                tables.store_global(E0, [k], Tier(rng.randrange(3)), clock.t, ttl_s=ttl)
            elif r < 0.75:
                tables.store.put(
                    Table.GLOBAL, E0, [k], Tier.HBM, clock.t, clock.t + rng.choice((5, 50)), False
                )
        if rng.random() < 0.5:
            tables.add_pending(E0, _keys_of(rng.sample(KEYS, rng.randrange(len(KEYS)))), clock.t)
        clock.t += 10  # some entries expired, not swept
        got = tables.view(E0).global_match(KEYS, tokens)
        assert got == _linear_match(tables, mode, tokens)
        assert got.pending == _linear_match(tables, mode, tokens).pending


def _keys_of(blocks: list[PrefixKey]) -> PrefixKeys:
    return PrefixKeys(0, 256, tuple(blocks), (), 256 * len(blocks))


def test_store_get_many_equals_get_key_by_key() -> None:
    rng = random.Random(5)
    for _ in range(100):
        tables, clock = make()
        store = tables.store
        for k in KEYS:
            for exact in (True, False):
                if rng.random() < 0.4:
                    expires = clock.t + rng.choice((-1.0, 10.0))
                    store.put(
                        Table.GLOBAL, E0, [k], Tier(rng.randrange(3)), clock.t, expires, exact
                    )
        for approx in (True, False):
            want = [store.get(Table.GLOBAL, E0, k, clock.t, approx) for k in KEYS]
            assert store.get_many(Table.GLOBAL, E0, KEYS, clock.t, approx) == want


def test_a_view_looks_up_once_per_request_and_a_new_view_sees_changes() -> None:
    tables, clock = make()
    tables.set_mode(E0, ViewMode.REPORTED)
    tables.store_global(E0, KEYS[:4], Tier.HBM, clock.t)
    calls: list[object] = []
    store = tables.store

    class Counting:  # the store, counting its lookups (the compiled store's methods
        def __getattr__(self, name: str) -> Any:  # cannot be replaced on the instance)
            return getattr(store, name)

        def get_many(self, *args: Any) -> Any:
            calls.append(args[0])
            return store.get_many(*args)

    tables.store = Counting()  # type: ignore[assignment]
    bounds = [(10, PrefixKey(1))]
    view = tables.view(E0)
    for _ in range(3):  # the incumbent, the candidate, the router's in-flight figure
        assert view.global_match(KEYS, TOKENS).total == 4 * 256
        assert view.swa_match(bounds) == 0
    assert calls == [Table.GLOBAL, Table.SWA]
    assert view.global_match(KEYS[:2], TOKENS[:2]).total == 2 * 256  # other keys: looked up
    tables.store_global(E0, KEYS[4:6], Tier.HOST, clock.t)
    tables.store_swa(E0, [PrefixKey(1)], clock.t)
    fresh = tables.view(E0)
    assert fresh.global_match(KEYS, TOKENS) == GlobalMatch(hbm=4 * 256, host=2 * 256)
    assert fresh.global_match(KEYS, TOKENS).blocks == 6
    assert fresh.swa_match(bounds) == 10


def test_global_entries_expire_on_the_tables_clock() -> None:
    tables, clock = make(global_ttl_s=100.0)
    tables.set_mode(E0, ViewMode.REPORTED)
    tables.store_global(E0, KEYS[:4], Tier.HBM, clock.t)
    tables.store_global(E0, KEYS[4:6], Tier.HBM, clock.t, ttl_s=10.0)  # engine's shorter TTL
    clock.t += 11
    assert tables.view(E0).global_match(KEYS, TOKENS).total == 4 * 256
    clock.t += 90
    assert tables.view(E0).global_match(KEYS, TOKENS).total == 0
    assert tables.expire() == 6
    assert tables.size(Table.GLOBAL) == 0


def test_swa_match_returns_furthest_live_boundary() -> None:
    tables, clock = make(swa_ttl_s=60.0)
    tables.set_mode(E0, ViewMode.REPORTED)
    bounds = [(100, PrefixKey(1)), (300, PrefixKey(2)), (700, PrefixKey(3))]
    tables.store_swa(E0, [PrefixKey(1), PrefixKey(2)], clock.t)
    assert tables.view(E0).swa_match(bounds) == 300
    tables.expire_swa(E0, [PrefixKey(2)])
    assert tables.view(E0).swa_match(bounds) == 100
    clock.t += 61
    assert tables.view(E0).swa_match(bounds) == 0


def test_record_routed_is_approximate_and_never_overrides_exact() -> None:
    rendered = render_chat([{"role": "user", "content": "x" * 2000}])
    keys = compute_keys(rendered, key_seed("m"))
    tokens = [256] * len(keys.blocks)
    tables, clock = make(approximate_ttl_s=50.0)
    tables.record_routed(E0, keys, clock.t)
    view = tables.view(E0)
    assert view.global_match(keys.blocks, tokens).hbm == 256 * len(keys.blocks)
    assert view.swa_match(keys.boundaries) == keys.boundaries[-1][0]
    # an exact entry (host tier) stays what it is when the router records the route again
    tables.store_global(E0, keys.blocks[:2], Tier.HOST, clock.t)
    tables.record_routed(E0, keys, clock.t + 1)
    m = tables.view(E0).global_match(keys.blocks, tokens)
    assert (m.hbm, m.host) == (256 * (len(keys.blocks) - 2), 512)
    # once the engine reports, approximate entries neither steer nor get written
    tables.set_mode(E0, ViewMode.REPORTED)
    assert tables.view(E0).global_match(keys.blocks, tokens) == GlobalMatch(host=512)
    clock.t += 51
    tables.set_mode(E0, ViewMode.APPROXIMATE)
    assert tables.view(E0).global_match(keys.blocks, tokens) == GlobalMatch(host=512)


def test_silent_engine_does_not_steer() -> None:
    tables, clock = make()
    tables.store_global(E0, KEYS[:3], Tier.HBM, clock.t)
    tables.store_swa(E0, [PrefixKey(9)], clock.t)
    tables.set_mode(E0, ViewMode.SILENT)
    view = tables.view(E0)
    assert view.global_match(KEYS, TOKENS) == GlobalMatch()
    assert view.swa_match([(10, PrefixKey(9))]) == 0


def test_snapshot_replaces_and_purge_forgets() -> None:
    tables, clock = make()
    tables.set_mode(E0, ViewMode.REPORTED)
    tables.store_global(E0, KEYS[:10], Tier.HBM, clock.t)
    tables.store_global(E1, KEYS[:10], Tier.HBM, clock.t)
    snap = [(k, Tier.SSD, None) for k in KEYS[:3]]
    tables.replace_engine(E0, snap, [(PrefixKey(5), 30.0)], clock.t)
    assert tables.view(E0).global_match(KEYS, TOKENS) == GlobalMatch(ssd=3 * 256)
    assert tables.view(E0).swa_match([(7, PrefixKey(5))]) == 7
    assert tables.size(Table.GLOBAL) == 13
    tables.purge_engine(E0)
    assert tables.view(E0).global_match(KEYS, TOKENS) == GlobalMatch()
    assert tables.size(Table.GLOBAL) == 10 and tables.size(Table.SWA) == 0


def test_cap_evicts_approximate_first_then_least_recently_confirmed() -> None:
    tables, clock = make(max_global_entries=5)
    keys = compute_keys(render_chat([{"role": "u", "content": "y" * 600}]), 1)
    routed = keys.blocks
    tables.record_routed(E1, keys, clock.t)
    assert tables.size(Table.GLOBAL) == 2
    tables.store_global(E0, KEYS[:4], Tier.HBM, clock.t + 1)
    assert tables.size(Table.GLOBAL) == 5
    # the table was full: the least recently confirmed approximate entry went first
    assert tables.store.get(Table.GLOBAL, E1, routed[0], clock.t + 1, True) is None
    assert tables.store.get(Table.GLOBAL, E1, routed[1], clock.t + 1, True) is not None
    tables.store_global(E0, [KEYS[4]], Tier.HBM, clock.t + 1)
    assert tables.store.get(Table.GLOBAL, E1, routed[1], clock.t + 1, True) is None
    assert tables.size(Table.GLOBAL) == 5
    # no approximate entry left: the least recently confirmed exact one goes
    tables.store_global(E0, [KEYS[0]], Tier.HBM, clock.t + 3)  # refresh: now most recent
    tables.store_global(E0, [KEYS[7]], Tier.HBM, clock.t + 4)
    assert tables.size(Table.GLOBAL) == 5
    assert tables.store.get(Table.GLOBAL, E0, KEYS[0], clock.t + 4, False) is not None
    assert tables.store.get(Table.GLOBAL, E0, KEYS[1], clock.t + 4, False) is None


def test_metrics_collector_reports_sizes() -> None:
    reg = CollectorRegistry()
    tables = ResidencyTables(registry=reg, clock=Clock())
    tables.store_global(E0, KEYS[:3], Tier.HBM, 1000.0)
    assert reg.get_sample_value("ramjet_residency_entries", {"table": "global"}) == 3
    assert reg.get_sample_value("ramjet_residency_entries", {"table": "swa"}) == 0


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError):
        ResidencyConfig.model_validate({"global_ttl_s": 0})
    with pytest.raises(ValueError):
        ResidencyConfig.model_validate({"swa_ttl_s": 10, "swa_max_ttl_s": 5})
    with pytest.raises(ValueError):
        ResidencyConfig.model_validate({"nope": 1})
