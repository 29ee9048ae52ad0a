"""The cost model's priority-aware wait (`ramjet.policy.cost.keyed_wait`): on an engine
that serves by the priority hint's key, a request waits only for the work queued there
with a lower key; and the router's `KeyedQueues`, which feeds it."""

from __future__ import annotations

import pytest
from policy_fakes import engine, request

from ramjet.policy.base import FleetStats, KeyedQueue
from ramjet.policy.cost import estimate, keyed_ahead, wait_seconds
from ramjet.policy.fleet_stats import KeyedQueues
from ramjet.policy.priority_key import hint_key_s
from ramjet.policy.profile import CurvePoint, EngineProfile
from ramjet.policy.tier_aware import TierAware, TierAwareParams
from ramjet.types import EngineId

# 10k tokens/s flat, no decode interference (nothing decodes in these views)
P = EngineProfile(
    prefill_curve=[CurvePoint(context_tokens=0, seconds_per_token=1e-4)],
    replay_floor_s=0.02,
    global_kv_bytes_per_token=1000,
)
N = 4096
NOW = 100.0
A = EngineId("a")


def q(*entries: tuple[float, int, bool], preemptive: bool = True) -> KeyedQueue:
    return KeyedQueue(0.05, 20.0, preemptive, entries)


def test_only_lower_keys_are_ahead() -> None:
    e = engine("a", queued=30_000)
    mine = hint_key_s(0.1, 0.05, NOW, 20.0)
    queue = q((mine - 1, 10_000, False), (mine + 1, 20_000, False))
    assert keyed_ahead(queue, mine, e.load, 8192) == (10_000, 1)
    # an equal key arrived first: ahead
    assert keyed_ahead(q((mine, 5_000, False)), mine, engine("a", queued=5_000).load, 8192) == (
        5_000,
        1,
    )


def test_a_started_prefill_counts_in_full_unless_the_engine_preempts_it() -> None:
    e = engine("a", queued=20_000)
    mine = 0.0
    started = (mine + 5, 20_000, True)
    assert keyed_ahead(q(started, preemptive=False), mine, e.load, 8192) == (20_000, 0)
    assert keyed_ahead(q(started, preemptive=True), mine, e.load, 8192) == (8192, 0)


def test_outstanding_work_without_a_known_key_is_ahead() -> None:
    # 12k tokens outstanding, 2k of them keyed (behind us): the other 10k count as FCFS
    e = engine("a", queued=12_000)
    assert keyed_ahead(q((1e9, 2_000, False)), 0.0, e.load, 8192) == (10_000, 0)


def test_without_keyed_engines_the_estimate_is_unchanged() -> None:
    views = [engine("a", hbm=N, queued=60_000, profile=P), engine("b", profile=P)]
    plain = estimate(request(N), views, FleetStats(now_s=NOW))
    other = estimate(request(N), views, FleetStats(now_s=NOW, keyed={EngineId("c"): q()}))
    assert plain == other
    assert plain[0].wait_s == pytest.approx(wait_seconds(P, views[0], 0, 8192))


def test_a_short_turn_stays_on_its_warm_busy_engine_when_it_will_jump_the_queue() -> None:
    # a holds the turn's prefix but has a 6 s cold prompt queued (key: the horizon cap);
    # b is idle and cold. FCFS: a waits 6 s, so the turn moves (0.41 s of recompute).
    # On a key-ordered engine the turn's key is lower: it waits for nothing there.
    policy = TierAware(TierAwareParams(default_profile=P))
    warm_busy = engine("a", hbm=N, queued=60_000, profile=P)
    cold_idle = engine("b", queued=0, profile=P)
    views = [warm_busy, cold_idle]
    fcfs = FleetStats(now_s=NOW)
    assert policy.pick(request(N), views, fcfs).engine == "b"
    long_key = hint_key_s(6.0, 0.05, NOW - 1.0, 20.0)
    keyed = FleetStats(now_s=NOW, keyed={A: q((long_key, 60_000, False))})
    d = policy.pick(request(N), views, keyed)
    assert d.engine == "a"
    assert d.components["a"]["wait_s"] == pytest.approx(0.0)
    # behind a lower key (an earlier short turn) it does wait for it
    short_key = hint_key_s(0.001, 0.05, NOW - 0.5, 20.0)
    keyed = FleetStats(now_s=NOW, keyed={A: q((short_key, 60_000, False))})
    assert policy.pick(request(N), views, keyed).engine == "b"


def test_later_arrivals_with_a_lower_key_add_to_the_wait_within_the_window() -> None:
    # a one-job-per-step engine with ρ = 0.5: a request with 1 s of queued work ahead is
    # overtaken by arrivals for min(wait, h/aging, horizon)
    e = engine("a", queued=10_000, profile=P)
    queue = q((0.0, 10_000, False))  # lower key than anything at NOW
    fleet = FleetStats(now_s=NOW, work_rate={A: 0.5}, keyed={A: queue})
    [est] = estimate(request(N), [e], fleet, default_profile=P)
    h = est.work.work_s  # cold: 0.41 s, so h / aging = 8.2 s > the 1 s wait
    assert est.wait_s == pytest.approx(1.0 + 0.5 * 1.0)
    # a packing engine: the packing term counts those arrivals instead
    [packed] = estimate(request(N), [e], fleet, default_profile=P, per_job=False)
    assert packed.wait_s == pytest.approx(1.0)
    assert packed.packing_s == pytest.approx(0.5 * (1.0 + h))


def test_router_queues_drop_the_lowest_keys_as_first_bytes_come() -> None:
    kq = KeyedQueues({A: (0.05, 20.0, False)})
    assert kq.queue(EngineId("b"), 0) is None
    kq.add(A, "r1", 10.0, 1000)
    kq.add(A, "r2", 5.0, 2000)
    kq.add(A, "r3", 20.0, 4000)
    assert kq.queue(A, 7000) == KeyedQueue(
        0.05, 20.0, False, ((5.0, 2000, False), (10.0, 1000, False), (20.0, 4000, False))
    )
    # 5000 tokens left in flight: the lowest key (r2) has started answering
    assert [k for k, _, _ in kq.queue(A, 5000).entries] == [10.0, 20.0]  # type: ignore[union-attr]
    kq.done(A, "r3")
    assert [k for k, _, _ in kq.queue(A, 5000).entries] == [10.0]  # type: ignore[union-attr]
    kq.done(A, "r1")
    kq.done(A, "r1")  # idempotent
    assert kq.queue(A, 0) == KeyedQueue(0.05, 20.0, False, ())
