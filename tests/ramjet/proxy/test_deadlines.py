"""`ramjet.proxy.deadlines`: asyncio.timeout's semantics for fixed-length waits, one
timer for all of them."""

from __future__ import annotations

import asyncio
import time

import pytest

from ramjet.proxy.deadlines import Deadlines


async def _bounded(d: Deadlines, sleep_s: float) -> str:
    with d.wait() as w:
        try:
            await asyncio.sleep(sleep_s)
        except asyncio.CancelledError:
            w.raise_if_expired()
            raise
    return "done"


async def test_a_wait_past_its_deadline_raises_timeout_error_at_the_deadline() -> None:
    d = Deadlines(0.05)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        await _bounded(d, 5.0)
    took = time.monotonic() - t0
    assert 0.045 <= took < 0.5
    assert asyncio.current_task() is not None
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_waits_that_end_in_time_share_one_timer_and_are_not_cancelled() -> None:
    d = Deadlines(0.2)
    for _ in range(200):
        assert await _bounded(d, 0) == "done"
    assert d.timers == 1
    assert len(d._waits) <= 1
    await asyncio.sleep(0.25)  # the one timer fires, finds every wait ended, re-arms none
    assert d._timer is None and not d._waits
    assert await _bounded(d, 0.01) == "done"  # the next wait arms a fresh timer
    assert d.timers == 2


async def test_each_wait_expires_at_its_own_deadline() -> None:
    d = Deadlines(0.1)
    first = asyncio.ensure_future(_bounded(d, 5.0))
    await asyncio.sleep(0.05)
    second = asyncio.ensure_future(_bounded(d, 5.0))
    quick = asyncio.ensure_future(_bounded(d, 0.01))
    await asyncio.sleep(0.07)  # first is past its deadline, second is not yet
    assert first.done() and isinstance(first.exception(), TimeoutError)
    assert quick.done() and quick.result() == "done"
    assert not second.done()
    await asyncio.sleep(0.06)
    assert second.done() and isinstance(second.exception(), TimeoutError)


async def test_a_cancellation_from_outside_stays_a_cancellation() -> None:
    d = Deadlines(0.05)
    task = asyncio.ensure_future(_bounded(d, 5.0))
    await asyncio.sleep(0.01)
    task.cancel()  # the client went away, before the deadline
    with pytest.raises(asyncio.CancelledError):
        await task
    # and when both happen, the outside cancellation wins too
    task = asyncio.ensure_future(_bounded(d, 5.0))
    await asyncio.sleep(0.01)
    loop = asyncio.get_running_loop()
    loop.call_at(task_deadline(d), task.cancel)
    with pytest.raises(asyncio.CancelledError):
        await task


def task_deadline(d: Deadlines) -> float:
    """The deadline of the newest wait (an outside cancel armed for the same instant)."""
    return d._waits[-1].when
