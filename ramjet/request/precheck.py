"""Counting a large body's messages before it is decoded, in a process of its own.

A body of a million tiny messages costs a C decode pass that holds the GIL for its whole
length (about 0.3 s for 32 MB on a busy 2-core machine), and a thread does not help: the
event loop waits for the GIL as long. So `Prechecker` counts a body's top-level
`messages` in a child process (`multiprocessing` spawn, one worker, started on the first
large body, off the event loop): the loop only pickles the bytes across. The count is a
typed decode that skips every message's fields (`message_count`), one small object per
message, and nothing comes back but the number. `ramjet.request.parse` runs the same
count in-process for bodies below the child's threshold (or if the child fails).
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import msgspec


class _Skipped(msgspec.Struct, gc=False):
    """A message, every field skipped (it is only counted)."""


class _Envelope(msgspec.Struct, gc=False):
    """The fields of a body that bound the work of decoding the rest."""

    messages: list[_Skipped] | None = None


def message_count(body: bytes) -> int:
    """The number of top-level `messages` in `body`, 0 if it has none, -1 if the
    envelope cannot be read (the full decode then names what is wrong)."""
    try:
        env = msgspec.json.decode(body, type=_Envelope)
    except (msgspec.MsgspecError, RecursionError, UnicodeDecodeError):
        return -1
    return len(env.messages) if env.messages is not None else 0


class Prechecker:
    """`message_count` in a child process (see the module docstring). On the event loop."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self._starting: asyncio.Future[ProcessPoolExecutor] | None = None

    @staticmethod
    def _start() -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        pool.submit(int).result()  # the worker is up (a thread waits, not the loop)
        return pool

    async def count(self, body: bytes) -> int:
        """`message_count(body)`, computed in the child (raises if the child fails)."""
        loop = asyncio.get_running_loop()
        pool = self._pool
        if pool is None:
            if self._starting is None:
                self._starting = asyncio.ensure_future(asyncio.to_thread(self._start))
            pool = self._pool = await asyncio.shield(self._starting)
        return await loop.run_in_executor(pool, message_count, body)

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None and self._starting is not None and self._starting.done():
            pool = self._starting.result() if not self._starting.exception() else None
        self._starting = None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
