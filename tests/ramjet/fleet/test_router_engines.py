"""Engine state machine with an injected clock: ejection, growth, re-admission by probe,
share cap, panic, backpressure, and that 4xx never penalises."""

from __future__ import annotations

import sys
from pathlib import Path

from ramjet.config import EngineConfig, HealthConfig, RetryConfig
from ramjet.fleet.engines import Fleet, Outcome, Ticket, classify_status

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers"))
from manual_clock import ManualClock


def _fleet(n: int = 2, **health: float) -> tuple[Fleet, ManualClock, list[tuple[str, float]]]:
    clock = ManualClock()
    ejected: list[tuple[str, float]] = []
    cfgs = [EngineConfig(id=f"e{i}", url=f"http://127.0.0.1:{9000 + i}") for i in range(n)]
    h = HealthConfig(consecutive_failures=3, ejection_base_s=10, ejection_max_s=35, **health)  # type: ignore[arg-type]
    fleet = Fleet(
        cfgs,
        h,
        RetryConfig(max_retry_after_s=20),
        clock,
        on_eject=lambda e, d: ejected.append((e, d)),
    )
    return fleet, clock, ejected


def _ids(fleet: Fleet) -> list[str]:
    return [e.id for e in fleet.routable().engines]


def test_classification() -> None:
    assert classify_status(200) is Outcome.OK
    assert classify_status(400) is Outcome.CLIENT_ERROR
    assert classify_status(404) is Outcome.CLIENT_ERROR
    assert classify_status(429) is Outcome.BACKPRESSURE
    assert classify_status(503) is Outcome.BACKPRESSURE
    assert classify_status(500) is Outcome.FAILURE
    assert classify_status(502) is Outcome.FAILURE


def test_consecutive_failures_eject_and_success_resets() -> None:
    fleet, _clock, ejected = _fleet()
    e0 = fleet.get("e0")
    fleet.record(e0, Outcome.FAILURE)
    fleet.record(e0, Outcome.FAILURE)
    fleet.record(e0, Outcome.OK)
    fleet.record(e0, Outcome.FAILURE)
    fleet.record(e0, Outcome.FAILURE)
    assert not e0.ejected
    fleet.record(e0, Outcome.FAILURE)
    assert e0.ejected and ejected == [("e0", 10.0)]
    assert _ids(fleet) == ["e1"]


def test_client_errors_and_backpressure_never_eject() -> None:
    fleet, _clock, ejected = _fleet()
    e0 = fleet.get("e0")
    for _ in range(10):
        fleet.record(e0, Outcome.CLIENT_ERROR)
        fleet.record(e0, Outcome.BACKPRESSURE, 0.5)
    assert not e0.ejected and ejected == []
    assert e0.consecutive_failures == 0


def test_readmission_needs_time_and_a_good_probe_and_ejection_grows() -> None:
    fleet, clock, ejected = _fleet()
    e0 = fleet.get("e0")
    durations = []
    for _round in range(4):
        for _ in range(3):
            fleet.record(e0, Outcome.FAILURE)
        assert e0.ejected
        durations.append(ejected[-1][1])
        clock.t += durations[-1] - 1
        fleet.record_probe(e0, True)
        assert e0.ejected, "a probe before the ejection time must not re-admit"
        clock.t += 1
        fleet.record_probe(e0, False)
        assert e0.ejected, "a failing probe must not re-admit"
        fleet.record_probe(e0, True)
        assert not e0.ejected and e0.healthy
    assert durations == [10, 20, 35, 35]  # base * 2**k, capped at ejection_max_s


def test_ejection_count_decays_while_healthy() -> None:
    fleet, clock, _ejected = _fleet()
    e0 = fleet.get("e0")
    for _ in range(3):
        fleet.record(e0, Outcome.FAILURE)
    clock.t += 10
    fleet.record_probe(e0, True)
    assert e0.ejections == 1
    clock.t += 35
    fleet.record_probe(e0, True)
    assert e0.ejections == 0


def test_never_eject_more_than_the_share() -> None:
    fleet, _clock, _ejected = _fleet()
    for e in fleet.engines:
        for _ in range(5):
            fleet.record(e, Outcome.FAILURE)
    assert [e.ejected for e in fleet.engines] == [True, False]
    single, _, _ = _fleet(n=1)
    for _ in range(10):
        single.record(single.engines[0], Outcome.FAILURE)
    assert not single.engines[0].ejected


def test_panic_routes_to_all_when_fewer_than_half_healthy() -> None:
    fleet, _clock, _ = _fleet(n=4)
    fleet.record_probe(fleet.get("e0"), False)
    fleet.record_probe(fleet.get("e1"), False)
    assert _ids(fleet) == ["e2", "e3"] and not fleet.routable().panic
    fleet.record_probe(fleet.get("e2"), False)
    r = fleet.routable()
    assert r.panic and [e.id for e in r.engines] == ["e0", "e1", "e2", "e3"]
    assert fleet.ready()
    fleet.record_probe(fleet.get("e3"), False)
    assert not fleet.ready()


def test_backpressure_holds_off_honouring_retry_after() -> None:
    fleet, clock, _ = _fleet()
    e0, e1 = fleet.get("e0"), fleet.get("e1")
    fleet.record(e0, Outcome.BACKPRESSURE, 3.0)
    assert _ids(fleet) == ["e1"]
    fleet.record(e1, Outcome.BACKPRESSURE, 100.0)  # capped at max_retry_after_s = 20
    r = fleet.routable()
    assert r.engines == () and abs(r.retry_after_s - 3.0) < 1e-9
    clock.t += 3.0
    assert _ids(fleet) == ["e0"]
    clock.t += 17.0
    assert _ids(fleet) == ["e0", "e1"]
    fleet.record(e0, Outcome.BACKPRESSURE)  # no Retry-After: 1 s
    clock.t += 1.0
    assert _ids(fleet) == ["e0", "e1"]


def test_ticket_release_is_idempotent() -> None:
    fleet, _, _ = _fleet()
    e0 = fleet.get("e0")
    t = Ticket(e0, 500)
    t2 = Ticket(e0, 100)
    assert (e0.inflight_requests, e0.inflight_prompt_tokens) == (2, 600)
    t.first_byte()
    t.first_byte()
    assert e0.inflight_prompt_tokens == 100
    t.close()
    t.close()
    t2.close()
    assert (e0.inflight_requests, e0.inflight_prompt_tokens) == (0, 0)
