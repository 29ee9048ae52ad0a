"""One forward's handle and record: `Exchange` (so shutdown can end it), `Attempt` and
`ForwardResult` (what happened, for the accounting), `ResponseTail` (the last bytes the
client got), and `UpstreamError` (an attempt that failed, by kind).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from ramjet.errors import ProxyError
from ramjet.transport.base import EngineResponse
from ramjet.types import EngineId


class UpstreamError(ProxyError):
    """An attempt failed; `kind` is a metric label (connect, first_byte_timeout, ...)."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


class ResponseTail:
    """The last `limit` bytes (at least) of a body, kept without copying the body: the
    chunks themselves are held, and a chunk is dropped once the later ones alone cover
    `limit` bytes. O(1) amortised per chunk; the bytes sent are never touched. The
    accounting reads the engine's final `usage` from here (`ramjet.decisions.log`)."""

    __slots__ = ("_chunks", "_size", "limit")

    def __init__(self, limit: int = 16 * 1024) -> None:
        self.limit = limit
        self._chunks: collections.deque[bytes] = collections.deque()
        self._size = 0

    def add(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._size += len(chunk)
        while len(self._chunks) > 1 and self._size - len(self._chunks[0]) >= self.limit:
            self._size -= len(self._chunks.popleft())

    def bytes(self) -> bytes:
        """The kept bytes (the last `limit`, or the whole body if shorter)."""
        return b"".join(self._chunks)[-self.limit :]


@dataclass(init=False, slots=True)
class Attempt:
    engine: EngineId
    status: int | None = None
    error: str | None = None

    def __init__(
        self,
        engine: EngineId,
        status: int | None = None,
        error: str | None = None,
    ) -> None:
        self.engine = engine
        self.status = status
        self.error = error


@dataclass(init=False, slots=True)
class ForwardResult:
    engine: EngineId | None = None
    """The engine whose response reached the client (None if none did)."""
    status: int = 0
    attempts: list[Attempt] = field(default_factory=list)
    ttft_s: float | None = None
    """From forwarding start to the first response byte written to the client."""
    end: str = "ok"
    """ok, upstream_<kind>, client_gone, slow_reader, shutdown, no_engine."""
    bytes_out: int = 0
    engine_headers: dict[str, str] = field(default_factory=dict)
    tail: ResponseTail = field(default_factory=lambda: ResponseTail())
    """The last bytes of the body sent to the client (the engine's usage is there)."""

    def __init__(
        self,
        engine: EngineId | None = None,
        status: int = 0,
        attempts: list[Attempt] | None = None,
        ttft_s: float | None = None,
        end: str = "ok",
        bytes_out: int = 0,
        engine_headers: dict[str, str] | None = None,
        tail: ResponseTail | None = None,
    ) -> None:
        self.engine = engine
        self.status = status
        self.attempts = [] if attempts is None else attempts
        self.ttft_s = ttft_s
        self.end = end
        self.bytes_out = bytes_out
        self.engine_headers = {} if engine_headers is None else engine_headers
        self.tail = ResponseTail() if tail is None else tail


class Exchange:
    """Handle on one in-flight forward, so shutdown can end it."""

    __slots__ = ("shutdown", "upstream")

    def __init__(self) -> None:
        self.upstream: EngineResponse | None = None
        self.shutdown = False

    def abort(self) -> None:
        self.shutdown = True
        if self.upstream is not None:
            self.upstream.close()
