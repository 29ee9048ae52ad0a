"""The seam between the router and an engine: `EngineTransport` (one engine's requests)
and `EngineResponse` (one answer, its body as it arrives), with an in-memory
implementation for tests that need no sockets. The HTTP/1.1 implementation is
`ramjet.transport.http1.EnginePool`.

The contract (every implementation keeps it; `ramjet.proxy.forward` relies on nothing
else):

- **Request framing.** `request(method, path_qs, headers, body)` sends one whole request:
  `headers` are sent as given (already cleaned, `ramjet.proxy.headers`; no Host,
  Content-Length or Transfer-Encoding among them), the body with its length. It returns
  once the response's status and headers arrived; nothing of the body need have.
- **Response framing.** The body is handed over as payload bytes, never framing: a
  chunked body is de-chunked, a length-framed one ends at its length, one with neither
  ends at the connection's close. Bytes are otherwise unchanged (no decompression).
  `content_length` is the declared length, or None. `read_nowait()` returns every byte
  buffered now in one piece (b"" if none); `readany(idle_s)` waits for the next bytes,
  returns b"" at the end of the body, and raises `TimeoutError` when nothing came within
  `idle_s`. `at_eof()`: the body ended and every byte of it was read.
- **Direct relay (optional).** `set_sink(sink)` offers later body pieces to `sink` (a
  callable that returns True when it wrote the piece to the client) before they are
  buffered; a piece it takes is not read again. An implementation may ignore the sink
  (every piece is then buffered and read as usual); HTTP/1.1's uses it
  (`ramjet.transport.http1`, which also says when a piece is never offered).
- **Backpressure.** An implementation stops reading the engine while its buffer of unread
  body bytes is full, and resumes when the reader takes them.
- **Abort.** `close()` on a response whose body has not ended aborts the engine's request
  (HTTP/1.1: its connection is closed, never reused); a reader waiting on it is woken
  with `UpstreamClosed`. `close()` after the end is free and required (it returns the
  connection to the pool). Cancelling a `request` call aborts it the same way.
- **Error kinds.** Every failure is an `OSError`:
  `UpstreamConnectError`: nothing was sent (refused, unreachable, not connected in time);
  safe to retry anywhere. Its `refused` is True when the engine's host refused the
  connection (nothing listens: the engine is gone) and False for the other causes.
  `UpstreamClosed`: the engine closed or broke the exchange, or answered something that
  is not HTTP; it may have seen the request.
  Timeouts other than connect belong to the caller (`asyncio.timeout` around `request`,
  `idle_s` on reads), and raise `TimeoutError`.
- `close()` on the transport ends its idle connections; requests in flight keep theirs
  until their responses are closed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from ramjet.errors import ProxyError


def http_url(url: str) -> URL:
    """`url` parsed: ValueError unless it is http(s)://host[:port][/path][?query] with no
    fragment (an engine's, a pull target's or a push URL)."""
    try:
        u = URL(url)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"not an http(s) URL: {url!r} ({exc})") from None
    if u.scheme not in ("http", "https") or not u.host or u.fragment:
        raise ValueError(f"not http(s)://host[:port][/path]: {url!r}")
    return u


class UpstreamConnectError(ProxyError, OSError):
    """The connection to the engine could not be made (refused, unreachable, timed out).
    `refused`: the engine's host answered that nothing listens on the port (the engine's
    process is gone), rather than not answering at all."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class UpstreamClosed(ProxyError, OSError):
    """The engine closed or broke the connection, or answered something not HTTP/1.x."""


class EngineResponse(Protocol):
    """One engine answer (see the module docstring for the contract)."""

    @property
    def status(self) -> int: ...
    @property
    def reason(self) -> str: ...
    @property
    def headers(self) -> CIMultiDictProxy[str]: ...
    @property
    def content_length(self) -> int | None: ...

    def at_eof(self) -> bool: ...
    def read_nowait(self) -> bytes: ...
    async def readany(self, idle_s: float | None = None) -> bytes: ...
    def set_sink(self, sink: Callable[[bytes], bool] | None) -> None: ...
    def close(self) -> None: ...


class EngineTransport(Protocol):
    """Requests to one engine (see the module docstring for the contract)."""

    async def request(
        self, method: str, path_qs: str, headers: Iterable[tuple[str, str]], body: bytes
    ) -> EngineResponse: ...

    async def close(self) -> None: ...


# -- in memory --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MemoryRequest:
    """What a `MemoryTransport` was sent."""

    method: str
    path_qs: str
    headers: tuple[tuple[str, str], ...]
    body: bytes


@dataclass(slots=True)
class MemoryReply:
    """What the engine answers: status, headers and the body's pieces. `body` is bytes
    (one piece) or an async iterator of pieces; an iterator that raises `UpstreamClosed`
    cuts the body there, one that stops waiting stalls it."""

    status: int = 200
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes | AsyncIterator[bytes] = b""
    reason: str = "OK"


Handler = Callable[[MemoryRequest], Awaitable[MemoryReply]]
"""The engine: answers a request (or raises `UpstreamConnectError` / `UpstreamClosed`,
which `request` raises as they are; sleeping in it is a slow engine)."""


class MemoryResponse:
    """An `EngineResponse` fed from a `MemoryReply` by a task on the running loop."""

    def __init__(self, reply: MemoryReply, on_abort: Callable[[], None]) -> None:
        self.status = reply.status
        self.reason = reply.reason
        self.headers = CIMultiDictProxy(CIMultiDict(reply.headers))
        body = reply.body
        length = self.headers.get("Content-Length")
        self.content_length = int(length) if length is not None else None
        if isinstance(body, bytes) and self.content_length is None:
            self.content_length = len(body)
        self._buf: list[bytes] = []
        self._eof = False
        self._error: BaseException | None = None
        self._on_abort = on_abort
        self._more = asyncio.Event()
        self._feeder: asyncio.Task[None] | None = None
        if isinstance(body, bytes):
            if body:
                self._buf.append(body)
            self._eof = True
        else:
            self._feeder = asyncio.ensure_future(self._feed(body))

    async def _feed(self, pieces: AsyncIterator[bytes]) -> None:
        try:
            async for piece in pieces:
                if piece:
                    self._buf.append(piece)
                    self._more.set()
            self._eof = True
        except UpstreamClosed as exc:
            self._error = exc
        self._more.set()

    def at_eof(self) -> bool:
        return self._eof and not self._buf

    def set_sink(self, sink: Callable[[bytes], bool] | None) -> None:
        """Ignored: every piece is buffered (the contract's sink is optional)."""

    def read_nowait(self) -> bytes:
        data = b"".join(self._buf)
        self._buf.clear()
        return data

    async def readany(self, idle_s: float | None = None) -> bytes:
        while not self._buf:
            if self._eof:
                return b""
            if self._error is not None:
                raise self._error
            self._more.clear()
            async with asyncio.timeout(idle_s):
                await self._more.wait()
        return self.read_nowait()

    def close(self) -> None:
        if not self._eof and self._error is None:
            self._error = UpstreamClosed("response closed")
            self._on_abort()
        if self._feeder is not None and not self._feeder.done():
            self._feeder.cancel()
        self._more.set()


class MemoryTransport:
    """An `EngineTransport` whose engine is a coroutine (`handler`), for unit tests of
    the forward path without sockets. `requests`: every request sent, in order;
    `aborted`: responses closed before their body ended; `closed`: `close()` was called."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[MemoryRequest] = []
        self.aborted = 0
        self.closed = False

    def _abort(self) -> None:
        self.aborted += 1

    async def request(
        self, method: str, path_qs: str, headers: Iterable[tuple[str, str]], body: bytes
    ) -> MemoryResponse:
        if self.closed:
            raise UpstreamClosed("transport closed")
        req = MemoryRequest(method, path_qs, tuple(headers), body)
        self.requests.append(req)
        reply = await self.handler(req)
        return MemoryResponse(reply, self._abort)

    async def close(self) -> None:
        self.closed = True


async def fetch(
    transport: EngineTransport,
    method: str,
    path_qs: str,
    *,
    timeout_s: float,
    headers: Iterable[tuple[str, str]] = (),
    body: bytes = b"",
    max_bytes: int = 1 << 20,
) -> tuple[int, bytes]:
    """One whole small exchange (a probe, `/v1/models`, a metrics scrape, a control
    POST): sends `headers` and `body`, returns the status and the whole answer body,
    within `timeout_s` in all (else `TimeoutError`); a body over `max_bytes` is
    `UpstreamClosed`. The response is always closed (aborted if unfinished)."""
    status, _, data = await exchange(
        transport, method, path_qs, timeout_s=timeout_s, headers=headers, body=body,
        max_bytes=max_bytes,
    )  # fmt: skip
    if data is None:
        raise UpstreamClosed(f"{path_qs}: answer over {max_bytes} bytes")
    return status, data


async def exchange(
    transport: EngineTransport,
    method: str,
    path_qs: str,
    *,
    timeout_s: float,
    headers: Iterable[tuple[str, str]] = (),
    body: bytes = b"",
    max_bytes: int,
    read_status: int | None = None,
) -> tuple[int, CIMultiDictProxy[str], bytes | None]:
    """`fetch` with the answer's headers: (status, headers, body), the body None when it
    passed `max_bytes`, or when `read_status` is given and the status is another (the
    body left unread). Within `timeout_s` in all; the response always closed."""
    async with asyncio.timeout(timeout_s):
        resp = await transport.request(method, path_qs, headers, body)
        try:
            if read_status is not None and resp.status != read_status:
                return resp.status, resp.headers, None
            return resp.status, resp.headers, await read_body(resp, max_bytes)
        finally:
            resp.close()


async def read_body(resp: EngineResponse, max_bytes: int) -> bytes | None:
    """The rest of `resp`'s body, or None as soon as it passes `max_bytes` (the rest is
    left unread; closing the response then aborts it). No timeout of its own: the
    caller's `asyncio.timeout` bounds it (`fetch`)."""
    parts: list[bytes] = []
    size = 0
    while piece := resp.read_nowait() or await resp.readany():
        size += len(piece)
        if size > max_bytes:
            return None
        parts.append(piece)
    return b"".join(parts)
