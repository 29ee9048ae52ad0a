"""The session term: learned remaining turns, committed work per engine, and its price."""

from __future__ import annotations

import pytest

from ramjet.policy.base import EngineLoad, EngineView, FleetStats, GlobalMatch, RequestView
from ramjet.policy.registry import create_policy
from ramjet.policy.session_load import SessionLoad
from ramjet.types import EngineId, PrefixKey

A, B = EngineId("a"), EngineId("b")


def test_remaining_turns_is_the_prior_until_enough_sessions_ended_then_learned() -> None:
    s = SessionLoad(idle_s=10.0, min_sessions=3)
    assert s.remaining_turns(4) == 4.0  # prior: as long again
    # three sessions of 2, 4 and 6 turns, then silence past idle_s ends them
    t = 0.0
    for sid, n in (("x", 2), ("y", 4), ("z", 6)):
        for _ in range(n):
            s.routed(sid, A, 0.1, t)
            t += 0.1
    s.routed("late", A, 0.1, t + 100.0)
    assert s.ended == 3
    assert s.remaining_turns(1) == pytest.approx((1 + 3 + 5) / 3)
    assert s.remaining_turns(3) == pytest.approx((1 + 3) / 2)
    assert s.remaining_turns(6) == 0.0


def test_committed_work_follows_a_session_that_moves() -> None:
    s = SessionLoad(idle_s=100.0)
    s.routed("x", A, 0.2, 0.0)
    s.routed("x", A, 0.2, 1.0)
    assert s.committed[A] == pytest.approx(2 * 0.2)  # prior R = 2 turns seen
    s.routed("x", B, 0.2, 2.0)
    assert s.committed[A] == 0.0
    assert s.committed[B] == pytest.approx(3 * 0.2)


def test_session_cost_prices_the_engine_above_its_fair_share() -> None:
    s = SessionLoad(idle_s=100.0)
    for i in range(4):
        s.routed(f"a{i}", A, 0.1, 0.0)
    s.routed("b0", B, 0.1, 0.0)
    cost = s.session_cost("new", [A, B], mean_wait_s=0.5)
    # committed A 0.4, B 0.1, fair 0.25; R for a new session under the prior = 1
    assert cost[A] == pytest.approx(1 * 0.5 * (0.4 / 0.25 - 1))
    assert cost[B] == pytest.approx(1 * 0.5 * (0.1 / 0.25 - 1))
    assert s.session_cost(None, [A, B], 0.5) == {A: 0.0, B: 0.0}
    assert s.session_cost("new", [A, B], 0.0) == {A: 0.0, B: 0.0}
    with pytest.raises(ValueError):
        SessionLoad(idle_s=0.0)


class Resident:
    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def global_match(self, block_keys: object, block_tokens: object) -> GlobalMatch:
        return GlobalMatch(self.tokens)

    def swa_match(self, boundary_keys: object) -> int:
        return 0


def test_tier_aware_adds_the_session_term_to_its_cost_only_when_asked() -> None:
    keys = [PrefixKey(i + 1) for i in range(4)]
    req = RequestView("r", "m", 256, keys, [64] * 4, (), session="x")
    engines = [EngineView(e, True, EngineLoad(), Resident(0)) for e in (A, B)]
    fleet = FleetStats(now_s=1.0, arrival_rate_per_s=1.0, mean_wait_s=0.5)
    off = create_policy("tier_aware", {})
    on = create_policy("tier_aware", {"session_scale": 1.0})
    for i in range(3):  # three other sessions already live on a
        for p in (off, on):
            other = RequestView(f"o{i}", "m", 256, keys, [64] * 4, (), session=f"o{i}")
            p.pick(other, engines[:1], fleet)
    d_off = off.pick(req, engines, fleet)
    d_on = on.pick(req, engines, fleet)
    assert d_off.components[A]["session_s"] == 0.0
    assert d_on.components[A]["session_s"] > 0 > d_on.components[B]["session_s"]
    assert d_on.engine == B
