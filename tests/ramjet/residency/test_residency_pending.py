"""Pending residency: blocks of requests sent to an engine, not yet confirmed by a report."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from ramjet.keys.prefix import PrefixKeys, compute_keys, key_seed, render_chat
from ramjet.policy.base import EngineLoad, EngineView, GlobalMatch, RequestView
from ramjet.policy.candidates import uncached_prompt_tokens
from ramjet.residency.config import ResidencyConfig
from ramjet.residency.pending import PendingOverlay
from ramjet.residency.store import Table
from ramjet.residency.tables import ResidencyTables, ViewMode
from ramjet.types import EngineId, PrefixKey, Tier

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers"))
from manual_clock import ManualClock

E0 = EngineId("e0")
E1 = EngineId("e1")


def make(**cfg: object) -> tuple[ResidencyTables, ManualClock]:
    clock = ManualClock()
    return ResidencyTables(ResidencyConfig.model_validate(cfg), clock=clock), clock


def prompt(text: str, turns: int = 1) -> PrefixKeys:
    msgs = [{"role": "user", "content": f"{text} {i}"} for i in range(turns)]
    return compute_keys(render_chat(msgs), key_seed("m"))


KEYS = prompt("x" * 2000)
N = len(KEYS.blocks)
TOK = [256] * N
FULL = 256 * N


def match(tables: ResidencyTables, engine: EngineId, keys: PrefixKeys = KEYS) -> GlobalMatch:
    return tables.view(engine).global_match(keys.blocks, [256] * len(keys.blocks))


@pytest.mark.parametrize("mode", [ViewMode.REPORTED, ViewMode.APPROXIMATE])
def test_pending_is_visible_at_once_as_hbm_and_live_swa(mode: ViewMode) -> None:
    tables, clock = make()
    tables.set_mode(E0, mode)
    tables.add_pending(E0, KEYS, clock.t)
    assert N >= 5
    assert match(tables, E0) == GlobalMatch(hbm=FULL, pending=FULL)
    assert tables.view(E0).swa_match(KEYS.boundaries) == KEYS.boundaries[-1][0]
    assert match(tables, E1) == GlobalMatch()  # only where it was sent
    tables.set_mode(E0, ViewMode.SILENT)  # a silent engine steers nothing, pending included
    assert match(tables, E0) == GlobalMatch()
    assert tables.view(E0).swa_match(KEYS.boundaries) == 0


def test_pending_never_enters_the_store_or_its_gauge() -> None:
    reg = CollectorRegistry()
    clock = ManualClock()
    tables = ResidencyTables(ResidencyConfig(), clock=clock, registry=reg)
    tables.add_pending(E0, KEYS, clock.t)
    assert tables.size(Table.GLOBAL) == 0 and tables.size(Table.SWA) == 0
    assert tables.store.get(Table.GLOBAL, E0, KEYS.blocks[0], clock.t, True) is None
    assert reg.get_sample_value("ramjet_residency_entries", {"table": "global"}) == 0
    assert reg.get_sample_value("ramjet_residency_pending_entries") == N + 1


def test_pending_never_overrides_exact_and_fills_behind_it() -> None:
    tables, clock = make()
    tables.set_mode(E0, ViewMode.REPORTED)
    tables.store_global(E0, KEYS.blocks[:2], Tier.HOST, clock.t)
    tables.add_pending(E0, KEYS, clock.t)
    # the reported host blocks stay host; the rest of the prompt is pending in HBM
    m = match(tables, E0)
    assert m == GlobalMatch(hbm=FULL - 512, host=512, pending=FULL - 512)
    assert m.total == FULL


def test_a_report_confirms_and_an_eviction_is_not_undone() -> None:
    tables, clock = make()
    tables.set_mode(E0, ViewMode.REPORTED)
    tables.add_pending(E0, KEYS, clock.t)
    tables.store_global(E0, iter(KEYS.blocks[:3]), Tier.HBM, clock.t)  # a one-shot iterator
    assert match(tables, E0) == GlobalMatch(hbm=FULL, pending=FULL - 3 * 256)
    assert tables.pending.size() == N + 1 - 3
    # the engine later evicts block 1: the confirmed block is gone, pending does not return it
    tables.evict_global(E0, [KEYS.blocks[1]])
    assert match(tables, E0) == GlobalMatch(hbm=256)
    # the SWA boundary: reported stored, then expired
    last = KEYS.boundaries[-1][1]
    tables.store_swa(E0, [last], clock.t)
    tables.expire_swa(E0, [last])
    assert tables.view(E0).swa_match(KEYS.boundaries) == 0


def test_a_snapshot_confirms_what_it_lists_and_leaves_the_rest_pending() -> None:
    tables, clock = make()
    tables.set_mode(E0, ViewMode.REPORTED)
    tables.add_pending(E0, KEYS, clock.t)
    # the snapshot was taken while the request was prefilling: its first two blocks only
    tables.replace_engine(E0, [(k, Tier.HBM, None) for k in KEYS.blocks[:2]], [], clock.t)
    assert tables.pending.size() == N + 1 - 2
    assert match(tables, E0) == GlobalMatch(hbm=FULL, pending=FULL - 512)


def test_pending_expires_after_its_ttl() -> None:
    tables, clock = make(pending_ttl_s=30.0)
    tables.set_mode(E0, ViewMode.REPORTED)
    tables.add_pending(E0, KEYS, clock.t)
    clock.t += 29.9
    assert match(tables, E0).pending == FULL
    clock.t += 0.2
    assert match(tables, E0) == GlobalMatch()
    assert tables.view(E0).swa_match(KEYS.boundaries) == 0
    assert tables.pending.size() == 0 and tables.pending.tickets() == 0


def test_a_failed_request_releases_only_its_own_holds() -> None:
    tables, clock = make()
    tables.set_mode(E0, ViewMode.REPORTED)
    system = {"role": "system", "content": "s" * 1500}
    seed = key_seed("m")
    first = compute_keys(render_chat([system, {"role": "user", "content": "a" * 900}]), seed)
    other = compute_keys(render_chat([system, {"role": "user", "content": "b" * 900}]), seed)
    shared = next(
        i for i, (x, y) in enumerate(zip(first.blocks, other.blocks, strict=False)) if x != y
    )
    assert 0 < shared < len(first.blocks)
    t_first = tables.add_pending(E0, first, clock.t)
    t_other = tables.add_pending(E0, other, clock.t)
    tables.settle_pending(t_first, None, clock.t)  # the first request failed
    assert match(tables, E0, other).pending == 256 * len(other.blocks)
    assert match(tables, E0, first).pending == 256 * shared  # only the shared system prefix
    tables.settle_pending(t_other, None, clock.t)
    tables.settle_pending(t_other, None, clock.t)  # idempotent
    assert match(tables, E0, other) == GlobalMatch()
    assert tables.pending.size() == 0


def test_success_keeps_the_holds_and_a_retry_moves_them() -> None:
    tables, clock = make()
    ticket = tables.add_pending(E0, KEYS, clock.t)
    tables.settle_pending(ticket, E0, clock.t + 1)
    assert match(tables, E0).pending == FULL
    tables.settle_pending(ticket, E1, clock.t + 1)  # it was answered by E1 after a retry
    assert match(tables, E0) == GlobalMatch()
    assert match(tables, E1).pending == FULL


def test_a_new_epoch_drops_the_engines_holds() -> None:
    tables, clock = make()
    tables.add_pending(E0, KEYS, clock.t)
    tables.add_pending(E1, KEYS, clock.t)
    tables.purge_engine(E0)
    assert match(tables, E0) == GlobalMatch()
    assert match(tables, E1).pending == FULL
    assert tables.pending.size() == N + 1


def test_memory_is_bounded_and_the_oldest_tickets_go_first() -> None:
    overlay = PendingOverlay(ttl_s=30.0, max_entries=10)
    a = overlay.add(E0, [PrefixKey(i) for i in range(4)], None, 0.0)
    b = overlay.add(E0, [PrefixKey(100 + i) for i in range(4)], None, 1.0)
    c = overlay.add(E1, [PrefixKey(200 + i) for i in range(4)], None, 2.0)
    assert overlay.size() <= 10
    assert not a.live and b.live and c.live  # a (the oldest) was dropped whole
    held = overlay.holds(Table.GLOBAL, E0)
    assert held is not None and set(held) == {PrefixKey(100 + i) for i in range(4)}
    # one ticket over the whole cap keeps its SWA key and its first blocks
    big = overlay.add(E0, [PrefixKey(300 + i) for i in range(50)], PrefixKey(9), 3.0)
    assert overlay.size() == 10 and big.live and not b.live and not c.live
    held = overlay.holds(Table.GLOBAL, E0)
    assert held is not None and set(held) == {PrefixKey(300 + i) for i in range(9)}
    assert overlay.holds(Table.SWA, E0) is not None
    overlay.release(big)
    assert overlay.size() == 0 and overlay.holds(Table.GLOBAL, E0) is None


def test_bad_overlay_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        PendingOverlay(ttl_s=0.0, max_entries=1)
    with pytest.raises(ValueError, match="max_entries"):
        PendingOverlay(ttl_s=1.0, max_entries=0)
    with pytest.raises(ValueError):
        ResidencyConfig.model_validate({"pending_ttl_s": -1})


def test_uncached_prompt_tokens_subtract_the_predicted_match() -> None:
    tables, clock = make()
    tables.set_mode(E0, ViewMode.REPORTED)
    tables.store_global(E0, KEYS.blocks[:2], Tier.SSD, clock.t)
    n = FULL + 100
    req = RequestView("r", "m", n, KEYS.blocks, TOK, [])

    def view(e: EngineId) -> EngineView:
        return EngineView(e, True, EngineLoad(), tables.view(e))

    assert uncached_prompt_tokens(req, view(E0)) == n - 512
    assert uncached_prompt_tokens(req, view(E1)) == n
    tables.add_pending(E1, KEYS, clock.t)
    assert uncached_prompt_tokens(req, view(E1)) == 100
    short = RequestView("r", "m", 300, KEYS.blocks, TOK, [])
    assert uncached_prompt_tokens(short, view(E1)) == 0  # a match past the prompt clips
