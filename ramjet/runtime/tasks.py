"""Stopping background tasks: `cancel_and_wait` cancels asyncio tasks and waits for them
to end, the one shutdown step every long-running loop (report pulls and pushes, health
checks, residency and cursor sync, the engine's sweeper and flusher) goes through.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any


async def cancel_and_wait(
    tasks: Iterable[asyncio.Task[Any]], timeout_s: float | None = None
) -> None:
    """Cancel every task, then await each in turn, swallowing its `CancelledError`.

    With `timeout_s`, each wait gives up after that many seconds (the task is shielded, so
    giving up leaves it to finish on its own): for a loop that may sit in a network call
    which does not answer cancellation at once."""
    tasks = list(tasks)
    for t in tasks:
        t.cancel()
    for t in tasks:
        if timeout_s is None:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        else:
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await asyncio.shield(t)
