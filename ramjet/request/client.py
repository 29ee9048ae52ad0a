"""The client side of a completion request, whichever server read it.

The two completion routes are served by `ramjet.app.fast_server` (an asyncio protocol
on httptools) when the request qualifies, else by aiohttp. The router's request path
(`ramjet.app.router`, `ramjet.request.admission`, `ramjet.proxy`) reads either through one
seam, `ClientExchange`: the request's head and body, its connection's transport and
write state, and `respond`, which starts the streamed answer (`ClientResponse`). Each
server has one adapter: `FastRequest` (the fast server's request itself) and
`AiohttpExchange` (around aiohttp's `web.Request`). Nothing on the path asks which one
it has.

`FastRequest` is a request whose head and whole body have arrived (the protocol reads
the body before the router sees it, under `timeouts.body_s`). `FastResponse` is the
streamed answer to it: an aiohttp `StreamResponse` whose `write`/`write_eof` frame the
body (Content-Length or chunked, as aiohttp would choose) and write straight to the
connection, the headers leaving with the first body piece. Its head follows aiohttp's
rules (Date, Server, a default Content-Type, `Connection: close` when the connection
will not be kept, no body framing for 1xx/204/304), so a client cannot tell the two
servers apart. A header name or value with CR or LF is refused (`ValueError`) before
anything is written, as aiohttp refuses it. The framing itself, and the relay's direct
writes of SSE pieces (`ClientResponse.direct`), are `ramjet.request.framing`'s
(compiled; this module is not, since its responses subclass aiohttp's class).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from ramjet.request.framing import BodyFramer, Connection, no_body, serialize_head


class BodyReader(Protocol):
    """A request body as it arrives: aiohttp's `StreamReader`, or `WholeBody`."""

    def is_eof(self) -> bool: ...
    def exception(self) -> BaseException | None: ...
    def read_nowait(self, n: int = -1) -> bytes: ...
    async def readany(self) -> bytes: ...


class WritePause(Protocol):
    """The connection's write state: paused while its buffer is past the high mark."""

    @property
    def writing_paused(self) -> bool: ...


class ClientResponse(web.StreamResponse):
    """The streamed answer to a `ClientExchange` (`ClientExchange.respond`): aiohttp's
    `StreamResponse` (`write`, `write_eof`, `force_close`, `headers`), ready to write as
    made, plus what the relay needs of it. Its headers leave with the first body piece."""

    @property
    def direct(self) -> tuple[BodyFramer, Connection] | None:
        """The framing and connection the relay writes body pieces through from the engine
        connection's callback (`ramjet.request.framing.BodyFramer.write_now`); None: every
        piece goes through `write`."""
        return None


class ClientExchange(Protocol):
    """What the router and the relay need of the client side of one request (see the
    module docstring)."""

    @property
    def method(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def path_qs(self) -> str: ...
    @property
    def headers(self) -> CIMultiDictProxy[str]: ...
    @property
    def raw_headers(self) -> tuple[tuple[bytes, bytes], ...]: ...
    @property
    def content_length(self) -> int | None: ...
    @property
    def content(self) -> BodyReader: ...
    @property
    def transport(self) -> asyncio.Transport | None:
        """The client's connection (None once it is gone, or for none at all)."""
        ...

    @property
    def protocol(self) -> WritePause: ...
    @property
    def budgeted(self) -> bool:
        """Its body was charged to the body budget by the server that read it
        (`ramjet.request.admission.charged_here`)."""
        ...

    def respond(
        self, status: int, reason: str, headers: CIMultiDict[str], length: int | None
    ) -> ClientResponse:
        """The streamed answer, `length` its body's declared length (None: chunked)."""
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
        "budgeted",
        "content",
        "content_length",
        "headers",
        "keep_alive",
        "method",
        "path",
        "path_qs",
        "protocol",
        "raw_headers",
        "response",
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
        self.budgeted = False
        """Its body is charged to the body budget by the server that read it
        (`ramjet.request.admission.charged_here`)."""
        self.response: FastResponse | None = None
        """The streamed answer `respond` made, if any (`ramjet.app.fast_server` tells a
        streamed answer from a whole one by it)."""

    def respond(
        self, status: int, reason: str, headers: CIMultiDict[str], length: int | None
    ) -> FastResponse:
        resp = self.response = FastResponse(self, status, reason, headers, length)
        return resp


class AiohttpExchange:
    """aiohttp's `web.Request` as a `ClientExchange` (aiohttp's server's adapter)."""

    __slots__ = (
        "_request",
        "content",
        "content_length",
        "headers",
        "method",
        "path",
        "path_qs",
        "protocol",
        "raw_headers",
    )

    budgeted = False

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.method = request.method
        self.path, self.path_qs = request.path, request.path_qs
        self.headers = request.headers
        self.raw_headers = request.raw_headers
        self.content_length = request.content_length
        self.content: BodyReader = request.content
        self.protocol: WritePause = request.protocol

    @property
    def transport(self) -> asyncio.Transport | None:
        return self._request.transport

    def respond(
        self, status: int, reason: str, headers: CIMultiDict[str], length: int | None
    ) -> AiohttpResponse:
        resp = AiohttpResponse(self._request, status, reason, headers)
        if length is not None:
            resp.content_length = length
        return resp


class AiohttpResponse(ClientResponse):
    """A streamed answer on aiohttp's server, prepared at its first write, whose headers
    leave in the same write as the first body piece (aiohttp's `Response` does this;
    `StreamResponse` sends them at `prepare`): one syscall fewer per response, nothing
    else changes (a body-less end still sends them)."""

    _send_headers_immediately = False

    def __init__(
        self, request: web.Request, status: int, reason: str, headers: CIMultiDict[str]
    ) -> None:
        super().__init__(status=status, reason=reason, headers=headers)
        self._request = request

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self.prepared:
            await self.prepare(self._request)
        await super().write(data)

    async def write_eof(self, data: bytes = b"") -> None:
        if not self.prepared:
            await self.prepare(self._request)
        await super().write_eof(data)


def serialize_response(resp: web.StreamResponse, keep_alive: bool) -> bytes:
    """A whole (unprepared) `web.Response` as bytes, head and body, as aiohttp writes it;
    `keep_alive` is False when the connection closes after it."""
    body = resp.body if isinstance(resp, web.Response) else None
    data = body if isinstance(body, bytes) else b""
    headers = CIMultiDict(resp.headers)
    headers.popall("Content-Length", None)
    headers.popall("Transfer-Encoding", None)
    head, _ = serialize_head(resp.status, resp.reason, headers, len(data), keep_alive)
    return head + (b"" if no_body(resp.status) else data)


class FastResponse(ClientResponse):
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
        self.framer = BodyFramer(status, length)
        """The body's framing and the relay's direct writes (`ramjet.request.framing`)."""

    @property
    def done(self) -> bool:
        """The whole body was written (the connection may carry the next request)."""
        return self._eof_sent

    @property
    def conn(self) -> Connection:
        return self._conn

    @property
    def direct(self) -> tuple[BodyFramer, Connection]:
        return self.framer, self._conn

    def _frame(self, data: bytes, eof: bool) -> bytes:
        framer = self.framer
        if framer.head is None:
            keep = self._request_keep_alive and self._keep_alive is not False
            framer.set_head(
                *serialize_head(self.status, self.reason, self._headers, self._length, keep)
            )
            self._keep_alive = keep
        return framer.frame(data, eof)

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

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._eof_sent:
            raise RuntimeError("Cannot call write() after write_eof()")
        await self._send(self._frame(bytes(data), False))

    async def write_eof(self, data: bytes = b"") -> None:
        if self._eof_sent:
            return
        framed = self._frame(data, True)
        self._eof_sent = self.framer.eof_sent = True
        await self._send(framed)
