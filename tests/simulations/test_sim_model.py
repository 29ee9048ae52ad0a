"""The simulator's model: conservation, closed forms, capacities, SWA expiry, determinism."""

from __future__ import annotations

import math
import random

import pytest
from sim_helpers import BLOCK, PROFILE, entrant_simulation, req, spec, workload

from ramjet.policy.registry import create_policy
from simulations.lineup import ENTRANTS
from simulations.simulator import Simulation, simulate
from simulations.views import Clock, RoutedIndex
from simulations.workload import chain_keys, scale_rate


def _random_workload(n: int, seed: int) -> list:
    rng = random.Random(seed)
    sessions: dict[int, list[int]] = {}
    fresh = iter(range(10, 10**9))
    out = []
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(4.0)
        s = rng.randrange(12)
        ids = sessions.get(s, []) + [next(fresh) for _ in range(rng.randint(1, 30))]
        sessions[s] = ids
        out.append(req(t, list(ids), out=rng.randint(1, 60), session=f"s{s}"))
    return workload(out)


@pytest.mark.parametrize("name", sorted(ENTRANTS))
def test_every_request_completes_exactly_once(name: str) -> None:
    reqs = _random_workload(150, 1)
    sim = entrant_simulation(reqs, name)
    out = sim.run()
    assert out.decisions == len(reqs)
    assert all(e in (0, 1) for e in out.engine)
    assert all(not math.isnan(t) and t >= 0 for t in out.ttft)
    assert all(w <= t + 1e-12 for w, t in zip(out.wait, out.ttft, strict=True))
    assert sum(e.inflight for e in sim.engines) == 0  # every request finished decode
    assert not sim._events


def test_all_cold_isolated_requests_match_closed_form() -> None:
    lengths = [100, 640, 1500, 4000, 9000]
    reqs = workload(
        [
            req(100.0 * i, [1000 * i + j for j in range(-(-n // BLOCK))], tokens=n)
            for i, n in enumerate(lengths)
        ]
    )
    out = simulate(reqs, spec(), create_policy("round_robin", {}), block_tokens=BLOCK)
    for r, t in zip(reqs, out.ttft, strict=True):
        assert t == pytest.approx(PROFILE.prefill_seconds(r.prompt_tokens, 0), rel=1e-9)
    assert out.new_tokens == lengths


def test_all_cold_burst_on_one_engine_queues_fcfs() -> None:
    lengths = [3000, 1000, 2000]
    reqs = workload(
        [
            req(0.0, [1000 * i + j for j in range(n // BLOCK)], tokens=n)
            for i, n in enumerate(lengths)
        ]
    )
    out = simulate(reqs, spec(), create_policy("round_robin", {}), block_tokens=BLOCK, engines=1)
    done = 0.0
    for n, t in zip(lengths, out.ttft, strict=True):
        done += PROFILE.prefill_seconds(n, 0)
        assert t == pytest.approx(done, rel=1e-9)


def test_tier_capacities_are_never_exceeded_and_tiers_are_used() -> None:
    reqs = _random_workload(300, 2)
    small = spec(hbm_tokens=40 * BLOCK, host_tokens=60 * BLOCK, ssd_tokens=100 * BLOCK)
    sim = Simulation(
        reqs, small, create_policy("tier_aware", {}), block_tokens=BLOCK, check_capacity=True
    )
    out = sim.run()
    for peak, cap in zip(out.peak_tier_blocks, out.tier_capacity_blocks, strict=True):
        assert all(p <= c for p, c in zip(peak, cap, strict=True))
    assert out.demotions > 0 and out.evictions > 0
    assert sum(h[1] for h in out.hit) > 0 and sum(h[2] for h in out.hit) > 0
    for e in sim.engines:
        for tier, cap in enumerate(e.cache.capacity):
            assert e.cache.used_blocks(tier) <= cap


@pytest.mark.parametrize(
    ("gap_s", "resume", "replay"), [(30.0, "swa", False), (90.0, "global", True)]
)
def test_swa_expiry_triggers_replay(gap_s: float, resume: str, replay: bool) -> None:
    first = list(range(1, 21))
    reqs = workload([req(0.0, first, out=5), req(gap_s, [*first, 99, 100], out=5)])
    out = simulate(
        reqs, spec(swa_ttl_s=60.0), create_policy("prefix_affinity", {}), block_tokens=BLOCK
    )
    assert out.engine[0] == out.engine[1]
    assert out.resume[1] == resume
    assert out.replay[1] is replay
    swa_work = PROFILE.prefill_seconds(2 * BLOCK, 20 * BLOCK)
    expected = swa_work + (PROFILE.replay_floor_s if replay else 0.0)
    assert out.ttft[1] == pytest.approx(expected, rel=1e-9)


def test_swa_pool_cap_evicts() -> None:
    a, b = list(range(1, 11)), list(range(100, 111))
    reqs = workload([req(0.0, a, out=1), req(1.0, b, out=1), req(5.0, [*a, 50], out=1)])
    out = simulate(
        reqs, spec(swa_sequences=1), create_policy("round_robin", {}), block_tokens=BLOCK, engines=1
    )
    assert out.replay[2] and out.resume[2] == "global"


def test_same_seed_same_result() -> None:
    reqs = _random_workload(200, 3)
    runs = []
    for _ in range(2):
        ent = ENTRANTS["prodstack_prefix:exact"]
        out = Simulation(
            reqs, spec(), ent.make(7), block_tokens=BLOCK, knowledge=ent.knowledge
        ).run()
        runs.append((out.engine, out.ttft, out.hit))
    assert runs[0] == runs[1]


def test_rate_scale_compresses_arrivals() -> None:
    reqs = _random_workload(20, 4)
    fast = scale_rate(reqs, 2.0)
    assert fast[-1].arrival_s == pytest.approx((reqs[-1].arrival_s - reqs[0].arrival_s) / 2)
    with pytest.raises(ValueError):
        scale_rate(reqs, 0)


def test_routed_index_forgets_after_ttl_and_capacity() -> None:
    clock = Clock()
    keys = chain_keys(range(1, 11))
    tokens = [BLOCK] * 10
    ttl = RoutedIndex(clock, BLOCK, ttl_s=120.0)
    ttl.routed(keys)
    clock.now = 119.0
    assert ttl.global_match(keys, tokens).total == 10 * BLOCK
    clock.now = 121.0
    assert ttl.global_match(keys, tokens).total == 0
    lru = RoutedIndex(clock, BLOCK, capacity_tokens=4 * BLOCK, max_match_tokens=2 * BLOCK)
    lru.routed(keys)
    assert len(lru.entries) == 4
    # the prefix's head is kept (its tail is evicted first), and the match is capped
    assert lru.global_match(keys, tokens).total == 2 * BLOCK
