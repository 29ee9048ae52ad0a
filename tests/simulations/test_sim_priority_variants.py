"""The simulator's priority schedulers (`simulations.engine`): the chunk-preemptive one
(`priority`), vLLM V1's (`vllm-priority`: the hint orders waiting jobs only; a running
prefill is never preempted; a job's last chunk leaves the step's token budget to the next
job), vLLM's packing in arrival order (`vllm-fcfs`), and aging bounding a long prompt's
wait. Closed forms on one engine with the test profile."""

from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry
from sim_helpers import BLOCK, PROFILE, req, spec, workload

from ramjet.app.priority import PriorityHints
from ramjet.config import parse_policy
from ramjet.policy.base import KeyedQueue
from ramjet.policy.registry import create_policy
from ramjet.types import EngineId
from simulations.simulator import simulate
from simulations.workload import Request


def cold(t: float, n: int, base: int, out: int = 0) -> Request:
    return req(t, [base + j for j in range(-(-n // BLOCK))], tokens=n, out=out)


def run(
    reqs: list[Request], scheduler: str, aging: float = 0.5, horizon: float | None = None
) -> list[float]:
    """First-token times (arrival + TTFT) per request, in arrival order."""
    out = simulate(
        reqs,
        spec(scheduler=scheduler, aging=aging, horizon_s=horizon),
        create_policy("round_robin", {}),
        block_tokens=BLOCK,
        engines=1,
    )
    return [r.arrival_s + t for r, t in zip(reqs, out.ttft, strict=True)]


def test_short_arrival_preempts_only_under_the_chunk_preemptive_scheduler() -> None:
    # A long prompt runs; a second long one and then a short one arrive while it does.
    reqs = workload([cold(0.0, 3000, 10_000), cold(0.01, 2000, 20_000), cold(0.02, 100, 30_000)])
    a, d, c = run(reqs, "fcfs")
    assert a < d < c  # arrival order
    a, d, c = run(reqs, "vllm-priority")
    assert a < c < d  # the short one overtakes the waiting long one, not the running one
    assert a == pytest.approx(PROFILE.prefill_seconds(3000, 0), rel=1e-9)
    a, d, c = run(reqs, "priority")
    # the short one preempts the running prefill at a chunk boundary, and so does the
    # second long one: its 2000 tokens are less work than the first one's remaining 2488
    assert c < d < a
    # ... after at most the chunk that was running when it arrived
    first_chunk_end = PROFILE.prefill_seconds(512, 0)
    assert c == pytest.approx(first_chunk_end + PROFILE.prefill_seconds(100, 0), rel=1e-9)


def test_vllm_packing_saves_one_decode_step_per_packed_job() -> None:
    # R0 decodes for a long time; R1 and R2 (short, cold) arrive together. FCFS runs one
    # job per forward pass, each with the running batch's decode step; vLLM puts R2 in
    # R1's step (R1 leaves 412 of 512 tokens), so R2 pays no step of its own.
    reqs = workload([cold(0.0, 64, 1, out=1000), cold(0.5, 100, 100), cold(0.5, 100, 200)])
    step = PROFILE.decode_step_s
    p100 = PROFILE.prefill_seconds(100, 0)
    _, r1, r2 = run(reqs, "fcfs")
    assert r1 == pytest.approx(0.5 + p100 + step, rel=1e-9)
    assert r2 == pytest.approx(0.5 + 2 * (p100 + step), rel=1e-9)
    for sched in ("vllm-fcfs", "vllm-priority"):
        _, r1, r2 = run(reqs, sched)
        assert r1 == pytest.approx(0.5 + p100 + step, rel=1e-9)
        assert r2 == pytest.approx(0.5 + 2 * p100 + step, rel=1e-9)


def test_leftover_budget_is_dropped_when_the_engine_goes_idle() -> None:
    # R1 ends mid-step with nothing queued; R2 arrives later: a new step, its own decode
    reqs = workload([cold(0.0, 64, 1, out=1000), cold(0.5, 100, 100), cold(0.9, 100, 200)])
    step = PROFILE.decode_step_s
    p100 = PROFILE.prefill_seconds(100, 0)
    _, _, r2 = run(reqs, "vllm-fcfs")
    assert r2 == pytest.approx(0.9 + p100 + step, rel=1e-9)


def overload(n_shorts: int) -> tuple[list[Request], int, float]:
    """Short prompts (~0.013 s of work each) every 0.01 s and one long cold prompt at
    0.05 s: the requests, the long one's index and its work h."""
    shorts = [cold(0.01 * i, 100, 10_000 + 100 * i) for i in range(n_shorts)]
    reqs = workload([*shorts, cold(0.05, 5000, 1)])
    idx = next(i for i, r in enumerate(reqs) if r.prompt_tokens == 5000)
    return reqs, idx, PROFILE.prefill_seconds(5000, 0)


@pytest.mark.parametrize("scheduler", ["priority", "vllm-priority"])
def test_aging_bounds_the_wait_of_a_long_prompt(scheduler: str) -> None:
    # An overload of short prompts (each ~0.013 s of work every 0.01 s for 3 s) and one
    # long prompt early on. Without aging it waits for the whole backlog; with aging a it
    # is overtaken only by arrivals within h/a of its own (h: its predicted work).
    reqs, idx, h = overload(300)
    no_aging = run(reqs, scheduler, aging=0.0)[idx] - 0.05
    aged = run(reqs, scheduler, aging=0.5)[idx] - 0.05
    backlog_end = max(run(reqs, "fcfs"))
    assert no_aging > backlog_end - 0.05 - 2 * h  # it starves behind the whole backlog
    # aged: arrivals within h/a overtake it (their work plus its own), then it runs
    bound = 1.4 * (h / 0.5) + h + 2 * PROFILE.prefill_seconds(512, 0)
    assert aged < bound < no_aging


@pytest.mark.parametrize("scheduler", ["priority", "vllm-priority"])
def test_a_horizon_bounds_the_wait_under_a_small_aging(scheduler: str) -> None:
    # A 6 s overload of short prompts (each ~0.013 s of work every 0.01 s) and one long
    # prompt early on, at aging 0.05: h/a is longer than the backlog, so the long prompt
    # waits for all of it. With a 1 s horizon (work capped at 0.05 s, above a short's)
    # the shorts still go first, but only those that arrive within 1 s of it.
    reqs, idx, h = overload(600)
    assert h / 0.05 > 6.0
    uncapped = run(reqs, scheduler, aging=0.05)[idx] - 0.05
    capped_run = run(reqs, scheduler, aging=0.05, horizon=1.0)
    capped = capped_run[idx] - 0.05
    backlog_end = max(run(reqs, "fcfs"))
    assert uncapped > backlog_end - 0.05 - 2 * h
    bound = 1.4 * 1.0 + h + 2 * PROFILE.prefill_seconds(512, 0)
    assert capped < bound < uncapped
    # within the horizon least work still goes first: a short that arrived after the
    # long one gets its first token before the long one does
    first_after = next(i for i, r in enumerate(reqs) if r.arrival_s > 0.06)
    assert capped_run[first_after] < capped_run[idx]


class _Recording:
    """tier_aware, recording each arrival's `FleetStats.keyed` and engines' queued tokens."""

    def __init__(self) -> None:
        self.inner = create_policy("tier_aware", {})
        self.name = "tier_aware"
        self.seen: list[tuple[dict[str, list[tuple[float, int, bool]]], dict[str, int]]] = []

    def pick(self, request, engines, fleet):  # type: ignore[no-untyped-def]
        self.seen.append(
            (
                {e: list(qu.entries) for e, qu in fleet.keyed.items()},
                {e.id: e.load.queued_prompt_tokens or 0 for e in engines},
            )
        )
        return self.inner.pick(request, engines, fleet)


@pytest.mark.parametrize("scheduler", ["priority", "vllm-priority", "fcfs"])
def test_keyed_wait_shows_the_policy_each_priority_engines_queue(scheduler: str) -> None:
    # three long prompts then a short one, 10 ms apart, on two engines
    reqs = workload(
        [cold(0.01 * i, 3000, 10_000 * (i + 1)) for i in range(3)] + [cold(0.03, 100, 90_000)]
    )
    pol = _Recording()
    simulate(reqs, spec(scheduler=scheduler), pol, block_tokens=BLOCK, engines=2, keyed_wait=True)
    if scheduler == "fcfs":  # an FCFS engine serves by no key: nothing to tell
        assert all(not keyed for keyed, _ in pol.seen)
        return
    keyed, queued = pol.seen[-1]
    assert set(keyed) == {"e0", "e1"}
    for e, entries in keyed.items():
        # every job not yet at its first token, with its tokens left: the engine's queue
        assert sum(t for _, t, _ in entries) == queued[e]
        assert sum(started for _, _, started in entries) <= 1
    assert any(entries for entries in keyed.values())


@pytest.mark.parametrize("charge", [True, False])
@pytest.mark.parametrize(
    ("scheduler", "convention"), [("priority", "reference"), ("vllm-priority", "vllm")]
)
def test_router_and_simulator_give_the_cost_model_the_same_keyed_queue(
    scheduler: str, convention: str, charge: bool
) -> None:
    # the simulator's queue at the last arrival, and the router's queue fed the same
    # requests (keys, tokens) from a pool file with the same aging, horizon and
    # charge_jumps: the same KeyedQueue but for what the router cannot see (a started
    # prefill: it learns of a start only at the first byte)
    reqs = workload(
        [cold(0.01 * i, 3000, 10_000 * (i + 1)) for i in range(3)] + [cold(0.03, 100, 90_000)]
    )
    pol = _Queues()
    simulate(
        reqs,
        spec(scheduler=scheduler, aging=0.05, horizon_s=20.0),
        pol,
        block_tokens=BLOCK,
        engines=2,
        keyed_wait=True,
        charge_jumps=charge,
    )
    cfg = parse_policy(
        {
            "engines": [{"id": e, "url": "http://127.0.0.1:1"} for e in ("e0", "e1")],
            "incumbent": {"name": "tier_aware"},
            "priority": [
                {
                    "name": "p",
                    "engines": ["e0", "e1"],
                    "mode": "on",
                    "convention": convention,
                    "aging": 0.05,
                    "horizon_s": 20.0,
                    "charge_jumps": charge,
                }
            ],
        }
    )
    hints = PriorityHints(cfg.priority, CollectorRegistry())
    assert pol.last
    for e, sim_q in pol.last.items():
        waiting = [(k, t) for k, t, started in sim_q.entries if not started]
        for i, (k, t) in enumerate(waiting):
            hints.queues.add(e, f"r{i}", k, t)
        got = hints.queues.queue(e, sum(t for _, t in waiting))
        want = replace(sim_q, entries=tuple(sorted((k, t, False) for k, t in waiting)))
        assert got == want
        assert got is not None and got.charge_jumps is charge


class _Queues:
    """tier_aware, keeping the last arrival's `FleetStats.keyed`."""

    def __init__(self) -> None:
        self.inner = create_policy("tier_aware", {})
        self.name = "tier_aware"
        self.last: dict[EngineId, KeyedQueue] = {}

    def pick(self, request, engines, fleet):  # type: ignore[no-untyped-def]
        self.last = dict(fleet.keyed)
        return self.inner.pick(request, engines, fleet)
