"""Verification and commit: every rejection counted by reason and changing nothing;
gaps, snapshots, epochs, trust grades, staleness, rate limit (RELIABILITY rows 9, 17-22)."""

from __future__ import annotations

import pytest
from reports_fixtures import E0, E1, WALL0, Rig, frame, load_body, rig, stored

from ramjet.policy.base import GlobalMatch
from ramjet.reports.bodies import DeltaBody, SnapshotBody, SwaStates, TierKeys
from ramjet.reports.verify import Accepted, Reason, Rejected
from ramjet.residency.store import Table
from ramjet.residency.tables import ViewMode
from ramjet.types import PrefixKey, Tier, TrustGrade

K = [PrefixKey(100 + i) for i in range(8)]
T = [256] * 8


def residency(r: Rig) -> tuple[object, ...]:
    """Everything a rejection must leave alone."""
    p = r.processor
    return (
        r.tables.size(Table.GLOBAL),
        r.tables.size(Table.SWA),
        r.tables.view(E0).global_match(K, T),
        p.cursor(E0),
        p.trust(E0),
        p.snapshot_needed(E0),
        p.load(E0),
    )


def submit_ok(r: Rig, f: bytes) -> Accepted:
    out = r.processor.submit(f)
    assert isinstance(out, Accepted), out
    return out


def expect_rejected(r: Rig, f: bytes, reason: Reason, engine: str = "e0") -> None:
    before = residency(r)
    count = r.rejected(reason.value, engine)
    out = r.processor.submit(f)
    assert isinstance(out, Rejected) and out.reason is reason, out
    assert r.rejected(reason.value, engine) == count + 1
    assert residency(r) == before


def test_accepted_delta_fills_the_table_exactly() -> None:
    r = rig()
    assert r.processor.trust(E0) is TrustGrade.APPROXIMATE
    submit_ok(r, frame(stored(100, 101, 102), seq=1))
    submit_ok(r, frame(stored(103, tier="host"), seq=2))
    assert r.tables.view(E0).global_match(K, T) == GlobalMatch(hbm=768, host=256)
    assert r.processor.trust(E0) is TrustGrade.EXACT
    assert r.tables.mode(E0) is ViewMode.REPORTED
    assert r.accepted("e0", "delta") == 2


@pytest.mark.parametrize(
    ("mutate", "reason", "engine"),
    [
        (lambda f: f + b"x" * (5000 - len(f)), Reason.OVERSIZE, "unknown"),
        (lambda f: f[:-68], Reason.MISSING_SIGNATURE, "unknown"),
        (lambda f: f[:30], Reason.MALFORMED, "unknown"),
        (lambda f: b"X" + f[1:], Reason.MALFORMED, "unknown"),
        (lambda f: f[:-1] + bytes([f[-1] ^ 1]), Reason.BAD_SIGNATURE, "e0"),
        (lambda f: f + b"\x00", Reason.MALFORMED, "unknown"),
    ],
)
def test_broken_frames_are_rejected(mutate, reason, engine) -> None:  # type: ignore[no-untyped-def]
    r = rig(max_report_bytes=4096)
    submit_ok(r, frame(stored(100), seq=1))
    expect_rejected(r, mutate(frame(stored(101), seq=2)), reason, engine)


def test_key_rules() -> None:
    r = rig()
    submit_ok(r, frame(stored(100), seq=1))
    expect_rejected(r, frame(stored(101), seq=2, key_id="e0-old"), Reason.RETIRED_KEY)
    expect_rejected(
        r, frame(stored(101), seq=2, key_id="nope", signer="stranger"), Reason.UNKNOWN_KEY
    )
    # engine e0's report under e1's key id (and signed by e1's key): another engine's key
    expect_rejected(r, frame(stored(101), seq=2, key_id="e1-a"), Reason.WRONG_ENGINE_KEY)
    # e1's report signed with e0's key but naming e1's key id: the signature fails
    expect_rejected(
        r, frame(stored(101), engine=E1, key_id="e1-a", signer="e0-a"), Reason.BAD_SIGNATURE, "e1"
    )
    # e0's key id with a stranger's signature
    expect_rejected(r, frame(stored(101), seq=2, signer="stranger"), Reason.BAD_SIGNATURE)
    # rotation overlap: the second active key is accepted
    submit_ok(r, frame(stored(101), seq=2, key_id="e0-b"))


def test_engine_mismatch_on_a_pulled_frame() -> None:
    r = rig()
    f = frame(stored(1), engine=E1, key_id="e1-a")
    before = residency(r)
    out = r.processor.submit(f, expected_engine=E0)
    assert isinstance(out, Rejected) and out.reason is Reason.ENGINE_MISMATCH
    assert residency(r) == before and r.rejected("engine_mismatch", "e1") == 1


def test_issue_time_window_both_ways() -> None:
    r = rig(max_age_s=60, max_future_skew_s=5)
    ms = int(WALL0 * 1000)
    expect_rejected(r, frame(stored(1), seq=1, issued_at_ms=ms - 60_001), Reason.TOO_OLD)
    expect_rejected(r, frame(stored(1), seq=1, issued_at_ms=ms + 5_001), Reason.FUTURE)
    submit_ok(r, frame(stored(1), seq=1, issued_at_ms=ms + 4_999))
    submit_ok(r, frame(stored(2), seq=2, issued_at_ms=ms - 59_999))


def test_replay_and_reorder_are_rejected_and_gap_is_healed_by_snapshot() -> None:
    r = rig()
    submit_ok(r, frame(stored(100), seq=1))
    f2 = frame(stored(101), seq=2)
    f3 = frame(stored(102), seq=3)
    f4 = frame(stored(103), seq=4)
    submit_ok(r, f2)
    expect_rejected(r, f2, Reason.REPLAYED)  # replay
    submit_ok(r, f4)  # f3 lost in transit: a gap
    assert r.processor.trust(E0) is TrustGrade.DEGRADED and r.processor.snapshot_needed(E0)
    assert r.registry.get_sample_value("ramjet_reports_gaps_total", {"engine": "e0"}) == 1
    expect_rejected(r, f3, Reason.REPLAYED)  # arrives late: reordered, refused
    assert r.tables.view(E0).global_match(K, T).total == 2 * 256  # the hole at 102
    snap = SnapshotBody(seq=4, residency=[TierKeys(tier="hbm", keys=(K[0], K[1], K[2], K[3]))])
    submit_ok(r, frame(snap, seq=4, issued_at_ms=int(WALL0 * 1000) + 1))
    assert r.tables.view(E0).global_match(K, T).total == 4 * 256
    assert r.processor.trust(E0) is TrustGrade.EXACT and not r.processor.snapshot_needed(E0)
    # the same snapshot again, or an older one, is a replay
    expect_rejected(r, frame(snap, seq=4, issued_at_ms=int(WALL0 * 1000) + 1), Reason.REPLAYED)
    old = SnapshotBody(seq=3, residency=[])
    expect_rejected(r, frame(old, seq=3, issued_at_ms=int(WALL0 * 1000) + 2), Reason.REPLAYED)


def test_new_epoch_purges_and_old_epoch_is_refused() -> None:
    r = rig()
    submit_ok(r, frame(stored(100, 101), seq=1, epoch=7))
    submit_ok(
        r,
        frame(
            DeltaBody(swa_created=[SwaStates(keys=(PrefixKey(9),), ttl_ms=60_000)]), seq=2, epoch=7
        ),
    )
    assert r.tables.size(Table.SWA) == 1
    submit_ok(r, frame(stored(100), seq=1, epoch=8))  # restarted: first report of epoch 8
    assert r.tables.view(E0).global_match(K, T) == GlobalMatch(hbm=256)
    assert r.tables.size(Table.SWA) == 0 and r.processor.trust(E0) is TrustGrade.EXACT
    assert r.registry.get_sample_value("ramjet_reports_epoch", {"engine": "e0"}) == 8
    expect_rejected(r, frame(stored(105), seq=3, epoch=7), Reason.EPOCH_OLD)


def test_first_contact_mid_epoch_is_a_gap() -> None:
    r = rig()
    submit_ok(r, frame(stored(100), seq=57))
    assert r.processor.trust(E0) is TrustGrade.DEGRADED and r.processor.snapshot_needed(E0)


def test_malformed_bodies_and_key_bounds() -> None:
    r = rig(max_keys=4)
    submit_ok(r, frame(stored(1), seq=1))
    expect_rejected(r, frame(stored(1, 2, 3, 4, 5), seq=2), Reason.MALFORMED_BODY)
    expect_rejected(r, frame(load_body(), kind="delta", seq=2), Reason.MALFORMED_BODY)
    bad_snap = SnapshotBody(seq=1, residency=[])
    expect_rejected(
        r, frame(bad_snap, seq=2, issued_at_ms=int(WALL0 * 1000) + 5), Reason.MALFORMED_BODY
    )
    expect_rejected(r, frame(stored(1), seq=0), Reason.MALFORMED)


def test_swa_ttl_counts_from_issue_time_and_expiry_reports() -> None:
    r = rig()
    bk = [(50, PrefixKey(9)), (90, PrefixKey(10))]
    d = DeltaBody(swa_created=[SwaStates(keys=(PrefixKey(9), PrefixKey(10)), ttl_ms=30_000)])
    r.clocks.advance(10)  # the report spent 10 s in transit
    submit_ok(r, frame(d, seq=1))
    assert r.tables.view(E0).swa_match(bk) == 90
    r.clocks.advance(19)
    assert r.tables.view(E0).swa_match(bk) == 90
    submit_ok(r, frame(DeltaBody(swa_expired=(PrefixKey(10),)), seq=2, wall=r.clocks.wall))
    assert r.tables.view(E0).swa_match(bk) == 50
    r.clocks.advance(2)
    assert r.tables.view(E0).swa_match(bk) == 0


def test_load_profile_and_staleness() -> None:
    r = rig(stale_after_s=10, stale_ttl_s=30)
    submit_ok(r, frame(stored(100), seq=1))
    submit_ok(r, frame(load_body(42), seq=2))
    load = r.processor.load(E0)
    assert load is not None and load.queued_prompt_tokens == 42
    r.clocks.advance(11)
    r.processor.tick()
    assert r.processor.trust(E0) is TrustGrade.DEGRADED and r.processor.load(E0) is None
    assert r.tables.view(E0).global_match(K, T).total == 256  # still steering
    assert r.registry.get_sample_value("ramjet_reports_trust_grade", {"engine": "e0"}) == 1
    assert r.registry.get_sample_value("ramjet_reports_staleness_seconds", {"engine": "e0"}) == 11
    r.clocks.advance(20)
    r.processor.tick()
    assert r.tables.mode(E0) is ViewMode.SILENT
    assert r.tables.view(E0).global_match(K, T).total == 0
    submit_ok(r, frame(load_body(1), seq=3, wall=r.clocks.wall))
    assert r.tables.mode(E0) is ViewMode.REPORTED and r.processor.trust(E0) is TrustGrade.EXACT
    assert r.tables.view(E0).global_match(K, T).total == 256


def test_rate_limit_per_engine_after_authentication() -> None:
    r = rig(rate_per_s=1, burst=3)
    for i in range(1, 4):
        submit_ok(r, frame(stored(i), seq=i))
    expect_rejected(r, frame(stored(9), seq=4), Reason.RATE_LIMITED)
    # forged frames do not spend e0's budget; e1 has its own bucket
    r.clocks.advance(1.0)
    for _ in range(10):
        r.processor.submit(frame(stored(9), seq=4, signer="stranger"))
    submit_ok(r, frame(stored(9), seq=4, wall=r.clocks.wall))
    submit_ok(r, frame(stored(1), engine=E1, key_id="e1-a"))


def test_unknown_engines_do_not_become_labels() -> None:
    r = rig()
    from reports_fixtures import KEYS

    from ramjet.reports.envelope import Envelope, sign

    env = Envelope("zz-attacker", "stranger", 1, 1, int(WALL0 * 1000), "delta", b"{}")  # type: ignore[arg-type]
    out = r.processor.submit(sign(env, KEYS["stranger"]))
    assert isinstance(out, Rejected) and out.reason is Reason.UNKNOWN_KEY
    assert r.rejected("unknown_key", "unknown") == 1
    assert r.rejected("unknown_key", "zz-attacker") == 0


def test_snapshot_sets_tiers_and_ttls() -> None:
    r = rig()
    snap = SnapshotBody(
        seq=0,
        residency=[
            TierKeys(tier="hbm", keys=(K[0],)),
            TierKeys(tier="ssd", keys=(K[1], K[2]), ttl_ms=5000),
        ],
        swa=[SwaStates(keys=(PrefixKey(77),), ttl_ms=1000)],
    )
    submit_ok(r, frame(snap, seq=0))
    assert r.tables.view(E0).global_match(K, T) == GlobalMatch(hbm=256, ssd=512)
    assert r.processor.trust(E0) is TrustGrade.EXACT
    r.clocks.advance(6)
    assert r.tables.view(E0).global_match(K, T) == GlobalMatch(hbm=256)
    assert r.tables.store.get(Table.GLOBAL, E0, K[0], r.clocks.mono, False) is not None
    assert r.tables.store.get(Table.GLOBAL, E0, K[0], r.clocks.mono, False).tier == Tier.HBM  # type: ignore[union-attr]


def test_ten_mib_or_a_million_keys_is_refused_before_parsing() -> None:
    from reports_fixtures import KEYS

    from ramjet.reports.bodies import pack_keys
    from ramjet.reports.envelope import Envelope, sign

    r = rig()
    body = b'{"evicted": "' + pack_keys(range(1_000_000)).encode() + b'"}'
    env = Envelope(E0, "e0-a", 7, 1, int(WALL0 * 1000), "delta", body)
    expect_rejected(r, sign(env, KEYS["e0-a"]), Reason.OVERSIZE, "unknown")
    expect_rejected(r, bytes(10 << 20), Reason.OVERSIZE, "unknown")
