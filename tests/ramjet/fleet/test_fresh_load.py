"""Fresh load (`ramjet.fleet.signals.ReportSignals.load`): a signed load report received
before the router saw a request start on the engine may still count that request's
prompt as queued, so its queue is left out until the next report. The demo's turn 7 was
predicted at 2.0 s (a 1.8 s wait for 2,405 tokens that had already been prefilled) and
took 0.11 s."""

from __future__ import annotations

import pytest
from policy_fakes import FixedResidency, curve_profile
from reports_fixtures import E0, frame, load_body, rig

from ramjet.config import EngineConfig
from ramjet.fleet.engines import EngineState, Ticket
from ramjet.fleet.signals import NoSignals, ReportSignals
from ramjet.policy.base import EngineLoad, EngineView
from ramjet.policy.cost import V41_FLASH_TP4_ESTIMATE, wait_seconds
from ramjet.types import EngineId


def _engine() -> EngineState:
    return EngineState(EngineConfig(id="e0", url="http://127.0.0.1:1"))


def test_a_report_from_before_the_last_start_adds_no_queued_work() -> None:
    r = rig()
    signals, engine = ReportSignals(r.processor), _engine()
    r.processor.submit(frame(load_body(2405), seq=1))
    assert signals.load(engine).queued_prompt_tokens == 2405  # nothing started since

    r.clocks.advance(0.2)
    ticket = Ticket(engine, 2405)
    ticket.first_byte(r.clocks.clock())  # the queued turn started: the report is behind
    ticket.close()
    stale = signals.load(engine)
    assert stale.queued_prompt_tokens is None and stale.waiting_requests is None
    assert stale.running_requests == 1  # what runs still counts

    r.clocks.advance(0.2)
    r.processor.submit(frame(load_body(300), seq=2, wall=r.clocks.wall))
    assert signals.load(engine).queued_prompt_tokens == 300  # a newer report counts again


def test_a_failed_attempt_is_no_start() -> None:
    r = rig()
    signals, engine = ReportSignals(r.processor), _engine()
    r.processor.submit(frame(load_body(500), seq=1))
    r.clocks.advance(0.2)
    Ticket(engine, 500).close()  # no first byte: nothing is known to have started
    assert signals.load(engine).queued_prompt_tokens == 500
    assert engine.id == E0


def test_the_head_of_the_queue_is_partly_done() -> None:
    """`EngineLoad.busy_s`: the engine has worked on the router's oldest unanswered
    request since it was sent, and on the next since the previous one's first byte; for a
    reported queue, since the report came (it counted what was left then)."""
    r = rig()
    signals, engine = ReportSignals(r.processor), _engine()
    t = r.clocks.clock
    assert signals.load(engine, t()).busy_s == 0.0  # nothing outstanding
    a = Ticket(engine, 400, t())
    r.clocks.advance(0.1)
    b = Ticket(engine, 300, t())  # queued behind a: busy_since stays at a's send
    r.clocks.advance(0.15)
    assert abs(signals.load(engine, t()).busy_s - 0.25) < 1e-9
    a.first_byte(t())  # a has started answering: the engine is on b now
    r.clocks.advance(0.05)
    assert abs(signals.load(engine, t()).busy_s - 0.05) < 1e-9
    assert signals.load(engine).busy_s == 0.0  # no clock, no claim
    b.first_byte(t())
    a.close()
    b.close()
    assert signals.load(engine, t()).busy_s == 0.0
    # another router's work, seen only in a report: progress since the report came
    r.processor.submit(frame(load_body(900), seq=1, wall=r.clocks.wall))
    r.clocks.advance(0.3)
    load = signals.load(engine, t())
    assert load.queued_prompt_tokens == 900 and abs(load.busy_s - 0.3) < 1e-9


def test_the_wait_counts_only_what_is_left_of_the_head() -> None:
    prof = V41_FLASH_TP4_ESTIMATE
    full = prof.prefill_seconds(2000, 0)

    def wait(busy_s: float) -> float:
        load = EngineLoad(
            inflight_requests=1, inflight_prompt_tokens=2000, running_requests=0, busy_s=busy_s
        )
        view = EngineView(
            id=EngineId("e0"), healthy=True, load=load, residency=FixedResidency(), profile=prof
        )
        return wait_seconds(prof, view, 100, 512)

    assert abs(wait(0.0) - full) < 1e-9
    assert abs(wait(0.4 * full) - 0.6 * full) < 1e-9
    assert wait(2 * full) == 0.0  # the head is late: nothing is left, never negative


def test_each_request_in_flight_is_priced_at_its_own_context() -> None:
    """Two 3,000-token turns on a 4,000-token context each are two prompts: attention runs
    over each one's own context, not over the other's tokens (`EngineLoad.inflight_jobs`,
    filled from the router's tickets)."""
    prof = curve_profile((0, 1e-4), (8192, 3e-4), prefill_overhead_s=0.02)
    engine = _engine()
    tickets = [Ticket(engine, 3000, 0.0, context_tokens=4000) for _ in range(2)]
    load = NoSignals().load(engine, 0.0)
    assert load.inflight_jobs == ((3000, 4000), (3000, 4000))
    view = EngineView(EngineId("e0"), True, load, FixedResidency(), prof)
    each = prof.prefill_seconds(3000, 4000) - prof.prefill_overhead_s
    assert wait_seconds(prof, view, 100, 512) == pytest.approx(prof.prefill_overhead_s + 2 * each)
    assert wait_seconds(prof, view, 100, 512) != pytest.approx(prof.prefill_seconds(6000, 0))
    tickets[0].first_byte(0.5)  # the first has started answering: only the second is left
    assert NoSignals().load(engine, 0.5).inflight_jobs == ((3000, 4000),)
    for t in tickets:
        t.close()
    assert engine.inflight_jobs == {} and engine.inflight_prompt_tokens == 0
