"""`Deadlines`: `asyncio.timeout` for many waits of one fixed length, without a timer each.

Every forward waits for its engine's first byte under `timeouts.first_byte_s`.
`asyncio.timeout` arms and cancels an event-loop timer per wait (with uvloop a libuv
handle made and freed each time), which was 8-11 us of a small request's CPU under
py-spy. Here the waits share one timer: since every wait lasts the same `delay_s`,
deadlines arrive in order and live in a FIFO; the timer is armed at the oldest live
deadline, and when it fires it drops the waits that ended (most of them, long before
their deadline) and expires the ones past theirs. Arming is an append, ending a wait sets
a flag; the timer fires about once per `delay_s` while waits come and go.

Semantics are `asyncio.timeout`'s: an expired wait's task is cancelled, and that
cancellation (and only that one, not another's) comes out of the block as
`TimeoutError`::

    with deadlines.wait() as w:
        try:
            ...awaits...
        except asyncio.CancelledError:
            w.raise_if_expired()  # TimeoutError if the deadline did it; else re-raise
            raise
"""

from __future__ import annotations

import asyncio
import collections
from types import TracebackType


class Wait:
    """One wait under a `Deadlines` (see the module docstring)."""

    __slots__ = ("_cancelling", "_task", "done", "expired", "when")

    def __init__(self, task: asyncio.Task[object], when: float) -> None:
        self._task: asyncio.Task[object] | None = task
        self._cancelling = task.cancelling()
        self.when = when
        self.done = False
        self.expired = False

    def _expire(self) -> None:
        if self._task is not None:
            self.expired = True
            self._task.cancel()

    def raise_if_expired(self) -> None:
        """In an `except CancelledError`: raise `TimeoutError` if this wait's deadline
        cancelled the task (and nothing else asked for a cancellation meanwhile)."""
        task = self._task
        if self.expired and task is not None and task.uncancel() <= self._cancelling:
            raise TimeoutError from None

    def __enter__(self) -> Wait:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.done = True
        self._task = None  # an ended wait waits in the FIFO: it keeps no task alive


class Deadlines:
    """Waits of `delay_s` each on the running loop, one timer for all of them."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self._waits: collections.deque[Wait] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None
        self.timers = 0
        """Timers armed so far (tests read it)."""

    def wait(self) -> Wait:
        """A wait for the current task, expiring `delay_s` from now; use it as a context
        manager around the awaits it bounds."""
        loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("Deadlines.wait() outside a task")
        w = Wait(task, loop.time() + self.delay_s)
        waits = self._waits
        while waits and waits[0].done:  # waits mostly end in order: the FIFO stays short
            waits.popleft()
        waits.append(w)
        if self._timer is None:
            self._arm(loop, w.when)
        return w

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        self.timers += 1
        self._timer = loop.call_at(when, self._fire, loop)

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        waits, now = self._waits, loop.time()
        while waits:
            w = waits[0]
            if w.done:
                waits.popleft()
            elif w.when <= now:
                waits.popleft()
                w.done = True
                w._expire()
            else:
                self._arm(loop, w.when)
                return
