"""`StreamWriter`: an engine's response, from its first body byte, to the client.

It writes through the two seams only: the client side is a `ClientExchange`
(`ramjet.request.client`; `respond` starts the answer, whichever server read the
request) and the engine side an `EngineResponse` (`ramjet.transport.base`). When the
answer offers direct writes (`ClientResponse.direct`, the fast server's), body pieces
go to the client from the engine connection's callback (`EngineResponse.set_sink`),
else every piece goes through the read loop below.

Nothing is retried once the first byte was sent (`ramjet.proxy.forward`). Then:

- Writes to the client wait on the transport's high-water mark (`stream_buffer_bytes`),
  which pauses the upstream read (`ramjet.transport.http1` stops reading the engine's socket
  when its own buffer fills); a write blocked longer than `send_s` ends the exchange (`slow_reader`).
- Each read takes everything the engine has delivered in one piece, waiting at most
  `idle_s` only when nothing is buffered. Bodies are forwarded byte-exact (no
  decompression, no re-encoding).
- A stream cut by the engine (or by an idle timeout, or by shutdown) ends for an SSE
  client with an `event: error` whose data is an OpenAI-style error object and a
  properly terminated chunked body, never `data: [DONE]`; the client's connection stays
  open for its next request (it was never announced closed, so closing it would lose
  that request). A non-SSE (or length-framed) body cut short closes the connection so
  the client sees a truncated body.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
from aiohttp import web

from ramjet.config import PolicyConfig
from ramjet.fleet.engines import EngineState, Fleet, Outcome, classify_status
from ramjet.metrics import RouterMetrics
from ramjet.proxy.exchange import Exchange, ForwardResult, UpstreamError
from ramjet.proxy.headers import client_response_headers
from ramjet.proxy.retries import RETRY_STATUSES
from ramjet.request.client import ClientExchange, ClientResponse
from ramjet.request.framing import FRAMING_BYTES, BodyFramer, Connection
from ramjet.request.openai_errors import error_body
from ramjet.transport.base import EngineResponse
from ramjet.types import EngineId


class _Relay:
    """What a response's body has sent (`add`: bytes out, the response tail, the last 2
    bytes), and for an answer with direct writes (`ClientResponse.direct`) its body
    pieces written from the engine connection's callback (`take`, given to
    `EngineResponse.set_sink`) while the client
    takes them without waiting: no reader wake-up, no coroutine step per piece. A piece
    that would wait (the client's buffer is full or paused), the last piece, and every
    piece while any is buffered go through the coroutine's loop as before, with its
    backpressure and send deadline."""

    __slots__ = ("conn", "framer", "high", "res", "tail")

    def __init__(
        self, direct: tuple[BodyFramer, Connection] | None, res: ForwardResult, high: int
    ) -> None:
        # the response's framing and connection, so that a piece's write is compiled code
        # end to end (`ramjet.request.framing`), not a call into the interpreted response
        self.framer: BodyFramer | None = None if direct is None else direct[0]
        self.conn: Connection | None = None if direct is None else direct[1]
        self.res = res
        self.high = high
        self.tail = b"\n\n"
        """The body's last 2 bytes sent (a cut SSE stream's error event follows them)."""

    def add(self, chunk: bytes) -> None:
        res = self.res
        res.bytes_out += len(chunk)
        res.tail.add(chunk)
        self.tail = chunk[-2:] if len(chunk) >= 2 else (self.tail + chunk)[-2:]

    def take(self, chunk: bytes) -> bool:
        framer, conn = self.framer, self.conn
        if framer is None or conn is None or not framer.write_now(conn, chunk, self.high):
            return False
        self.add(chunk)
        return True


class StreamWriter:
    def __init__(self, config: PolicyConfig, fleet: Fleet, metrics: RouterMetrics) -> None:
        self._cfg = config
        self._fleet = fleet
        self._metrics = metrics

    async def stream(
        self,
        request: ClientExchange,
        upstream: EngineResponse,
        first: bytes,
        engine: EngineState,
        res: ForwardResult,
        exchange: Exchange,
        t0: float,
    ) -> web.StreamResponse:
        """Send `upstream`'s response, whose first body piece is `first`, to the client;
        records the outcome in `res` and the fleet. `t0`: forwarding start (monotonic)."""
        t = self._cfg.timeouts
        status = upstream.status
        out_headers, res.engine_headers = client_response_headers(upstream.headers)
        out_headers["X-Ramjet-Engine"] = engine.id
        sse = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
        length = upstream.content_length
        resp = request.respond(status, upstream.reason, out_headers, length)
        res.engine, res.status = engine.id, status
        if request.transport is not None:
            request.transport.set_write_buffer_limits(high=self._cfg.limits.stream_buffer_bytes)
        content = upstream
        # The last piece ends the body in the same write (for a chunked body, with the
        # terminator); a length-framed body only once it is complete.
        direct = resp.direct
        relay = _Relay(direct, res, self._cfg.limits.stream_buffer_bytes)
        try:
            chunk = first
            # Headers leave with the first piece (`ClientResponse`): count them against
            # the write buffer once.
            extra = FRAMING_BYTES + sum(len(k) + len(v) + 4 for k, v in out_headers.items())
            while chunk:
                last = content.at_eof() and (length is None or res.bytes_out + len(chunk) >= length)
                if not await self._send(request, resp, chunk, last, extra):
                    res.end = "slow_reader"
                    self._metrics.stream_errors.labels(reason="slow_reader").inc()
                    resp.force_close()
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
                extra = FRAMING_BYTES
                if res.ttft_s is None:
                    res.ttft_s = time.monotonic() - t0
                    if direct is not None and not last:
                        upstream.set_sink(relay.take)  # the head has gone (`_Relay`)
                relay.add(chunk)
                if last:
                    break
                try:
                    # Everything the engine has delivered, in one piece; wait (under the
                    # idle timeout) only when nothing is buffered.
                    chunk = content.read_nowait()
                    if not chunk and not content.at_eof():
                        chunk = await content.readany(t.idle_s)
                except TimeoutError:
                    raise UpstreamError("idle_timeout") from None
                except OSError as exc:
                    raise UpstreamError("disconnect", type(exc).__name__) from None
            if length is not None and res.bytes_out < length:
                raise UpstreamError("disconnect", "body shorter than Content-Length")
            await resp.write_eof()
            if status not in RETRY_STATUSES:  # those were recorded on arrival
                self._fleet.record(engine, classify_status(status))
            return resp
        except UpstreamError as exc:
            reason = "shutdown" if exchange.shutdown else exc.kind
            res.end = f"upstream_{reason}"
            self._metrics.stream_errors.labels(reason=reason).inc()
            if not exchange.shutdown:
                self._fleet.record(engine, Outcome.FAILURE)
                self._metrics.upstream_errors.labels(engine=engine.id, kind=exc.kind).inc()
            await self._end_cut(request, resp, sse, relay.tail, engine.id, reason)
            return resp
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            res.end = "client_gone"
            return resp
        finally:
            upstream.close()
            exchange.upstream = None

    async def _send(
        self,
        request: ClientExchange,
        resp: ClientResponse,
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
        request: ClientExchange,
        resp: ClientResponse,
        sse: bool,
        tail: bytes,
        engine: EngineId,
        reason: str,
    ) -> None:
        # A chunked SSE body ends properly (error event, then the terminator), so the
        # client's connection stays usable for its next request: a keep-alive client
        # cannot know of a close that was never announced. Any other body cut short
        # closes the connection so the client sees it truncated.
        chunked = resp.headers.get("Transfer-Encoding", "").lower() == "chunked"
        if not (sse and chunked):
            resp.force_close()
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
