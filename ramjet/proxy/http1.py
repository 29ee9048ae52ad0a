"""A lean HTTP/1.1 client for the router's hop to an engine: one keep-alive pool per
engine, on an `asyncio.Protocol`. `EnginePool` is the HTTP/1.1 `EngineTransport` and
`UpstreamResponse` its `EngineResponse` (`ramjet.proxy.transport` holds the contract).

Per request: the head and the body leave in one write; the response's status line and
headers are parsed once they are complete (`\\r\\n\\r\\n`), then body bytes go to the
reader as they arrive, unchanged (a chunked body is de-chunked; a body with neither
Content-Length nor chunking runs to the connection's close). Nothing is decompressed.

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
- Errors are `OSError`s: `UpstreamConnectError` (refused, unreachable, or not connected
  within `connect_s`), `UpstreamClosed` (the engine closed or broke the connection, or
  sent something that is not HTTP/1.x). Timeouts other than connect are the caller's
  (`asyncio.timeout` around `request`/`readany`).
"""

from __future__ import annotations

import asyncio
import collections
import re
import socket
import ssl
import time
from collections.abc import Callable, Iterable

from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from ramjet.proxy.transport import UpstreamClosed as UpstreamClosed
from ramjet.proxy.transport import UpstreamConnectError as UpstreamConnectError

_MAX_HEAD_BYTES = 64 * 1024
"""A response head (status line and headers) longer than this is refused."""
_MAX_HEADERS = 256
"""A response head with more header lines than this is refused."""
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""A header name (RFC 9110 token)."""


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
                self._deadline = w.get_loop().time() + self._idle_s
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
    """One connection to an engine, one request at a time."""

    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.paused = False
        self.idle_since = 0.0
        self._closed = False
        self._lost: BaseException | None = None
        # Response state: waiting for the head, then the body in one of three framings.
        self._head_waiter: asyncio.Future[UpstreamResponse] | None = None
        self._buf = b""
        # A head that came in pieces: the pieces, their length, the last 3 bytes. One copy
        # and one scan per piece, not of all so far (a 60 KB head sent a byte at a time
        # cost ~1 s of CPU that way).
        self._head_parts: list[bytes] = []
        self._head_len = 0
        self._head_tail = b""
        self._resp: UpstreamResponse | None = None
        self._keep_alive = True
        self._remaining = -1  # Content-Length bytes still due; -1: not length-framed
        self._chunked = False
        self._chunk_left = 0  # bytes of the current chunk still due (+2 for its CRLF)
        self._trailers = False
        self._until_close = False

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
            if self._until_close and exc is None and not self._buf:
                resp._end()
            else:
                resp._fail(UpstreamClosed("engine closed the connection mid-body"))
        w, self._head_waiter = self._head_waiter, None
        if w is not None and not w.done():
            w.set_exception(UpstreamClosed("engine closed the connection before answering"))

    def eof_received(self) -> bool:
        return False  # close our side too

    def data_received(self, data: bytes) -> None:
        if self._resp is not None:
            self._body(data)
            return
        if self._head_waiter is None:  # nothing asked for: not HTTP as we speak it
            self._close()
            return
        if self._head_parts:
            probe = self._head_tail + data
            self._head_parts.append(data)
            self._head_len += len(data)
            if probe.find(b"\r\n\r\n") < 0:
                if self._head_len > _MAX_HEAD_BYTES:
                    self._fail_head("response head too large")
                else:
                    self._head_tail = probe[-3:]
                return
            buf = b"".join(self._head_parts)
            self._head_parts = []
        else:
            buf = data
        while True:  # interim (1xx) heads are skipped: a loop, since one read may hold many
            end = buf.find(b"\r\n\r\n")
            if end < 0 or end > _MAX_HEAD_BYTES:
                if len(buf) > _MAX_HEAD_BYTES:
                    self._fail_head("response head too large")
                else:
                    self._head_parts = [buf]
                    self._head_len = len(buf)
                    self._head_tail = buf[-3:]
                return
            try:
                resp = self._parse_head(buf[:end])
            except (ValueError, UnicodeDecodeError) as exc:
                self._fail_head(f"malformed response head: {exc}")
                return
            if resp is not None:
                break
            buf = buf[end + 4 :]
            if not buf:
                return
        w, self._head_waiter = self._head_waiter, None
        self._resp = resp
        if not w.done():
            w.set_result(resp)
        rest = buf[end + 4 :]
        if self._remaining == 0:
            self._finish()
            if rest:
                self._close()  # bytes past the body: the connection is not reusable
        elif rest:
            self._body(rest)

    # -- parsing ----------------------------------------------------------------------

    def _parse_head(self, head: bytes) -> UpstreamResponse | None:
        # A CR or LF other than a line's CRLF, or a NUL, would reach the client's response
        # as written (response splitting): refused, as are bare-LF line ends.
        crlf = head.count(b"\r\n")
        if head.count(b"\r") != crlf or head.count(b"\n") != crlf or b"\0" in head:
            raise ValueError("CR, LF or NUL inside a line")
        if crlf >= _MAX_HEADERS:
            raise ValueError(f"more than {_MAX_HEADERS} header lines")
        lines = head.decode("utf-8", "surrogateescape").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        code, _, reason = rest.partition(" ")
        if version not in ("HTTP/1.1", "HTTP/1.0") or not code.isascii() or not code.isdigit():
            raise ValueError(repr(lines[0][:80]))
        status = int(code)
        if not 100 <= status <= 599 or len(code) != 3 or status == 101:
            raise ValueError(repr(lines[0][:80]))  # 101: no upgrade was asked for
        headers: CIMultiDict[str] = CIMultiDict()
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or _TOKEN.fullmatch(name) is None:
                raise ValueError(f"bad header line {line[:80]!r}")
            headers.add(name, value.strip())
        if status < 200:
            return None
        conn_tokens = ",".join(headers.getall("Connection", ())).lower()
        self._keep_alive = version == "HTTP/1.1" and "close" not in conn_tokens
        te = ",".join(headers.getall("Transfer-Encoding", ())) or None
        length: int | None = None
        self._chunked = self._until_close = self._trailers = False
        self._chunk_left = 0
        if status in (204, 304):
            self._remaining = 0
        elif te is not None:
            if te.lower().rsplit(",", 1)[-1].strip() != "chunked":
                raise ValueError(f"unsupported Transfer-Encoding {te!r}")
            self._chunked = True
            self._remaining = -1
            if "Content-Length" in headers:  # both framings: a smuggling attempt or a bug
                self._keep_alive = False
        elif "Content-Length" in headers:
            cl = headers["Content-Length"]
            if not (cl.isascii() and cl.isdigit()) or len(headers.getall("Content-Length")) > 1:
                raise ValueError(f"bad Content-Length {cl!r}")
            length = int(cl)
            self._remaining = length
        else:
            self._until_close = True
            self._keep_alive = False
            self._remaining = -1
        return UpstreamResponse(self, status, reason, CIMultiDictProxy(headers), length)

    def _body(self, data: bytes) -> None:
        resp = self._resp
        assert resp is not None
        if self._chunked:
            self._dechunk(data)
        elif self._until_close:
            resp._feed(data)
        else:
            n = self._remaining
            if len(data) < n:
                self._remaining = n - len(data)
                resp._feed(data)
            else:
                if n:
                    resp._feed(data if len(data) == n else data[:n], last=True)
                self._remaining = 0
                self._finish()
                if len(data) > n:
                    self._close()
                return
        if (
            self._resp is resp
            and resp._buffered > self.pool.read_high
            and not self.paused
            and self.transport is not None
        ):
            self.paused = True
            self.transport.pause_reading()

    def _dechunk(self, data: bytes) -> None:
        """Chunked framing off: the chunk data of `data` goes to the reader in one piece.
        A chunk-size line or CRLF split across reads waits in `_buf`."""
        resp = self._resp
        assert resp is not None
        buf = self._buf + data if self._buf else data
        self._buf = b""
        out: list[bytes] = []
        pos, n = 0, len(buf)
        left = self._chunk_left  # chunk data still due, plus its 2-byte CRLF
        try:
            while pos < n:
                if left > 2:  # chunk data
                    take = left - 2
                    if take > n - pos:
                        take = n - pos
                    out.append(buf[pos : pos + take])
                    pos += take
                    left -= take
                elif left > 0:  # the CRLF after the chunk data
                    need = buf[pos : pos + left]
                    if b"\r\n"[2 - left : 2 - left + len(need)] != need:
                        self._fail_body("bad chunk terminator")
                        return
                    pos += len(need)
                    left -= len(need)
                else:
                    eol = buf.find(b"\r\n", pos)
                    if eol < 0:
                        if n - pos > 1024:
                            self._fail_body("chunk size line too long")
                        else:
                            self._buf = buf[pos:]
                        return
                    if self._trailers:  # trailer lines until an empty one
                        if eol == pos:
                            self._chunk_left = 0
                            if out:
                                resp._feed(out[0] if len(out) == 1 else b"".join(out), True)
                                out = []
                            self._finish()
                            if eol + 2 < n:
                                self._close()
                            return
                        pos = eol + 2
                        continue
                    size_s = buf[pos:eol].split(b";", 1)[0].strip()
                    if not size_s or size_s.strip(b"0123456789abcdefABCDEF"):
                        self._fail_body("bad chunk size")
                        return
                    pos = eol + 2
                    size = int(size_s, 16)
                    if size == 0:
                        self._trailers = True
                    else:
                        left = size + 2
        finally:
            self._chunk_left = left
            if out:
                resp._feed(out[0] if len(out) == 1 else b"".join(out))

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
        self.transport.write(data)
        return w


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
            raise UpstreamConnectError(f"connect to {self.host}:{self.port}: {exc}") from None
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
