"""A `FastResponse`'s body framing and its direct writes, compiled (`ramjet.native`).

`ramjet.request.client.FastResponse` is an aiohttp `StreamResponse` subclass, so it
stays interpreted; what it does per body piece lives here instead: `BodyFramer` holds a
response's framing state (its head, chunked or length-framed, what is left of a length,
no body for 1xx/204/304, whether the head has gone and the end been written) and frames
each piece, and `write_now` writes a relayed piece straight to the connection when
nothing has to wait (`ramjet.proxy.stream`'s relay from the engine connection's
callback, once per SSE chunk). The head is `serialize_head`'s, aiohttp's rules.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from aiohttp.http import SERVER_SOFTWARE
from multidict import CIMultiDict

_EMPTY_BODY = frozenset({204, 304})
FRAMING_BYTES = 64
"""Upper bound on what a write adds to a body piece (chunk size line, CRLFs, terminator)."""
_date_cache: tuple[int, str] = (0, "")
_SIZE_LINES: list[bytes] = [b"%x\r\n" % n for n in range(4096)]
"""A chunk's size line by its size, for the sizes SSE events have: framing a relayed piece
is a join of three (`BodyFramer.frame`, once per SSE chunk), not a `%` format (which
builds a tuple and parses its format string: about twice the cost)."""


class Connection(Protocol):
    """What a `FastResponse` writes through (`ramjet.app.fast_server.FastProtocol`)."""

    transport: asyncio.Transport | None
    writing_paused: bool
    response_started: bool

    async def drain(self) -> None:
        """Return once the transport takes writes again (raises if the client is gone)."""
        ...


def http_date() -> str:
    """The Date header's value (formatted once a second, as aiohttp does)."""
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(now)))
    return _date_cache[1]


def no_body(status: int) -> bool:
    return status in _EMPTY_BODY or 100 <= status < 200


def serialize_head(
    status: int, reason: str, headers: CIMultiDict[str], length: int | None, keep_alive: bool
) -> tuple[bytes, bool]:
    """The response head as aiohttp would write it for an HTTP/1.1 POST, and whether the
    body is chunked. Adds Content-Length or Transfer-Encoding, the default Content-Type,
    Date, Server and `Connection: close` (when not `keep_alive`) to `headers`."""
    chunked = False
    if no_body(status):
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


class BodyFramer:
    """One response's framing (see the module docstring). `head` is None until the
    response sets it (`set_head`, at its first write: the keep-alive decision is made
    then); the first framed piece carries it."""

    __slots__ = ("chunked", "empty", "eof_sent", "head", "left", "sent", "started")

    def __init__(self, status: int, length: int | None) -> None:
        self.head: bytes | None = None
        self.chunked = False
        self.left = length
        self.empty = no_body(status)
        self.started = False
        self.eof_sent = False
        self.sent = 0
        """Bytes framed so far, head included (the access log's `%b`)."""

    def set_head(self, head: bytes, chunked: bool) -> None:
        self.head, self.chunked = head, chunked

    def frame(self, data: bytes, eof: bool) -> bytes:
        """`data` framed for the wire (after the head, for the first piece)."""
        out = b""
        if not self.started:
            assert self.head is not None
            out, self.started = self.head, True
        if self.empty:
            data = b""
        elif self.chunked:
            if data:
                n = len(data)
                line = _SIZE_LINES[n] if n < len(_SIZE_LINES) else b"%x\r\n" % n
                data = b"".join((line, data, b"\r\n"))
            if eof:
                data += b"0\r\n\r\n"
        elif self.left is not None:
            if len(data) > self.left:
                data = data[: self.left]
            self.left -= len(data)
        out = out + data if out else data
        self.sent += len(out)
        return out

    def write_now(self, conn: Connection, data: bytes, high: int) -> bool:
        """Write a body piece (not the first: the head has gone) at once, if that cannot
        wait: the connection is open, not paused, and its buffer stays within `high`
        bytes with it; else write nothing and return False (a `write` would wait). Never
        raises for a gone client (False: the caller's `write` sees it)."""
        transport = conn.transport
        if (
            self.eof_sent
            or not self.started
            or conn.writing_paused
            or transport is None
            or transport.is_closing()
            or transport.get_write_buffer_size() + len(data) + FRAMING_BYTES > high
        ):
            return False
        transport.write(self.frame(data, False))
        return True
