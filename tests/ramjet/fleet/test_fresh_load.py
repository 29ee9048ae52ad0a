"""Fresh load (`ramjet.fleet.signals.ReportSignals.load`): a signed load report received
before the router saw a request start on the engine may still count that request's
prompt as queued, so its queue is left out until the next report. The demo's turn 7 was
predicted at 2.0 s (a 1.8 s wait for 2,405 tokens that had already been prefilled) and
took 0.11 s."""

from __future__ import annotations

from reports_fixtures import E0, frame, load_body, rig

from ramjet.config import EngineConfig
from ramjet.fleet.engines import EngineState, Ticket
from ramjet.fleet.signals import ReportSignals


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
