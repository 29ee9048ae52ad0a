"""`ramjet_engine_profile_source`: which profile prices each engine, from the live policies
and signals (`ramjet.app.profile_source`). The router-level scrape is in
tests/integration/test_router_reports.py; here every source and the reload case."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from ramjet.app.profile_source import ProfileSources, default_profile_of, profile_source
from ramjet.fleet.signals import NoSignals
from ramjet.policy.cost import V41_FLASH_TP4_ESTIMATE
from ramjet.policy.profile import CurvePoint, EngineProfile
from ramjet.policy.registry import create_policy
from ramjet.types import EngineId, TrustGrade

MEASURED = EngineProfile(
    prefill_curve=[CurvePoint(context_tokens=0, seconds_per_token=2e-4)],
    replay_floor_s=0.02,
    global_kv_bytes_per_token=1000,
    decode_step_s=0.03,
)


def test_the_source_of_each_case() -> None:
    est = V41_FLASH_TP4_ESTIMATE
    assert profile_source(MEASURED, TrustGrade.EXACT, est) == "reported"
    assert profile_source(est, TrustGrade.EXACT, est) == "reported"  # signed: its own
    assert profile_source(None, TrustGrade.APPROXIMATE, est) == "builtin_estimate"
    assert profile_source(MEASURED, TrustGrade.DEGRADED, est) == "builtin_estimate"
    assert profile_source(None, TrustGrade.APPROXIMATE, MEASURED) == "policy_default"


def test_default_profile_follows_the_live_policies() -> None:
    own = create_policy("tier_aware", {"default_profile": MEASURED.model_dump()})
    affinity = create_policy("prefix_affinity", {})
    assert default_profile_of([affinity]) == V41_FLASH_TP4_ESTIMATE
    assert default_profile_of([own, affinity]) == MEASURED
    assert default_profile_of([create_policy("tier_aware", {})]) == V41_FLASH_TP4_ESTIMATE


def test_collector_exports_one_source_per_engine_and_follows_a_reload() -> None:
    live = [create_policy("tier_aware", {})]
    reg = CollectorRegistry()
    reg.register(ProfileSources([EngineId("e0"), EngineId("e1")], NoSignals, lambda: live))

    def value(engine: str, source: str) -> float | None:
        return reg.get_sample_value(
            "ramjet_engine_profile_source", {"engine": engine, "source": source}
        )

    for e in ("e0", "e1"):
        assert value(e, "builtin_estimate") == 1.0
        assert value(e, "policy_default") == 0.0 and value(e, "reported") == 0.0
    live[0] = create_policy("tier_aware", {"default_profile": MEASURED.model_dump()})
    assert value("e0", "policy_default") == 1.0 and value("e0", "builtin_estimate") == 0.0
