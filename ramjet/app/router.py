"""The request path: admit → read body → parse once → views → policies → mode → forward
→ account.

1. Admission: while draining, or when `limits.max_concurrent` requests are forwarding
   and `limits.queue` more are waiting, a request is refused at once with 503 and
   Retry-After; a queued one waits at most `limits.queue_timeout_s`.
2. The body is read up to `limits.max_body_bytes` (a declared Content-Length over it is
   refused before reading anything; a chunked body is cut off as soon as it passes it),
   then parsed once (`ramjet.request.parse`). Steps 1-2 are `ramjet.request.admission`.
   Every refusal is an OpenAI error object; nothing is forwarded.
3. Views: `RequestView` from the parse; one `EngineView` per engine serving the model,
   `healthy` meaning routable now (probe ok, not ejected, not backing off; all engines
   in panic), load from the router's in-flight counters merged with the engine's signed
   load report, trust and profile from its reports (`router.signals`, a
   `ramjet.fleet.signals.EngineSignals` given by `ramjet.app.wiring`), residency from
   the tables (`ramjet.fleet.views`).
4. The mode runner (`ramjet.app.modes`) asks the policies and fixes the live pick; the
   accounting-only pick (observe's candidate, enforce's incumbent) is made on the same
   views once the request has been sent (`call_soon`), off the request's latency.
   If the live engine is in a priority pool (`ramjet.app.priority`), the request's hint
   (predicted prompt work there, aged by arrival) is computed: logged and counted, and
   in mode `on` inserted into the body as `priority`; otherwise the body is untouched.
5. `ramjet.proxy.forward` forwards; a retry goes to the least-loaded routable engine not tried.
   As it forwards, the prompt's blocks become pending residency on the engine
   (`ResidencySource.add_pending`) until its report confirms them or the forward fails,
   and the engine's in-flight prompt tokens count the prompt's predicted uncached tokens
   there (`ramjet.policy.candidates.uncached_prompt_tokens`), not the whole prompt.
6. On the end, the routed prefix is recorded as approximate residency, metrics are
   updated and a `DecisionRecord` goes to the `DecisionSink`: `ramjet.decisions.accounting`,
   which measures it, logs it (`ramjet.decisions.log`), feeds the mean wait back into
   `FleetStats`, then passes it to the sink given to the router, if any.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import itertools
import json
import logging
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from ramjet.app.modes import ArrivalRate, ModeOutcome, ModeRunner
from ramjet.app.priority import PriorityHint, PriorityHints, without_priority
from ramjet.config import PolicyConfig
from ramjet.decisions.accounting import Accounting
from ramjet.decisions.record import DecisionRecord, DecisionSink
from ramjet.fleet.engines import EngineState, Fleet, HealthProber
from ramjet.fleet.signals import EngineSignals
from ramjet.fleet.views import PoolSpec, engine_views, retry_engine
from ramjet.keys.pools import KeyPools
from ramjet.metrics import RouterMetrics
from ramjet.policy.base import Decision, EngineView
from ramjet.policy.calibration import Calibrations
from ramjet.policy.candidates import uncached_prompt_tokens
from ramjet.policy.fleet_stats import WorkRates, decided_work, fleet_stats
from ramjet.proxy.exchange import Exchange, ForwardResult
from ramjet.proxy.forward import Proxy, Transports, generation_deadline
from ramjet.request.admission import Admission, charged_here, client_of, reject
from ramjet.request.client import ClientExchange
from ramjet.request.openai_errors import json_error
from ramjet.request.parse import (
    ParsedRequest,
    ParseLimits,
    RequestError,
    check_counts,
    count_limits,
    parse_request,
    to_request_view,
)
from ramjet.request.precheck import Prechecker
from ramjet.residency.source import ResidencySource
from ramjet.transport.base import EngineTransport, fetch
from ramjet.types import EngineId

log = logging.getLogger(__name__)

PRECHECK_PROCESS_BYTES = 4 * 1024 * 1024
"""Bodies larger than this have their messages, content parts and prompt items counted
in a child process, off the GIL (`ramjet.request.precheck`)."""
REKEY_INLINE_BYTES = 16 * 1024
"""Bodies larger than this get their token-block keys (`KeyPools.rekey`: the pool's chat
template and tokenizer, some microseconds per token) on the parse threads."""


class Router:
    def __init__(
        self,
        config: PolicyConfig,
        *,
        metrics: RouterMetrics,
        residency: ResidencySource,
        signals: EngineSignals,
        key_pools: KeyPools,
        accounting: Accounting,
        calibration: Calibrations | None,
        fleet: Fleet,
        proxy: Proxy,
        modes: ModeRunner,
        pools: dict[EngineId, tuple[PoolSpec, ...]],
        arrivals: ArrivalRate,
        work_rates: WorkRates,
        parse_limits: ParseLimits,
        trusted_networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...],
        prechecker: Prechecker,
        priority: PriorityHints,
        admission: Admission,
        transports: Transports,
        clock: Callable[[], float],
    ) -> None:
        """Given every part, built (`ramjet.app.wiring.build`); it builds none itself and
        nothing is set on it from outside (a reload swaps its config and mode runner in
        one step: `reconfigure`)."""
        self.config = config
        self.metrics = metrics
        self.residency = residency
        self.signals = signals
        self.clock = clock
        self.calibration = calibration
        self.accounting = accounting
        self.sink: DecisionSink = accounting
        self.fleet = fleet
        self.proxy = proxy
        self.modes = modes
        self.pools = pools
        """Each engine's shared tiers (`ramjet.config.FabricConfig`); empty: islands."""
        self.arrivals = arrivals
        self.work_rates = work_rates
        self.parse_limits = parse_limits
        self._trusted_networks = trusted_networks
        self._parse_pool: ThreadPoolExecutor | None = None
        """Threads parsing large bodies (`_parse`), made on first use."""
        self._prechecker = prechecker
        """Counts a large body's messages in a child process (`ramjet.request.precheck`)."""
        self.key_pools = key_pools
        self.priority = priority
        self.admission = admission
        self._transports = transports
        self.draining = False
        self.leaving = False
        """Set on SIGTERM before the drain (`ramjet serve --shutdown-delay`): /readyz
        answers 503 so load balancers stop sending, while requests are still served."""
        # Request ids without a getrandom() call each: a random per-process prefix and a
        # counter (16 hex digits, as before).
        prefix, counter = secrets.token_hex(4), itertools.count()
        self._new_id: Callable[[], str] = lambda: f"{prefix}{next(counter) & 0xFFFFFFFF:08x}"
        self._exchanges: set[Exchange] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        # Probes and /v1/models go through the engine transport seam, on pools of their
        # own: a probe must not queue behind forwards for a connection.
        self._probe_transports: dict[EngineId, EngineTransport] = {}
        # /v1/models has pools of its own too (a flood of it must not take the probes'
        # connections), and concurrent calls share one fetch of every engine's list.
        self._models_transports: dict[EngineId, EngineTransport] = {}
        self._models_fetch: asyncio.Future[list[dict[str, Any]]] | None = None
        self._prober: HealthProber | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None
        """The loop serving requests, kept on first use (`asyncio.get_running_loop` makes a
        getpid syscall each time)."""

    def leave(self) -> None:
        """Fail /readyz from now on while still serving (`leaving`)."""
        self.leaving = True

    def reconfigure(self, config: PolicyConfig, modes: ModeRunner) -> None:
        """Put `config` and its mode runner in force (a reload, `ramjet.app.reload`), in
        one step between two requests."""
        self.config, self.modes = config, modes

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        await self.proxy.start()
        for e in self.fleet.engines:
            self._probe_transports[e.id] = self._transports(e, "probe")
            self._models_transports[e.id] = self._transports(e, "models")
        self._prober = HealthProber(self.fleet, self._probe, self.config.health)
        await self._prober.probe_all()
        self._prober.start()

    def start_counting_child(self) -> None:
        """Start the process that counts large bodies now, off the loop, rather than on
        the first one (`ramjet.request.precheck`; `ramjet serve` does at start)."""
        self._prechecker.start()

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
        for pt in (*self._probe_transports.values(), *self._models_transports.values()):
            await pt.close()
        self._probe_transports.clear()
        self._models_transports.clear()
        await self.proxy.close()
        self._prechecker.close()
        if self._parse_pool is not None:
            self._parse_pool.shutdown(wait=False, cancel_futures=True)
            self._parse_pool = None
        await asyncio.to_thread(self.accounting.close)

    async def _probe(self, e: EngineState) -> bool:
        status, _ = await fetch(
            self._probe_transports[e.id],
            "GET",
            self.config.health.probe_path,
            timeout_s=self.config.timeouts.probe_s,
        )
        return 200 <= status < 300

    @property
    def inflight(self) -> int:
        return len(self._exchanges)

    # -- handlers -----------------------------------------------------------------------

    async def handle_completion(self, request: ClientExchange) -> web.StreamResponse:
        t0 = self.clock()
        self.arrivals.arrive(t0)
        refused = self.admission.refuse_early(request, self.draining)
        if refused is not None:
            return refused
        # The body first: a client that sends it slowly (or never) holds no slot.
        body = await self.admission.read_body(request)
        if not isinstance(body, bytes):  # refused
            return body
        held = len(body) if charged_here(request) else 0
        try:
            if not self.admission.take():  # else wait for a slot
                refused = await self.admission.acquire()
                if refused is not None:
                    return refused
            try:
                return await self._admitted(request, t0, body)
            finally:
                self.admission.release()
        finally:
            self.admission.bodies.give(held)

    def _priority_trusted(self, request: ClientExchange) -> bool:
        """Whether the client's own `priority` is kept (`limits.priority_trusted_networks`)."""
        if not self._trusted_networks:
            return False
        try:
            addr = ipaddress.ip_address(client_of(request.transport))
        except ValueError:
            return False
        return any(addr in net for net in self._trusted_networks)

    async def _parse(self, request: ClientExchange, body: bytes) -> ParsedRequest:
        """Parse, render and key `body`: a large one on the parse threads, so the event
        loop keeps serving others meanwhile (`limits.parse_thread_bytes`)."""
        if len(body) <= self.config.limits.parse_thread_bytes:
            parsed = parse_request(request.path, body, request.headers, self.parse_limits)
            return parsed
        prechecked = False
        if len(body) > PRECHECK_PROCESS_BYTES:  # its counts, in a child process
            try:
                counts = await self._prechecker.count(body, count_limits(self.parse_limits))
            except Exception:  # the child failed: the parse thread counts instead
                log.exception("counting a body in the child process failed")
            else:
                check_counts(counts, self.parse_limits)
                prechecked = True
        return await self._loop().run_in_executor(
            self._parse_threads(),
            parse_request,
            request.path,
            body,
            request.headers,
            self.parse_limits,
            prechecked,
        )

    def _parse_threads(self) -> ThreadPoolExecutor:
        pool = self._parse_pool
        if pool is None:
            pool = self._parse_pool = ThreadPoolExecutor(
                self.config.limits.parse_threads, thread_name_prefix="ramjet-parse"
            )
        return pool

    async def _rekey(self, parsed: ParsedRequest, engines: list[EngineId]) -> ParsedRequest:
        """`key_pools.rekey`: a chat template and a tokenizer cost far more per byte than
        the parse, so any body over `REKEY_INLINE_BYTES` is keyed on the parse threads,
        off the event loop."""
        if len(parsed.body) <= REKEY_INLINE_BYTES:
            return self.key_pools.rekey(parsed, engines)
        return await self._loop().run_in_executor(
            self._parse_threads(), self.key_pools.rekey, parsed, engines
        )

    def _views(self, model: str, now: float) -> tuple[list[EngineView], web.StreamResponse | None]:
        """The engines' views for `model` at `now`, or the refusal when none serves it or
        every one is backing off."""
        views, serving, retry_after = engine_views(
            self.fleet, self.signals, self.residency, model, now, self.pools
        )
        if not serving:
            return views, reject(
                self.metrics,
                "model_not_found",
                json_error(
                    404,
                    f"The model {model!r} is not served here.",
                    "invalid_request_error",
                    "model_not_found",
                ),
            )
        if not any(v.healthy for v in views):
            return views, reject(
                self.metrics,
                "no_engine",
                json_error(
                    503,
                    "Every engine is backing off; retry later.",
                    "server_error",
                    "engines_unavailable",
                    retry_after_s=max(retry_after, 1.0),
                ),
            )
        return views, None

    async def _admitted(
        self, request: ClientExchange, t0: float, body: bytes
    ) -> web.StreamResponse:
        try:
            parsed = await self._parse(request, body)
        except RequestError as exc:
            self.metrics.rejected.labels(reason=exc.code).inc()
            resp = web.Response(
                status=exc.status, body=exc.to_openai_json(), content_type="application/json"
            )
            return resp
        if "priority" in parsed.json and not self._priority_trusted(request):
            parsed = untrusted_priority_removed(parsed)
        request_id = request.headers.get("X-Request-Id", "")[:64] or self._new_id()
        views, refused = self._views(parsed.model, t0)
        if refused is not None:
            return refused
        now = t0
        if self.key_pools:  # token-block keys for a pool of tokenizing engines
            off_loop = len(parsed.body) > REKEY_INLINE_BYTES
            try:
                parsed = await self._rekey(parsed, [v.id for v in views])
            except RequestError as exc:
                self.metrics.rejected.labels(reason=exc.code).inc()
                return web.Response(
                    status=exc.status, body=exc.to_openai_json(), content_type="application/json"
                )
            if off_loop:  # requests routed while it was keyed are in flight now: look again
                now = self.clock()
                views, refused = self._views(parsed.model, now)
                if refused is not None:
                    return refused
        rv = to_request_view(parsed, request_id)
        session_key = parsed.session or (
            str(parsed.keys.boundaries[0][1]) if parsed.keys.boundaries else request_id
        )
        # engines that serve by the hint's key (`ramjet.app.priority`), where any pool does
        keyed = self.priority.keyed(views, session_key) if self.priority.queues else None
        fleet = fleet_stats(
            now, self.arrivals, self.accounting.waits, self.work_rates, keyed, self.calibration,
            self.config.fleet_stats.calibrated_decisions,
        )  # fmt: skip
        # The accounting-only pick is deferred (`ramjet.app.modes`) unless a priority pool
        # needs every pick's figures for its hint now.
        outcome = self.modes.decide(rv, views, fleet, session_key, defer=not self.priority)
        live = next((v for v in views if v.id == outcome.live.engine), None)
        new = uncached_prompt_tokens(rv, live) if live is not None else parsed.prompt_tokens
        routed_work = _work(outcome, outcome.live.engine)
        if routed_work is not None:  # the packing term's ρ (`ramjet.policy.fleet_stats`)
            self.work_rates.routed(t0, outcome.live.engine, routed_work)
        if outcome.deferred is not None:  # made once the forward has yielded to the loop
            self._loop().call_soon(self._settle, outcome, t0)
        body, hint = parsed.body, None
        if self.priority:  # priority hints (`ramjet.app.priority`): the body changes if sent
            age = self.clock() - t0
            body, hint = self.priority.apply(
                parsed, rv, live, outcome, fleet, session_key, age, routed_work
            )
            if hint is not None and hint.sent:
                self.priority.track(hint, request_id, t0, new)
        return await self._forward(
            request, parsed, outcome, request_id, t0, tuple(views), new, body, hint
        )

    async def _forward(
        self,
        request: ClientExchange,
        parsed: ParsedRequest,
        outcome: ModeOutcome,
        request_id: str,
        t0: float,
        views: tuple[EngineView, ...],
        new_tokens: int,
        body: bytes,
        hint: PriorityHint | None = None,
    ) -> web.StreamResponse:
        """`new_tokens`: the prompt tokens predicted uncached on the live engine, counted
        in flight there until the first byte (a retry counts the same figure). `body`: what
        is forwarded (the client's, or with a priority hint `hint`)."""
        first = self.fleet.get(outcome.live.engine)
        t = self.config.timeouts
        deadline_s = (
            None
            if parsed.stream
            else generation_deadline(t.first_byte_s, t.token_s, t.generation_s, parsed.max_tokens)
        )
        pending = self.residency.add_pending(first.id, parsed.keys, self.clock())
        exchange = Exchange()
        self._exchanges.add(exchange)
        self._idle.clear()
        res = ForwardResult()
        try:
            resp, res = await self.proxy.forward(
                request,
                body,
                first,
                new_tokens,
                lambda tried: retry_engine(self.fleet, parsed.model, tried),
                request_id,
                exchange,
                deadline_s,
                res,
                max(parsed.prompt_tokens - new_tokens, 0),
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
            if hint is not None and hint.sent:
                self.priority.untrack(hint, request_id)
            self._account(parsed, outcome, request_id, t0, res, views, hint)

    def _settle(self, outcome: ModeOutcome, t0: float) -> None:
        """Make `outcome`'s deferred accounting-only pick if it is still pending (scheduled
        right after the decision; `_account` makes sure of it); its predicted work feeds
        the packing term's ρ when the live pick recorded none (observe's baseline
        incumbent), as it would have at decide time."""
        if outcome.deferred is None:  # made already (the usual case in `_account`) or none
            return
        engine = outcome.live.engine
        counted = _work(outcome, engine) is not None  # at decide time
        self.modes.settle(outcome)
        work = None if counted else _work(outcome, engine)
        if work is not None:
            self.work_rates.routed(t0, engine, work)

    def _loop(self) -> asyncio.AbstractEventLoop:
        loop = self._event_loop
        if loop is None:
            loop = self._event_loop = asyncio.get_running_loop()
        return loop

    def _account(
        self,
        parsed: ParsedRequest,
        outcome: ModeOutcome,
        request_id: str,
        t0: float,
        res: ForwardResult,
        views: tuple[EngineView, ...],
        hint: PriorityHint | None = None,
    ) -> None:
        self._settle(outcome, t0)
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
        live, incumbent, candidate = outcome.live, outcome.incumbent, outcome.candidate
        capped = self.residency.capped_engines()
        if capped:  # a match on them may be missing: say so in every pick
            notes = tuple(f"residency_capped:{v.id}" for v in views if v.id in capped)
            if notes:
                live = _noted(live, notes)
                incumbent = None if incumbent is None else _noted(incumbent, notes)
                candidate = None if candidate is None else _noted(candidate, notes)
        record = DecisionRecord(
            request_id=request_id,
            time_unix=time.time(),
            model=parsed.model,
            session=parsed.session,
            prompt_tokens=parsed.prompt_tokens,
            stream=parsed.stream,
            mode=self.config.mode.kind,
            live_role=outcome.live_role,
            live=live,
            incumbent=incumbent,
            candidate=candidate,
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
            priority=None if hint is None else hint.to_json(),
        )
        try:
            self.sink.on_decision(record)
        except Exception:  # accounting must never fail a request
            log.exception("decision sink failed")

    async def handle_models(self, request: web.Request) -> web.Response:
        """The union of the engines' models (live from each admitted engine, else config).
        Requests that come while a fetch of the engines' lists is under way share it, on
        pools apart from the health probes' (a flood of this route must not starve them)."""
        fetching = self._models_fetch
        if fetching is None:
            fetching = self._models_fetch = asyncio.ensure_future(self._fetch_models())

            def done(f: asyncio.Future[list[dict[str, Any]]]) -> None:
                if self._models_fetch is f:
                    self._models_fetch = None

            fetching.add_done_callback(done)
        data = await asyncio.shield(fetching)
        return web.json_response({"object": "list", "data": data})

    async def _fetch_models(self) -> list[dict[str, Any]]:
        timeout_s = self.config.timeouts.probe_s

        async def one(e: EngineState) -> list[dict[str, Any]]:
            declared = [{"id": m, "object": "model", "owned_by": e.id} for m in e.models]
            if e.ejected or e.id not in self._models_transports:
                return declared
            try:
                status, body = await fetch(
                    self._models_transports[e.id], "GET", "/v1/models", timeout_s=timeout_s
                )
                if status != 200:
                    return declared
                data = json.loads(body)
                got = [m for m in data.get("data", []) if isinstance(m, dict) and "id" in m]
                return got + declared
            except (OSError, TimeoutError, ValueError, AttributeError):
                return declared

        merged: dict[str, dict[str, Any]] = {}
        for models in await asyncio.gather(*(one(e) for e in self.fleet.engines)):
            for m in models:
                merged.setdefault(str(m["id"]), m)
        return list(merged.values())

    async def handle_healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def handle_readyz(self, request: web.Request) -> web.Response:
        engines = {
            e.id: {"healthy": e.healthy, "probe_ok": e.probe_ok, "ejected": e.ejected}
            for e in self.fleet.engines
        }
        ready = self.fleet.ready() and not self.draining and not self.leaving
        return web.json_response(
            {"ready": ready, "draining": self.draining or self.leaving, "engines": engines},
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


def untrusted_priority_removed(parsed: ParsedRequest) -> ParsedRequest:
    """`parsed` with the client's top-level `priority` taken out of its body and JSON (a
    client not in `limits.priority_trusted_networks`)."""
    rest = {k: v for k, v in parsed.json.items() if k != "priority"}
    return dataclasses.replace(parsed, body=without_priority(parsed.body), json=rest)


def _noted(d: Decision, notes: tuple[str, ...]) -> Decision:
    """`d` with `notes` added (`residency_capped:<engine>`: the residency table's cap
    evicted entries the engine's reports confirmed, so its match may be missing)."""
    return Decision(d.engine, d.policy, d.components, d.notes + notes)


def _work(outcome: ModeOutcome, engine: EngineId) -> float | None:
    """`decided_work` on `engine` from `outcome`'s decisions."""
    return decided_work(engine, outcome.live, outcome.candidate, outcome.incumbent)
