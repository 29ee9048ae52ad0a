"""Modes: observe never lets the candidate change the live pick (raising, slow, invalid);
canary is deterministic by session with the configured share; enforce uses the
candidate with the incumbent as fallback; the accounting-only pick, deferred, is made as
it would have been, on the views as they were. Plus the arrival-rate EWMA."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from policy_fakes import engine

from ramjet.app.modes import ArrivalRate, ModeOutcome, ModeRunner, canary_share_of
from ramjet.config import ModeConfig
from ramjet.keys.prefix import PrefixKey, PrefixKeys
from ramjet.metrics import RouterMetrics
from ramjet.policy.base import Decision, EngineLoad, EngineView, FleetStats, RequestView
from ramjet.residency.tables import ResidencyTables
from ramjet.types import EngineId

REQ = RequestView("r1", "m", 10, (), (), ())
FLEET = FleetStats()
ENGINES = [engine("e0"), engine("e1")]


class Fixed:
    def __init__(self, name: str, pick: str) -> None:
        self.name = name
        self._pick = pick
        self.calls = 0

    def pick(
        self, request: RequestView, engines: Sequence[EngineView], fleet: FleetStats
    ) -> Decision:
        self.calls += 1
        return Decision(engine=EngineId(self._pick), policy=self.name)


class Raising:
    name = "raising"

    def pick(
        self, request: RequestView, engines: Sequence[EngineView], fleet: FleetStats
    ) -> Decision:
        raise RuntimeError("scorer bug")


class FakeTimer:
    """Each pick 'takes' `step` seconds of timer time."""

    def __init__(self, step: float) -> None:
        self.t = 0.0
        self.step = step
        self.n = 0

    def __call__(self) -> float:
        self.n += 1
        if self.n % 2 == 0:
            self.t += self.step
        return self.t


def _count(m: RouterMetrics, kind: str, role: str = "candidate") -> float:
    v = m.registry.get_sample_value("ramjet_policy_errors_total", {"role": role, "kind": kind})
    return v or 0.0


def test_observe_candidate_raising_never_changes_the_pick() -> None:
    m = RouterMetrics()
    r = ModeRunner(ModeConfig(kind="observe"), Fixed("inc", "e1"), Raising(), m)  # type: ignore[arg-type]
    for _ in range(5):
        out = r.decide(REQ, ENGINES, FLEET, "s")
        assert out.live.engine == "e1" and out.live_role == "incumbent"
        assert out.candidate is None and out.candidate_error is not None
        assert out.candidate_error.startswith("raised: RuntimeError")
    assert _count(m, "raised") == 5


def test_observe_candidate_invalid_pick_is_contained() -> None:
    m = RouterMetrics()
    r = ModeRunner(ModeConfig(kind="observe"), Fixed("inc", "e0"), Fixed("cand", "e9"), m)
    out = r.decide(REQ, ENGINES, FLEET, "s")
    assert out.live.engine == "e0" and out.candidate_error == "invalid"


@pytest.mark.parametrize("defer", [False, True])
def test_observe_slow_candidate_discarded_then_skipped_for_cooldown(defer: bool) -> None:
    """Deferred or not, the candidate's budget and cool-down hold the same."""
    m = RouterMetrics()
    now = [0.0]
    cand = Fixed("cand", "e0")
    r = ModeRunner(
        ModeConfig(kind="observe", candidate_budget_s=0.01, slow_cooldown_s=5.0),
        Fixed("inc", "e1"),
        cand,
        m,
        clock=lambda: now[0],
        timer=FakeTimer(0.05),
    )

    def decide() -> ModeOutcome:
        out = r.decide(REQ, ENGINES, FLEET, "s", defer=defer)
        assert (out.deferred is not None) == defer
        r.settle(out)
        return out

    outs = [decide() for _ in range(4)]
    assert all(o.live.engine == "e1" and o.candidate is None for o in outs)
    assert [o.candidate_error for o in outs] == ["slow", "slow", "slow", "skipped"]
    assert cand.calls == 3 and _count(m, "slow") == 3 and _count(m, "skipped") == 1
    now[0] = 5.0
    assert decide().candidate_error == "slow"
    assert cand.calls == 4


def test_observe_disagreement_is_recorded_for_the_accounting() -> None:
    m = RouterMetrics()
    r = ModeRunner(ModeConfig(kind="observe"), Fixed("inc", "e1"), Fixed("cand", "e0"), m)
    out = r.decide(REQ, ENGINES, FLEET, "s")
    assert out.candidate is not None and out.candidate.engine == "e0" and out.live.engine == "e1"
    assert out.incumbent is not None and out.incumbent.engine == "e1"
    # agreement has one counter pair, by mode, in the accounting (ramjet_policy_agreed_total)
    assert (
        m.registry.get_sample_value("ramjet_decision_agreement_total", {"agree": "false"}) is None
    )


def test_error_series_exist_at_zero_by_role() -> None:
    reg = RouterMetrics().registry
    for role, kinds in (("candidate", ("raised", "invalid", "slow", "skipped")),
                        ("incumbent", ("raised", "invalid"))):  # fmt: skip
        for kind in kinds:
            labels = {"role": role, "kind": kind}
            assert reg.get_sample_value("ramjet_policy_errors_total", labels) == 0.0


def test_incumbent_accounting_pick_failing_in_canary_and_enforce_is_counted() -> None:
    for mode in (ModeConfig(kind="enforce"), ModeConfig(kind="canary", share=1.0)):
        m = RouterMetrics()
        r = ModeRunner(mode, Raising(), Fixed("cand", "e1"), m)  # type: ignore[arg-type]
        out = r.decide(REQ, ENGINES, FLEET, "s")
        assert out.live.engine == "e1" and out.live_role == "candidate"
        assert out.incumbent is None
        assert _count(m, "raised", "incumbent") == 1
        assert _count(m, "raised") == 0
        r = ModeRunner(mode, Fixed("inc", "e9"), Fixed("cand", "e1"), m)
        assert r.decide(REQ, ENGINES, FLEET, "s").live.engine == "e1"
        assert _count(m, "invalid", "incumbent") == 1


def test_observe_incumbent_failing_is_counted_by_role() -> None:
    m = RouterMetrics()
    r = ModeRunner(ModeConfig(kind="observe"), Raising(), Fixed("cand", "e0"), m)  # type: ignore[arg-type]
    out = r.decide(REQ, ENGINES, FLEET, "s")
    assert out.live_role == "fallback"
    assert _count(m, "raised", "incumbent") == 1 and _count(m, "raised") == 0


def test_canary_share_is_deterministic_by_session() -> None:
    m = RouterMetrics()
    r = ModeRunner(ModeConfig(kind="canary", share=0.3), Fixed("inc", "e0"), Fixed("cand", "e1"), m)
    sessions = [f"session-{i}" for i in range(2000)]
    first = [r.decide(REQ, ENGINES, FLEET, s).live.engine for s in sessions]
    second = [r.decide(REQ, ENGINES, FLEET, s).live.engine for s in sessions]
    assert first == second
    share = first.count(EngineId("e1")) / len(first)
    assert 0.25 < share < 0.35
    assert all(
        (canary_share_of(s) < 0.3) == (e == "e1") for s, e in zip(sessions, first, strict=True)
    )


def test_enforce_uses_candidate_and_falls_back() -> None:
    m = RouterMetrics()
    r = ModeRunner(ModeConfig(kind="enforce"), Fixed("inc", "e0"), Fixed("cand", "e1"), m)
    assert r.decide(REQ, ENGINES, FLEET, "s").live.engine == "e1"
    r2 = ModeRunner(ModeConfig(kind="enforce"), Fixed("inc", "e0"), Raising(), m)  # type: ignore[arg-type]
    out = r2.decide(REQ, ENGINES, FLEET, "s")
    assert out.live.engine == "e0" and out.live_role == "incumbent"
    assert _count(m, "raised") == 1 and _count(m, "raised", "incumbent") == 0


def test_both_failing_falls_back_to_least_loaded_healthy() -> None:
    m = RouterMetrics()
    engines = [
        engine("e0", inflight_tokens=900),
        engine("e1", inflight_tokens=10, healthy=False),
        engine("e2", inflight_tokens=50),
    ]
    r = ModeRunner(ModeConfig(kind="enforce"), Raising(), Raising(), m)  # type: ignore[arg-type]
    out = r.decide(REQ, engines, FLEET, "s")
    assert out.live.engine == "e2" and out.live_role == "fallback"


def test_arrival_rate_tracks_a_steady_stream() -> None:
    a = ArrivalRate(tau_s=2.0)
    t = 0.0
    for _ in range(2000):
        t += 0.01  # 100 requests/s
        a.arrive(t)
    assert math.isclose(a.rate(t), 100.0, rel_tol=0.05)
    assert a.rate(t + 10.0) < 100.0 * math.exp(-4)


# -- the deferred accounting-only pick (`decide(..., defer=True)`, `settle`) -------------


def test_observe_defers_the_candidate_and_settle_fills_it_in_as_decide_would() -> None:
    m = RouterMetrics()
    cand = Fixed("cand", "e0")
    r = ModeRunner(ModeConfig(kind="observe"), Fixed("inc", "e1"), cand, m)
    now = r.decide(REQ, ENGINES, FLEET, "s")
    out = r.decide(REQ, ENGINES, FLEET, "s", defer=True)
    assert cand.calls == 1  # the deferred pick is not made yet
    assert out.live == now.live and out.live_role == "incumbent" and out.incumbent == now.incumbent
    assert out.candidate is None and out.deferred is not None
    assert r.settle(out) is True and cand.calls == 2
    assert out.deferred is None
    assert (out.candidate, out.candidate_error) == (now.candidate, now.candidate_error)
    assert out.candidate_s >= 0.0
    assert r.settle(out) is False and cand.calls == 2  # once
    assert r.settle(now) is False  # nothing was deferred


def test_enforce_defers_only_the_incumbent_and_never_a_live_fallback() -> None:
    m = RouterMetrics()
    inc = Fixed("inc", "e1")
    r = ModeRunner(ModeConfig(kind="enforce"), inc, Fixed("cand", "e0"), m)
    out = r.decide(REQ, ENGINES, FLEET, "s", defer=True)
    assert out.live.engine == "e0" and out.live_role == "candidate" and inc.calls == 0
    assert out.incumbent is None and out.deferred is not None
    assert r.settle(out) and out.incumbent is not None and out.incumbent.engine == "e1"
    # the candidate fails: the incumbent is the live pick, made now
    r = ModeRunner(ModeConfig(kind="enforce"), inc, Raising(), m)  # type: ignore[arg-type]
    out = r.decide(REQ, ENGINES, FLEET, "s", defer=True)
    assert out.live.engine == "e1" and out.live_role == "incumbent" and out.deferred is None
    assert out.candidate_error is not None and out.candidate_error.startswith("raised")


class Looking:
    """A candidate that reports what the residency views show it for the request."""

    name = "looking"

    def __init__(self) -> None:
        self.seen: list[dict[str, tuple[int, int, int]]] = []

    def pick(
        self, request: RequestView, engines: Sequence[EngineView], fleet: FleetStats
    ) -> Decision:
        seen = {}
        for e in engines:
            g = e.residency.global_match(request.block_keys, request.block_tokens)
            seen[e.id] = (g.total, g.pending, e.residency.swa_match(request.boundary_keys))
        self.seen.append(seen)
        return Decision(engine=engines[0].id, policy=self.name)


def test_a_deferred_pick_reads_the_residency_as_it_was_at_decide_time() -> None:
    """What the forward does between the decision and the deferred pick (its blocks
    pending on the live engine, a report putting them in another engine's table) is not
    seen by the deferred pick: it reads what a pick at decide time read. A pick made
    that late on fresh views would see both."""
    tables = ResidencyTables()
    blocks = tuple(PrefixKey(1000 + i) for i in range(4))
    keys = PrefixKeys(0, 256, blocks, ((1024, blocks[-1]),), 1024)
    req = RequestView("r1", "m", 1024, blocks, (256,) * 4, ((1024, blocks[-1]),))

    def views() -> list[EngineView]:
        return [
            EngineView(EngineId(e), True, EngineLoad(), tables.view(EngineId(e), 0.0))
            for e in ("e0", "e1")
        ]

    looking = Looking()
    r = ModeRunner(ModeConfig(kind="observe"), Fixed("inc", "e0"), looking, RouterMetrics())
    out = r.decide(req, views(), FLEET, "s", defer=True)
    tables.add_pending(EngineId("e0"), keys, 0.0)  # the forward to e0
    tables.record_routed(EngineId("e1"), keys, 0.0)  # and something else, elsewhere
    r.settle(out)
    assert looking.seen == [{"e0": (0, 0, 0), "e1": (0, 0, 0)}]
    r.decide(req, views(), FLEET, "s")  # fresh views, made now
    assert looking.seen[1] == {"e0": (1024, 1024, 1024), "e1": (1024, 0, 1024)}
