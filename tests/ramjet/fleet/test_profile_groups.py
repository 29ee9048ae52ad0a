"""Profile groups (`EngineConfig.profile_group`): engines of one kind are priced with the
mean of their signed profiles (`ramjet.fleet.signals.GroupedProfiles`,
`ramjet.policy.profile.mean_profile`), so one engine's luckier probe cannot make it the
cheaper of two identical engines."""

from __future__ import annotations

import pytest
from policy_fakes import curve_profile
from reports_fixtures import E0, E1, frame, rig

from ramjet.app.wiring import profile_groups
from ramjet.config import parse_policy
from ramjet.fleet.signals import GroupedProfiles, ReportSignals
from ramjet.policy.profile import EngineProfile, TierCost, mean_profile
from ramjet.reports.bodies import ProfileBody


def _profile(rates: list[tuple[int, float]], floor: float, **extra: object) -> EngineProfile:
    return curve_profile(*rates, replay_floor_s=floor, global_kv_bytes_per_token=890.0, **extra)


def test_the_mean_prices_every_prompt_at_the_mean_of_the_members() -> None:
    a = _profile([(0, 1e-4), (4096, 3e-4)], 0.01, prefill_overhead_s=0.02)
    b = _profile(
        [(0, 2e-4), (2048, 4e-4)],
        0.03,
        tiers={"host": TierCost(bandwidth_bytes_per_s=2e9, latency_s=0.001)},
    )
    m = mean_profile([a, b])
    for n, c in ((500, 0), (2000, 1000), (3000, 1096)):  # within the probes: exact
        want = (a.prefill_seconds(n, c) + b.prefill_seconds(n, c)) / 2
        assert m.prefill_seconds(n, c) == pytest.approx(want)
    assert m.replay_floor_s == pytest.approx(0.02) and m.prefill_overhead_s == 0.01
    assert m.tiers == {"host": TierCost(bandwidth_bytes_per_s=2e9, latency_s=0.001)}
    assert m.prefill_curve[-1].context_tokens == 4096  # the longest probe
    assert mean_profile([a]) is a
    with pytest.raises(ValueError, match="no profiles"):
        mean_profile([])


def test_grouped_engines_share_the_mean_of_their_signed_profiles() -> None:
    r = rig()
    cheap = _profile([(0, 1e-4)], 0.01)
    dear = _profile([(0, 1.8e-4)], 0.01)  # the same engine, probed under load
    signals = GroupedProfiles(ReportSignals(r.processor), {E0: (E0, E1), E1: (E0, E1)})
    r.processor.submit(frame(ProfileBody(**cheap.model_dump()), seq=1))
    got = [signals.profile(e) for e in (E0, E1)]
    assert [p.model_dump() for p in got if p] == [cheap.model_dump()] * 2  # the only one yet
    r.processor.submit(frame(ProfileBody(**dear.model_dump()), engine=E1, key_id="e1-a"))
    mean = signals.profile(E0)
    assert mean is signals.profile(E1)  # made once for both
    assert mean is not None and mean.prefill_seconds(1000) == pytest.approx(0.14)
    # an ungrouped engine keeps its own
    alone = GroupedProfiles(ReportSignals(r.processor), {})
    own = alone.profile(E1)
    assert own is not None and own.model_dump() == dear.model_dump()


def test_the_policy_names_the_groups() -> None:
    engines = [
        {"id": "e0", "url": "http://127.0.0.1:9000", "profile_group": "tp4"},
        {"id": "e1", "url": "http://127.0.0.1:9001", "profile_group": "tp4"},
        {"id": "e2", "url": "http://127.0.0.1:9002"},
    ]
    config = parse_policy({"engines": engines, "incumbent": {"name": "round_robin"}})
    assert profile_groups(config) == {E0: (E0, E1), E1: (E0, E1)}
    bad = [{**engines[0], "profile_group": "no spaces"}]
    with pytest.raises(ValueError, match="profile_group"):
        parse_policy({"engines": bad, "incumbent": {"name": "round_robin"}})
