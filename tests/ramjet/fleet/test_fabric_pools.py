"""Shared pools (issue 30, ARCHITECTURE 5b): the policy declares them, each member's view
carries the pool's residency and pull cost, and the cost model prices a session moved to
the other engine as a pull from the pool (milliseconds), not a recompute (seconds)."""

from __future__ import annotations

import pytest
from reports_fixtures import KEYS, frame, rig, stored

from ramjet.config import parse_policy
from ramjet.fleet.engines import Fleet
from ramjet.fleet.signals import NoSignals
from ramjet.fleet.views import engine_views
from ramjet.policy.base import EngineLoad, FleetStats, RequestView
from ramjet.policy.cost import V41_FLASH_TP4_ESTIMATE, estimate
from ramjet.policy.views import EngineView, PoolView
from ramjet.reports.verify import Reason
from ramjet.residency.tables import ResidencyTables
from ramjet.types import EngineId, PrefixKey, Tier

E0, E1, POOL = EngineId("e0"), EngineId("e1"), EngineId("host0")
BLOCKS = 200  # 50k tokens of a V4.1 prompt at 256 tokens a block
KEYS_ = [PrefixKey(1000 + i) for i in range(BLOCKS)]
POLICY = {
    "engines": [{"id": "e0", "url": "http://127.0.0.1:9"}, {"id": "e1", "url": "http://127.0.0.1:9"}],
    "incumbent": {"name": "tier_aware"},
    "fabric": {
        "pools": [
            {"id": "host0", "tier": "host", "engines": ["e0", "e1"],
             "bandwidth_bytes_per_s": 50e9, "latency_s": 0.0005,
             "members": {"e1": {"bandwidth_bytes_per_s": 25e9}}},
        ]
    },
}  # fmt: skip


def _request() -> RequestView:
    return RequestView("r", "m", BLOCKS * 256 + 100, KEYS_, [256] * BLOCKS + [100], [])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"engines": ["e0", "e9"]}, "'e9' is not a declared engine"),
        ({"id": "e0"}, "is an engine id"),
        ({"members": {"e9": {"latency_s": 0.001}}}, "not a member"),
        ({"tier": "nvme"}, "tier"),
        ({"bandwidth_bytes_per_s": 0}, "bandwidth_bytes_per_s"),
    ],
)
def test_a_bad_pool_is_refused_at_load(change: dict[str, object], message: str) -> None:
    pool = {**POLICY["fabric"]["pools"][0], **change}  # type: ignore[index]
    with pytest.raises(ValueError, match=message):
        parse_policy({**POLICY, "fabric": {"pools": [pool]}})


def test_keys_for_an_undeclared_pool_are_refused_at_load() -> None:
    key = {"key_id": "k", "public_key": "AAAA"}
    with pytest.raises(ValueError, match="host9: not a declared engine or fabric pool"):
        parse_policy({**POLICY, "keys": {"engines": {"host9": [key]}}})


def test_a_report_from_an_identity_without_keys_changes_nothing() -> None:
    r = rig()
    out = r.processor.submit(
        frame(stored(1, 2, tier="host"), engine=EngineId("host9"), key_id="e0-a")
    )
    assert getattr(out, "reason", None) == Reason.WRONG_ENGINE_KEY, out
    assert r.tables.view(EngineId("host9")).global_match([PrefixKey(1)], [256]).total == 0
    assert "e0-a" in KEYS


def test_each_member_sees_the_pool_at_its_own_pull_cost() -> None:
    config = parse_policy(POLICY)
    tables = ResidencyTables()
    tables.store_global(POOL, KEYS_, Tier.HOST, now=0.0)
    fleet = Fleet(config.engines, config.health, config.retry, lambda: 0.0)
    pools = {
        EngineId(e.id): tuple(
            (p.id, p.tier, *p.cost_into(e.id)) for p in config.fabric.pools_of(e.id)
        )
        for e in config.engines
    }
    views, _, _ = engine_views(fleet, NoSignals(), tables, "m", 0.0, pools)
    by = {v.id: v for v in views}
    assert [p.bandwidth_bytes_per_s for p in by[E0].pools] == [50e9]
    assert [p.bandwidth_bytes_per_s for p in by[E1].pools] == [25e9]
    match = by[E1].pools[0].residency.global_match(KEYS_, [256] * BLOCKS)
    assert match.total == BLOCKS * 256


class _Held:
    def __init__(self, blocks: int) -> None:
        self.blocks = blocks

    def global_match(self, keys: object, tokens: object) -> object:
        from ramjet.policy.views import GlobalMatch

        return GlobalMatch(self.blocks * 256, blocks=self.blocks)

    def swa_match(self, keys: object) -> int:
        return 0


def test_a_moved_session_is_priced_as_a_pull_not_a_recompute() -> None:
    """e0 holds the 50k-token prefix in HBM but is busy; e1 holds nothing of its own but
    pulls it from the shared host pool: about 1 ms of pull (44.5 MB at 50 GB/s) against
    about 2.8 s of recompute on an island."""
    req, prof = _request(), V41_FLASH_TP4_ESTIMATE
    pool = PoolView("host0", "host", 50e9, 0.0005, _Held(BLOCKS))  # type: ignore[arg-type]
    busy = EngineLoad(queued_prompt_tokens=40_000)
    e0 = EngineView(E0, True, busy, _Held(BLOCKS), prof)  # type: ignore[arg-type]
    island = EngineView(E1, True, EngineLoad(), _Held(0), prof)  # type: ignore[arg-type]
    shared = EngineView(E1, True, EngineLoad(), _Held(0), prof, pools=(pool,))  # type: ignore[arg-type]
    alone = estimate(req, [e0, island], FleetStats())[1]
    pulled = estimate(req, [e0, shared], FleetStats())[1]
    assert alone.work.prefill_s > 2.5 and alone.pool_tokens == 0
    assert pulled.pool_tokens == BLOCKS * 256
    assert pulled.work.restore_s == pytest.approx(0.0005 + BLOCKS * 256 * 890 / 50e9)
    assert pulled.work.work_s < 0.05  # the pull, the replay floor and 100 new tokens
    picks = estimate(req, [e0, shared], FleetStats())
    assert min(picks, key=lambda s: s.cost_s).engine == E1  # moved: the pool made it cheap
    assert pulled.components()["pool_tokens"] == BLOCKS * 256


def test_a_degraded_pool_is_not_pulled_from() -> None:
    from ramjet.types import TrustGrade

    req, prof = _request(), V41_FLASH_TP4_ESTIMATE
    pool = PoolView("host0", "host", 50e9, 0.0005, _Held(BLOCKS), TrustGrade.DEGRADED)  # type: ignore[arg-type]
    e1 = EngineView(E1, True, EngineLoad(), _Held(0), prof, pools=(pool,))  # type: ignore[arg-type]
    assert estimate(req, [e1], FleetStats())[0].pool_tokens == 0


def test_a_pool_reports_under_its_own_keys_once_for_all_members() -> None:
    """The pool is a reporting identity (its own key, epoch and sequence): its signed
    snapshot is kept once, under the pool's id, and both members read it."""
    from prometheus_client import CollectorRegistry
    from reports_fixtures import WALL0, Clocks

    from ramjet.reports.config import ReportsConfig
    from ramjet.reports.keys import KeyRing
    from ramjet.reports.processor import ReportProcessor
    from ramjet.reports.verify import Accepted

    clocks = Clocks()
    tables = ResidencyTables(clock=clocks.clock)
    ring = KeyRing({"stranger": (POOL, KEYS["stranger"].public_key())})
    proc = ReportProcessor(
        ring, tables, ReportsConfig(), CollectorRegistry(), clocks.wall_clock, clocks.clock
    )
    body = stored(*range(1000, 1000 + BLOCKS), tier="host")
    assert isinstance(
        proc.submit(frame(body, engine=POOL, key_id="stranger", wall=WALL0)), Accepted
    )
    for member in (E0, E1):
        assert tables.view(member).global_match(KEYS_, [256] * BLOCKS).total == 0  # not theirs
    held = tables.view(POOL).global_match(KEYS_, [256] * BLOCKS)
    assert held.total == BLOCKS * 256 and held.host == BLOCKS * 256
    forged = frame(stored(5, tier="host"), engine=POOL, key_id="stranger", signer="e0-a", seq=2)
    assert not isinstance(proc.submit(forged), Accepted)  # signed by another key
    assert tables.view(POOL).global_match([PrefixKey(5)], [256]).total == 0
