"""The cost model's priority-aware wait (`ramjet.policy.cost.keyed_wait`): on an engine
that serves by the priority hint's key, a request waits only for the work queued there
with a lower key; the jump charge (`jump_seconds`): each request it overtakes there waits
its service time longer; and the router's `KeyedQueues`, which feeds both."""

from __future__ import annotations

from dataclasses import replace

import pytest
from policy_fakes import engine, request

from ramjet.policy.base import EngineLoad, EngineView, FleetStats, KeyedQueue
from ramjet.policy.cost import (
    estimate,
    keyed_ahead,
    keyed_jumped,
    packing_room,
    service_seconds,
    wait_seconds,
)
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


def q(
    *entries: tuple[float, int, bool], preemptive: bool = True, charge: bool = False
) -> KeyedQueue:
    return KeyedQueue(0.05, 20.0, preemptive, entries, charge)


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
    # at most what the room left in its last step (chunk_tokens 8,192) holds
    room = packing_room(P, e.load, N, 8192)
    assert 0 < room < 0.5 * (1.0 + h)
    assert packed.packing_s == pytest.approx(min(0.5 * (1.0 + h), room))


def test_router_queues_drop_the_lowest_keys_as_first_bytes_come() -> None:
    kq = KeyedQueues({A: (0.05, 20.0, False, True)})
    assert kq.queue(EngineId("b"), 0) is None
    kq.add(A, "r1", 10.0, 1000)
    kq.add(A, "r2", 5.0, 2000)
    kq.add(A, "r3", 20.0, 4000)
    assert kq.queue(A, 7000) == KeyedQueue(
        0.05, 20.0, False, ((5.0, 2000, False), (10.0, 1000, False), (20.0, 4000, False)), True
    )
    # 5000 tokens left in flight: the lowest key (r2) has started answering
    assert [k for k, _, _ in kq.queue(A, 5000).entries] == [10.0, 20.0]  # type: ignore[union-attr]
    kq.done(A, "r3")
    assert [k for k, _, _ in kq.queue(A, 5000).entries] == [10.0]  # type: ignore[union-attr]
    kq.done(A, "r1")
    kq.done(A, "r1")  # idempotent
    assert kq.queue(A, 0) == KeyedQueue(0.05, 20.0, False, (), True)


def test_jumped_are_the_waiting_requests_with_a_higher_key() -> None:
    entries = ((1.0, 100, False), (3.0, 100, False), (3.0, 100, True), (2.0, 100, False))
    # a started prefill is not counted, preempted (chunk) or not (vLLM)
    assert keyed_jumped(q(*entries, preemptive=True), 2.0) == 1
    assert keyed_jumped(q(*entries, preemptive=False), 2.0) == 1
    assert keyed_jumped(q(*entries), 0.5) == 3
    assert keyed_jumped(q(*entries), 3.0) == 0  # an equal key arrived first


def test_service_is_priced_as_one_more_job_ahead() -> None:
    # work, the job's fixed overhead (one-job-per-step), a decode step per chunk while
    # the engine decodes
    stepping = P.model_copy(update={"decode_step_s": 0.025, "prefill_overhead_s": 0.004})
    idle, decoding = engine("a"), engine("a", inflight=2)
    assert service_seconds(stepping, idle, 0.3, 3000, 2048, True) == pytest.approx(0.304)
    assert service_seconds(stepping, decoding, 0.3, 3000, 2048, True) == pytest.approx(0.354)
    # one chunk at least on a one-job-per-step engine; a packing engine shares its steps
    # and has no per-job overhead in its wait (`wait_seconds`)
    assert service_seconds(stepping, decoding, 0.01, 10, 2048, True) == pytest.approx(0.039)
    assert service_seconds(stepping, decoding, 0.01, 1024, 2048, False) == pytest.approx(0.0225)
    assert service_seconds(stepping, idle, 0.01, 1024, 2048, False) == 0.01


def _jump_case() -> tuple[list[EngineView], KeyedQueue, float]:
    # a holds half the turn's prefix and three medium prompts queued there, each with a
    # higher key than the turn's (0.3 s of work, 0.1 s earlier); b is idle and cold
    views = [engine("a", hbm=N // 2, queued=9_000, profile=P), engine("b", profile=P)]
    theirs = hint_key_s(0.3, 0.05, NOW - 0.1, 20.0)
    return views, q(*[(theirs, 3_000, False)] * 3, charge=True), theirs


def test_the_jump_charge_sends_a_turn_where_the_fleet_waits_less() -> None:
    views, queue, theirs = _jump_case()
    policy = TierAware(TierAwareParams(default_profile=P))
    free = policy.pick(
        request(N), views, FleetStats(now_s=NOW, keyed={A: replace(queue, charge_jumps=False)})
    )
    # jumps free: the turn jumps the three (its key is lower) and waits for nothing on a
    work_a = free.components["a"]["work_s"]  # replay + 2048 tokens: 0.2248 s
    assert hint_key_s(work_a, 0.05, NOW, 20.0) < theirs
    assert free.components["a"]["wait_s"] == 0.0
    assert free.engine == "a"
    assert "jump_s" in free.components["a"] and free.components["a"]["jump_s"] == 0.0
    # but each of the three then waits work_a longer: the fleet's added TTFT on a is
    # 4 x 0.2248 s, against b's 0.41 s cold prefill that delays no one
    ttft_b = free.components["b"]["ttft_s"]
    assert work_a + 3 * work_a > ttft_b
    charged = policy.pick(request(N), views, FleetStats(now_s=NOW, keyed={A: queue}))
    assert charged.engine == "b"
    ca = charged.components["a"]
    assert ca["jump_s"] == pytest.approx(3 * work_a)
    assert ca["externality_s"] == pytest.approx(3 * work_a)  # part of the externality
    assert ca["cost_s"] == pytest.approx(ca["ttft_s"] + 3 * work_a)
    assert "jump_s" not in charged.components["b"]  # b serves by no key: priced as before
    # the decision line writes the components in their order: the jump term comes last
    assert list(ca)[-1] == "jump_s" and list(charged.components["b"])[-1] == "calibration_samples"


def test_the_jump_charge_scales_with_the_externality_and_is_zero_with_nothing_to_jump() -> None:
    views, queue, _ = _jump_case()
    selfish = TierAware(TierAwareParams(default_profile=P, externality_scale=0.0))
    assert selfish.pick(request(N), views, FleetStats(now_s=NOW, keyed={A: queue})).engine == "a"
    half = estimate(
        request(N),
        views,
        FleetStats(now_s=NOW, keyed={A: queue}),
        externality_scale=0.5,
        default_profile=P,
    )
    assert half[0].jump_s == pytest.approx(0.5 * 3 * half[0].work.work_s)
    # only lower keys queued: nothing to jump, the charge is 0 and the estimate is the
    # uncharged one to the bit
    low = hint_key_s(0.0, 0.05, NOW - 10.0, 20.0)
    lower = q((low, 9_000, False), charge=True)
    fleet = FleetStats(now_s=NOW, keyed={A: lower})
    [a, b] = estimate(request(N), views, fleet, default_profile=P)
    [fa, fb] = estimate(
        request(N),
        views,
        replace(fleet, keyed={A: replace(lower, charge_jumps=False)}),
        default_profile=P,
    )
    assert a.jump_s == 0.0 and (a.cost_s, a.externality_s, b) == (fa.cost_s, fa.externality_s, fb)


def test_an_engine_of_no_keyed_pool_is_priced_as_before_with_charged_queues_elsewhere() -> None:
    views, queue, _ = _jump_case()
    plain = estimate(request(N), views, FleetStats(now_s=NOW), default_profile=P)
    other = estimate(
        request(N), views, FleetStats(now_s=NOW, keyed={EngineId("c"): queue}), default_profile=P
    )
    assert plain == other
    assert all(s.jump_s is None and "jump_s" not in s.components() for s in plain)


def test_packing_adds_at_most_the_room_left_in_the_last_step() -> None:
    """vLLM schedules the prompts it has started before waiting ones: an arrival only
    fills what this request's final chunk leaves of the step budget."""
    load = EngineLoad(inflight_prompt_tokens=1000)
    assert packing_room(P, load, 1048, 2048) == 0.0  # 2,048 tokens: the step is full
    room = P.prefill_seconds(1000, 0) - P.prefill_overhead_s
    assert packing_room(P, load, 48, 2048) == pytest.approx(room)  # 1,048 used: 1,000 free
    assert packing_room(P, load, 2096, 2048) == pytest.approx(room)  # the same, a step on
