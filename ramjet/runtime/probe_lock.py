"""One lock per host for profile probes: engines that share a machine (`make run`'s
pair, two vLLM engines behind their sidecars) probe one at a time, so that no probe
measures another's load (a probe under load reads every cost slow, and every prediction
made with it follows). An exclusive `flock` on a file in the temp directory: released
when its holder exits, however it exits."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_PROBE_LOCK = str(Path(tempfile.gettempdir()) / "ramjet-engine-probe.lock")
POLL_S = 0.05


def _try(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _gave_up(path: str, t0: float, timeout_s: float) -> bool:
    if time.monotonic() - t0 <= timeout_s:
        return False
    log.warning("probe lock %s still held after %.0fs: probing anyway", path, timeout_s)
    return True


@contextlib.contextmanager
def host_lock(path: str | None, timeout_s: float = 300.0) -> Iterator[float]:
    """Hold the lock at `path` (None or '': no lock), waiting at most `timeout_s` (then
    go on without it, logged); yields the seconds waited."""
    if not path:
        yield 0.0
        return
    t0 = time.monotonic()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        while not _try(fd) and not _gave_up(path, t0, timeout_s):
            time.sleep(POLL_S)
        yield time.monotonic() - t0
    finally:
        os.close(fd)  # releases the lock


@contextlib.asynccontextmanager
async def async_host_lock(path: str | None, timeout_s: float = 300.0) -> AsyncIterator[float]:
    """`host_lock` for a coroutine: waits without blocking the event loop."""
    if not path:
        yield 0.0
        return
    t0 = time.monotonic()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        while not _try(fd) and not _gave_up(path, t0, timeout_s):
            await asyncio.sleep(POLL_S)
        yield time.monotonic() - t0
    finally:
        os.close(fd)
