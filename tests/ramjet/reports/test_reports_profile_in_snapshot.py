"""A router started after an engine published its profile still gets it (issue 15,
problem 8): the profile rides in every snapshot, and a new epoch re-sends it as its
first report. Before, the profile was a single report at start; a router that joined
later took a snapshot (cache contents only) and priced the engine with the default."""

from __future__ import annotations

from reports_fixtures import E0, KEYS, WALL0, rig

from ramjet.policy.profile import CurvePoint, EngineProfile
from ramjet.reports.bodies import DeltaBody, TierKeys
from ramjet.reports.envelope import decode
from ramjet.reports.publisher import ReportPublisher
from ramjet.types import PrefixKey

PROFILE = EngineProfile(
    prefill_curve=[CurvePoint(context_tokens=0, seconds_per_token=2e-4)],
    prefill_overhead_s=0.01,
    replay_floor_s=0.0,
    global_kv_bytes_per_token=1.0,
)


def publisher() -> ReportPublisher:
    keys = [TierKeys(tier="hbm", keys=(PrefixKey(1), PrefixKey(2)))]
    return ReportPublisher(
        E0, KEYS["e0-a"], "e0-a", epoch=7, snapshot=lambda: (keys, []), wall_clock=lambda: WALL0
    )


def test_a_late_router_gets_the_profile_from_the_snapshot() -> None:
    pub = publisher()
    pub.publish_profile(PROFILE)
    for _ in range(3):
        pub.publish_delta(DeltaBody(evicted=(PrefixKey(9),)))
    late = rig()  # never saw report 1
    late.processor.submit(pub.snapshot_frame())
    got = late.processor.profile(E0)
    assert got is not None and got.model_dump() == PROFILE.model_dump()
    assert late.accepted("e0", "snapshot") == 1 and late.accepted("e0", "profile") == 0


def test_a_new_epoch_re_sends_the_profile_first() -> None:
    pub = publisher()
    pub.publish_profile(PROFILE)
    pub.new_epoch(8)
    first = pub.frames_after(0)[0]
    env = decode(first, 1 << 20).envelope
    assert (env.epoch, env.seq, env.kind) == (8, 1, "profile")
    fresh = rig()
    fresh.processor.submit(first)
    got = fresh.processor.profile(E0)
    assert got is not None and got.model_dump() == PROFILE.model_dump()
