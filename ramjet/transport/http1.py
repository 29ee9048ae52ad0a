"""A lean HTTP/1.1 client for the router's hop to an engine: one keep-alive pool per
engine, on an `asyncio.Protocol`. `EnginePool` is the HTTP/1.1 `EngineTransport` and
`UpstreamResponse` its `EngineResponse` (`ramjet.transport.base` holds the contract).

Per request: the head and the body leave in one write. The response is parsed by
httptools' `HttpResponseParser` (llhttp, strict: a bare CR or LF, a NUL or other control
byte in a header, a name that is not a token, a bad or repeated Content-Length or chunk
size is refused), one parser per connection; a NUL in the reason phrase and a status
line that does not start with "HTTP/" are refused as well. Interim (1xx) heads are skipped; a head
past 64 KiB or 255 header lines, an HTTP version other than 1.0/1.1, a status outside
100-599 or a 101, a Transfer-Encoding that does not end in chunked, and 64 KiB of chunk
framing (size lines, extensions, trailers) with no data are refused too. Body bytes go
to the reader as they arrive, those of one read in one piece, unchanged (a chunked body
is de-chunked, trailers dropped; a body with neither Content-Length nor chunking runs to
the connection's close). Nothing is decompressed. Bytes past a body's end (other than
blank lines, which llhttp skips) retire the connection.

- Pool (`EnginePool`): at most `limit` open connections; a request past the limit waits
  for one to be released. A connection goes back to the pool only when its response
  body ended cleanly and neither side asked to close; idle ones are dropped after
  `keepalive_s` or as soon as the engine closes them.
- Backpressure: past `read_high` buffered body bytes the socket stops being read
  until the reader takes them (`UpstreamResponse.read_nowait`/`readany`).
- Direct relay: `UpstreamResponse.set_sink(sink)` offers each body piece to `sink` from
  the connection's callback, before it is buffered; a piece the sink takes (it returns
  True: written to the client) wakes no reader and moves the `readany` idle deadline as
  a buffered one would. A piece it declines, any piece while others are buffered, and
  the body's last piece are buffered and read as before. The sink must not raise.
- `UpstreamResponse.close()` before the body ended closes the connection, which is how
  an engine's request is aborted (client gone, stream cut, shutdown); a reader waiting
  on it is woken with `UpstreamClosed`.
- Errors are `OSError`s: `UpstreamConnectError` (refused, with `refused` set;
  unreachable; or not connected within `connect_s`), `UpstreamClosed` (the engine
  closed or broke the connection, or sent something that is not HTTP/1.x). Timeouts
  other than connect are the caller's (`asyncio.timeout` around `request`/`readany`).
"""

from __future__ import annotations

import asyncio
import collections
import errno
import re
import socket
import ssl
import time
from collections.abc import Callable, Iterable

from httptools import (
    HttpParserCallbackError,
    HttpParserError,
    HttpParserUpgrade,
    HttpResponseParser,
)
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from ramjet.transport.base import UpstreamClosed as UpstreamClosed
from ramjet.transport.base import UpstreamConnectError as UpstreamConnectError

_MAX_HEAD_BYTES = 64 * 1024
"""A response head (status line and headers) longer than this is refused."""
_MAX_HEADERS = 256
"""A response head with this many header lines or more is refused."""


def _why(exc: Exception) -> str:
    """What the parser refused: a callback's own error, else llhttp's reason."""
    if isinstance(exc, HttpParserCallbackError) and exc.__context__ is not None:
        return str(exc.__context__)
    return str(exc) or type(exc).__name__


class UpstreamResponse:
    """An engine's response: status, headers, and its body as it arrives."""

    __slots__ = (
        "_buf",
        "_buffered",
        "_conn",
        "_deadline",
        "_eof",
        "_error",
        "_idle_s",
        "_loop",
        "_sink",
        "_timer",
        "_waiter",
        "content_length",
        "headers",
        "reason",
        "status",
    )

    def __init__(
        self,
        conn: _Conn,
        status: int,
        reason: str,
        headers: CIMultiDictProxy[str],
        content_length: int | None,
    ) -> None:
        self._conn: _Conn | None = conn
        self.status = status
        self.reason = reason
        self.headers = headers
        self.content_length = content_length
        self._buf: list[bytes] = []
        self._buffered = 0
        self._eof = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._sink: Callable[[bytes], bool] | None = None
        self._idle_s: float | None = None
        self._loop = conn.pool.loop  # the sink's clock (`_feed`), no lookup per piece

    def set_sink(self, sink: Callable[[bytes], bool] | None) -> None:
        """Offer each later body piece to `sink` first (module docstring, direct relay);
        None: buffer every piece."""
        self._sink = sink

    # -- fed by the connection --------------------------------------------------------

    def _feed(self, data: bytes, last: bool = False) -> None:
        """A body piece; `last`: the body ends with it (it is buffered: the reader ends
        the client's body in the same write)."""
        sink = self._sink
        if sink is not None and not last and not self._buf and sink(data):
            w = self._waiter
            if w is not None and self._idle_s is not None:  # data came: not idle
                self._deadline = self._loop.time() + self._idle_s
            return
        self._buf.append(data)
        self._buffered += len(data)
        self._wake()

    def _end(self) -> None:
        self._eof = True
        self._conn = None
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if not self._eof and self._error is None:
            self._error = exc
        self._conn = None
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    # -- read by the caller -----------------------------------------------------------

    def at_eof(self) -> bool:
        """The body ended and every byte of it was read."""
        return self._eof and not self._buf

    def read_nowait(self) -> bytes:
        """Every body byte buffered now, in one piece (b"" if none)."""
        buf = self._buf
        if not buf:
            return b""
        data = buf[0] if len(buf) == 1 else b"".join(buf)
        buf.clear()
        self._buffered = 0
        conn = self._conn
        if conn is not None and conn.paused:
            conn.resume()
        return data

    async def readany(self, idle_s: float | None = None) -> bytes:
        """The next body bytes (everything buffered), b"" at the end of the body; raises
        `UpstreamClosed` if the body was cut, `TimeoutError` if nothing came within
        `idle_s` (None: no limit).

        The idle limit costs no timer per wait: one timer per response is armed at the
        first wait's deadline; each later wait only moves the deadline, and a timer that
        fires early re-arms itself at the current one."""
        while not self._buf:
            if self._eof:
                return b""
            if self._error is not None:
                raise self._error
            loop = asyncio.get_running_loop()
            w = loop.create_future()
            self._waiter = w
            self._idle_s = idle_s
            if idle_s is not None:
                self._deadline = loop.time() + idle_s
                if self._timer is None:
                    self._timer = loop.call_at(self._deadline, self._idle_check)
            try:
                await w
            finally:
                self._waiter = None
        return self.read_nowait()

    def _idle_check(self) -> None:
        self._timer = None
        w = self._waiter
        if w is None or w.done():  # not waiting now: the next wait arms a new timer
            return
        loop = w.get_loop()
        if loop.time() >= self._deadline:
            w.set_exception(TimeoutError())
        else:
            self._timer = loop.call_at(self._deadline, self._idle_check)

    def close(self) -> None:
        """Done with the response: a connection whose body has not ended is closed (the
        engine sees its request aborted); one that ended already went back to the pool."""
        self._sink = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        conn = self._conn
        if conn is not None:
            conn.abort_response()
        elif not self._eof and self._error is None:
            self._error = UpstreamClosed("response closed")
        self._wake()


class _Conn(asyncio.Protocol):
    """One connection to an engine, one request at a time. Its bytes go through one
    `httptools.HttpResponseParser` (llhttp) for the connection's life; the parser's
    callbacks below build each head and collect each read's body pieces."""

    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.paused = False
        self.idle_since = 0.0
        self._closed = False
        self._head_waiter: asyncio.Future[UpstreamResponse] | None = None
        self._resp: UpstreamResponse | None = None
        self._parser = HttpResponseParser(self)
        # Both framings: chunked wins (llhttp would refuse the response) and the
        # connection is not reused (`on_headers_complete`).
        self._parser.set_dangerous_leniencies(lenient_chunked_length=True)
        # The head being parsed: its reason phrase's pieces, headers, size and lines.
        self._reason: list[bytes] = []
        self._headers: CIMultiDict[str] = CIMultiDict()
        self._head_size = 0
        self._head_lines = 0
        self._head_len = 0  # bytes read since the last head ended, while no head is whole
        self._quiet = 0  # body-state bytes read since the last body byte (framing only)
        # This read's body pieces, handed over as one: the first (an SSE chunk's one piece)
        # held alone, any later ones in the list.
        self._piece: bytes | None = None
        self._pieces: list[bytes] = []
        self._done = False  # this read ended the body
        self._keep_alive = True
        self._until_close = False
        self._fresh = False  # a request was sent and nothing of its answer came yet

    # -- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport; they have its methods.
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:  # a request leaves in one write: never hold it back (Nagle)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self.pool._gone(self)
        resp, self._resp = self._resp, None
        if resp is not None:
            if self._until_close and exc is None:
                resp._end()
            else:
                resp._fail(UpstreamClosed("engine closed the connection mid-body"))
        w, self._head_waiter = self._head_waiter, None
        if w is not None and not w.done():
            w.set_exception(UpstreamClosed("engine closed the connection before answering"))

    def eof_received(self) -> bool:
        return False  # close our side too

    def data_received(self, data: bytes) -> None:
        in_head = self._resp is None
        if in_head:
            if self._head_waiter is None:  # nothing asked for: not HTTP as we speak it
                self._close()
                return
            if self._fresh:  # the answer's first byte: "H" (llhttp also takes RTSP/, ICE/)
                self._fresh = False
                if data[0] != 72:
                    self._fail_head("malformed response head: not HTTP")
                    return
            self._head_len += len(data)
        err: Exception | None = None
        try:
            self._parser.feed_data(data)
        except (HttpParserError, HttpParserUpgrade) as exc:
            err = exc
        resp = self._resp
        if resp is not None:
            piece = self._piece
            if piece is not None:
                self._piece = None
                self._quiet = 0
                more = self._pieces
                if more:
                    more.insert(0, piece)
                    piece = b"".join(more)
                    more.clear()
                resp._feed(piece, self._done)
            elif not in_head:
                self._quiet += len(data)
        if self._done:
            self._done = False
            self._finish()
            if err is not None:  # bytes past the body: the connection is not reusable
                self._close()
        elif err is not None:
            why = _why(err)
            if resp is None:
                self._fail_head(f"malformed response head: {why}")
            else:
                self._fail_body(f"malformed response body: {why}")
        elif resp is None:
            if self._head_len > _MAX_HEAD_BYTES:
                self._fail_head("response head too large")
        elif self._quiet > _MAX_HEAD_BYTES:  # chunk size lines or trailers, no data
            self._fail_body("chunk framing too long")
        elif (
            resp._buffered > self.pool.read_high and not self.paused and self.transport is not None
        ):
            self.paused = True
            self.transport.pause_reading()

    # -- the parser's callbacks (httptools) -------------------------------------------

    def on_message_begin(self) -> None:
        if self._resp is not None or self._head_waiter is None:
            raise ValueError("bytes past the body")  # stops the parser
        self._reason = []
        self._headers = CIMultiDict()
        self._head_size = 0
        self._head_lines = 0

    def on_status(self, reason: bytes) -> None:
        if b"\0" in reason:  # llhttp takes it; it would reach the client's status line
            raise ValueError("NUL in the reason phrase")
        self._reason.append(reason)
        self._head_size += len(reason)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._resp is not None:  # a trailer: dropped
            return
        self._head_lines += 1
        self._head_size += len(name) + len(value) + 4
        if self._head_lines >= _MAX_HEADERS:
            raise ValueError(f"more than {_MAX_HEADERS - 1} header lines")
        if self._head_size > _MAX_HEAD_BYTES:
            raise ValueError("response head too large")
        self._headers.add(name.decode("latin-1"), value.decode("utf-8", "surrogateescape").strip())

    def on_headers_complete(self) -> None:
        self._head_len = 0
        parser = self._parser
        version = parser.get_http_version()
        status = parser.get_status_code()
        if version != "1.1" and version != "1.0":
            raise ValueError(f"HTTP version {version}")
        if not 100 <= status <= 599 or status == 101:  # 101: no upgrade was asked for
            raise ValueError(f"status {status}")
        if self._head_size > _MAX_HEAD_BYTES:
            raise ValueError("response head too large")
        if status < 200:  # an interim head: skipped
            return
        headers = self._headers
        conn_tokens = ",".join(headers.getall("Connection", ())).lower()
        self._keep_alive = version == "1.1" and "close" not in conn_tokens
        self._until_close = False
        self._quiet = 0
        length = None if status in (204, 304) else self._framing(headers)  # 204/304: no body
        reason = self._reason
        text = (reason[0] if len(reason) == 1 else b"".join(reason)).decode(
            "utf-8", "surrogateescape"
        )
        resp = UpstreamResponse(self, status, text, CIMultiDictProxy(headers), length)
        self._resp = resp
        w, self._head_waiter = self._head_waiter, None
        if w is not None and not w.done():
            w.set_result(resp)

    def _framing(self, headers: CIMultiDict[str]) -> int | None:
        """How the body is framed: its Content-Length, or None (chunked, or until the
        connection closes: then not kept alive)."""
        te = ",".join(headers.getall("Transfer-Encoding", ())) or None
        if te is not None:
            if te.lower().rsplit(",", 1)[-1].strip() != "chunked":
                raise ValueError(f"unsupported Transfer-Encoding {te!r}")
            if "Content-Length" in headers:  # both framings: a smuggling attempt or a bug
                self._keep_alive = False
            return None
        if "Content-Length" in headers:
            return int(headers["Content-Length"])  # llhttp checked it: digits, one
        self._until_close = True
        self._keep_alive = False
        return None

    def on_body(self, data: bytes) -> None:
        if self._piece is None:
            self._piece = data
        else:
            self._pieces.append(data)

    def on_message_complete(self) -> None:
        if self._resp is not None:  # not an interim head's end
            self._done = True

    # -- lifecycle --------------------------------------------------------------------

    def _finish(self) -> None:
        """The body ended: hand the end to the reader, the connection to the pool."""
        resp, self._resp = self._resp, None
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        if resp is not None:
            resp._end()
        # Part of the request still unsent: the engine answered without reading it all,
        # and what it reads next would be the rest of that body, not our next request.
        t = self.transport
        if (
            self._keep_alive
            and not self._closed
            and t is not None
            and not t.get_write_buffer_size()
        ):
            self.pool._release(self)
        else:
            self._close()

    def _fail_head(self, msg: str) -> None:
        w, self._head_waiter = self._head_waiter, None
        if w is not None and not w.done():
            w.set_exception(UpstreamClosed(msg))
        self._close()

    def _fail_body(self, msg: str) -> None:
        resp, self._resp = self._resp, None
        if resp is not None:
            resp._fail(UpstreamClosed(msg))
        self._close()

    def resume(self) -> None:
        self.paused = False
        if self.transport is not None:
            self.transport.resume_reading()

    def abort_response(self) -> None:
        resp, self._resp = self._resp, None
        if resp is not None:
            resp._fail(UpstreamClosed("response closed"))
        self._close()

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self.pool._gone(self)
            if self.transport is not None:
                self.transport.close()

    @property
    def usable(self) -> bool:
        return not self._closed and self.transport is not None and not self.transport.is_closing()

    def send(self, data: bytes) -> asyncio.Future[UpstreamResponse]:
        assert self.transport is not None
        w: asyncio.Future[UpstreamResponse] = self.pool.loop.create_future()
        self._head_waiter = w
        self._fresh = True
        self.transport.write(data)
        return w


_ERRNO = re.compile(r"\[Errno (\d+)\]")


def _refused(exc: OSError) -> bool:
    """Whether a failed connect was refused at every address tried (nothing listens:
    the engine is gone). Python 3.11's asyncio folds the errors of a name with several
    addresses (localhost as ::1 and 127.0.0.1) into one plain `OSError` whose message
    lists each as `[Errno N] ...`: refused when every one is ECONNREFUSED."""
    if isinstance(exc, ConnectionRefusedError):
        return True
    if exc.errno is not None or not str(exc).startswith("Multiple exceptions: "):
        return False
    codes = _ERRNO.findall(str(exc))
    return bool(codes) and all(int(c) == errno.ECONNREFUSED for c in codes)


class EnginePool:
    """Keep-alive connections to one engine (`url`: http(s)://host[:port]), at most
    `limit` open."""

    def __init__(
        self,
        url: str,
        *,
        limit: int,
        connect_s: float,
        keepalive_s: float = 30.0,
        read_high: int = 64 * 1024,
    ) -> None:
        u = URL(url)
        if u.scheme not in ("http", "https") or not u.host or u.port is None:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.host: str = u.host
        self.port: int = u.port
        self._ssl = ssl.create_default_context() if u.scheme == "https" else None
        authority = u.raw_authority if not u.is_default_port() else (u.raw_host or u.host)
        if ":" in authority and not authority.startswith("[") and u.is_default_port():
            authority = f"[{authority}]"
        self.limit = limit
        self.connect_s = connect_s
        self.keepalive_s = keepalive_s
        self.read_high = read_high
        self.loop = asyncio.get_running_loop()
        self._host_header = f"Host: {authority}\r\n"
        self._idle: collections.deque[_Conn] = collections.deque()
        self._open: set[_Conn] = set()
        self._connecting = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._closed = False

    # -- the pool ---------------------------------------------------------------------

    def _release(self, conn: _Conn) -> None:
        if self._closed:
            conn._close()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)
        self._wake_one()

    def _gone(self, conn: _Conn) -> None:
        if conn in self._open:
            self._open.discard(conn)
            if conn in self._idle:
                self._idle.remove(conn)
            self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(None)
                return

    async def _acquire(self) -> _Conn:
        while True:
            idle = self._idle
            while idle:
                conn = idle.pop()  # the most recently used: least likely to be stale
                if conn.usable and time.monotonic() - conn.idle_since < self.keepalive_s:
                    return conn
                conn._close()
            if len(self._open) + self._connecting < self.limit:
                return await self._connect()
            w = self.loop.create_future()
            self._waiters.append(w)
            try:
                await w
            except BaseException:
                if w.done() and not w.cancelled():
                    self._wake_one()  # pass the wake-up on
                raise

    async def _connect(self) -> _Conn:
        self._connecting += 1
        try:
            async with asyncio.timeout(self.connect_s):
                _, proto = await self.loop.create_connection(
                    lambda: _Conn(self), self.host, self.port, ssl=self._ssl
                )
        except TimeoutError:
            raise UpstreamConnectError(
                f"connect to {self.host}:{self.port} timed out after {self.connect_s}s"
            ) from None
        except OSError as exc:
            raise UpstreamConnectError(
                f"connect to {self.host}:{self.port}: {exc}", refused=_refused(exc)
            ) from None
        finally:
            self._connecting -= 1
            if len(self._open) + self._connecting < self.limit:
                self._wake_one()
        self._open.add(proto)
        return proto

    # -- requests ---------------------------------------------------------------------

    async def request(
        self, method: str, path_qs: str, headers: Iterable[tuple[str, str]], body: bytes
    ) -> UpstreamResponse:
        """Send one request; returns once the response head arrived (the body is read
        from the returned response, which the caller must `close`)."""
        fields = "".join([f"{k}: {v}\r\n" for k, v in headers])
        # Header names hold no CR/LF, so a line starting "accept:" is an Accept header.
        accept = "" if ("\r\n" + fields).lower().find("\r\naccept:") >= 0 else "Accept: */*\r\n"
        head = (
            f"{method} {path_qs} HTTP/1.1\r\n{self._host_header}{fields}{accept}"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        data = head.encode("utf-8", "surrogateescape") + body
        if self._closed:
            raise UpstreamClosed("pool closed")
        conn = await self._acquire()
        try:
            return await conn.send(data)
        except BaseException:
            conn._close()
            raise

    async def close(self) -> None:
        self._closed = True
        for conn in list(self._open):
            conn._close()
        self._idle.clear()
