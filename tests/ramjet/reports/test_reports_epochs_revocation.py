"""Issue 29, trust: epochs are bounded and not sticky, replays do not spend the engine's
rate budget, and revoking a key by reload purges what it signed (real Ed25519 keys)."""

from __future__ import annotations

from reports_fixtures import E0, E1, KEYS, WALL0, frame, load_body, rig, stored

from ramjet.reports.config import KeyEntry, KeysConfig
from ramjet.reports.keys import KeyRing, public_key_b64
from ramjet.reports.verify import Accepted, Reason, Rejected
from ramjet.residency.store import Table
from ramjet.types import PrefixKey, TrustGrade

MS = int(WALL0 * 1000)


def _held(r, engine=E0) -> set[int]:  # type: ignore[no-untyped-def]
    return {int(k) for k, _ in r.tables.store.entries(Table.GLOBAL, engine, exact=True)}


def test_replays_are_refused_without_draining_the_engine_bucket() -> None:
    r = rig(rate_per_s=1, burst=5)
    f1 = frame(stored(1), seq=1)
    assert isinstance(r.processor.submit(f1), Accepted)
    for _ in range(200):  # an authentic frame replayed by many sources
        out = r.processor.submit(f1)
        assert isinstance(out, Rejected) and out.reason is Reason.REPLAYED
    assert r.rejected("rate_limited") == 0
    for seq in range(2, 6):  # the engine's own next reports still fit its burst
        out = r.processor.submit(frame(stored(seq), seq=seq))
        assert isinstance(out, Accepted), out


def test_an_epoch_ahead_of_its_issue_time_is_refused() -> None:
    r = rig(max_future_skew_s=5)
    out = r.processor.submit(frame(stored(1), epoch=MS + 5_001, seq=1, issued_at_ms=MS))
    assert isinstance(out, Rejected) and out.reason is Reason.EPOCH_FUTURE, out
    assert r.processor.cursor(E0) is None and _held(r) == set()
    out = r.processor.submit(frame(stored(1), epoch=MS + 4_999, seq=1, issued_at_ms=MS))
    assert isinstance(out, Accepted), out


def test_an_engine_restarted_under_a_clock_stepped_back_is_taken_once_the_old_epoch_is_silent() -> (
    None
):
    r = rig(stale_after_s=10)
    old_epoch = MS + 4_000  # started with its clock 4 s ahead, since stepped back
    replay_me = frame(stored(1), epoch=old_epoch, seq=1, issued_at_ms=MS)
    assert isinstance(r.processor.submit(replay_me), Accepted)
    # restarted 2 s later: its epoch (start time) is below the old one
    r.clocks.advance(2)
    new_epoch = MS + 2_000
    early = frame(stored(2), epoch=new_epoch, seq=1, issued_at_ms=MS + 2_000)
    out = r.processor.submit(early)
    assert isinstance(out, Rejected) and out.reason is Reason.EPOCH_OLD  # old one may live
    assert _held(r) == {1}
    # the old epoch has been silent for stale_after_s: the new process is taken
    r.clocks.advance(9)
    ok = frame(stored(2), epoch=new_epoch, seq=2, issued_at_ms=MS + 11_000)
    assert isinstance(r.processor.submit(ok), Accepted)
    assert r.processor.cursor(E0).epoch == new_epoch  # type: ignore[union-attr]
    assert _held(r) == {2}  # purged, then applied
    assert r.registry.get_sample_value("ramjet_reports_epoch_changes_total", {"engine": "e0"}) == 1
    # the old process's frames, replayed, cannot take the engine back
    out = r.processor.submit(replay_me)
    assert isinstance(out, Rejected) and out.reason is Reason.REPLAYED
    out = r.processor.submit(frame(stored(7), epoch=old_epoch, seq=9, issued_at_ms=MS + 1))
    assert isinstance(out, Rejected) and out.reason is Reason.REPLAYED
    assert _held(r) == {2} and r.processor.cursor(E0).epoch == new_epoch  # type: ignore[union-attr]


def test_a_lower_epoch_is_refused_while_the_current_one_reports() -> None:
    r = rig(stale_after_s=10)
    assert isinstance(r.processor.submit(frame(stored(1), epoch=9, seq=1)), Accepted)
    for i in range(1, 30):  # the current epoch keeps reporting every second
        r.clocks.advance(1)
        assert isinstance(
            r.processor.submit(frame(load_body(), epoch=9, seq=1 + i, wall=r.clocks.wall)),
            Accepted,
        )
        out = r.processor.submit(frame(stored(5), epoch=8, seq=1, wall=r.clocks.wall))
        assert isinstance(out, Rejected) and out.reason is Reason.EPOCH_OLD


def _ring(*kids: str, retired: tuple[str, ...] = ()) -> KeyRing:
    engines: dict[str, list[KeyEntry]] = {}
    for kid in kids:
        engines.setdefault(kid.split("-")[0], []).append(
            KeyEntry(key_id=kid, public_key=public_key_b64(KEYS[kid].public_key()))
        )
    return KeyRing.from_config(KeysConfig(engines=engines, retired=list(retired)))


def test_revoking_a_key_by_reload_purges_what_it_signed() -> None:
    r = rig()
    r.processor.replace_keyring(_ring("e0-a", "e0-b", "e1-a"))
    # e0-b (stolen) signs a state; e1's view is signed by e1-a only
    assert isinstance(r.processor.submit(frame(stored(1, 2), key_id="e0-b", epoch=9)), Accepted)
    assert isinstance(r.processor.submit(frame(stored(3), engine=E1, key_id="e1-a")), Accepted)
    assert _held(r) == {1, 2} and r.processor.trust(E0) is TrustGrade.EXACT

    out = r.processor.replace_keyring(_ring("e0-a", "e1-a", retired=("e0-b",)))
    assert out == {"revoked": ["e0-b"], "purged": ["e0"]}
    assert _held(r) == set() and _held(r, E1) == {3}
    assert r.processor.cursor(E0) is None and r.processor.snapshot_needed(E0)
    assert r.registry.get_sample_value("ramjet_reports_revoked_purges_total", {"engine": "e0"}) == 1
    # the revoked key is refused; the engine's real key starts it over at any epoch
    out2 = r.processor.submit(frame(stored(4), key_id="e0-b", epoch=10, seq=1))
    assert isinstance(out2, Rejected) and out2.reason is Reason.RETIRED_KEY
    assert isinstance(r.processor.submit(frame(stored(5), key_id="e0-a", epoch=3)), Accepted)
    assert _held(r) == {5}


def test_a_key_file_with_new_material_revokes_the_old_key() -> None:
    r = rig()
    r.processor.replace_keyring(_ring("e0-a"))
    assert isinstance(r.processor.submit(frame(stored(1))), Accepted)
    swapped = KeyRing.from_config(
        KeysConfig(
            engines={
                "e0": [
                    KeyEntry(key_id="e0-a", public_key=public_key_b64(KEYS["e0-b"].public_key()))
                ]
            }
        )
    )
    assert r.processor.replace_keyring(swapped)["purged"] == ["e0"]
    # an unchanged ring revokes nothing
    assert r.processor.replace_keyring(swapped) == {"revoked": [], "purged": []}
    assert _held(r) == set() and PrefixKey(1) not in _held(r)
