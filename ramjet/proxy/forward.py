"""Forwarding: one client request to one engine at a time, retries.

Per attempt, nothing reaches the client until the engine's first body byte (or the end
of an empty body) has arrived. Until then a failure is invisible to the client and the
request may be retried on another engine:

  connect ─► headers ─► first body chunk ─► (client response prepared) ─► chunks ─► end
  └──────── first_byte_s deadline ─────────┘                             idle_s each

- Retried (on an engine not tried yet, at most `retry.max_attempts` attempts, and only
  while the retry budget allows, `ramjet.proxy.retries`): refused/failed connections,
  disconnects before the first byte, first-byte timeouts, and 502/503/504/429 statuses.
  Anything else is passed through.
- From the first byte on, `ramjet.proxy.stream` sends the response; nothing is retried.
- If the client goes away, the handler task is cancelled (server runs with
  `handler_cancellation`), and the upstream response is closed, which aborts the
  engine's request by closing its connection.

Headers are cleaned both ways by `ramjet.proxy.headers`; the record of a forward is
`ramjet.proxy.exchange`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from aiohttp import web

from ramjet.config import PolicyConfig
from ramjet.fleet.engines import EngineState, Fleet, Outcome, Ticket, classify_status
from ramjet.metrics import RouterMetrics
from ramjet.proxy.exchange import Attempt, Exchange, ForwardResult, UpstreamError
from ramjet.proxy.headers import upstream_request_headers
from ramjet.proxy.http1 import EnginePool, UpstreamConnectError, UpstreamResponse
from ramjet.proxy.retries import RETRY_STATUSES, RetryBudget, parse_retry_after
from ramjet.proxy.stream import StreamWriter
from ramjet.request.openai_errors import json_error
from ramjet.types import EngineId

log = logging.getLogger(__name__)

ChooseNext = Callable[[set[EngineId]], EngineState | None]


class Proxy:
    def __init__(self, config: PolicyConfig, fleet: Fleet, metrics: RouterMetrics) -> None:
        self._cfg = config
        self._fleet = fleet
        self._metrics = metrics
        self.budget = RetryBudget(config.retry.budget_ratio, config.retry.min_retries)
        self._writer = StreamWriter(config, fleet, metrics)
        # The in-flight gauges read the engines' counters when scraped, instead of
        # being set twice per attempt.
        for e in fleet.engines:
            self._watch(e)
        self._pools: dict[EngineId, EnginePool] = {}

    def _watch(self, e: EngineState) -> None:
        def requests() -> float:
            return e.inflight_requests

        def prompt_tokens() -> float:
            return e.inflight_prompt_tokens

        self._metrics.inflight_of(e.id).set_function(requests)
        self._metrics.inflight_prompt_tokens_of(e.id).set_function(prompt_tokens)

    async def start(self) -> None:
        for e in self._fleet.engines:
            self._pools[e.id] = EnginePool(
                e.url,
                limit=self._cfg.limits.connections_per_engine,
                connect_s=self._cfg.timeouts.connect_s,
                keepalive_s=30.0,
                read_high=64 * 1024,
            )

    async def close(self) -> None:
        for p in self._pools.values():
            await p.close()
        self._pools.clear()

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
        headers: list[tuple[str, str]],
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
        pool = self._pools[engine.id]
        upstream: UpstreamResponse | None = None
        try:
            try:
                async with asyncio.timeout(t.first_byte_s):
                    upstream = await pool.request(
                        request.method, request.rel_url.path_qs, headers, body
                    )
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
                        if can_retry:
                            upstream.close()
                            return None
                    first = await upstream.readany()
            except TimeoutError:
                raise UpstreamError("first_byte_timeout") from None
            except UpstreamConnectError as exc:
                raise UpstreamError("connect", str(exc)) from None
            except OSError as exc:
                raise UpstreamError("disconnect", type(exc).__name__) from None
        except asyncio.CancelledError:  # the client went away: abort the engine's request
            if upstream is not None:
                upstream.close()
            raise
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
        return await self._writer.stream(request, upstream, first, engine, res, exchange, t0)
