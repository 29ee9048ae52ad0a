"""Forwarding: one client request to one engine at a time, retries.

Per attempt, nothing reaches the client until the engine's first body byte (or the end
of an empty body) has arrived. Until then a failure is invisible to the client and the
request may be retried on another engine:

  connect ─► headers ─► first body chunk ─► (client response prepared) ─► chunks ─► end
  └──────── first_byte_s deadline ─────────┘                             idle_s each

- Retried (on an engine not tried yet, at most `retry.max_attempts` attempts, and only
  while the retry budget allows, `ramjet.proxy.retries`): refused/failed connections,
  disconnects before the first byte, first-byte timeouts, and 502/503/504/429 statuses.
  Anything else is passed through. A refused connection or a disconnect needs no budget:
  the failed engine does none of the request's work, so a retry adds no load (a killed
  engine's requests must not be lost for want of budget); a zero budget still turns
  retries off.
- A non-stream request's first byte comes after its whole generation: with `max_tokens`
  its deadline grows to `first_byte_s + token_s * max_tokens` (capped at
  `generation_s`). Passing that extended deadline ends the request with 504
  (`generation_timeout`): not an engine fault (no ejection, no breaker count) and never
  retried, since the engine has been working on it.
- From the first byte on, `ramjet.proxy.stream` sends the response; nothing is retried.
- If the client goes away, the handler task is cancelled (server runs with
  `handler_cancellation`), and the upstream response is closed, which aborts the
  engine's request by closing its connection.

Headers are cleaned both ways by `ramjet.proxy.headers`; the record of a forward is
`ramjet.proxy.exchange`. Engines are reached through `ramjet.transport.base`'s
`EngineTransport`, each made by the `transports` the proxy is given (HTTP/1.1 pools,
`ramjet.transport.http1`, from `ramjet.app.wiring`; in-memory engines in unit tests). `Proxy.open` is everything up to the first byte (attempts, retries,
in-flight counts) and writes nothing to the client, so it is unit-tested over in-memory
engines; `Proxy.forward` is `open`, then the stream, then `finish`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from ramjet.config import PolicyConfig
from ramjet.fleet.engines import EngineState, Fleet, Outcome, Ticket, classify_status
from ramjet.metrics import RouterMetrics
from ramjet.proxy.deadlines import Deadlines
from ramjet.proxy.exchange import Attempt, Exchange, ForwardResult, UpstreamError
from ramjet.proxy.headers import upstream_request_headers
from ramjet.proxy.retries import FREE_RETRIES, RETRY_STATUSES, RetryBudget, parse_retry_after
from ramjet.proxy.stream import StreamWriter
from ramjet.request.client import ClientExchange
from ramjet.request.openai_errors import json_error
from ramjet.transport.base import EngineResponse, EngineTransport, UpstreamConnectError
from ramjet.types import EngineId

log = logging.getLogger(__name__)

ChooseNext = Callable[[set[EngineId]], EngineState | None]
TransportFactory = Callable[[EngineState], EngineTransport]
"""Builds an engine's transport (called in `Proxy.start`, on the running loop)."""
Transports = Callable[[EngineState, str], EngineTransport]
"""Builds an engine's transport for a use: "forward" (the proxy's), "probe" (health
probes) or "models" (`/v1/models`); each use has pools of its own. Called on the
running loop (`Proxy.start`, `Router.start`)."""


class _NextEngine:
    """The engine a failed attempt would be retried on, chosen only when asked (most
    attempts succeed and never ask)."""

    __slots__ = ("_choose", "_done", "_engine", "_more", "_tried")

    def __init__(self, choose: ChooseNext, tried: set[EngineId], more: bool) -> None:
        self._choose, self._tried, self._more = choose, tried, more
        self._done = False
        self._engine: EngineState | None = None

    def get(self) -> EngineState | None:
        if not self._done:
            self._done = True
            self._engine = self._choose(self._tried) if self._more else None
        return self._engine


@dataclass(init=False, slots=True)
class Opened:
    """An attempt that got its first body byte (or a body-less end): what `forward`
    streams to the client. `ticket` and a held retry token (`retried`) are released by
    whoever finishes the exchange (`Proxy.finish`)."""

    engine: EngineState
    upstream: EngineResponse
    first: bytes
    ticket: Ticket
    retried: bool

    def __init__(
        self,
        engine: EngineState,
        upstream: EngineResponse,
        first: bytes,
        ticket: Ticket,
        retried: bool,
    ) -> None:
        self.engine = engine
        self.upstream = upstream
        self.first = first
        self.ticket = ticket
        self.retried = retried


class Proxy:
    def __init__(
        self,
        config: PolicyConfig,
        fleet: Fleet,
        metrics: RouterMetrics,
        transports: TransportFactory,
    ) -> None:
        """`transports`: how each engine is reached (HTTP/1.1 pools from
        `ramjet.app.wiring`, a `ramjet.transport.base.MemoryTransport` in unit tests)."""
        self._cfg = config
        self._fleet = fleet
        self._metrics = metrics
        self.budget = RetryBudget(config.retry.budget_ratio, config.retry.min_retries)
        self._writer = StreamWriter(config, fleet, metrics)
        self._make_transport = transports
        # The in-flight gauges read the engines' counters when scraped, instead of
        # being set twice per attempt.
        for e in fleet.engines:
            self._watch(e)
        self._pools: dict[EngineId, EngineTransport] = {}
        self._deadlines: Deadlines | None = None

    def _first_byte(self, delay_s: float) -> Deadlines:
        """The first-byte waits, one timer for all (`ramjet.proxy.deadlines`)."""
        d = self._deadlines
        if d is None or d.delay_s != delay_s:
            d = self._deadlines = Deadlines(delay_s)
        return d

    def _watch(self, e: EngineState) -> None:
        def requests() -> float:
            return e.inflight_requests

        def prompt_tokens() -> float:
            return e.inflight_prompt_tokens

        self._metrics.inflight_of(e.id).set_function(requests)
        self._metrics.inflight_prompt_tokens_of(e.id).set_function(prompt_tokens)

    async def start(self) -> None:
        for e in self._fleet.engines:
            self._pools[e.id] = self._make_transport(e)

    async def close(self) -> None:
        for p in self._pools.values():
            await p.close()
        self._pools.clear()

    async def forward(
        self,
        request: ClientExchange,
        body: bytes,
        first: EngineState,
        prompt_tokens: int,
        choose_next: ChooseNext,
        request_id: str,
        exchange: Exchange,
        deadline_s: float | None = None,
        res: ForwardResult | None = None,
        context_tokens: int = 0,
    ) -> tuple[web.StreamResponse, ForwardResult]:
        """`deadline_s`: the first-byte deadline when not `timeouts.first_byte_s` (a
        non-stream request's, `generation_deadline`). `res`: the caller's record of the
        outcome, filled as the exchange goes, so that a caller cancelled mid-exchange (the
        client left) still knows the engine, status and TTFT reached. `prompt_tokens` are
        counted in flight until the first byte, as prefilled on `context_tokens`."""
        res = ForwardResult() if res is None else res
        headers = upstream_request_headers(request.headers, request_id)
        t0 = time.monotonic()
        self.budget.active += 1
        opened: Opened | None = None
        try:
            opened = await self.open(
                request.method,
                request.path_qs,
                headers,
                body,
                first,
                prompt_tokens,
                choose_next,
                exchange,
                res,
                deadline_s,
                context_tokens,
            )
            if opened is None:
                return self._give_up(res), res
            resp = await self._writer.stream(
                request, opened.upstream, opened.first, opened.engine, res, exchange, t0
            )
            return resp, res
        finally:
            if opened is not None:
                self.finish(opened)
            self.budget.active -= 1

    def finish(self, opened: Opened) -> None:
        """The exchange `open` returned is over: release its in-flight share and retry."""
        opened.ticket.close()
        if opened.retried:
            self.budget.release()
            opened.retried = False

    async def open(
        self,
        method: str,
        path_qs: str,
        headers: list[tuple[str, str]],
        body: bytes,
        first: EngineState,
        prompt_tokens: int,
        choose_next: ChooseNext,
        exchange: Exchange,
        res: ForwardResult,
        deadline_s: float | None = None,
        context_tokens: int = 0,
    ) -> Opened | None:
        """Attempts, from `first`, until one gets its first body byte: that one
        (`finish` it when done), or None when every attempt failed (`res.attempts` says
        how). Nothing here writes to the client, so everything may be retried."""
        engine: EngineState | None = first
        tried: set[EngineId] = set()
        retrying = False
        while engine is not None:
            tried.add(engine.id)
            attempt = Attempt(engine.id)
            res.attempts.append(attempt)
            ticket = Ticket(engine, prompt_tokens, self._fleet.clock(), context_tokens)
            more = len(res.attempts) < self._cfg.retry.max_attempts
            nxt = _NextEngine(choose_next, tried, more)
            got = None
            try:
                got = await self._attempt(
                    method, path_qs, headers, body, engine, attempt, exchange, nxt, deadline_s
                )
            finally:
                if got is None:
                    ticket.close()
                    if retrying:
                        self.budget.release()
                        retrying = False
            if got is not None:
                ticket.first_byte(self._fleet.clock())
                return Opened(engine, got[0], got[1], ticket, retrying)
            # The attempt failed before any byte reached the client: maybe retry.
            if exchange.shutdown or attempt.error == "generation_timeout" or nxt.get() is None:
                break
            if attempt.error in FREE_RETRIES and self.budget.enabled:
                self.budget.retrying += 1  # counted, but not refused (see module docstring)
            elif not self.budget.try_acquire():
                self._metrics.retries_denied.inc()
                break
            retrying = True
            self._metrics.retries.labels(reason=attempt.error or str(attempt.status)).inc()
            engine = nxt.get()
        return None

    def _give_up(self, res: ForwardResult) -> web.StreamResponse:
        last = res.attempts[-1] if res.attempts else None
        kind = last.error if last else None
        if kind == "generation_timeout":
            res.status, res.end = 504, "upstream_generation_timeout"
            return json_error(
                504,
                "The engine did not finish the generation in time.",
                "server_error",
                "upstream_timeout",
            )
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
        method: str,
        path_qs: str,
        headers: list[tuple[str, str]],
        body: bytes,
        engine: EngineState,
        attempt: Attempt,
        exchange: Exchange,
        nxt: _NextEngine,
        deadline_s: float | None = None,
    ) -> tuple[EngineResponse, bytes] | None:
        """One attempt: the response and its first body piece, or None if it failed
        before that (or answered a retryable status while a retry is possible).
        `deadline_s`: an extended first-byte deadline (see `forward`)."""
        t = self._cfg.timeouts
        pool = self._pools[engine.id]
        got: list[EngineResponse] = []  # the response, once its head has come
        try:
            try:
                if deadline_s is None or deadline_s <= t.first_byte_s:
                    with self._first_byte(t.first_byte_s).wait() as deadline:
                        try:
                            first = await self._first(
                                method, path_qs, headers, body, engine, attempt, exchange,
                                nxt, pool, got,
                            )  # fmt: skip
                        except asyncio.CancelledError:
                            deadline.raise_if_expired()  # TimeoutError if the deadline did it
                            raise
                else:
                    try:
                        async with asyncio.timeout(deadline_s):
                            first = await self._first(
                                method, path_qs, headers, body, engine, attempt, exchange,
                                nxt, pool, got,
                            )  # fmt: skip
                    except TimeoutError:
                        raise UpstreamError("generation_timeout") from None
                if first is None:
                    return None
            except TimeoutError:
                raise UpstreamError("first_byte_timeout") from None
            except UpstreamConnectError as exc:
                raise UpstreamError("connect", str(exc)) from None
            except OSError as exc:
                raise UpstreamError("disconnect", type(exc).__name__) from None
        except asyncio.CancelledError:  # the client went away: abort the engine's request
            for upstream in got:
                upstream.close()
            raise
        except UpstreamError as exc:
            for upstream in got:
                upstream.close()
            if exchange.shutdown:
                attempt.error = "shutdown"
                return None
            attempt.error = exc.kind
            if exc.kind != "generation_timeout":  # a long generation is no engine fault
                self._fleet.record(engine, Outcome.FAILURE)
            self._metrics.upstream_errors.labels(engine=engine.id, kind=exc.kind).inc()
            return None
        return got[0], first

    async def _first(
        self,
        method: str,
        path_qs: str,
        headers: list[tuple[str, str]],
        body: bytes,
        engine: EngineState,
        attempt: Attempt,
        exchange: Exchange,
        nxt: _NextEngine,
        pool: EngineTransport,
        got: list[EngineResponse],
    ) -> bytes | None:
        """The attempt's request and its first body piece (the response goes in `got`);
        None for a retryable status that will be retried."""
        upstream = await pool.request(method, path_qs, headers, body)
        got.append(upstream)
        exchange.upstream = upstream
        status = upstream.status
        attempt.status = status
        if status in RETRY_STATUSES:
            outcome = classify_status(status)
            ra = parse_retry_after(upstream.headers.get("Retry-After"))
            self._fleet.record(engine, outcome, ra)
            kind = "backpressure" if outcome is Outcome.BACKPRESSURE else "status_5xx"
            self._metrics.upstream_errors.labels(engine=engine.id, kind=kind).inc()
            attempt.error = kind
            if nxt.get() is not None and self.budget.has_room():
                upstream.close()
                got.clear()
                return None
        first = await upstream.readany()
        return first


def generation_deadline(
    first_byte_s: float, token_s: float, generation_s: float, max_tokens: int | None
) -> float | None:
    """A non-stream request's first-byte deadline when it is longer than `first_byte_s`
    (its whole generation comes before its first byte), else None."""
    if not max_tokens or token_s <= 0:
        return None
    deadline = min(first_byte_s + token_s * max_tokens, max(first_byte_s, generation_s))
    return deadline if deadline > first_byte_s else None
