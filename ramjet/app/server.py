"""The router's HTTP server: aiohttp app, connection-level limits, lifecycle.

Plain completion requests (`POST /v1/chat/completions` and `/v1/completions` with a
Content-Length body) are served by `ramjet.app.fast_server`, an asyncio protocol on
httptools that every connection starts on; it hands a connection to the aiohttp handler
below, replaying the bytes it read, for anything else (other routes, chunked bodies,
anything malformed or over a limit). `RouterServer(fast_path=False)` leaves everything
to aiohttp. With `logging.access_log`, both write the same lines to `ramjet.access`.

Connection-level protections live below the app, in a `RequestHandler` subclass:

- **Header deadline** (slowloris): once a connection has sent the first byte of a
  request (or right after connect), its headers must be complete within
  `timeouts.header_deadline_s`, else it gets 408 and is closed. Other connections are
  unaffected (the timer is per connection, on the event loop).
- **Pending connections** (`limits.max_pending_per_client`): from the first bytes of a
  request that did not come with its whole head until the head is in, a connection
  counts as one of its client's that have not sent a whole request (the router counts
  it again while its body is read); one too many is answered 429 `too_many_pending`
  and closed.
- **Silent connections** (`limits.max_silent_per_client`): from connect to its first
  byte a connection counts as one of its client's silent ones; past the limit, the
  client's oldest are closed (after `SilentConnections`' short delay, so a burst whose
  requests are on their way loses none; the header deadline bounds each too).
- **Parser refusals**: aiohttp's strict parser rejects Content-Length with
  Transfer-Encoding, duplicate Content-Length, bare LF, CR/LF in header values, too many
  headers and over-long header lines. They are answered with an OpenAI error object
  (431 for too many headers, else 400) and the connection is closed; nothing reaches an
  engine because no handler ever runs.

Public API for tests and the CLI:

- `create_app(config, ...) -> web.Application` (the `Router` is at `app[ROUTER_KEY]`;
  it and its parts are built by `ramjet.app.wiring.build`);
- `RouterServer(config, host, port=0)`: `await start()`, `.url`, `.router`,
  `await stop(drain_s=...)`;
- `serve(config, host, port)`: runs until SIGTERM/SIGINT, then drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from prometheus_client import CollectorRegistry

from ramjet.app.fast_server import FastServer, raw_error
from ramjet.app.reload import admin_reload_handler, on_sighup
from ramjet.app.router import Router
from ramjet.app.wiring import FastServerFactory, Wired, build, fast_server, mount
from ramjet.config import PolicyConfig
from ramjet.decisions.record import DecisionSink
from ramjet.proxy.forward import Transports
from ramjet.request.admission import PendingClients, SilentConnections, client_of
from ramjet.request.client import AiohttpExchange
from ramjet.request.openai_errors import json_error
from ramjet.residency.tables import ResidencyTables
from ramjet.runtime.gc import tune_gc

log = logging.getLogger(__name__)

ROUTER_KEY = web.AppKey("router", Router)


class _Handler(RequestHandler):
    """aiohttp's connection handler plus a header deadline and OpenAI-style refusals."""

    def __init__(
        self,
        manager: Any,
        *,
        header_deadline_s: float,
        pending: PendingClients | None = None,
        silent: SilentConnections | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, **kwargs)
        self._silent = silent
        """Counted there from connect to the first byte (None: not counted, as for a
        connection the fast server hands over, which has sent bytes)."""
        self._deadline_s = header_deadline_s
        self._deadline: asyncio.TimerHandle | None = None
        self._pending = pending
        self._client = ""
        self._counted = False

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self._loop.call_later(self._deadline_s, self._headers_late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._uncount()

    def _count(self) -> None:
        """A request's first bytes came without its whole head: count the connection as
        its client's pending one (`limits.max_pending_per_client`); one too many is
        answered 429 and closed."""
        pending = self._pending
        if self._counted or pending is None:
            return
        if pending.enter(self._client):
            self._counted = True
            return
        if self.transport is not None:
            self.transport.write(
                raw_error(
                    429,
                    "Too Many Requests",
                    f"More than {pending.limit} connections from this client have "
                    "not sent a whole request.",
                    "too_many_pending",
                    retry_after_s=1,
                )
            )
        self.force_close()
        if self.transport is not None:
            self.transport.close()

    def _uncount(self) -> None:
        if self._counted and self._pending is not None:
            self._counted = False
            self._pending.leave(self._client)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._client = client_of(transport)
        self._arm()
        if self._silent is not None:
            self._silent.add(self._client, self, self._evicted)

    def _unsilence(self) -> None:
        silent, self._silent = self._silent, None
        if silent is not None:
            silent.remove(self._client, self)

    def _evicted(self) -> None:
        """Closed to make room for a newer silent connection of the same client."""
        self._silent = None
        self.force_close()
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._unsilence()
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._silent is not None:
            self._unsilence()
        idle = not self._request_in_progress and not self._messages
        super().data_received(data)
        if self._request_in_progress or self._messages:
            self._disarm()
        elif data and idle:
            # The first bytes of a request whose headers are not complete yet. (A
            # request that arrives whole, the common case, never arms the timer.)
            self._arm()
            self._count()

    def _headers_late(self) -> None:
        self._deadline = None
        self._uncount()
        if self._request_in_progress or self._messages or self.transport is None:
            return
        self.transport.write(
            raw_error(
                408, "Request Timeout", "Request headers not received in time.", "request_timeout"
            )
        )
        self.force_close()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if isinstance(exc, HttpProcessingError):
            text = str(exc.message).strip().splitlines()[0] if exc.message else "Bad request"
            if "Too many headers" in text:
                resp = json_error(
                    431, text, "invalid_request_error", "too_many_headers", close=True
                )
            else:
                code = "header_too_large" if isinstance(exc, LineTooLong) else "bad_request"
                resp = json_error(400, text, "invalid_request_error", code, close=True)
            log.debug("refused malformed request: %s", text)
            return resp
        if status == 500 and exc is not None:
            log.error("unhandled error", exc_info=exc)
        return json_error(
            status, message or "Internal error.", "server_error", f"http_{status}", close=True
        )


class _Server(web.Server):
    def __init__(
        self,
        *args: Any,
        header_deadline_s: float,
        pending: PendingClients | None,
        silent: SilentConnections | None,
        fast: FastServerFactory | None,
        **kwargs: Any,
    ) -> None:
        """`pending`, `silent`: the router's pending and silent connections by client;
        `fast`: builds the completion routes' own server, in front (over `handler`, its
        fallback)."""
        super().__init__(*args, **kwargs)
        self._header_deadline_s = header_deadline_s
        self.pending = pending
        self.silent = silent
        self.fast = None if fast is None else fast(self.handler)

    def handler(self) -> _Handler:
        """aiohttp's handler for one connection (with the header deadline)."""
        return _Handler(
            self,
            loop=self._loop,
            header_deadline_s=self._header_deadline_s,
            pending=self.pending,
            **self._kwargs,
        )

    def __call__(self) -> RequestHandler:
        if self.fast is not None:
            # The fast server's protocol, which hands a connection to `handler()` for
            # anything it does not serve itself (`ramjet.app.fast_server`).
            return self.fast()  # type: ignore[return-value]
        handler = self.handler()
        handler._silent = self.silent  # counted from connect (not when handed over)
        return handler

    def pre_shutdown(self) -> None:
        super().pre_shutdown()
        if self.fast is not None:
            self.fast.close_idle()

    async def shutdown(self, timeout: float | None = None) -> None:
        await super().shutdown(timeout)
        if self.fast is not None:
            await self.fast.shutdown(timeout or 0.0)


class _Runner(web.AppRunner):
    def __init__(
        self,
        app: web.Application,
        *,
        header_deadline_s: float,
        pending: PendingClients | None = None,
        silent: SilentConnections | None = None,
        fast: FastServerFactory | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(app, **kwargs)
        self._header_deadline_s = header_deadline_s
        self._pending = pending
        self._silent = silent
        self._fast = fast
        self.fast: FastServer | None = None
        """The completion routes' own server, once the server is made (with `fast`)."""

    async def _make_server(self) -> web.Server:
        loop = asyncio.get_running_loop()
        app = self._app
        app._set_loop(loop)
        app.on_startup.freeze()
        await app.startup()
        app.freeze()
        server = _Server(
            app._handle,
            request_factory=app._make_request,
            loop=loop,
            header_deadline_s=self._header_deadline_s,
            pending=self._pending,
            silent=self._silent,
            fast=self._fast,
            **self._kwargs,
        )
        self.fast = server.fast
        return server


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        resp: web.StreamResponse = await handler(request)
        return resp
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return json_error(exc.status, exc.reason, "invalid_request_error", f"http_{exc.status}")


def create_app(
    config: PolicyConfig,
    *,
    registry: CollectorRegistry | None = None,
    residency: ResidencyTables | None = None,
    sink: DecisionSink | None = None,
    policy_path: str | None = None,
    ops_routes: bool = True,
    transports: Transports | None = None,
) -> web.Application:
    """The router as an aiohttp app; start/stop ride on the app's lifecycle.
    `ops_routes` False leaves out /metrics and /admin/reload (`RouterServer`'s ops port
    serves them instead: `ops_app`).
    `policy_path` is the file `POST /admin/reload` reloads (`ramjet.app.reload`); key files
    in its `keys:` section resolve against its directory. A policy with engine keys gets
    the signed-report runtime; the router is built by `ramjet.app.wiring`."""
    wired = build(
        config,
        registry=registry,
        residency=residency,
        sink=sink,
        policy_path=policy_path,
        transports=transports,
    )
    return app_of(wired, policy_path, ops_routes)


def app_of(wired: Wired, policy_path: str | None, ops_routes: bool = True) -> web.Application:
    """The aiohttp app over a built router (see `create_app`)."""
    r = wired.router
    app = web.Application(middlewares=[_errors], client_max_size=r.config.limits.max_body_bytes)
    app[ROUTER_KEY] = r
    mount(app, wired)

    async def completion(request: web.Request) -> web.StreamResponse:
        return await r.handle_completion(AiohttpExchange(request))

    app.router.add_post("/v1/chat/completions", completion)
    app.router.add_post("/v1/completions", completion)
    app.router.add_get("/v1/models", r.handle_models)
    app.router.add_get("/healthz", r.handle_healthz)
    app.router.add_get("/readyz", r.handle_readyz)
    if ops_routes:
        app.router.add_get("/metrics", r.handle_metrics)
        app.router.add_post("/admin/reload", admin_reload_handler(r, policy_path))

    async def on_startup(_: web.Application) -> None:
        await r.start()

    async def on_cleanup(_: web.Application) -> None:
        await r.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def ops_app(router: Router, policy_path: str | None) -> web.Application:
    """The operators' routes alone (/metrics, /admin/reload, /healthz, /readyz), for a
    port of their own that the client-facing Service does not expose."""
    app = web.Application()
    app.router.add_get("/metrics", router.handle_metrics)
    app.router.add_post("/admin/reload", admin_reload_handler(router, policy_path))
    app.router.add_get("/healthz", router.handle_healthz)
    app.router.add_get("/readyz", router.handle_readyz)
    return app


class RouterServer:
    """A router listening on a socket (port 0 picks a free one); with `ops_port` (0: a
    free one) /metrics and /admin/reload move from it to a second listener (`ops_app`)."""

    def __init__(
        self,
        config: PolicyConfig,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        registry: CollectorRegistry | None = None,
        residency: ResidencyTables | None = None,
        sink: DecisionSink | None = None,
        policy_path: str | None = None,
        fast_path: bool = True,
        ops_port: int | None = None,
    ) -> None:
        """`fast_path`: serve plain completion requests from `ramjet.app.fast_server`
        (off: aiohttp serves everything). Both log the same access lines."""
        self.config = config
        self.fast_path = fast_path
        self.host = host
        self.port = port
        self.app = create_app(
            config,
            registry=registry,
            residency=residency,
            sink=sink,
            policy_path=policy_path,
            ops_routes=ops_port is None,
        )
        self.router = self.app[ROUTER_KEY]
        self.ops_port = ops_port
        self._ops: web.AppRunner | None = None
        if ops_port is not None:
            self._ops = web.AppRunner(ops_app(self.router, policy_path), access_log=None)
        lim = config.limits
        self._runner = _Runner(
            self.app,
            header_deadline_s=config.timeouts.header_deadline_s,
            pending=self.router.admission.pending,
            silent=self.router.admission.silent,
            fast=fast_server(self.router) if self.fast_path else None,
            handler_cancellation=True,
            access_log=logging.getLogger("ramjet.access") if config.logging.access_log else None,
            max_line_size=lim.max_header_line_bytes,
            max_field_size=lim.max_header_line_bytes,
            max_headers=lim.max_headers,
            shutdown_timeout=1.0,
            lingering_time=config.timeouts.linger_s,
        )
        self._site: web.TCPSite | None = None

    @property
    def fast(self) -> FastServer | None:
        """The completion routes' own server while started with `fast_path`."""
        return self._runner.fast

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self.host, self.port, backlog=1024)
        await self._site.start()
        listening = self._site._server
        if self.port == 0 and listening is not None:
            self.port = listening.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        if self._ops is not None:
            await self._ops.setup()
            ops_site = web.TCPSite(self._ops, self.host, self.ops_port)
            await ops_site.start()
            if self.ops_port == 0 and ops_site._server is not None:
                self.ops_port = ops_site._server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    @property
    def ops_url(self) -> str:
        """The ops listener's base URL (`ops_port` set and started)."""
        return f"http://{self.host}:{self.ops_port}"

    async def stop(self, drain_s: float | None = None) -> None:
        """Drain (refuse new, finish or end in-flight), then close everything."""
        await self.router.drain(drain_s)
        await self._runner.cleanup()
        if self._ops is not None:
            await self._ops.cleanup()


async def serve(
    config: PolicyConfig,
    host: str,
    port: int,
    policy_path: str | None = None,
    shutdown_delay_s: float = 0.0,
    ops_port: int | None = None,
) -> None:
    """Run until SIGTERM/SIGINT; then, for `shutdown_delay_s`, fail /readyz while still
    serving (load balancers that poll it stop sending first), then drain for
    `timeouts.drain_s` and exit; a second signal cuts the delay short. SIGHUP
    reloads mode and policies from `policy_path` (`ramjet.app.reload`). With `store.kind:
    redis` the residency is shared with other replicas (docs/redis.md; built and started
    by `ramjet.app.wiring`)."""
    server = RouterServer(config, host, port, policy_path=policy_path, ops_port=ops_port)
    await server.start()
    server.router.start_counting_child()  # ready before the first large body
    tune_gc()  # start-up state frozen, fewer young collections (`ramjet.runtime.gc`)
    log.info("ramjet listening on %s (mode %s)", server.url, config.mode.kind)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if policy_path is not None:
        loop.add_signal_handler(signal.SIGHUP, on_sighup, server.router, policy_path)
    await stop.wait()
    if shutdown_delay_s > 0:
        server.router.leave()
        stop.clear()
        log.info("leaving: /readyz fails, still serving for %.1fs", shutdown_delay_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), shutdown_delay_s)
    log.info("draining (up to %.0fs)", config.timeouts.drain_s)
    await server.stop()
