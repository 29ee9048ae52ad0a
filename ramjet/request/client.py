"""The client side of a completion request, whichever server read it.

The two completion routes are served by `ramjet.app.fast_server` (an asyncio protocol
on httptools) when the request qualifies, else by aiohttp; the router's request path
(`ramjet.app.router`, `ramjet.request.admission`, `ramjet.proxy`) reads either through
the same attributes: `ClientRequest` is `web.Request | FastRequest`.

`FastRequest` is a request whose head and whole body have arrived (the protocol reads
the body before the router sees it, under `timeouts.body_s`). `FastResponse` is the
streamed answer to it: an aiohttp `StreamResponse` whose `write`/`write_eof` frame the
body (Content-Length or chunked, as aiohttp would choose) and write straight to the
connection, the headers leaving with the first body piece. Its head follows aiohttp's
rules (Date, Server, a default Content-Type, `Connection: close` when the connection
will not be kept, no body framing for 1xx/204/304), so a client cannot tell the two
servers apart. A header name or value with CR or LF is refused (`ValueError`) before
anything is written, as aiohttp refuses it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol, TypeAlias

from aiohttp import web
from aiohttp.http import SERVER_SOFTWARE
from multidict import CIMultiDict, CIMultiDictProxy


class Connection(Protocol):
    """What a `FastResponse` writes through (`ramjet.app.fast_server.FastProtocol`)."""

    transport: asyncio.Transport | None
    writing_paused: bool
    response_started: bool

    async def drain(self) -> None:
        """Return once the transport takes writes again (raises if the client is gone)."""
        ...


class WholeBody:
    """A body that arrived whole: the subset of aiohttp's `StreamReader` the admission
    reads (`ramjet.request.admission.Admission.read_body`)."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data = data

    def is_eof(self) -> bool:
        return True

    def exception(self) -> BaseException | None:
        return None

    def read_nowait(self, n: int = -1) -> bytes:
        data, self._data = self._data, b""
        return data

    async def readany(self) -> bytes:
        return self.read_nowait()


class FastRequest:
    """A POST to a completion route, head and body read (see the module docstring)."""

    __slots__ = (
        "content",
        "content_length",
        "headers",
        "keep_alive",
        "method",
        "path",
        "path_qs",
        "protocol",
        "raw_headers",
        "transport",
    )

    def __init__(
        self,
        protocol: Connection,
        path: str,
        raw_headers: tuple[tuple[bytes, bytes], ...],
        headers: CIMultiDictProxy[str],
        body: bytes,
        keep_alive: bool,
    ) -> None:
        self.protocol = protocol
        self.transport = protocol.transport
        self.method = "POST"
        self.path = self.path_qs = path
        self.raw_headers = raw_headers
        self.headers = headers
        self.content_length: int | None = len(body)
        self.content = WholeBody(body)
        self.keep_alive = keep_alive


ClientRequest: TypeAlias = web.Request | FastRequest

_EMPTY_BODY = frozenset({204, 304})
FRAMING_BYTES = 64
"""Upper bound on what a write adds to a body piece (chunk size line, CRLFs, terminator)."""
_date_cache: tuple[int, str] = (0, "")


def http_date() -> str:
    """The Date header's value (formatted once a second, as aiohttp does)."""
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(now)))
    return _date_cache[1]


def _no_body(status: int) -> bool:
    return status in _EMPTY_BODY or 100 <= status < 200


def serialize_head(
    status: int, reason: str, headers: CIMultiDict[str], length: int | None, keep_alive: bool
) -> tuple[bytes, bool]:
    """The response head as aiohttp would write it for an HTTP/1.1 POST, and whether the
    body is chunked. Adds Content-Length or Transfer-Encoding, the default Content-Type,
    Date, Server and `Connection: close` (when not `keep_alive`) to `headers`."""
    chunked = False
    if _no_body(status):
        if status != 304:
            headers.popall("Content-Length", None)
        headers.popall("Transfer-Encoding", None)
    else:
        if length is None:
            chunked = True
            headers["Transfer-Encoding"] = "chunked"
        else:
            headers["Content-Length"] = str(length)
        if length != 0:
            headers.setdefault("Content-Type", "application/octet-stream")
    if "Date" not in headers:
        headers["Date"] = http_date()
    headers.setdefault("Server", SERVER_SOFTWARE)
    if "Connection" not in headers and not keep_alive:
        headers["Connection"] = "close"
    lines = [f"HTTP/1.1 {status} {reason}"]
    for k, v in headers.items():
        if "\r" in k or "\n" in k or "\r" in v or "\n" in v:
            raise ValueError("Newline or carriage return character detected in a header")
        lines.append(f"{k}: {v}")
    lines.append("\r\n")
    return "\r\n".join(lines).encode("utf-8", "surrogateescape"), chunked


def serialize_response(resp: web.StreamResponse, keep_alive: bool) -> bytes:
    """A whole (unprepared) `web.Response` as bytes, head and body, as aiohttp writes it;
    `keep_alive` is False when the connection closes after it."""
    body = resp.body if isinstance(resp, web.Response) else None
    data = body if isinstance(body, bytes) else b""
    headers = CIMultiDict(resp.headers)
    headers.popall("Content-Length", None)
    headers.popall("Transfer-Encoding", None)
    head, _ = serialize_head(resp.status, resp.reason, headers, len(data), keep_alive)
    return head + (b"" if _no_body(resp.status) else data)


class FastResponse(web.StreamResponse):
    """A streamed answer on a `FastRequest`'s connection (see the module docstring)."""

    def __init__(
        self,
        request: FastRequest,
        status: int,
        reason: str | None,
        headers: CIMultiDict[str],
        length: int | None,
    ) -> None:
        super().__init__(status=status, reason=reason)
        self._headers = headers
        self._conn = request.protocol
        self._request_keep_alive = request.keep_alive
        self._length = length
        self._head: bytes | None = None
        self._chunked_body = False
        self._left = length
        self._empty = _no_body(status)
        self.started = False

    @property
    def done(self) -> bool:
        """The whole body was written (the connection may carry the next request)."""
        return self._eof_sent

    def _frame(self, data: bytes, eof: bool) -> bytes:
        if self._head is None:
            keep = self._request_keep_alive and self._keep_alive is not False
            self._head, self._chunked_body = serialize_head(
                self.status, self.reason, self._headers, self._length, keep
            )
            self._keep_alive = keep
        out = b""
        if not self.started:
            out, self.started = self._head, True
        if self._empty:
            data = b""
        elif self._chunked_body:
            if data:
                data = b"%x\r\n%b\r\n" % (len(data), data)
            if eof:
                data += b"0\r\n\r\n"
        elif self._left is not None:
            if len(data) > self._left:
                data = data[: self._left]
            self._left -= len(data)
        return out + data if out else data

    async def _send(self, data: bytes) -> None:
        conn = self._conn
        transport = conn.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        if data:
            conn.response_started = True
            transport.write(data)
        if conn.writing_paused:
            await conn.drain()

    def write_now(self, data: bytes, high: int) -> bool:
        """Write a body piece (not the first: the head has gone) at once, if that cannot
        wait: the connection is open, not paused, and its buffer stays within `high`
        bytes with it; else write nothing and return False (`write` would wait). For
        `ramjet.proxy.stream`'s direct relay, called from the engine connection's
        callback, so it never raises for a gone client (False: the caller's `write`
        sees it)."""
        conn = self._conn
        transport = conn.transport
        if (
            self._eof_sent
            or not self.started
            or conn.writing_paused
            or transport is None
            or transport.is_closing()
            or transport.get_write_buffer_size() + len(data) + FRAMING_BYTES > high
        ):
            return False
        transport.write(self._frame(data, False))
        return True

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._eof_sent:
            raise RuntimeError("Cannot call write() after write_eof()")
        await self._send(self._frame(bytes(data), False))

    async def write_eof(self, data: bytes = b"") -> None:
        if self._eof_sent:
            return
        framed = self._frame(data, True)
        self._eof_sent = True
        await self._send(framed)
