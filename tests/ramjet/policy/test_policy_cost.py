"""Table-driven tests of the cost model (`ramjet.policy.cost`) and the `tier_aware` policy."""

from __future__ import annotations

import math

import pytest
from policy_fakes import engine, request

from ramjet.policy.base import FleetStats, GlobalMatch
from ramjet.policy.cost import (
    V41_FLASH_TP4_ESTIMATE,
    estimate,
    prompt_work,
    swa_reach,
    wait_seconds,
)
from ramjet.policy.profile import CurvePoint, EngineProfile, TierCost
from ramjet.policy.registry import create_policy
from ramjet.policy.tier_aware import TierAware, TierAwareParams
from ramjet.types import EngineId, TrustGrade

# Round figures: 10k tokens/s flat, 20 ms replay floor, 1000 bytes/token,
# host 1 GB/s + 1 ms, SSD 100 MB/s + 5 ms.
P = EngineProfile(
    prefill_curve=[CurvePoint(context_tokens=0, seconds_per_token=1e-4)],
    replay_floor_s=0.02,
    global_kv_bytes_per_token=1000,
    tiers={
        "host": TierCost(bandwidth_bytes_per_s=1e9, latency_s=0.001),
        "ssd": TierCost(bandwidth_bytes_per_s=1e8, latency_s=0.005),
    },
    decode_step_s=0.01,
)
N = 4096


@pytest.mark.parametrize(
    ("label", "n", "match", "swa", "resume", "restore", "replay", "prefill"),
    [
        ("all cold", N, GlobalMatch(), 0, "cold", 0.0, 0.0, N * 1e-4),
        ("full HBM hit, live SWA: no replay", N, GlobalMatch(hbm=N), N, "swa", 0.0, 0.0, 0.0),
        (
            "HBM hit, live SWA at the boundary",
            5120,
            GlobalMatch(hbm=N),
            N,
            "swa",
            0.0,
            0.0,
            1024e-4,
        ),
        (
            "full global hit, SWA expired: exactly the floor",
            N,
            GlobalMatch(hbm=N),
            0,
            "global",
            0.0,
            0.02,
            0.0,
        ),
        ("partial HBM hit, SWA expired", N, GlobalMatch(hbm=1024), 0, "global", 0.0, 0.02, 3072e-4),
        (
            "host hit: restore by bandwidth",
            N,
            GlobalMatch(host=2048),
            0,
            "global",
            0.001 + 2048e3 / 1e9,
            0.02,
            2048e-4,
        ),
        (
            "SSD hit: restore by bandwidth",
            N,
            GlobalMatch(ssd=2048),
            0,
            "global",
            0.005 + 2048e3 / 1e8,
            0.02,
            2048e-4,
        ),
        (
            "all tiers",
            N,
            GlobalMatch(hbm=1024, host=1024, ssd=1024),
            0,
            "global",
            0.001 + 1024e3 / 1e9 + 0.005 + 1024e3 / 1e8,
            0.02,
            1024e-4,
        ),
        # cheaper of two resume points: SWA at 2048 costs 0.2048; global at 4096 costs the floor
        (
            "global beats an earlier SWA point",
            N,
            GlobalMatch(hbm=N),
            2048,
            "global",
            0.0,
            0.02,
            0.0,
        ),
        # ... but SWA at 2048 (0.2048) beats global at 2100 (0.02 + 0.1996)
        (
            "SWA beats a slightly longer global hit",
            N,
            GlobalMatch(hbm=2100),
            2048,
            "swa",
            0.0,
            0.0,
            2048e-4,
        ),
        # the match is clipped to the prompt
        ("match longer than the prompt", 1024, GlobalMatch(hbm=N), 0, "global", 0.0, 0.02, 0.0),
    ],
)
def test_prompt_work(
    label: str,
    n: int,
    match: GlobalMatch,
    swa: int,
    resume: str,
    restore: float,
    replay: float,
    prefill: float,
) -> None:
    work = prompt_work(P, n, match, swa)
    assert work.resume == resume, label
    assert work.restore_s == pytest.approx(restore, abs=1e-12), label
    assert work.replay_s == replay, label
    assert work.prefill_s == pytest.approx(prefill, abs=1e-12), label
    assert work.work_s == pytest.approx(restore + replay + prefill, abs=1e-12)


def test_cold_wins_when_restore_is_dearer_than_recompute() -> None:
    slow = P.model_copy(
        update={"tiers": {"ssd": TierCost(bandwidth_bytes_per_s=1e6, latency_s=0.0)}}
    )
    work = prompt_work(slow, N, GlobalMatch(ssd=N), 0)
    assert work.resume == "cold"
    assert work.work_s == pytest.approx(N * 1e-4)


def test_prefill_follows_the_curve_at_context_length() -> None:
    rising = P.model_copy(
        update={
            "prefill_curve": [
                CurvePoint(context_tokens=0, seconds_per_token=1e-4),
                CurvePoint(context_tokens=10_000, seconds_per_token=2e-4),
            ]
        }
    )
    deep = prompt_work(rising, 10_000, GlobalMatch(hbm=9_000), 0)
    shallow = prompt_work(rising, 1_000, GlobalMatch(), 0)
    assert deep.prefill_s == pytest.approx(1000 * 1.95e-4)
    assert shallow.prefill_s == pytest.approx(1000 * 1.05e-4)


@pytest.mark.parametrize(
    ("queued", "inflight_tokens", "inflight", "new", "expected"),
    [
        (0, 0, 0, 1000, 0.0),
        (20_000, 0, 0, 1000, 2.0),
        # the router's in-flight corrects a stale (lower) report
        (1_000, 30_000, 0, 1000, 3.0),
        # decode interference: one decode step per 8192-token chunk of queued + own tokens
        (20_000, 0, 3, 1000, 2.0 + math.ceil(21_000 / 8192) * 0.01),
    ],
)
def test_wait(queued: int, inflight_tokens: int, inflight: int, new: int, expected: float) -> None:
    e = engine("a", queued=queued, inflight_tokens=inflight_tokens, inflight=inflight)
    assert wait_seconds(P, e, new, 8192) == pytest.approx(expected)


def test_overloaded_engine_loses_affinity() -> None:
    policy = TierAware(TierAwareParams(default_profile=P))
    warm_busy = engine("a", hbm=N, queued=60_000, profile=P)  # wait 6 s, work 0.02 s
    cold_idle = engine("b", queued=0, profile=P)  # work 0.41 s
    decision = policy.pick(request(N), [warm_busy, cold_idle], FleetStats())
    assert decision.engine == "b"
    warm_light = engine("a", hbm=N, queued=2_000, profile=P)  # wait 0.2 s
    assert policy.pick(request(N), [warm_light, cold_idle], FleetStats()).engine == "a"


def test_externality_charges_wasted_work() -> None:
    # a: warm but queued; TTFT 0.30 + 0.02 = 0.32. b: cold, idle; TTFT 0.4096.
    # Selfish picks a anyway here; make b's TTFT the smaller one and check the charge.
    a = engine("a", hbm=N, queued=4_000, profile=P)  # TTFT 0.4 + 0.02 = 0.42
    b = engine("b", profile=P)  # TTFT 0.4096, wasted work 0.3896
    selfish = TierAware(TierAwareParams(default_profile=P, externality_scale=0.0))
    assert (
        selfish.pick(request(N), [a, b], FleetStats(arrival_rate_per_s=2, mean_wait_s=0.5)).engine
        == "b"
    )
    policy = TierAware(TierAwareParams(default_profile=P))
    fleet = FleetStats(arrival_rate_per_s=2.0, mean_wait_s=0.5)
    decision = policy.pick(request(N), [a, b], fleet)
    assert decision.engine == "a"
    cb = decision.components["b"]
    assert cb["delta_s"] == pytest.approx(N * 1e-4 - 0.02)
    assert cb["externality_s"] == pytest.approx(2.0 * 0.5 * cb["delta_s"])
    assert cb["cost_s"] == pytest.approx(cb["ttft_s"] + cb["externality_s"])
    assert decision.components["a"]["externality_s"] == 0.0
    # with no measured load the term is off and the decision says so
    quiet = policy.pick(request(N), [a, b], FleetStats())
    assert quiet.engine == "b" and "externality_off" in quiet.notes


def test_missing_profile_uses_defaults_and_says_so() -> None:
    # b measured cheaper than the built-in estimate: a keeps the estimate (a dearer
    # measured profile would price a instead, see the test below)
    fast = P.model_copy(
        update={"prefill_curve": [CurvePoint(context_tokens=0, seconds_per_token=1e-5)]}
    )
    policy = create_policy("tier_aware", {})
    decision = policy.pick(
        request(N), [engine("a", hbm=N), engine("b", profile=fast)], FleetStats()
    )
    assert "default_profile:a" in decision.notes
    assert "default_profile:b" not in decision.notes
    # the default is the hard-coded V4.1 estimate: the decision names the engine priced so
    assert "estimate_profile:a" in decision.notes
    assert "estimate_profile:b" not in decision.notes
    # an operator's own default profile is no estimate of ours: no such note
    own = create_policy("tier_aware", {"default_profile": P.model_dump()})
    mine = own.pick(request(N), [engine("a", hbm=N), engine("b", profile=fast)], FleetStats())
    assert "default_profile:a" in mine.notes
    assert not [n for n in mine.notes if n.startswith("estimate_profile:")]
    ca = decision.components["a"]
    assert ca["default_profile"] == 1.0
    assert ca["replay_s"] == V41_FLASH_TP4_ESTIMATE.replay_floor_s
    assert decision.components["b"]["prefill_s"] == pytest.approx(N * 1e-5)


def test_default_profile_comes_from_policy_params() -> None:
    params = {"default_profile": P.model_dump()}
    policy = create_policy("tier_aware", params)
    decision = policy.pick(request(N), [engine("a")], FleetStats())
    assert decision.components["a"]["prefill_s"] == pytest.approx(N * 1e-4)


def test_degraded_view_is_priced_with_caution() -> None:
    ests = estimate(
        request(N, boundaries=[N]),
        [engine("a", hbm=N, swa=N, profile=P, trust=TrustGrade.DEGRADED)],
        FleetStats(),
        default_profile=P,
    )
    (a,) = ests
    assert a.degraded and a.default_profile
    assert a.swa_tokens == 0
    assert a.work.resume == "global"
    assert a.work.restore_s == pytest.approx(0.005 + N * 1000 / 1e8)


def test_every_component_is_recorded() -> None:
    decision = create_policy("tier_aware", {}).pick(
        request(N), [engine("a"), engine("b")], FleetStats()
    )
    for comps in decision.components.values():
        assert {
            "wait_s",
            "work_s",
            "restore_s",
            "replay_s",
            "prefill_s",
            "delta_s",
            "externality_s",
            "cost_s",
        } <= set(comps)


# -- SWA resume past g: the byte-level refinement of q <= g --------------------------
# Blocks of 256 tokens; g = 4 full blocks (1024) matched; the request has 16 blocks.
T = 256
G4 = GlobalMatch(hbm=4 * T, blocks=4)


@pytest.mark.parametrize(
    ("label", "n", "match", "swa", "resume", "resume_tokens"),
    [
        ("q inside the block after g: credited", N, G4, 4 * T + 100, "swa", 4 * T + 100),
        ("q at the last token before the next block", N, G4, 5 * T - 1, "swa", 5 * T - 1),
        ("q at the next block's end: that block is missing", N, G4, 5 * T, "global", 4 * T),
        ("q two blocks past g: no usable state, replay from g", N, G4, 7 * T, "global", 4 * T),
        ("q at g exactly", N, G4, 4 * T, "swa", 4 * T),
        ("no global match, q inside the first block", N, GlobalMatch(blocks=0), 100, "swa", 100),
        ("no global match, q past the first block", N, GlobalMatch(blocks=0), T + 1, "cold", 0),
        ("all full blocks matched, q in the tail", 4 * T + 50, G4, 4 * T + 20, "swa", 4 * T + 20),
        ("q at the prompt's end: one token must be prefilled", 4 * T + 50, G4, 4 * T + 50, "global", 4 * T),
        ("a view that counts no blocks: uniform sizes", N, GlobalMatch(hbm=4 * T), 4 * T + 9, "swa", 4 * T + 9),
    ],
)  # fmt: skip
def test_swa_resume_past_the_last_matched_block(
    label: str, n: int, match: GlobalMatch, swa: int, resume: str, resume_tokens: int
) -> None:
    req = request(n, block=T)
    reach = swa_reach(req, match)
    w = prompt_work(P, n, match, swa, reach)
    assert (w.resume, w.resume_tokens) == (resume, resume_tokens), label
    if resume == "swa" and resume_tokens > match.total:
        assert w.replay_s == 0.0
        assert w.prefill_s == pytest.approx(P.prefill_seconds(n - resume_tokens, resume_tokens))
    # without `reach` (block granularity) q is clipped to g
    assert prompt_work(P, n, match, swa).resume_tokens == min(swa, match.total) or not swa


def test_swa_past_g_restores_all_of_g_from_its_tiers() -> None:
    m = GlobalMatch(hbm=2 * T, host=2 * T, blocks=4)
    req = request(N, block=T)
    w = prompt_work(P, N, m, 4 * T + 10, swa_reach(req, m))
    assert w.resume == "swa" and w.resume_tokens == 4 * T + 10
    assert w.restore_s == pytest.approx(2 * T * 1000 / 1e9 + 0.001)  # all host tokens


def test_estimate_credits_a_boundary_past_g_through_the_view() -> None:
    e = engine("e0", hbm=4 * T, swa=4 * T + 100)
    (est,) = estimate(request(N, block=T, boundaries=(4 * T + 100,)), [e], FleetStats())
    assert est.work.resume == "swa" and est.work.resume_tokens == 4 * T + 100


def test_an_engine_without_a_measured_profile_never_looks_cheaper() -> None:
    """Issue 15, problem 8: one engine's probed profile arrived (2e-4 s/token), the
    other's did not; priced with the built-in estimate (5.4e-5 s/token) the engine
    without one looked cheap and took 47 of 48 requests. It is priced with the dearest
    of the default and the fleet's measured profiles, so with equal caches and loads it
    is never the cheaper one; with no measured profile in the fleet the default stands."""
    slow = EngineProfile(
        prefill_curve=[CurvePoint(context_tokens=0, seconds_per_token=2e-4)],
        prefill_overhead_s=0.01,
        replay_floor_s=0.0,
        global_kv_bytes_per_token=1.0,
    )
    measured, unknown = engine("m", profile=slow), engine("u")
    est = {e.engine: e for e in estimate(request(), [measured, unknown], FleetStats())}
    assert est["u"].default_profile and not est["m"].default_profile
    assert est["u"].stand_in == "m"
    notes = TierAware().pick(request(), [measured, unknown], FleetStats()).notes
    assert "default_profile:u" in notes and "estimate_profile:u" not in notes
    assert est["u"].ttft_s >= est["m"].ttft_s
    picks = {
        TierAware().pick(request(), [measured, unknown], FleetStats()).engine for _ in range(4)
    }
    assert picks == {"m"}
    # the unknown engine with a real cache advantage still wins
    warm = engine("u", hbm=4096)
    assert TierAware().pick(request(), [measured, warm], FleetStats()).engine == "u"
    # nobody measured: the default profile prices both
    alone = estimate(request(), [engine("a"), engine("b")], FleetStats())
    assert (
        alone[0].ttft_s
        == alone[1].ttft_s
        == V41_FLASH_TP4_ESTIMATE.prefill_seconds(request().prompt_tokens, 0)
    )


def test_the_curve_extrapolates_no_faster_than_the_measured_trend() -> None:
    """Issue 15, problem 9: probed to ~1.3k tokens with a noisy, steep last segment, the
    curve predicted 1.07 s for 3.1k tokens where vLLM took 0.6 s. Past its last point
    the rate grows at most at the trend of the whole curve (first to last point), never
    at a steeper last segment's slope; within the points nothing changes."""
    prof = EngineProfile(
        prefill_curve=[
            CurvePoint(context_tokens=0, seconds_per_token=1.6e-4),
            CurvePoint(context_tokens=256, seconds_per_token=1.5e-4),
            CurvePoint(context_tokens=1024, seconds_per_token=2.2e-4),
        ],
        replay_floor_s=0.0,
        global_kv_bytes_per_token=1.0,
    )
    trend = (2.2e-4 - 1.6e-4) / 1024
    assert prof._rate(2048) == pytest.approx(2.2e-4 + trend * 1024)
    assert prof._rate(600) == pytest.approx(1.5e-4 + (0.7e-4 / 768) * 344)  # unchanged
    assert prof.prefill_seconds(3100, 0) < 0.8
    # a falling trend past the last point holds the last rate (never below it)
    falling = prof.model_copy(
        update={"prefill_curve": [CurvePoint(context_tokens=0, seconds_per_token=3e-4),
                                  CurvePoint(context_tokens=512, seconds_per_token=1e-4),
                                  CurvePoint(context_tokens=1024, seconds_per_token=2e-4)]}
    )  # fmt: skip
    assert falling._rate(4096) == pytest.approx(2e-4)


def test_a_profile_that_was_asked_copies_pickles_and_rebuilds_its_curve() -> None:
    """A profile keeps its curve (`EngineProfile.curve`, a compiled class on the built
    router) beside its fields once asked: a deep copy, a pickle and a `model_copy(deep=
    True)` of it answer as it does (the compiled class failed all three before it said
    how to remake itself), and a `model_copy` with another curve or overhead answers by
    its own figures, not the first one's kept answers."""
    import copy
    import pickle

    asked = V41_FLASH_TP4_ESTIMATE.model_copy()
    want = [asked.prefill_seconds(n, c) for n, c in ((100, 0), (5000, 200_000), (1, 2_000_000))]
    for twin in (
        copy.deepcopy(asked),
        pickle.loads(pickle.dumps(asked)),
        asked.model_copy(deep=True),
    ):
        assert twin == asked
        got = [twin.prefill_seconds(n, c) for n, c in ((100, 0), (5000, 200_000), (1, 2_000_000))]
        assert got == want
    slower = asked.model_copy(update={"prefill_overhead_s": asked.prefill_overhead_s + 1.0})
    assert slower.prefill_seconds(100, 0) == pytest.approx(want[0] + 1.0)
    flat = asked.model_copy(
        update={"prefill_curve": [CurvePoint(context_tokens=0, seconds_per_token=1e-3)]}
    )
    assert flat.prefill_seconds(100, 0) == pytest.approx(asked.prefill_overhead_s + 0.1)
    assert asked.prefill_seconds(100, 0) == want[0]


def test_each_waiting_request_costs_its_own_chunk_on_a_one_prefill_per_step_engine() -> None:
    from dataclasses import replace

    from ramjet.policy.cost import V41_FLASH_TP4_ESTIMATE, wait_seconds

    p = V41_FLASH_TP4_ESTIMATE
    a, b = engine("a", queued=600, inflight=8), engine("b", queued=600, inflight=8)
    many = replace(a, load=replace(a.load, waiting_requests=5, running_requests=3))
    one = replace(b, load=replace(b.load, waiting_requests=0, running_requests=3))
    step, over = p.decode_step_s, p.prefill_overhead_s
    # six 100-token prompts queued: five waiting, one in prefill; ours is the seventh job
    assert wait_seconds(p, many, 100, 8192) == pytest.approx(
        p.prefill_seconds(600, 0) + 5 * over + 7 * step
    )
    # one 600-token prompt in prefill: it and ours, a chunk each
    assert wait_seconds(p, one, 100, 8192) == pytest.approx(p.prefill_seconds(600, 0) + 2 * step)
    # an engine that packs prompts into a step's budget: tokens only
    packed = wait_seconds(p, many, 100, 8192, per_job=False)
    assert packed == pytest.approx(p.prefill_seconds(600, 0) + step)
    # the same queued tokens: the policy prefers one long prompt to six short ones
    decision = create_policy("tier_aware", {}).pick(request(100), [many, one], FleetStats())
    assert decision.engine == "b"
    tokens = create_policy("tier_aware", {"per_job_prefill": False})
    assert {
        c["wait_s"]
        for c in tokens.pick(request(100), [many, one], FleetStats()).components.values()
    } == {packed}


def test_a_packing_engine_adds_the_prompts_routed_there_meanwhile() -> None:
    # vLLM packs the prompts that arrive while ours waits into our step: with ρ_e of the
    # engine's time routed to it as prompt work, TTFT grows by ρ_e · (wait + work); a
    # one-job-per-step engine (per_job) adds nothing, and ρ is capped at 1
    a, b = engine("a", queued=600, inflight=2), engine("b", queued=600, inflight=2)
    fleet = FleetStats(work_rate={"a": 0.5, "b": 3.0})  # type: ignore[dict-item]
    packed = create_policy("tier_aware", {"per_job_prefill": False})
    comps = packed.pick(request(100), [a, b], fleet).components
    for eid, rho in (("a", 0.5), ("b", 1.0)):
        c = comps[eid]
        assert c["packing_s"] == pytest.approx(rho * (c["wait_s"] + c["work_s"]))
        assert c["ttft_s"] == pytest.approx(c["wait_s"] + c["work_s"] + c["packing_s"])
    assert packed.pick(request(100), [a, b], fleet).engine == "a"  # the less loaded
    per_job = create_policy("tier_aware", {}).pick(request(100), [a, b], fleet).components
    assert {c["packing_s"] for c in per_job.values()} == {0.0}
    none = packed.pick(request(100), [a, b], FleetStats()).components
    assert {c["packing_s"] for c in none.values()} == {0.0}


def test_components_are_the_estimates_own_sums_exactly() -> None:
    # `components()` adds work, TTFT and cost inline (once per engine per decision): its
    # figures must be the properties' to the last bit, with every term non-zero
    a = engine("a", hbm=1024, host=1024, ssd=512, queued=3000, inflight=3)
    b = engine("b", hbm=256, queued=500, inflight=1)
    fleet = FleetStats(
        now_s=5.0,
        arrival_rate_per_s=4.0,
        mean_wait_s=0.3,
        work_rate={EngineId("a"): 0.4, EngineId("b"): 0.7},
    )
    sess = {EngineId("a"): 0.05, EngineId("b"): 0.02}
    ests = estimate(request(4096), [a, b], fleet, per_job=False, session_s=sess)
    for e in ests:
        c = e.components()
        assert e.packing_s > 0 and e.session_s > 0 and e.work.restore_s + e.work.replay_s > 0
        assert c["work_s"] == e.work.work_s
        assert c["ttft_s"] == e.ttft_s
        assert c["cost_s"] == e.cost_s
    assert any(e.externality_s > 0 for e in ests)
