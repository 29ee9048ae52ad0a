"""Table-driven tests of the baseline policies."""

from __future__ import annotations

from collections import Counter

import pytest
from policy_fakes import engine, request

from ramjet.policy.base import EngineView, FleetStats
from ramjet.policy.baselines import (
    LeastLoaded,
    LeastLoadedParams,
    PrefixAffinity,
    PrefixAffinityParams,
    RoundRobin,
    SessionHash,
    SessionHashParams,
)

FLEET = FleetStats()


def test_round_robin_cycles_over_healthy_engines() -> None:
    engines = [engine("a"), engine("b", healthy=False), engine("c")]
    policy = RoundRobin()
    picks = [policy.pick(request(), engines, FLEET).engine for _ in range(4)]
    assert picks == ["a", "c", "a", "c"]


def test_round_robin_skips_engines_without_the_model() -> None:
    engines = [engine("a", models=frozenset({"x"})), engine("b", models=frozenset({"m"}))]
    policy = RoundRobin()
    assert {policy.pick(request(model="m"), engines, FLEET).engine for _ in range(3)} == {"b"}


def test_all_unhealthy_still_returns_an_engine() -> None:
    engines = [engine("a", healthy=False), engine("b", healthy=False)]
    assert RoundRobin().pick(request(), engines, FLEET).engine in {"a", "b"}


@pytest.mark.parametrize(
    ("engines", "weight", "expected"),
    [
        # fewer in-flight requests wins when tokens are equal
        ([engine("a", inflight=3), engine("b", inflight=1)], 1024, "b"),
        # tokens outweigh requests
        ([engine("a", inflight=1, inflight_tokens=50_000), engine("b", inflight=4)], 1024, "b"),
        ([engine("a", inflight=1, inflight_tokens=50_000), engine("b", inflight=4)], 20_000, "a"),
        # the engine's own report counts when it exceeds the router's in-flight
        (
            [engine("a", queued=90_000, inflight_tokens=10), engine("b", inflight_tokens=20_000)],
            0,
            "b",
        ),
        # the router's in-flight counts when the report is stale (lower)
        ([engine("a", queued=0, inflight_tokens=30_000), engine("b", queued=10_000)], 0, "b"),
        # unhealthy engines are never picked
        ([engine("a", healthy=False), engine("b", inflight=9)], 1024, "b"),
    ],
)
def test_least_loaded(engines: list[EngineView], weight: int, expected: str) -> None:
    policy = LeastLoaded(LeastLoadedParams(request_weight_tokens=weight))
    assert policy.pick(request(), engines, FLEET).engine == expected


def test_least_loaded_rotates_ties() -> None:
    engines = [engine("a"), engine("b")]
    policy = LeastLoaded()
    assert Counter(policy.pick(request(), engines, FLEET).engine for _ in range(10)) == {
        "a": 5,
        "b": 5,
    }


def test_session_hash_is_sticky_and_spreads() -> None:
    engines = [engine("a"), engine("b"), engine("c")]
    policy = SessionHash()
    picks = {
        f"s{i}": policy.pick(request(session=f"s{i}"), engines, FLEET).engine for i in range(300)
    }
    again = {s: policy.pick(request(session=s), engines, FLEET).engine for s in picks}
    assert again == picks
    counts = Counter(picks.values())
    assert set(counts) == {"a", "b", "c"} and min(counts.values()) > 60


def test_session_hash_moves_only_the_lost_engines_sessions() -> None:
    full = [engine("a"), engine("b"), engine("c")]
    less = [engine("a"), engine("b"), engine("c", healthy=False)]
    policy = SessionHash()
    moved = 0
    for i in range(300):
        before = policy.pick(request(session=f"s{i}"), full, FLEET).engine
        after = policy.pick(request(session=f"s{i}"), less, FLEET).engine
        assert after != "c"
        if before != "c":
            assert after == before
        else:
            moved += 1
    assert moved > 0


@pytest.mark.parametrize(
    ("fallback", "engines", "expected"),
    [
        ("least_loaded", [engine("a", inflight_tokens=5000), engine("b")], "b"),
        ("least_loaded", [engine("a"), engine("b", inflight_tokens=5000)], "a"),
    ],
)
def test_session_hash_without_session_falls_back(
    fallback: str, engines: list[EngineView], expected: str
) -> None:
    policy = SessionHash(SessionHashParams.model_validate({"fallback": fallback}))
    decision = policy.pick(request(session=None), engines, FLEET)
    assert decision.engine == expected
    assert decision.notes == (f"no_session:{fallback}",)


def test_session_hash_round_robin_fallback() -> None:
    policy = SessionHash(SessionHashParams(fallback="round_robin"))
    engines = [engine("a"), engine("b")]
    assert [policy.pick(request(), engines, FLEET).engine for _ in range(4)] == ["a", "b", "a", "b"]


AFF = PrefixAffinityParams(abs_margin_tokens=10_000, rel_factor=1.5)


@pytest.mark.parametrize(
    ("engines", "expected", "note"),
    [
        # longest match wins, whichever tier holds it
        ([engine("a", hbm=1024), engine("b", hbm=2048)], "b", ()),
        ([engine("a", hbm=1024), engine("b", host=512, ssd=1024)], "b", ()),
        # no match anywhere: least loaded
        ([engine("a", inflight_tokens=500), engine("b")], "b", ("no_match",)),
        # a busy engine keeps affinity while the absolute margin is not exceeded
        ([engine("a", hbm=4096, inflight_tokens=9_000), engine("b")], "a", ()),
        # ... nor the relative factor (20k is only 1.33x of 15k)
        (
            [engine("a", hbm=4096, inflight_tokens=20_000), engine("b", inflight_tokens=15_000)],
            "a",
            (),
        ),
        # both margins exceeded: affinity is lost to the least-loaded engine
        (
            [engine("a", hbm=4096, inflight_tokens=30_000), engine("b", inflight_tokens=15_000)],
            "b",
            ("affinity_lost_to_load",),
        ),
        # any queued work on an otherwise idle pair does not trip the bound (the mean-relative bug)
        ([engine("a", hbm=4096, inflight_tokens=2_000), engine("b")], "a", ()),
        # the engine's own report counts as load
        (
            [engine("a", hbm=4096, queued=40_000), engine("b", queued=1_000)],
            "b",
            ("affinity_lost_to_load",),
        ),
        # equal matches: the less loaded one
        ([engine("a", hbm=4096, inflight_tokens=3_000), engine("b", hbm=4096)], "b", ()),
        # an unhealthy engine's match does not count
        ([engine("a", hbm=8192, healthy=False), engine("b", hbm=256), engine("c")], "b", ()),
    ],
)
def test_prefix_affinity(engines: list[EngineView], expected: str, note: tuple[str, ...]) -> None:
    decision = PrefixAffinity(AFF).pick(request(), engines, FLEET)
    assert decision.engine == expected
    assert decision.notes == note


def test_prefix_affinity_components() -> None:
    engines = [engine("a", hbm=4096, inflight_tokens=30_000), engine("b", inflight_tokens=15_000)]
    decision = PrefixAffinity(AFF).pick(request(), engines, FLEET)
    assert decision.components["a"] == {
        "match_tokens": 4096.0,
        "pending_tokens": 0.0,
        "load_tokens": 30_000.0,
        "overloaded": 1.0,
    }
    assert decision.components["b"]["overloaded"] == 0.0


def test_prefix_affinity_min_match() -> None:
    params = PrefixAffinityParams(min_match_tokens=1000)
    engines = [engine("a", hbm=512, inflight_tokens=100), engine("b")]
    assert PrefixAffinity(params).pick(request(), engines, FLEET).engine == "b"


def test_prefix_affinity_tie_cursor_moves_only_on_ties() -> None:
    """Issue 15, problem 7: a four-request pattern (new conversation, its follow-up, ...)
    advanced the cursor on every pick, so the cursor was back in place at each new
    conversation and every one landed on the same engine. Only a real tie moves it."""
    policy = PrefixAffinity(AFF)
    firsts = []
    for _ in range(4):
        idle = [engine("a"), engine("b")]  # a new conversation: no match, a tie
        firsts.append(policy.pick(request(), idle, FLEET).engine)
        held = [engine(e, hbm=4096 if e == firsts[-1] else 0) for e in ("a", "b")]
        assert policy.pick(request(), held, FLEET).engine == firsts[-1]  # no tie
    assert firsts == ["b", "a", "b", "a"]
