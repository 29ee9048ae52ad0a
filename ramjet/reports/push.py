"""Report pushes on their own listener, limited per source before any verification.

A pushed frame is authenticated by its Ed25519 signature, and checking one costs about
100 us: anyone who can reach the port where pushes are accepted can spend that much of
the router's CPU per frame. So pushes do not ride on the client port. They get a
listener of their own, off by default (`reports.push.port: null`), bound where only
engines reach it, and every frame is counted against a token bucket of its source
address *before* its body is read or verified (`PushLimiter`).

    reports:
      push: {host: 127.0.0.1, port: 9401, rate_per_s: 50, burst: 100}

The listener speaks just enough HTTP/1.1 for `POST /ramjet/reports` with a
Content-Length body (what `ReportPublisher` sends); it is an asyncio protocol, not an
aiohttp app, so that a refused frame costs a few microseconds:

- over the source's bucket: `429`, the body passed over unread and unverified, the
  connection kept (a reconnect would cost more than the refusal) and counted
  (`ramjet_reports_push_limited_total`);
- a body over `reports.max_report_bytes`: `413`, closed (counted as `oversize`);
- no Content-Length, a Transfer-Encoding, a bad head: `400`/`411`, closed;
- another path or method: `404`/`405`, closed;
- otherwise the frame goes through the same `submit` as pulled frames
  (`ReportIngest.submit`): `202 {"accepted": seq}` or `4xx {"rejected": reason}`, as
  `docs/protocol.md` says; the connection stays open for the next frame.

A connection that has not sent a whole request `idle_s` after connecting or after its
last answer is closed, and at most `max_connections` are open at once (beyond: closed at
accept). The limiter keeps `max_sources` buckets; when full, buckets idle long enough to
have refilled are dropped, and sources still beyond it share one overflow bucket, so
cycling through addresses buys no fresh bursts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import cast

from prometheus_client import CollectorRegistry

from ramjet.metric_catalogue import counter, gauge
from ramjet.reports import transport as tp
from ramjet.reports.config import PushConfig
from ramjet.reports.verify import Accepted, Reason, Rejected
from ramjet.types import EngineId

log = logging.getLogger(__name__)

SubmitFn = Callable[[bytes, EngineId | None], Awaitable[Accepted | Rejected]]
_MAX_HEAD = 8192
_OVERFLOW = "*overflow*"
_STATUS_TEXT = {
    202: "Accepted",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    411: "Length Required",
    413: "Payload Too Large",
    429: "Too Many Requests",
}
_REJECT_STATUS = {Reason.OVERSIZE: 413, Reason.RATE_LIMITED: 429}


class PushLimiter:
    """Token buckets by source address (see the module docstring)."""

    def __init__(
        self,
        rate_per_s: float,
        burst: int,
        max_sources: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate = rate_per_s
        self.burst = float(burst)
        self.max_sources = max_sources
        self.clock = clock
        self._buckets: dict[str, list[float]] = {}  # source -> [tokens, last time]
        self._pruned_at = -1e18

    def __len__(self) -> int:
        return len(self._buckets)

    def allow(self, source: str) -> bool:
        now = self.clock()
        b = self._buckets.get(source)
        if b is None:
            if len(self._buckets) >= self.max_sources:
                self._prune(now)
            if len(self._buckets) >= self.max_sources:
                source = _OVERFLOW
                b = self._buckets.get(source)
            if b is None:
                b = self._buckets[source] = [self.burst, now]
        tokens = min(self.burst, b[0] + (now - b[1]) * self.rate)
        b[1] = now
        if tokens < 1.0:
            b[0] = tokens
            return False
        b[0] = tokens - 1.0
        return True

    def _prune(self, now: float) -> None:
        """Drop buckets that have refilled (they equal a fresh one); at most once a
        second, so a full table under attack costs one scan a second."""
        if now - self._pruned_at < 1.0:
            return
        self._pruned_at = now
        full_after = self.burst / self.rate
        for source in [s for s, b in self._buckets.items() if now - b[1] >= full_after]:
            if source != _OVERFLOW:
                del self._buckets[source]


class PushMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.limited = counter(registry, "ramjet_reports_push_limited_total")
        self.refused = counter(registry, "ramjet_reports_push_refused_total")
        for reason in ("bad_request", "length_required", "not_found", "connections", "idle"):
            self.refused.labels(reason)
        self.connections = gauge(registry, "ramjet_reports_push_connections")


_LIMITED: dict[str, object] = {"rejected": "push_rate_limited"}


def _response(status: int, body: dict[str, object], close: bool) -> bytes:
    data = json.dumps(body, separators=(",", ":")).encode()
    head = (
        f"HTTP/1.1 {status} {_STATUS_TEXT[status]}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
        + ("Connection: close\r\n" if close else "")
        + "\r\n"
    )
    return head.encode("latin-1") + data


_LIMITED_RESPONSE = _response(429, _LIMITED, close=False)


class _PushProtocol(asyncio.Protocol):
    def __init__(self, listener: PushListener) -> None:
        self.listener = listener
        self.transport: asyncio.Transport | None = None
        self.source = ""
        self.buf = bytearray()
        self.need: int | None = None  # body bytes wanted once the head is read
        self.skip = 0  # body bytes of a refused frame still to pass over unread
        self.out = bytearray()  # answers to write in one go when the buffer is done
        self.busy = False
        self.timer: asyncio.TimerHandle | None = None

    # -- connection ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        lst = self.listener
        if len(lst.conns) >= lst.config.max_connections:
            lst.metrics.refused.labels("connections").inc()
            self.transport.abort()
            return
        peer = transport.get_extra_info("peername")
        self.source = str(peer[0]) if peer else "?"
        lst.conns.add(self)
        lst.metrics.connections.set(len(lst.conns))
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        lst = self.listener
        if self in lst.conns:
            lst.conns.discard(self)
            lst.metrics.connections.set(len(lst.conns))

    def _arm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        loop = self.listener.loop
        self.timer = loop.call_later(self.listener.config.idle_s, self._idle)

    def _idle(self) -> None:
        self.listener.metrics.refused.labels("idle").inc()
        if self.transport is not None:
            self.transport.close()

    def _close_with(self, status: int, body: dict[str, object]) -> None:
        assert self.transport is not None
        self.out += _response(status, body, close=True)
        self.transport.write(bytes(self.out))
        self.out.clear()
        self.transport.close()
        self.buf.clear()

    # -- requests -----------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        self.buf += data
        if not self.busy:
            self._advance()

    def _advance(self) -> None:
        """Handle what the buffer holds: a head, then its body, then the next request;
        the answers go out in one write."""
        self._handle()
        if self.out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(bytes(self.out))
            self.out.clear()
            self._arm()

    def _handle(self) -> None:
        while not self.busy and self.transport is not None and not self.transport.is_closing():
            if self.skip:
                n = min(self.skip, len(self.buf))
                del self.buf[:n]
                self.skip -= n
                if self.skip:
                    return
            if self.need is None:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(self.buf) > _MAX_HEAD:
                        self.listener.metrics.refused.labels("bad_request").inc()
                        self._close_with(400, {"error": "head too large"})
                    return
                head = bytes(self.buf[:end])
                del self.buf[: end + 4]
                if not self._head(head):
                    if self.skip:
                        continue  # a limited frame: its body is passed over, unread
                    return
            if len(self.buf) < (self.need or 0):
                return
            assert self.need is not None
            frame = bytes(self.buf[: self.need])
            del self.buf[: self.need]
            self.need = None
            self.busy = True
            assert self.transport is not None
            self.transport.pause_reading()
            task = self.listener.loop.create_task(self._submit(frame))
            self.listener.tasks.add(task)
            task.add_done_callback(self.listener.tasks.discard)

    def _head(self, head: bytes) -> bool:
        """Parse a request head; True when a body of `self.need` bytes is to be read.
        False when answered already: the connection is closed, or (a frame over the
        source's limit) `self.skip` body bytes are to be passed over unread."""
        lst = self.listener
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or parts[2] not in (b"HTTP/1.1", b"HTTP/1.0"):
            lst.metrics.refused.labels("bad_request").inc()
            self._close_with(400, {"error": "bad request line"})
            return False
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if target != tp.REPORTS_PATH.encode():
            lst.metrics.refused.labels("not_found").inc()
            self._close_with(404, {"error": "not found"})
            return False
        if method != b"POST":
            lst.metrics.refused.labels("not_found").inc()
            self._close_with(405, {"error": "POST only"})
            return False
        length: int | None = None
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip():
                lst.metrics.refused.labels("bad_request").inc()
                self._close_with(400, {"error": "bad header line"})
                return False
            key = name.lower()
            if key == b"transfer-encoding":
                lst.metrics.refused.labels("length_required").inc()
                self._close_with(411, {"error": "send a Content-Length body"})
                return False
            if key == b"content-length":
                v = value.strip()
                if not v.isdigit() or (length is not None and int(v) != length):
                    lst.metrics.refused.labels("bad_request").inc()
                    self._close_with(400, {"error": "bad Content-Length"})
                    return False
                length = int(v)
        if length is None:
            lst.metrics.refused.labels("length_required").inc()
            self._close_with(411, {"error": "send a Content-Length body"})
            return False
        # the limit comes before anything else costs: the body is passed over unread and
        # unverified; the connection stays open (a reconnect would cost more than a 429)
        if not lst.limiter.allow(self.source):
            lst.metrics.limited.inc()
            if length > lst.max_report_bytes:
                self._close_with(429, _LIMITED)
            else:
                self.out += _LIMITED_RESPONSE
                self.skip = length
            return False
        if length > lst.max_report_bytes:
            lst.count_oversize()
            self._close_with(413, {"rejected": Reason.OVERSIZE.value})
            return False
        self.need = length
        return True

    async def _submit(self, frame: bytes) -> None:
        try:
            outcome = await self.listener.submit(frame, None)
        except Exception:  # a failing submit must not kill the connection loop unseen
            log.exception("report push: submit failed")
            self._close_with(400, {"rejected": "error"})
            return
        if isinstance(outcome, Rejected):
            status = _REJECT_STATUS.get(outcome.reason, 400)
            body: dict[str, object] = {"rejected": outcome.reason.value}
        else:
            status, body = 202, {"accepted": outcome.envelope.seq}
        self.busy = False
        t = self.transport
        if t is None or t.is_closing():
            return
        self.out += _response(status, body, close=False)
        self._arm()
        t.resume_reading()
        self._advance()


class PushListener:
    """The push listener (see the module docstring). `start()` binds it, `url` is its
    base URL afterwards, `stop()` closes it and every connection."""

    def __init__(
        self,
        config: PushConfig,
        submit: SubmitFn,
        registry: CollectorRegistry,
        *,
        max_report_bytes: int,
        count_oversize: Callable[[], None],
    ) -> None:
        self.config = config
        self.submit = submit
        self.max_report_bytes = max_report_bytes
        self.count_oversize = count_oversize
        self.metrics = PushMetrics(registry)
        self.limiter = PushLimiter(config.rate_per_s, config.burst, config.max_sources)
        self.conns: set[_PushProtocol] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.port: int | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "start() first"
        return self._loop

    @property
    def url(self) -> str:
        """`http://host:port`, the bound port (`start()` first)."""
        assert self.port is not None, "start() first"
        host = self.config.host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    async def start(self) -> None:
        if self._server is not None:
            return
        assert self.config.port is not None, "reports.push.port is not set"
        self._loop = asyncio.get_running_loop()
        self._server = await self._loop.create_server(
            lambda: _PushProtocol(self), self.config.host, self.config.port, backlog=256
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        log.info("report push listener on %s%s", self.url, tp.REPORTS_PATH)

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for conn in list(self.conns):
            if conn.transport is not None:
                conn.transport.abort()
        for task in list(self.tasks):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self.tasks, return_exceptions=True)
        await server.wait_closed()
