"""Forwarding: one client request to one engine at a time, retries, streaming.

Per attempt, nothing reaches the client until the engine's first body byte (or the end
of an empty body) has arrived. Until then a failure is invisible to the client and the
request may be retried on another engine:

  connect ─► headers ─► first body chunk ─► (client response prepared) ─► chunks ─► end
  └──────── first_byte_s deadline ─────────┘                             idle_s each

- Retried (on an engine not tried yet, at most `retry.max_attempts` attempts, and only
  while the retry budget allows: concurrent retries ≤ max(min_retries, budget_ratio ×
  active requests)): refused/failed connections, disconnects before the first byte,
  first-byte timeouts, and 502/503/504/429 statuses. Anything else is passed through.
- After the first byte was sent nothing is retried. A stream cut by the engine (or by an
  idle timeout, or by shutdown) ends for an SSE client with an `event: error` whose data
  is an OpenAI-style error object, then the connection closes; never `data: [DONE]`.
  A non-SSE body cut short closes the connection so the client sees a truncated body.
- Writes to the client wait on the transport's high-water mark (`stream_buffer_bytes`),
  which pauses the upstream read (aiohttp stops reading the engine's socket when its
  own buffer fills); a write blocked longer than `send_s` ends the exchange.
- If the client goes away, the handler task is cancelled (server runs with
  `handler_cancellation`), and the upstream response is closed, which aborts the
  engine's request by closing its connection.

Headers: hop-by-hop headers (RFC 9110 §7.6.1, plus any named in `Connection`) are
stripped both ways; client `X-Ramjet-*` headers never reach an engine, and engines'
`X-Ramjet-*` response headers are kept for accounting instead of reaching the client.
Bodies are forwarded byte-exact (no decompression, no re-encoding).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from ramjet.config import PolicyConfig
from ramjet.engines import EngineState, Fleet, Outcome, Ticket, classify_status
from ramjet.metrics import RouterMetrics
from ramjet.types import EngineId

log = logging.getLogger(__name__)

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
INTERNAL_PREFIX = "x-ramjet-"
_RETRY_STATUSES = frozenset({429, 502, 503, 504})


def _connection_tokens(headers: CIMultiDictProxy[str]) -> set[str]:
    return {t.strip().lower() for v in headers.getall("Connection", []) for t in v.split(",")}


_DROP_TO_ENGINE = HOP_BY_HOP | {"host", "content-length", "expect"}
_DROP_TO_CLIENT = HOP_BY_HOP | {"content-length"}


def upstream_request_headers(client: CIMultiDictProxy[str], request_id: str) -> CIMultiDict[str]:
    """What the engine sees of the client's headers, plus the router's own."""
    drop = _DROP_TO_ENGINE
    if "Connection" in client:
        drop = drop | _connection_tokens(client)
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in client.items():
        lk = k.lower()
        if lk not in drop and not lk.startswith(INTERNAL_PREFIX):
            out.add(k, v)
    out["X-Ramjet-Request-Id"] = request_id
    return out


def client_response_headers(
    upstream: CIMultiDictProxy[str],
) -> tuple[CIMultiDict[str], dict[str, str]]:
    """Headers for the client, and the engine's `X-Ramjet-*` headers (for accounting)."""
    drop = _DROP_TO_CLIENT
    if "Connection" in upstream:
        drop = drop | _connection_tokens(upstream)
    out: CIMultiDict[str] = CIMultiDict()
    internal: dict[str, str] = {}
    for k, v in upstream.items():
        lk = k.lower()
        if lk.startswith(INTERNAL_PREFIX):
            internal[lk] = v
        elif lk not in drop:
            out.add(k, v)
    return out, internal


def error_body(message: str, type_: str, code: str) -> dict[str, object]:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def json_error(
    status: int,
    message: str,
    type_: str,
    code: str,
    *,
    retry_after_s: float | None = None,
    close: bool = False,
) -> web.Response:
    resp = web.json_response(error_body(message, type_, code), status=status)
    if retry_after_s is not None:
        resp.headers["Retry-After"] = str(max(1, int(retry_after_s + 0.999)))
    if close:
        resp.force_close()
    return resp


def parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # HTTP-date form: treat as unspecified


class UpstreamError(Exception):
    """An attempt failed; `kind` is a metric label (connect, first_byte_timeout, ...)."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


class RetryBudget:
    """Envoy's retry budget: concurrent retries ≤ max(min_retries, ratio × active)."""

    def __init__(self, ratio: float, min_retries: int) -> None:
        self.ratio = ratio
        self.min_retries = min_retries
        self.active = 0
        self.retrying = 0

    def has_room(self) -> bool:
        return self.retrying < max(self.min_retries, self.ratio * self.active)

    def try_acquire(self) -> bool:
        if self.has_room():
            self.retrying += 1
            return True
        return False

    def release(self) -> None:
        self.retrying -= 1


class ResponseTail:
    """The last `limit` bytes (at least) of a body, kept without copying the body: the
    chunks themselves are held, and a chunk is dropped once the later ones alone cover
    `limit` bytes. O(1) amortised per chunk; the bytes sent are never touched. The
    accounting reads the engine's final `usage` from here (`ramjet.decisions`)."""

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


@dataclass(slots=True)
class Attempt:
    engine: EngineId
    status: int | None = None
    error: str | None = None


@dataclass(slots=True)
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


class Exchange:
    """Handle on one in-flight forward, so shutdown can end it."""

    __slots__ = ("shutdown", "upstream")

    def __init__(self) -> None:
        self.upstream: aiohttp.ClientResponse | None = None
        self.shutdown = False

    def abort(self) -> None:
        self.shutdown = True
        if self.upstream is not None:
            self.upstream.close()


ChooseNext = Callable[[set[EngineId]], EngineState | None]

_FRAMING_BYTES = 64
"""Upper bound on what a write adds to a body piece (chunk size line, CRLFs, terminator)."""


class _Passthrough(web.StreamResponse):
    """A streamed response whose headers leave in the same write as the first body piece
    (aiohttp's `Response` does this; `StreamResponse` sends them at `prepare`): one
    syscall fewer per response, nothing else changes (a body-less end still sends them)."""

    _send_headers_immediately = False


class Proxy:
    def __init__(self, config: PolicyConfig, fleet: Fleet, metrics: RouterMetrics) -> None:
        self._cfg = config
        self._fleet = fleet
        self._metrics = metrics
        self.budget = RetryBudget(config.retry.budget_ratio, config.retry.min_retries)
        self._sessions: dict[EngineId, aiohttp.ClientSession] = {}

    async def start(self) -> None:
        t = self._cfg.timeouts
        for e in self._fleet.engines:
            connector = aiohttp.TCPConnector(
                limit=self._cfg.limits.connections_per_engine,
                limit_per_host=0,
                keepalive_timeout=30.0,
            )
            self._sessions[e.id] = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=t.connect_s),
                auto_decompress=False,
                skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),
                read_bufsize=64 * 1024,
            )

    async def close(self) -> None:
        for s in self._sessions.values():
            await s.close()
        self._sessions.clear()

    def session(self, engine: EngineId) -> aiohttp.ClientSession:
        return self._sessions[engine]

    def _gauge(self, e: EngineState) -> None:
        self._metrics.inflight_of(e.id).set(e.inflight_requests)
        self._metrics.inflight_prompt_tokens_of(e.id).set(e.inflight_prompt_tokens)

    async def forward(
        self,
        request: web.Request,
        body: bytes,
        first: EngineState,
        prompt_tokens: int,
        choose_next: ChooseNext,
        request_id: str,
        exchange: Exchange,
    ) -> tuple[web.StreamResponse, ForwardResult]:
        res = ForwardResult()
        headers = upstream_request_headers(request.headers, request_id)
        engine: EngineState | None = first
        tried: set[EngineId] = set()
        t0 = time.monotonic()
        retrying = False
        self.budget.active += 1
        try:
            while engine is not None:
                tried.add(engine.id)
                attempt = Attempt(engine.id)
                res.attempts.append(attempt)
                ticket = Ticket(engine, prompt_tokens)
                self._gauge(engine)
                nxt = None
                if len(res.attempts) < self._cfg.retry.max_attempts:
                    nxt = choose_next(tried)
                can_retry = nxt is not None and self.budget.has_room()
                try:
                    out = await self._attempt(
                        request,
                        body,
                        headers,
                        engine,
                        ticket,
                        attempt,
                        res,
                        exchange,
                        t0,
                        can_retry,
                    )
                finally:
                    ticket.close()
                    self._gauge(engine)
                    if retrying:
                        self.budget.release()
                        retrying = False
                if out is not None:
                    return out, res
                # The attempt failed before any byte reached the client: maybe retry.
                if nxt is None or exchange.shutdown:
                    break
                if not self.budget.try_acquire():
                    self._metrics.retries_denied.inc()
                    break
                retrying = True
                self._metrics.retries.labels(reason=attempt.error or str(attempt.status)).inc()
                engine = nxt
            return self._give_up(res), res
        finally:
            self.budget.active -= 1

    def _give_up(self, res: ForwardResult) -> web.StreamResponse:
        last = res.attempts[-1] if res.attempts else None
        kind = last.error if last else None
        if kind == "first_byte_timeout":
            res.status, res.end = 504, "upstream_first_byte_timeout"
            return json_error(
                504, "The engine did not answer in time.", "server_error", "upstream_timeout"
            )
        res.status, res.end = 503, f"upstream_{kind or 'unavailable'}"
        return json_error(
            503,
            "No engine could take the request; retry later.",
            "server_error",
            "engines_unavailable",
            retry_after_s=1.0,
        )

    async def _attempt(
        self,
        request: web.Request,
        body: bytes,
        headers: CIMultiDict[str],
        engine: EngineState,
        ticket: Ticket,
        attempt: Attempt,
        res: ForwardResult,
        exchange: Exchange,
        t0: float,
        can_retry: bool,
    ) -> web.StreamResponse | None:
        """One attempt. Returns the client response, or None if it may be retried."""
        t = self._cfg.timeouts
        session = self._sessions[engine.id]
        upstream: aiohttp.ClientResponse | None = None
        try:
            try:
                async with asyncio.timeout(t.first_byte_s):
                    upstream = await session.request(
                        request.method,
                        engine.url + request.rel_url.path_qs,
                        data=body,
                        headers=headers,
                        allow_redirects=False,
                    )
                    exchange.upstream = upstream
                    status = upstream.status
                    attempt.status = status
                    if status in _RETRY_STATUSES:
                        outcome = classify_status(status)
                        ra = parse_retry_after(upstream.headers.get("Retry-After"))
                        self._fleet.record(engine, outcome, ra)
                        kind = "backpressure" if outcome is Outcome.BACKPRESSURE else "status_5xx"
                        self._metrics.upstream_errors.labels(engine=engine.id, kind=kind).inc()
                        attempt.error = kind
                        if can_retry:
                            upstream.close()
                            return None
                    first = await upstream.content.readany()
            except TimeoutError:
                raise UpstreamError("first_byte_timeout") from None
            except aiohttp.ClientConnectorError as exc:
                raise UpstreamError("connect", str(exc)) from None
            except aiohttp.ConnectionTimeoutError as exc:
                raise UpstreamError("connect", str(exc)) from None
            except (aiohttp.ClientError, OSError) as exc:
                raise UpstreamError("disconnect", type(exc).__name__) from None
        except UpstreamError as exc:
            if upstream is not None:
                upstream.close()
            if exchange.shutdown:
                attempt.error = "shutdown"
                return None
            attempt.error = exc.kind
            self._fleet.record(engine, Outcome.FAILURE)
            self._metrics.upstream_errors.labels(engine=engine.id, kind=exc.kind).inc()
            return None
        ticket.first_byte()
        return await self._stream(request, upstream, first, engine, res, exchange, t0)

    async def _stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        first: bytes,
        engine: EngineState,
        res: ForwardResult,
        exchange: Exchange,
        t0: float,
    ) -> web.StreamResponse:
        t = self._cfg.timeouts
        status = upstream.status
        out_headers, res.engine_headers = client_response_headers(upstream.headers)
        out_headers["X-Ramjet-Engine"] = engine.id
        sse = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
        resp = _Passthrough(status=status, reason=upstream.reason, headers=out_headers)
        if upstream.content_length is not None:
            resp.content_length = upstream.content_length
        res.engine, res.status = engine.id, status
        if request.transport is not None:
            request.transport.set_write_buffer_limits(high=self._cfg.limits.stream_buffer_bytes)
        content = upstream.content
        # Without a Content-Length the body goes out chunked: the last piece and the
        # chunked terminator can leave in one write.
        open_ended = upstream.content_length is None
        tail = b"\n\n"
        try:
            await resp.prepare(request)
            chunk = first
            # Headers leave with the first piece (`_Passthrough`): count them against
            # the write buffer once.
            extra = _FRAMING_BYTES + sum(len(k) + len(v) + 4 for k, v in out_headers.items())
            while chunk:
                last = open_ended and content.at_eof()
                if not await self._send(request, resp, chunk, last, extra):
                    res.end = "slow_reader"
                    self._metrics.stream_errors.labels(reason="slow_reader").inc()
                    resp.force_close()
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
                extra = _FRAMING_BYTES
                if res.ttft_s is None:
                    res.ttft_s = time.monotonic() - t0
                res.bytes_out += len(chunk)
                res.tail.add(chunk)
                tail = chunk[-2:] if len(chunk) >= 2 else (tail + chunk)[-2:]
                if last:
                    break
                try:
                    # Everything the engine has delivered, in one piece; wait (under the
                    # idle timeout) only when nothing is buffered.
                    chunk = content.read_nowait()
                    if not chunk and not content.at_eof():
                        async with asyncio.timeout(t.idle_s):
                            chunk = await content.readany()
                except TimeoutError:
                    raise UpstreamError("idle_timeout") from None
                except (aiohttp.ClientError, OSError) as exc:
                    raise UpstreamError("disconnect", type(exc).__name__) from None
            if upstream.content_length is not None and res.bytes_out < upstream.content_length:
                raise UpstreamError("disconnect", "body shorter than Content-Length")
            await resp.write_eof()
            if status not in _RETRY_STATUSES:  # those were recorded on arrival
                self._fleet.record(engine, classify_status(status))
            return resp
        except UpstreamError as exc:
            reason = "shutdown" if exchange.shutdown else exc.kind
            res.end = f"upstream_{reason}"
            self._metrics.stream_errors.labels(reason=reason).inc()
            if not exchange.shutdown:
                self._fleet.record(engine, Outcome.FAILURE)
                self._metrics.upstream_errors.labels(engine=engine.id, kind=exc.kind).inc()
            await self._end_cut(request, resp, sse, tail, engine.id, reason)
            return resp
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            res.end = "client_gone"
            return resp
        finally:
            upstream.close()
            exchange.upstream = None

    async def _send(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        chunk: bytes,
        eof: bool,
        extra: int,
    ) -> bool:
        """Write `chunk` to the client (and end the body if `eof`); False if the client
        did not take it within `send_s`.

        A write only waits when the transport has paused writing, which happens when its
        buffer passes the high-water mark. A write that cannot get there (not paused, and
        the buffer plus the bytes written, `extra` being framing and headers, stays
        within the mark) cannot wait, so it needs no timer."""
        transport = request.transport
        write = resp.write_eof if eof else resp.write
        if (
            transport is not None
            and not request.protocol.writing_paused
            and transport.get_write_buffer_size() + len(chunk) + extra
            <= self._cfg.limits.stream_buffer_bytes
        ):
            await write(chunk)
            return True
        try:
            async with asyncio.timeout(self._cfg.timeouts.send_s):
                await write(chunk)
        except TimeoutError:
            return False
        return True

    async def _end_cut(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        sse: bool,
        tail: bytes,
        engine: EngineId,
        reason: str,
    ) -> None:
        resp.force_close()
        if not sse:
            if request.transport is not None:
                request.transport.abort()
            return
        msg = (
            "The router is shutting down; the stream was ended."
            if reason == "shutdown"
            else f"The engine stream ended early ({reason}); the response is incomplete."
        )
        sep = b"" if tail == b"\n\n" else b"\n\n"
        data = json.dumps(error_body(msg, "server_error", f"stream_{reason}")).encode()
        try:
            async with asyncio.timeout(self._cfg.timeouts.send_s):
                await resp.write(sep + b"event: error\ndata: " + data + b"\n\n")
                await resp.write_eof()
        except (TimeoutError, ConnectionError, aiohttp.ClientConnectionResetError):
            if request.transport is not None:
                request.transport.abort()
