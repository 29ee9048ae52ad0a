"""The request path: admit → read body → parse once → views → policies → mode → forward
→ account.

1. Admission: while draining, or when `limits.max_concurrent` requests are forwarding
   and `limits.queue` more are waiting, a request is refused at once with 503 and
   Retry-After; a queued one waits at most `limits.queue_timeout_s`.
2. The body is read up to `limits.max_body_bytes` (a declared Content-Length over it is
   refused before reading anything; a chunked body is cut off as soon as it passes it),
   then parsed once (`ramjet.parsing`). Every refusal is an OpenAI error object; nothing
   is forwarded.
3. Views: `RequestView` from the parse; one `EngineView` per engine serving the model,
   `healthy` meaning routable now (probe ok, not ejected, not backing off; all engines
   in panic), load from the router's in-flight counters merged with the engine's signed
   load report, trust and profile from its reports (`router.signals`, set by
   `ramjet.router_reports`), residency from the tables.
4. The mode runner (`ramjet.modes`) asks the policies and fixes the live pick.
5. `ramjet.proxy` forwards; a retry goes to the least-loaded routable engine not tried.
   As it forwards, the prompt's blocks become pending residency on the engine
   (`ResidencySource.add_pending`) until its report confirms them or the forward fails,
   and the engine's in-flight prompt tokens count the prompt's predicted uncached tokens
   there (`ramjet.policy.candidates.uncached_prompt_tokens`), not the whole prompt.
6. On the end, the routed prefix is recorded as approximate residency, metrics are
   updated and a `DecisionRecord` goes to the `DecisionSink`: `ramjet.accounting`,
   which measures it, logs it (`ramjet.decisions`), feeds the mean wait back into
   `FleetStats`, then passes it to the sink given to the router, if any.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from ramjet.accounting import Accounting
from ramjet.config import PolicyConfig
from ramjet.engines import EngineState, Fleet, HealthProber
from ramjet.keymodes import KeyPools
from ramjet.metrics import RouterMetrics
from ramjet.modes import ArrivalRate, ModeOutcome, ModeRunner
from ramjet.parsing import ParsedRequest, ParseLimits, RequestError, parse_request, to_request_view
from ramjet.policy.base import (
    Decision,
    EngineView,
    FleetStats,
    GlobalMatch,
    ResidencyView,
)
from ramjet.policy.candidates import uncached_prompt_tokens
from ramjet.policy.registry import create_policy
from ramjet.prefix import PrefixKeys
from ramjet.proxy import Attempt, Exchange, ForwardResult, Proxy, json_error
from ramjet.residency.pending import PendingTicket
from ramjet.router_reports import EngineSignals, NoSignals
from ramjet.types import EngineId, PrefixKey

log = logging.getLogger(__name__)


class ResidencySource(Protocol):
    """What the router needs of the residency tables (`ramjet.residency`)."""

    def view(self, engine: EngineId, now: float | None = None) -> ResidencyView: ...

    def record_routed(self, engine: EngineId, keys: PrefixKeys, now: float) -> None: ...

    def add_pending(self, engine: EngineId, keys: PrefixKeys, now: float) -> PendingTicket | None:
        """Forwarding to `engine`: its blocks are pending there until reported."""
        ...

    def settle_pending(
        self, ticket: PendingTicket | None, engine: EngineId | None, now: float
    ) -> None:
        """The forward ended on `engine` (None: failed); keep, move or drop the ticket."""
        ...


class _EmptyView:
    def global_match(
        self, block_keys: Sequence[PrefixKey], block_tokens: Sequence[int]
    ) -> GlobalMatch:
        return GlobalMatch()

    def swa_match(self, boundary_keys: Sequence[tuple[int, PrefixKey]]) -> int:
        return 0


class NoResidency:
    """Residency that knows nothing (every match is 0); for tests and bare setups."""

    _VIEW = _EmptyView()

    def view(self, engine: EngineId, now: float | None = None) -> ResidencyView:
        return self._VIEW

    def record_routed(self, engine: EngineId, keys: PrefixKeys, now: float) -> None:
        return None

    def add_pending(self, engine: EngineId, keys: PrefixKeys, now: float) -> PendingTicket | None:
        return None

    def settle_pending(
        self, ticket: PendingTicket | None, engine: EngineId | None, now: float
    ) -> None:
        return None


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """One routed request: both picks, what happened, and the engine's own account."""

    request_id: str
    time_unix: float
    model: str
    session: str | None
    prompt_tokens: int
    stream: bool
    mode: str
    live_role: str
    live: Decision
    incumbent: Decision | None
    candidate: Decision | None
    candidate_error: str | None
    candidate_s: float
    engine: EngineId | None
    status: int
    attempts: tuple[Attempt, ...]
    ttft_s: float | None
    duration_s: float
    end: str
    engine_headers: Mapping[str, str] = field(default_factory=dict)
    """The engine's `X-Ramjet-*` response headers (its account of the prompt work)."""
    views: tuple[EngineView, ...] = ()
    response_tail: bytes = b""
    """The last bytes of the body sent to the client (`ramjet.proxy.ResponseTail`): the
    accounting reads the engine's final usage (`prompt_work`) there."""


class DecisionSink(Protocol):
    """Receives every decision record. Called on the event loop; must not block or raise."""

    def on_decision(self, record: DecisionRecord) -> None: ...


class NullSink:
    def on_decision(self, record: DecisionRecord) -> None:
        return None


class Router:
    def __init__(
        self,
        config: PolicyConfig,
        *,
        metrics: RouterMetrics | None = None,
        residency: ResidencySource | None = None,
        sink: DecisionSink | None = None,
        clock: Any = time.monotonic,
    ) -> None:
        self.config = config
        self.metrics = metrics or RouterMetrics()
        self.residency: ResidencySource = residency or NoResidency()
        self.signals: EngineSignals = NoSignals()
        self.clock = clock
        lg = config.logging
        self.accounting = Accounting(
            self.metrics.registry,
            log_path=lg.decisions_path,
            log_max_bytes=lg.decisions_max_bytes,
            log_backups=lg.decisions_backups,
            log_queue=lg.decisions_queue,
            downstream=sink,
            clock=clock,
        )
        self.sink: DecisionSink = self.accounting
        self.fleet = Fleet(
            config.engines, config.health, config.retry, clock, on_eject=self._on_eject
        )
        self.metrics.init_engines(e.id for e in config.engines)
        self.proxy = Proxy(config, self.fleet, self.metrics)
        incumbent = create_policy(
            config.incumbent.name, config.incumbent.params, path="incumbent.params"
        )
        candidate = None
        if config.candidate is not None:
            candidate = create_policy(
                config.candidate.name, config.candidate.params, path="candidate.params"
            )
        self.modes = ModeRunner(config.mode, incumbent, candidate, self.metrics, clock=clock)
        self.arrivals = ArrivalRate()
        self.parse_limits = ParseLimits(max_body_bytes=config.limits.max_body_bytes)
        self.key_pools = KeyPools(config.key_pools)
        self.draining = False
        self._slots = asyncio.Semaphore(config.limits.max_concurrent)
        self._waiting = 0
        self._exchanges: set[Exchange] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._probe_session: aiohttp.ClientSession | None = None
        self._prober: HealthProber | None = None

    def _on_eject(self, engine: EngineId, duration_s: float) -> None:
        self.metrics.ejections.labels(engine=engine).inc()

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        await self.proxy.start()
        self._probe_session = aiohttp.ClientSession()
        self._prober = HealthProber(
            self.fleet, self._probe_session, self.config.health, self.config.timeouts.probe_s
        )
        await self._prober.probe_all()
        self._prober.start()

    async def drain(self, timeout_s: float | None = None) -> None:
        """Refuse new requests; let in-flight ones finish for up to `timeout_s`, then end
        the rest (streams get an error event)."""
        self.draining = True
        limit = self.config.timeouts.drain_s if timeout_s is None else timeout_s
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(limit):
                await self._idle.wait()
        for ex in list(self._exchanges):
            ex.abort()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(1.0, limit)):
                await self._idle.wait()

    async def stop(self) -> None:
        if self._prober is not None:
            await self._prober.stop()
        if self._probe_session is not None:
            await self._probe_session.close()
        await self.proxy.close()
        await asyncio.to_thread(self.accounting.close)

    @property
    def inflight(self) -> int:
        return len(self._exchanges)

    # -- views --------------------------------------------------------------------------

    def _views(self, model: str, now: float) -> tuple[list[EngineView], list[EngineState], float]:
        routable = self.fleet.routable()
        ok = {e.id for e in routable.engines}
        serving = [e for e in self.fleet.engines if not e.models or model in e.models]
        views = [
            EngineView(
                id=e.id,
                healthy=e.id in ok,
                load=self.signals.load(e),
                residency=self.residency.view(e.id, now),
                profile=self.signals.profile(e.id),
                trust=self.signals.trust(e.id),
                models=frozenset(e.models),
            )
            for e in serving
        ]
        return views, serving, routable.retry_after_s

    def _choose_retry(self, model: str, tried: set[EngineId]) -> EngineState | None:
        pool = [
            e
            for e in self.fleet.routable().engines
            if e.id not in tried and (not e.models or model in e.models)
        ]
        if not pool:
            return None
        return min(pool, key=lambda e: (e.inflight_prompt_tokens, e.inflight_requests))

    # -- handlers -----------------------------------------------------------------------

    def _reject(self, reason: str, resp: web.Response) -> web.Response:
        self.metrics.rejected.labels(reason=reason).inc()
        return resp

    def _too_big(self) -> web.Response:
        limit = self.config.limits.max_body_bytes
        return json_error(
            413,
            f"Request body exceeds {limit} bytes.",
            "invalid_request_error",
            "request_too_large",
            close=True,
        )

    async def _read_body(self, request: web.Request) -> bytes | web.Response:
        limit = self.config.limits.max_body_bytes
        parts: list[bytes] = []
        total = 0
        try:
            async with asyncio.timeout(self.config.timeouts.body_s):
                while True:
                    chunk = await request.content.readany()
                    if not chunk:
                        break
                    total += len(chunk)
                    if total > limit:
                        return self._reject("body_too_large", self._too_big())
                    parts.append(chunk)
        except TimeoutError:
            return self._reject(
                "body_timeout",
                json_error(
                    408,
                    "Request body not received in time.",
                    "invalid_request_error",
                    "request_timeout",
                    close=True,
                ),
            )
        except aiohttp.web.HTTPException:
            raise
        except (aiohttp.ClientPayloadError, ValueError) as exc:
            return self._reject(
                "bad_body",
                json_error(
                    400,
                    f"Malformed request body: {exc}",
                    "invalid_request_error",
                    "bad_body",
                    close=True,
                ),
            )
        return b"".join(parts)

    def _header_bytes(self, request: web.Request) -> int:
        return sum(len(k) + len(v) + 4 for k, v in request.raw_headers)

    async def handle_completion(self, request: web.Request) -> web.StreamResponse:
        t0 = self.clock()
        self.arrivals.arrive(t0)
        if self._header_bytes(request) > self.config.limits.max_header_bytes:
            return self._reject(
                "headers_too_large",
                json_error(
                    431,
                    "Request headers too large.",
                    "invalid_request_error",
                    "headers_too_large",
                    close=True,
                ),
            )
        if self.draining:
            return self._reject(
                "draining",
                json_error(
                    503,
                    "The router is shutting down.",
                    "server_error",
                    "draining",
                    retry_after_s=1.0,
                    close=True,
                ),
            )
        lim = self.config.limits
        if request.content_length is not None and request.content_length > lim.max_body_bytes:
            return self._reject("body_too_large", self._too_big())
        if self._slots.locked():
            if self._waiting >= lim.queue:
                return self._reject("overload", self._overloaded())
            self._waiting += 1
            self.metrics.queued.set(self._waiting)
            try:
                async with asyncio.timeout(lim.queue_timeout_s):
                    await self._slots.acquire()
            except TimeoutError:
                return self._reject("queue_timeout", self._overloaded())
            finally:
                self._waiting -= 1
                self.metrics.queued.set(self._waiting)
        else:
            await self._slots.acquire()
        try:
            return await self._admitted(request, t0)
        finally:
            self._slots.release()

    def _overloaded(self) -> web.Response:
        return json_error(
            503,
            "The router is at capacity; retry later.",
            "server_error",
            "overloaded",
            retry_after_s=1.0,
        )

    async def _admitted(self, request: web.Request, t0: float) -> web.StreamResponse:
        body = await self._read_body(request)
        if isinstance(body, web.Response):
            return body
        try:
            parsed = parse_request(request.path, body, request.headers, self.parse_limits)
        except RequestError as exc:
            self.metrics.rejected.labels(reason=exc.code).inc()
            resp = web.Response(
                status=exc.status, body=exc.to_openai_json(), content_type="application/json"
            )
            return resp
        request_id = request.headers.get("X-Request-Id", "")[:64] or secrets.token_hex(8)
        views, serving, retry_after = self._views(parsed.model, t0)
        if not serving:
            return self._reject(
                "model_not_found",
                json_error(
                    404,
                    f"The model {parsed.model!r} is not served here.",
                    "invalid_request_error",
                    "model_not_found",
                ),
            )
        if not any(v.healthy for v in views):
            return self._reject(
                "no_engine",
                json_error(
                    503,
                    "Every engine is backing off; retry later.",
                    "server_error",
                    "engines_unavailable",
                    retry_after_s=max(retry_after, 1.0),
                ),
            )
        if self.key_pools:  # token-block keys for a pool of tokenizing engines
            try:
                parsed = self.key_pools.rekey(parsed, [v.id for v in views])
            except RequestError as exc:
                self.metrics.rejected.labels(reason=exc.code).inc()
                return web.Response(
                    status=exc.status, body=exc.to_openai_json(), content_type="application/json"
                )
        rv = to_request_view(parsed, request_id)
        fleet = FleetStats(
            now_s=t0,
            arrival_rate_per_s=self.arrivals.rate(t0),
            mean_wait_s=self.accounting.mean_wait_s(),
        )
        session_key = parsed.session or (
            str(parsed.keys.boundaries[0][1]) if parsed.keys.boundaries else request_id
        )
        outcome = self.modes.decide(rv, views, fleet, session_key)
        live = next((v for v in views if v.id == outcome.live.engine), None)
        new = uncached_prompt_tokens(rv, live) if live is not None else parsed.prompt_tokens
        return await self._forward(request, parsed, outcome, request_id, t0, tuple(views), new)

    async def _forward(
        self,
        request: web.Request,
        parsed: ParsedRequest,
        outcome: ModeOutcome,
        request_id: str,
        t0: float,
        views: tuple[EngineView, ...],
        new_tokens: int,
    ) -> web.StreamResponse:
        """`new_tokens`: the prompt tokens predicted uncached on the live engine, counted
        in flight there until the first byte (a retry counts the same figure)."""
        first = self.fleet.get(outcome.live.engine)
        pending = self.residency.add_pending(first.id, parsed.keys, self.clock())
        exchange = Exchange()
        self._exchanges.add(exchange)
        self._idle.clear()
        res = ForwardResult()
        try:
            resp, res = await self.proxy.forward(
                request,
                parsed.body,
                first,
                new_tokens,
                lambda tried: self._choose_retry(parsed.model, tried),
                request_id,
                exchange,
            )
            if res.engine is not None and res.status < 400:
                self.residency.record_routed(res.engine, parsed.keys, self.clock())
            return resp
        except asyncio.CancelledError:
            res.end = "client_gone"
            raise
        finally:
            ok = res.engine if res.status < 400 else None
            self.residency.settle_pending(pending, ok, self.clock())
            self._exchanges.discard(exchange)
            if not self._exchanges:
                self._idle.set()
            self._account(parsed, outcome, request_id, t0, res, views)

    def _account(
        self,
        parsed: ParsedRequest,
        outcome: ModeOutcome,
        request_id: str,
        t0: float,
        res: ForwardResult,
        views: tuple[EngineView, ...],
    ) -> None:
        m = self.metrics
        duration = self.clock() - t0
        engine = res.engine or "none"
        m.requests_of(engine, str(res.status), outcome.live.policy).inc()
        m.decisions_of("live", outcome.live.policy, outcome.live.engine).inc()
        if outcome.incumbent is not None:
            m.decisions_of("incumbent", outcome.incumbent.policy, outcome.incumbent.engine).inc()
        if outcome.candidate is not None:
            m.decisions_of("candidate", outcome.candidate.policy, outcome.candidate.engine).inc()
        if res.ttft_s is not None and res.engine is not None:
            m.ttft_of(res.engine).observe(res.ttft_s)
        m.duration_of(engine).observe(duration)
        record = DecisionRecord(
            request_id=request_id,
            time_unix=time.time(),
            model=parsed.model,
            session=parsed.session,
            prompt_tokens=parsed.prompt_tokens,
            stream=parsed.stream,
            mode=self.config.mode.kind,
            live_role=outcome.live_role,
            live=outcome.live,
            incumbent=outcome.incumbent,
            candidate=outcome.candidate,
            candidate_error=outcome.candidate_error,
            candidate_s=outcome.candidate_s,
            engine=res.engine,
            status=res.status,
            attempts=tuple(res.attempts),
            ttft_s=res.ttft_s,
            duration_s=duration,
            end=res.end,
            engine_headers=res.engine_headers,
            views=views,
            response_tail=res.tail.bytes(),
        )
        try:
            self.sink.on_decision(record)
        except Exception:  # accounting must never fail a request
            log.exception("decision sink failed")

    async def handle_models(self, request: web.Request) -> web.Response:
        """The union of the engines' models (live from each admitted engine, else config)."""
        timeout = aiohttp.ClientTimeout(total=self.config.timeouts.probe_s)

        async def one(e: EngineState) -> list[dict[str, Any]]:
            declared = [{"id": m, "object": "model", "owned_by": e.id} for m in e.models]
            if e.ejected:
                return declared
            try:
                async with self.proxy.session(e.id).get(e.url + "/v1/models", timeout=timeout) as r:
                    if r.status != 200:
                        return declared
                    data = await r.json(content_type=None)
                    got = [m for m in data.get("data", []) if isinstance(m, dict) and "id" in m]
                    return got + declared
            except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
                return declared

        merged: dict[str, dict[str, Any]] = {}
        for models in await asyncio.gather(*(one(e) for e in self.fleet.engines)):
            for m in models:
                merged.setdefault(str(m["id"]), m)
        return web.json_response({"object": "list", "data": list(merged.values())})

    async def handle_healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def handle_readyz(self, request: web.Request) -> web.Response:
        engines = {
            e.id: {"healthy": e.healthy, "probe_ok": e.probe_ok, "ejected": e.ejected}
            for e in self.fleet.engines
        }
        ready = self.fleet.ready() and not self.draining
        return web.json_response(
            {"ready": ready, "draining": self.draining, "engines": engines},
            status=200 if ready else 503,
        )

    async def handle_metrics(self, request: web.Request) -> web.Response:
        now = self.clock()
        for e in self.fleet.engines:
            self.metrics.engine_healthy.labels(engine=e.id).set(1 if e.healthy else 0)
        self.metrics.arrival_rate.set(self.arrivals.rate(now))
        return web.Response(
            body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"}
        )
