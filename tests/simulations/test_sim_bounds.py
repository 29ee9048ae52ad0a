"""Lower bounds on mean TTFT (`simulations.bounds`): the occupancy (queue) bound and the
decode-step bound by hand, against a brute-force optimum, and below every run of a few
cheap configurations of the simulator's engine models (benchmarks/priority_bound.py)."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest
from sim_helpers import BLOCK

from simulations.bounds import (
    SplitByOutput,
    descendants,
    floor,
    measured,
    occupancy_mean,
    run_bounds,
    srpt_merged,
)
from simulations.lineup import ENTRANTS
from simulations.preset import engine_spec
from simulations.sessions import closed_loop_plan, scale_for_load, scaled
from simulations.simulator import Outcome, Simulation
from simulations.workload import Request, chain_keys, finish


def test_occupancy_by_hand() -> None:
    # three 1 s jobs at 0 on two servers: each is in the system >= 1 s (3 on [0, 1)),
    # SRPT at speed 2 finishes them at 0.5, 1, 1.5 (1 left on [1, 1.5)): 3 + 0.5 = 3.5
    assert occupancy_mean([0.0, 0.0, 0.0], [1.0, 1.0, 1.0]) == pytest.approx(3.5 / 3)
    # the best two-server schedule: 1, 1, 2 -> 4/3; own work alone: 1; SRPT alone: 1
    assert occupancy_mean([0.0, 0.0], [1.0, 1.0]) == pytest.approx(1.0)
    assert occupancy_mean([0.0, 10.0], [1.0, 3.0]) == pytest.approx(2.0)
    # one server: SRPT at speed 1 is the optimum (1 and 3 done at 1 and 4: 2 + 4 = 6)
    assert occupancy_mean([0.0, 0.0], [1.0, 3.0], engines=1) == pytest.approx(2.5)
    assert occupancy_mean([], []) == 0.0


def _best_nonpreemptive(arr: list[float], work: list[float]) -> float:
    """The least mean response time on two servers without preemption: for a regular
    objective some optimal schedule starts every job as early as its server's order
    allows, so trying every order and every assignment finds it."""
    n, best = len(arr), float("inf")
    for order in itertools.permutations(range(n)):
        for mask in range(1 << n):
            free, total = [0.0, 0.0], 0.0
            for j in order:
                m = (mask >> j) & 1
                free[m] = max(free[m], arr[j]) + work[j]
                total += free[m] - arr[j]
            best = min(best, total / n)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_occupancy_is_under_the_optimum_and_over_its_parts(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(2, 5)
    arr = sorted(rng.choice([0.0, rng.uniform(0, 2)]) for _ in range(n))
    work = [rng.uniform(0.1, 2.0) for _ in range(n)]
    bound = occupancy_mean(arr, work)
    assert bound <= _best_nonpreemptive(arr, work) + 1e-9
    reqs = [Request(i, a, 1, 0, [], []) for i, a in enumerate(arr)]
    assert bound >= statistics.fmean(srpt_merged(reqs, work)) - 1e-9
    assert bound >= statistics.fmean(work) - 1e-9


def test_a_turn_gets_no_cache_from_its_own_later_turns() -> None:
    # one session of three turns, each extending the last by 40 blocks: in the closed
    # loop turn k+1 is sent after turn k finished, so the blocks turn k adds are resident
    # for nobody before it starts. any_order alone credits them (later turns hold them).
    step = 40
    ids = list(range(1, 3 * step + 1))
    trace = [
        Request(0, float(k), (k + 1) * step * BLOCK, 5, chain_keys(ids[: (k + 1) * step]),
                [BLOCK] * ((k + 1) * step), session="s", turn=k)
        for k in range(3)
    ]  # fmt: skip
    plan = closed_loop_plan(finish(trace, BLOCK), BLOCK)
    later = descendants(plan.loop.children)
    assert later == [{1, 2}, {2}, set()]
    profile = engine_spec().profile
    loose = floor(plan.requests, profile, any_order=True)
    tight = floor(plan.requests, profile, any_order=True, after=later)
    # loose: turns 0 and 1 resume at their whole prompt (a later turn holds it), turn 2
    # from turn 1's end; tight: turn 0 is cold, each later turn prefills what it added
    assert loose.new_tokens == [0, 0, step * BLOCK]
    assert tight.new_tokens == [step * BLOCK] * 3
    assert tight.work_s[0] == pytest.approx(profile.prefill_seconds(step * BLOCK, 0))
    assert tight.work_s[2] == loose.work_s[2]
    assert all(a >= b for a, b in zip(tight.work_s, loose.work_s, strict=True))


def _outcome(arrivals: list[float], window: tuple[float, float] | None = None) -> Outcome:
    out = Outcome()
    out.arrival = list(arrivals)
    out.busy_s = [0.0, 0.0]
    out.window = window
    return out


def test_step_bound_by_hand() -> None:
    # ten requests 0.1 s apart, 10 ms of work, 100 output tokens each: D = 50 steps of
    # 25 ms = 1.25 s. tau = 0.01 + 0.025; twice the span (0.9 + tau) = 1.87 s holds one
    # D, so K = 1 and at most 2 + 1 escape the step: 7 of 10 pay 25 ms
    profile = engine_spec().profile
    assert profile.decode_step_s == 0.025 and profile.spec_tokens_per_step == 2.0
    arr = [0.1 * i for i in range(10)]
    reqs = [Request(i, a, 100, 100, [], []) for i, a in enumerate(arr)]
    b = run_bounds(reqs, _outcome(arr), [0.01] * 10, profile, steps=True)
    assert b.alone == pytest.approx(0.01)
    assert b.steps == pytest.approx(0.01 + 0.025 * 7 / 10)
    assert b.queue == pytest.approx(0.01)
    assert b.valid(open_loop=True) == (pytest.approx(0.0275), "alone + steps")
    # no output: nothing ever decodes, every request may escape
    quiet = [Request(i, a, 100, 0, [], []) for i, a in enumerate(arr)]
    assert run_bounds(quiet, _outcome(arr), [0.01] * 10, profile, True).steps == b.alone
    # the window: only requests sent inside it count
    w = run_bounds(reqs, _outcome(arr, (0.25, 0.55)), [0.01] * 10, profile, False)
    assert measured(_outcome(arr, (0.25, 0.55))) == [3, 4, 5]
    assert w.steps == w.alone == pytest.approx(0.01)


def _agent_trace() -> list[Request]:
    """Sessions whose turns extend the previous prompt, a third of them with no output."""
    rng = random.Random(3)
    out, fresh = [], iter(range(10_000, 1 << 30))
    for s in range(6):
        ids = [next(fresh) for _ in range(rng.randint(20, 60))]
        for k in range(8):
            ids = ids + [next(fresh) for _ in range(rng.randint(1, 30))]
            out.append(
                Request(
                    0,
                    s * 0.5 + k * 0.4,
                    len(ids) * BLOCK,
                    rng.choice([0, 0, rng.randint(1, 200)]),
                    chain_keys(ids),
                    [BLOCK] * len(ids),
                    session=f"s{s}",
                    turn=k,
                )
            )
    return finish(out, BLOCK)


CONFIGS = [
    (name, sch)
    for name in ("round_robin", "least_loaded", "tier_aware", "oracle:tier_aware", "split")
    for sch in ("fcfs", "priority", "vllm-fcfs", "vllm-priority")
]


@pytest.mark.parametrize(("name", "scheduler"), CONFIGS)
def test_bounds_stay_under_every_run(name: str, scheduler: str) -> None:
    plan = closed_loop_plan(_agent_trace(), BLOCK, sessions=18)
    spec = engine_spec(scheduler=scheduler, aging=0.0 if name.startswith("oracle") else None)
    work = floor(
        plan.requests, spec.profile, any_order=True, after=descendants(plan.loop.children)
    ).work_s
    for load in (0.3, 0.9):
        at = scaled(plan, scale_for_load(plan, work, load, 2))
        if name == "split":
            policy, knowledge, shared = SplitByOutput(), ENTRANTS["tier_aware"].knowledge, False
        else:
            ent = ENTRANTS[name]
            policy, knowledge, shared = ent.make(0), ent.knowledge, ent.shared_cache
        out = Simulation(
            at,
            spec,
            policy,
            block_tokens=BLOCK,
            engines=2,
            knowledge=knowledge,
            shared_cache=shared,
            loop=plan.loop,
        ).run()
        s = measured(out)
        assert s
        mean = statistics.fmean(out.ttft[i] for i in s)
        b = run_bounds(at, out, work, spec.profile, scheduler in ("fcfs", "priority"))
        assert b.alone <= b.steps
        assert mean >= b.highest - 1e-12, (load, mean, b)


def test_the_witness_keeps_output_free_turns_off_the_decoding_engine() -> None:
    # two answers to decode, then a turn with no output: the split sends the first two to
    # engine 0 (the second pays a decode step: the first decodes there) and the third to
    # engine 1, where nothing ever decodes, so its TTFT is its bare prefill
    n = 10 * BLOCK
    reqs = finish(
        [
            Request(0, 0.0, n, 100, chain_keys(range(1, 11)), [BLOCK] * 10),
            Request(0, 0.2, n, 100, chain_keys(range(11, 21)), [BLOCK] * 10),
            Request(0, 0.3, n, 0, chain_keys(range(21, 31)), [BLOCK] * 10),
        ],
        BLOCK,
    )
    spec = engine_spec()
    out = Simulation(reqs, spec, SplitByOutput(), block_tokens=BLOCK, engines=2).run()
    assert out.engine == [0, 0, 1]
    bare = spec.profile.prefill_seconds(n, 0)
    assert out.ttft[0] == pytest.approx(bare)
    assert out.ttft[1] == pytest.approx(bare + spec.profile.decode_step_s)
    assert out.ttft[2] == pytest.approx(bare)
