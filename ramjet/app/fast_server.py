"""The completion routes' own HTTP/1.1 server: an asyncio protocol on httptools (llhttp,
the parser uvicorn uses), in front of aiohttp on the same port.

Every connection starts here. A request is served here only when it is plain: `POST
/v1/chat/completions` or `POST /v1/completions` (no query), HTTP/1.1, one valid
Content-Length within `limits.max_body_bytes`, no Transfer-Encoding, Expect or Upgrade,
headers within `limits.max_headers` and `limits.max_header_line_bytes`, CRLF line ends
only, and a head llhttp accepts. Anything else (another route, a chunked or oversized
body, a malformed or over-limit head) is handed to aiohttp's own connection handler
(`ramjet.app.server`), which gets the bytes of that request from its first byte on and
keeps the connection from then: its refusals (400, 413, 431, ...) and its routes are
exactly as without this layer.

What this layer keeps itself, as aiohttp's handler does:

- the header deadline (`timeouts.header_deadline_s`, slowloris): from connect or the
  first byte of a request until its head is complete, else 408 and close;
- the body deadline (`timeouts.body_s`): the body is read whole before the router sees
  it, else 408 and close (counted as `body_timeout`);
- keep-alive (idle connections closed after `keepalive_s`, 75 s as aiohttp's default),
  pipelined requests answered in order (reading pauses while a backlog past 1 MiB
  waits), and `Connection: close` honoured;
- the handler task is cancelled when the client goes away (aiohttp's
  `handler_cancellation`), so the engine's request is aborted;
- backpressure: `FastResponse` waits for the transport to drain when it has paused;
- a body of `PIECES_BYTES` (1 MiB) or more is kept as the pieces it came in, and joined
  on a thread (which lets go of the GIL) before the handler gets it, so a huge body costs
  the loop no copy;
- a head that comes in pieces is searched for its end once per piece, from where the
  last search stopped (not all of it again per packet: a 1.6 MB head in 1460-byte
  segments cost seconds of CPU that way);
- the body budget (`limits.max_inflight_body_bytes`, `ramjet.request.admission.BodyBudget`,
  shared with the router): a body is charged from its head on (Content-Length), until
  its request ends; one that does not fit is refused with 503 `overloaded` before it is
  read;
- the pending connections of each client (`limits.max_pending_per_client`,
  `ramjet.request.admission.PendingClients`, shared with the router): a connection
  counts from the first byte of a request that did not come whole until its head and
  body are in (one that arrives whole never counts); one more past the limit is refused
  with 429 `too_many_pending`;
- the silent connections of each client (`limits.max_silent_per_client`,
  `ramjet.request.admission.SilentConnections`, shared with the router): from connect to
  the first byte; past the limit the client's oldest silent ones are closed, after a
  short delay (each is also bounded by the header deadline).

The response head and framing are aiohttp's (`ramjet.request.client`). With
`logging.access_log`, each request served here is logged as aiohttp logs it (its
`AccessLogger`, default format, logger `ramjet.access`) once its answer is written.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import cast

import httptools
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.http import HttpVersion11
from multidict import CIMultiDict, CIMultiDictProxy

from ramjet.request.admission import BodyBudget, PendingClients, SilentConnections, client_of
from ramjet.request.client import FastRequest, serialize_response
from ramjet.request.openai_errors import error_body, json_error

log = logging.getLogger(__name__)

ROUTES = frozenset({b"/v1/chat/completions", b"/v1/completions"})
KEEPALIVE_S = 75.0
"""Idle keep-alive connections are closed after this long (aiohttp's default)."""
BACKLOG_BYTES = 1 << 20
"""Pipelined bytes buffered while a request is answered before reading pauses."""
PIECES_BYTES = 1 << 20
"""A body at least this long is kept as the pieces it came in and joined on a thread
(`bytes.join` lets go of the GIL while it copies): a 32 MB body appended to a buffer,
then copied out of it on the loop, stalled every other stream for ~20 ms."""

Handler = Callable[[FastRequest], Awaitable[web.StreamResponse]]


def raw_error(
    status: int,
    reason: str,
    message: str,
    code: str,
    type_: str = "invalid_request_error",
    retry_after_s: int | None = None,
) -> bytes:
    """A whole error response (OpenAI error object) that closes the connection."""
    body = json.dumps(error_body(message, type_, code)).encode()
    retry = f"Retry-After: {retry_after_s}\r\n" if retry_after_s is not None else ""
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n{retry}"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class _Head:
    """A parsed request head that qualifies for this server."""

    __slots__ = ("headers", "keep_alive", "length", "path", "raw", "size")

    def __init__(
        self,
        path: str,
        raw: tuple[tuple[bytes, bytes], ...],
        headers: CIMultiDictProxy[str],
        length: int,
        keep_alive: bool,
        size: int,
    ) -> None:
        self.path, self.raw, self.headers = path, raw, headers
        self.length, self.keep_alive, self.size = length, keep_alive, size


class _Served:
    """A request served here as aiohttp's access logger reads it (`%a`, `%r`, `%{..}i`)."""

    __slots__ = ("headers", "method", "path_qs", "remote", "version")

    def __init__(self, req: FastRequest, client: str) -> None:
        self.remote = client or None
        self.method, self.path_qs, self.headers = req.method, req.path_qs, req.headers
        self.version = HttpVersion11  # the only version served here


class _Answered:
    """Its answer as the logger reads it (`%s`, `%b`: bytes written, head included, as
    aiohttp counts them; `%{..}o`)."""

    __slots__ = ("body_length", "headers", "status")

    def __init__(self, status: int, sent: int, headers: CIMultiDict[str]) -> None:
        self.status, self.body_length, self.headers = status, sent, headers


class FastServer:
    """Builds the protocol of each connection and keeps them (for shutdown).
    `fallback()` builds aiohttp's handler for a connection handed over."""

    def __init__(
        self,
        handler: Handler,
        fallback: Callable[[], asyncio.Protocol],
        *,
        header_deadline_s: float,
        body_timeout_s: float,
        max_headers: int,
        max_line_bytes: int,
        max_body_bytes: int,
        on_body_timeout: Callable[[], None] = lambda: None,
        bodies: BodyBudget | None = None,
        pending: PendingClients | None = None,
        on_refused: Callable[[str], None] = lambda reason: None,
        silent: SilentConnections | None = None,
        access_log: AbstractAccessLogger | None = None,
    ) -> None:
        """`bodies`, `pending`: the router's body budget and pending-connection counts
        (none: unbounded); `on_refused(reason)` counts a refusal made here; `access_log`:
        aiohttp's access logger, given each request served here (`logging.access_log`)."""
        self.handler = handler
        self.fallback = fallback
        self.header_deadline_s = header_deadline_s
        self.body_timeout_s = body_timeout_s
        self.max_headers = max_headers
        self.max_line_bytes = max_line_bytes
        self.max_body_bytes = max_body_bytes
        self.on_body_timeout = on_body_timeout
        self.bodies = bodies if bodies is not None else BodyBudget(1 << 62)
        self.pending = pending if pending is not None else PendingClients(1 << 62)
        self.silent = silent if silent is not None else SilentConnections(1 << 62)
        self.on_refused = on_refused
        self.access_log = access_log
        self.head_scanned = 0
        """Bytes searched for a head's end so far (tests read it)."""
        self.keepalive_s = KEEPALIVE_S
        """An idle connection is closed after this long."""
        # A head longer than this breaks a limit (aiohttp refuses it once handed over).
        self.max_head_bytes = (max_headers + 2) * (max_line_bytes * 2 + 4)
        self.connections: set[FastProtocol] = set()
        self.served = 0
        """Requests given to the handler here so far (tests read it)."""
        self.handed_over = 0
        """Connections handed to aiohttp so far (tests read it)."""
        self.timers = 0
        """Deadline timers started so far, over every connection (tests read it)."""

    def __call__(self) -> FastProtocol:
        return FastProtocol(self)

    def close_idle(self) -> None:
        """Close every connection that is not answering a request."""
        for conn in list(self.connections):
            if conn.task is None:
                conn.close()

    async def shutdown(self, timeout_s: float) -> None:
        """Close idle connections; give busy ones `timeout_s`, then cancel them."""
        self.close_idle()
        tasks = [c.task for c in self.connections if c.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout_s)
            for t in pending:
                t.cancel()
        for conn in list(self.connections):
            conn.close()


class FastProtocol(asyncio.Protocol):
    """One client connection (see the module docstring)."""

    def __init__(self, server: FastServer) -> None:
        self._server = server
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.writing_paused = False
        self.response_started = False
        """Set by `FastResponse` once the current request's answer began to leave."""
        self.task: asyncio.Task[None] | None = None
        self._buf = bytearray()
        self._head: _Head | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._fields: list[tuple[bytes, bytes]] = []
        self._complete = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_kind = ""
        """The deadline armed ("head", "body", "idle"), or "" for none."""
        self._deadline = 0.0
        self._drain: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._closed = False
        self._scanned = 0
        """Bytes of the buffered head already searched for its end."""
        self._client = ""
        self._pending = False
        """Counted in the server's `pending` (a request not whole yet)."""
        self._held = 0
        """Body bytes charged to the server's `bodies` for the current request."""
        self._pieces: list[bytes] | None = None
        """The current request's body so far, as received, when it is long
        (`PIECES_BYTES`); None otherwise (the body is read into `_buf`)."""
        self._got = 0
        """Bytes in `_pieces`."""
        self._silent = False
        """Counted in the server's `silent` (no byte since connect)."""

    # -- llhttp callbacks (the head only; the body is sliced by Content-Length) ---------

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields.append((name, value))

    def on_headers_complete(self) -> None:
        self._complete = True

    # -- timers -------------------------------------------------------------------------

    def _arm(self, kind: str, delay: float) -> None:
        """Start the `kind` deadline `delay` from now (kept if `kind` is already armed).

        One timer per connection, not one per request: `_disarm` only forgets the
        deadline, and the timer left running is moved only when a new deadline comes
        before it; one that fires before the current deadline re-arms itself at it (a
        keep-alive connection's idle wait armed after every answer, and dropped at the
        next request, costs no timer made and cancelled each time)."""
        if self._timer_kind == kind:
            return
        self._timer_kind = kind
        when = self._loop.time() + delay
        self._deadline = when
        timer = self._timer
        if timer is not None:
            if timer.when() <= when:
                return
            timer.cancel()
        self._server.timers += 1
        self._timer = self._loop.call_at(when, self._expired)

    def _disarm(self) -> None:
        self._timer_kind = ""

    def _stop_timer(self) -> None:
        self._timer_kind = ""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        kind = self._timer_kind
        if not kind or self.transport is None:
            return
        if self._loop.time() < self._deadline:
            self._server.timers += 1
            self._timer = self._loop.call_at(self._deadline, self._expired)
            return
        self._timer_kind = ""
        if kind == "idle":
            if self.task is None and not self._buf:
                self.close()
            return
        if self.task is not None:
            return
        if kind == "body":
            self._server.on_body_timeout()
            msg = "Request body not received in time."
        else:
            msg = "Request headers not received in time."
        self.transport.write(raw_error(408, "Request Timeout", msg, "request_timeout"))
        self.close()

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self._server.connections.add(self)
        self._client = client_of(transport)
        self._arm("head", self._server.header_deadline_s)
        self._silent = True
        self._server.silent.add(self._client, self, self.close)

    def _unsilence(self) -> None:
        if self._silent:
            self._silent = False
            self._server.silent.remove(self._client, self)

    def _enter_pending(self) -> bool:
        """Count this connection as its client's pending one (once); False when that is
        one too many: the client has been refused and the connection is closing."""
        if self._pending:
            return True
        srv = self._server
        if srv.pending.enter(self._client):
            self._pending = True
            return True
        srv.on_refused("too_many_pending")
        self._refuse(
            raw_error(
                429,
                "Too Many Requests",
                f"More than {srv.pending.limit} connections from this client have not "
                "sent a whole request.",
                "too_many_pending",
                retry_after_s=1,
            )
        )
        return False

    def _leave_pending(self) -> None:
        if self._pending:
            self._pending = False
            self._server.pending.leave(self._client)

    def _give_back(self) -> None:
        if self._held:
            self._server.bodies.give(self._held)
            self._held = 0

    def _refuse(self, response: bytes) -> None:
        if self.transport is not None and not self._closed:
            self.transport.write(response)
        self.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._closed = True
        self._unsilence()
        self._leave_pending()
        if self.task is None:
            self._give_back()  # a body never handed to a handler (else `_run` gives it)
        self._stop_timer()
        self._server.connections.discard(self)
        if self.task is not None:
            self.task.cancel()  # the client went away: end its request (and the engine's)
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("Connection lost"))
        self.transport = None

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    async def drain(self) -> None:
        if self.transport is None:
            raise ConnectionResetError("Connection lost")
        if not self.writing_paused:
            return
        if self._drain is None or self._drain.done():
            self._drain = self._loop.create_future()
        await asyncio.shield(self._drain)

    def data_received(self, data: bytes) -> None:
        if self._closed:
            return
        if self._silent:
            self._unsilence()
        if self._pieces is not None and self.task is None and self._head is not None:
            need = self._head.length - self._got
            if len(data) > need:  # the body ends in this piece: the rest is the next request
                self._buf += data[need:]
                data = data[:need]
            self._pieces.append(data)
            self._got += len(data)
            if self._got < self._head.length:
                return
        else:
            self._buf += data
        if self.task is None:
            self._process()
        elif len(self._buf) > BACKLOG_BYTES and self.transport is not None:
            self.transport.pause_reading()
            self._reading_paused = True

    def eof_received(self) -> bool | None:
        if self.task is None:
            self.close()
        return None

    def close(self) -> None:
        self._stop_timer()
        self._unsilence()
        self._leave_pending()
        if self.task is None:
            self._give_back()
        if self.transport is not None and not self._closed:
            self._closed = True
            self.transport.close()

    # -- requests -----------------------------------------------------------------------

    def _process(self) -> None:
        """Serve what is buffered: dispatch a whole request, hand the connection over, or
        wait for more bytes (under the head or body deadline)."""
        head = self._head
        if self._pieces is not None and head is not None:  # a long body, read in pieces
            if self._got >= head.length:
                self._dispatch_pieces(head, self._pieces)
            return
        buf = self._buf
        if not buf:
            self._arm("idle", self._server.keepalive_s)
            return
        if head is None:
            # Search only what the last search did not (less the 3 bytes an end could
            # straddle), once per piece.
            start = max(0, self._scanned - 3)
            end = buf.find(b"\r\n\r\n", start)
            if end < 0:
                self._server.head_scanned += len(buf) - start
                self._scanned = len(buf)
                if len(buf) > self._server.max_head_bytes or buf.find(b"\n\n", start) >= 0:
                    self._hand_over()
                elif self._enter_pending():
                    self._arm("head", self._server.header_deadline_s)
                return
            self._server.head_scanned += end + 4 - start
            self._scanned = 0
            head = self._parse_head(bytes(buf[: end + 4]))
            if head is None:
                self._hand_over()
                return
            if head.length and not self._server.bodies.take(head.length):
                self._server.on_refused("body_budget")
                self._refuse(
                    raw_error(
                        503,
                        "Service Unavailable",
                        "The router holds too many request bodies; retry later.",
                        "overloaded",
                        "server_error",
                        retry_after_s=1,
                    )
                )
                return
            self._held = head.length
            self._head = head
            if head.length >= PIECES_BYTES:
                end = min(len(buf), head.size + head.length)
                first = bytes(buf[head.size : end])
                del buf[:end]
                self._pieces = [first] if first else []
                self._got = len(first)
        if self._pieces is not None:
            if self._got < head.length:
                if self._enter_pending():
                    self._arm("body", self._server.body_timeout_s)
                return
            self._dispatch_pieces(head, self._pieces)
            return
        need = head.size + head.length
        if len(buf) < need:
            if self._enter_pending():
                self._arm("body", self._server.body_timeout_s)
            return
        self._leave_pending()
        self._disarm()
        with memoryview(buf) as view:
            body = bytes(view[head.size : need])  # one copy of a large body, not two
        del buf[:need]
        try:
            self._parser.feed_data(body)  # the message ends: the parser is ready for the next
        except httptools.HttpParserError:
            self._parser = httptools.HttpRequestParser(self)
        self._head = None
        req = FastRequest(self, head.path, head.raw, head.headers, body, head.keep_alive)
        req.budgeted = True  # charged here (`_held`), given back when `_run` ends
        self._server.served += 1
        self.task = self._loop.create_task(self._run(req))

    def _dispatch_pieces(self, head: _Head, pieces: list[bytes]) -> None:
        """Hand a long body's request, its body still in pieces, to the handler."""
        self._leave_pending()
        self._disarm()
        self._pieces, self._got, self._head = None, 0, None
        try:
            for piece in pieces:  # the message ends: the parser is ready for the next
                self._parser.feed_data(piece)
        except httptools.HttpParserError:
            self._parser = httptools.HttpRequestParser(self)
        self._server.served += 1
        self.task = self._loop.create_task(self._run_pieces(head, pieces))

    async def _run_pieces(self, head: _Head, pieces: list[bytes]) -> None:
        try:
            # joined on a thread: `bytes.join` lets go of the GIL while it copies
            body = await asyncio.to_thread(b"".join, pieces)
        except asyncio.CancelledError:
            self.task = None
            self._give_back()
            raise
        del pieces[:]
        req = FastRequest(self, head.path, head.raw, head.headers, body, head.keep_alive)
        req.budgeted = True  # charged here (`_held`), given back when `_run` ends
        await self._run(req)

    def _parse_head(self, raw: bytes) -> _Head | None:
        """The head if this server takes the request, else None (handed over)."""
        srv = self._server
        if raw.count(b"\n") != raw.count(b"\r\n") or raw.count(b"\r") != raw.count(b"\r\n"):
            return None  # a bare LF or CR: aiohttp refuses it
        self._url, self._fields, self._complete = b"", [], False
        try:
            self._parser.feed_data(raw)
        except httptools.HttpParserError:
            return None
        p = self._parser
        url, fields = self._url, self._fields
        if (
            not self._complete
            or url not in ROUTES
            or p.get_method() != b"POST"
            or p.get_http_version() != "1.1"
            or p.should_upgrade()
            or len(fields) > srv.max_headers
            or raw.find(b"\r\n") > srv.max_line_bytes
        ):
            return None
        length: int | None = None
        limit = srv.max_line_bytes
        for name, value in fields:
            if len(name) > limit or len(value) > limit:
                return None
            lname = name.lower()
            if lname == b"content-length":
                if length is not None or not value.isdigit():
                    return None
                length = int(value)
            elif lname in (b"transfer-encoding", b"expect", b"upgrade"):
                return None
        if length is None or length > srv.max_body_bytes:
            return None
        raw_headers = tuple(fields)
        headers = CIMultiDictProxy(
            CIMultiDict(
                (k.decode("utf-8", "surrogateescape"), v.decode("utf-8", "surrogateescape"))
                for k, v in raw_headers
            )
        )
        keep_alive = bool(p.should_keep_alive())
        return _Head(url.decode(), raw_headers, headers, length, keep_alive, len(raw))

    def _hand_over(self) -> None:
        """Give the connection to aiohttp, with the current request's bytes so far."""
        transport = self.transport
        if transport is None:
            return
        self._stop_timer()
        self._leave_pending()  # aiohttp's handler counts a body it waits for
        self._give_back()
        self._scanned = 0
        self._closed = True
        self._server.connections.discard(self)
        self._server.handed_over += 1
        data, self._buf = bytes(self._buf), bytearray()
        handler = self._server.fallback()
        handler.connection_made(transport)
        transport.set_protocol(handler)
        self.transport = None
        if self._reading_paused:
            transport.resume_reading()
        if data:
            handler.data_received(data)

    async def _run(self, req: FastRequest) -> None:
        resp: web.StreamResponse | None = None
        start = self._loop.time() if self._server.access_log is not None else 0.0
        try:
            resp = await self._server.handler(req)
        except asyncio.CancelledError:
            self.task = None
            self._give_back()
            raise
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            resp = json_error(exc.status, exc.reason, "invalid_request_error", f"http_{exc.status}")
        except Exception as exc:
            log.error("unhandled error", exc_info=exc)
            resp = None
        self.task = None
        self._give_back()
        self._finish(req, resp, start)

    def _finish(self, req: FastRequest, resp: web.StreamResponse | None, start: float) -> None:
        transport = self.transport
        if transport is None or self._closed:
            return
        keep = req.keep_alive
        streamed = req.response  # the streamed answer the handler began, if any
        started, self.response_started = self.response_started, False
        if started:  # a streamed answer: the connection carries on only if it ended whole
            done = streamed is not None and resp is streamed and streamed.done
            keep = keep and done and resp is not None and resp.keep_alive is not False
            sent = streamed.framer.sent if streamed is not None else 0
        else:
            if resp is None or resp is streamed:  # none, or a streamed one that sent nothing
                resp = json_error(500, "Internal error.", "server_error", "http_500", close=True)
            keep = keep and resp.keep_alive is not False
            wire = serialize_response(resp, keep)
            sent = len(wire)
            transport.write(wire)
        access = self._server.access_log
        if access is not None and resp is not None and access.enabled:
            answer = _Answered(resp.status, sent, resp.headers)
            access.log(_Served(req, self._client), answer, self._loop.time() - start)  # type: ignore[arg-type]
        if not keep:
            self.close()
            return
        if self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
        self._process()
