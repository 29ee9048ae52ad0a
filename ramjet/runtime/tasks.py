"""Stopping background tasks: `cancel_and_wait` cancels asyncio tasks and waits for them
to end, the one shutdown step every long-running loop (report pulls and pushes, health
checks, residency and cursor sync, the engine's sweeper and flusher) goes through.

A cancellation can be lost. Python 3.11's `asyncio.wait_for`, for one, returns the
awaited call's result when that call finishes in the same loop turn as the cancel, and
the task carries on as if nobody had asked it to stop; a library that uses wait_for
inside loses cancels the same way (redis-py's socket timeout did, so
`ramjet.residency.redis_link` gives it none). A loop that lost its one cancel runs
forever, and a stop that waited for it with `suppress(CancelledError): await task` hung
with it, then swallowed its own caller's cancellation when someone gave up on it (CI saw
a router replica's stop hang that way until the test's timeout, the lost cancel a report
pull's Redis claim). So a task still running `recancel_s` after its cancel is cancelled
again, until it ends, and the wait never hides a cancellation of the task that waits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger("ramjet.runtime.tasks")

RECANCEL_S = 0.5
"""How long a cancelled task may run on before it is cancelled again."""


async def cancel_and_wait(
    tasks: Iterable[asyncio.Task[Any]],
    timeout_s: float | None = None,
    *,
    recancel_s: float = RECANCEL_S,
) -> None:
    """Cancel every task, then wait for each to end; a task's own `CancelledError` ends
    quietly, any other exception it ended with is raised (the first one) once every task
    was waited for. A task that is still running `recancel_s` after a cancel is cancelled
    again (a warning names it), since its cancel may have been lost.

    With `timeout_s`, each wait gives up after that many seconds (the task is left
    cancelled, to finish on its own): for a loop that may sit in a network call which
    does not answer cancellation at once.

    The caller's own cancellation is never swallowed: it propagates from the wait (the
    tasks stay cancelled)."""
    tasks = list(tasks)
    for t in tasks:
        t.cancel()
    failure: BaseException | None = None
    for t in tasks:
        await _wait_ended(t, timeout_s, recancel_s)
        if t.done() and not t.cancelled():
            exc = t.exception()  # retrieved for every task, raised for the first
            failure = failure or exc
    if failure is not None:
        raise failure


async def _wait_ended(task: asyncio.Task[Any], timeout_s: float | None, recancel_s: float) -> None:
    loop = asyncio.get_running_loop()
    give_up = None if timeout_s is None else loop.time() + timeout_s
    recancels = 0
    while not task.done():
        wait = recancel_s if give_up is None else min(recancel_s, give_up - loop.time())
        if wait <= 0:
            break
        # asyncio.wait neither cancels the task nor hides a cancellation of ours
        await asyncio.wait((task,), timeout=wait)
        if not task.done() and (give_up is None or loop.time() < give_up):
            task.cancel()
            recancels += 1
    if recancels:
        log.warning(
            "task %s ran on after its cancellation; cancelled %d more time(s) (%s)",
            task.get_name(),
            recancels,
            "ended" if task.done() else f"left running after {timeout_s}s",
        )
