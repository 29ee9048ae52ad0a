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


class _Waiter:
    """One wait for the lock at `path` (None or '': no lock, ready at once)."""

    def __init__(self, path: str | None, timeout_s: float) -> None:
        self.path, self.timeout_s = path, timeout_s
        self.t0 = time.monotonic()
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600) if path else -1

    def ready(self) -> bool:
        """Holds the lock now, or has waited `timeout_s` (then goes on without, logged)."""
        if self.fd < 0:
            return True
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() - self.t0 <= self.timeout_s:
                return False
            log.warning(
                "probe lock %s still held after %.0fs: probing anyway", self.path, self.timeout_s
            )
        return True

    def waited(self) -> float:
        return time.monotonic() - self.t0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # releases the lock
            self.fd = -1


@contextlib.contextmanager
def host_lock(path: str | None, timeout_s: float = 300.0) -> Iterator[float]:
    """Hold the lock at `path` (None or '': no lock), waiting at most `timeout_s` (then
    go on without it, logged); yields the seconds waited."""
    with contextlib.closing(_Waiter(path, timeout_s)) as w:
        while not w.ready():
            time.sleep(POLL_S)
        yield w.waited()


@contextlib.asynccontextmanager
async def async_host_lock(path: str | None, timeout_s: float = 300.0) -> AsyncIterator[float]:
    """`host_lock` for a coroutine: waits without blocking the event loop."""
    with contextlib.closing(_Waiter(path, timeout_s)) as w:
        while not w.ready():
            await asyncio.sleep(POLL_S)
        yield w.waited()
