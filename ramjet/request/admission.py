"""Admission: whether a request may enter the router, and reading its body under limits.

In order, before anything is parsed (each refusal is an OpenAI error object and counts in
`ramjet_rejected_requests_total` by reason):

1. header lines summing over `limits.max_header_bytes`: 431;
2. the router draining: 503 with Retry-After;
3. a declared Content-Length over `limits.max_body_bytes`: 413, before reading anything;
4. the body, read before any forwarding slot is taken (a client that sends its body
   slowly, or never, holds no slot): within `timeouts.body_s` (408 past it); a chunked
   body is cut off with 413 as soon as it passes `limits.max_body_bytes`, a malformed one
   is 400. While it is read:
   - its bytes are charged to one budget for all bodies held at once
     (`limits.max_inflight_body_bytes`, `BodyBudget`, shared with
     `ramjet.app.fast_server`, which charges the bodies it reads): a body that does not
     fit is 503 `overloaded` with Retry-After; the charge is given back when the
     request ends;
   - the connection counts as one of its client's connections that have not sent a
     whole request (`PendingClients`, shared with the servers, which count connections
     whose head is not complete): past `limits.max_pending_per_client`, 429
     `too_many_pending`;
5. a forwarding slot: at most `limits.max_concurrent` requests forward at once and
   `limits.queue` more wait, each at most `limits.queue_timeout_s`; beyond either, 503
   with Retry-After.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable

import aiohttp
from aiohttp import web

from ramjet.config import LimitsConfig
from ramjet.metrics import RouterMetrics
from ramjet.request.client import ClientExchange
from ramjet.request.openai_errors import json_error


def reject(metrics: RouterMetrics, reason: str, resp: web.Response) -> web.Response:
    """Count the refusal under `reason` and hand back its response."""
    metrics.rejected.labels(reason=reason).inc()
    return resp


def too_big(limit: int) -> web.Response:
    return json_error(
        413,
        f"Request body exceeds {limit} bytes.",
        "invalid_request_error",
        "request_too_large",
        close=True,
    )


def overloaded() -> web.Response:
    return json_error(
        503,
        "The router is at capacity; retry later.",
        "server_error",
        "overloaded",
        retry_after_s=1.0,
    )


def too_many_pending(limit: int) -> web.Response:
    return json_error(
        429,
        f"More than {limit} connections from this client have not sent a whole request.",
        "invalid_request_error",
        "too_many_pending",
        retry_after_s=1.0,
        close=True,
    )


def client_of(transport: object) -> str:
    """The client address of a connection's transport ("" when unknown)."""
    get = getattr(transport, "get_extra_info", None)
    peer = get("peername") if get is not None else None
    if isinstance(peer, tuple) and peer:
        return str(peer[0])
    return ""


class PendingClients:
    """Per client address, the connections that have not sent a whole request yet
    (`limits.max_pending_per_client`); on the event loop only."""

    __slots__ = ("counts", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.counts: dict[str, int] = {}

    def enter(self, client: str) -> bool:
        """Count one more pending connection of `client`: False (nothing counted) when
        it has `limit` already."""
        n = self.counts.get(client, 0)
        if n >= self.limit:
            return False
        self.counts[client] = n + 1
        return True

    def leave(self, client: str) -> None:
        n = self.counts.get(client, 0) - 1
        if n > 0:
            self.counts[client] = n
        else:
            self.counts.pop(client, None)


SWEEP_DELAY_S = 0.1
"""How long after a client passes `limits.max_silent_per_client` its oldest silent
connections are closed (see `SilentConnections`)."""


class SilentConnections:
    """Per client address, the connections that have sent no byte yet since connect
    (`limits.max_silent_per_client`), oldest first; on the event loop only.

    Past the limit, the client's oldest silent connections are closed rather than the
    new one refused: a connection cannot tell whether its request will come, and a client
    (or the clients behind one address, such as an ingress) that opens a new connection
    to send a request must not be locked out by idle ones. The closing waits
    `SWEEP_DELAY_S` (at least one poll of the sockets): a burst of new connections is
    accepted before any of their requests is read, and those that bring one leave the
    count meanwhile."""

    __slots__ = ("_loop", "_sweeps", "by_client", "delay_s", "evicted", "limit", "on_evict")

    def __init__(
        self,
        limit: int,
        on_evict: Callable[[], None] = lambda: None,
        delay_s: float = SWEEP_DELAY_S,
    ) -> None:
        self.limit = limit
        self.delay_s = delay_s
        self.by_client: dict[str, dict[object, Callable[[], None]]] = {}
        self.evicted = 0
        """Silent connections closed to make room so far (tests read it)."""
        self.on_evict = on_evict
        """Called per eviction (the router counts it as a `too_many_silent` refusal)."""
        self._sweeps: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, client: str, conn: object, close: Callable[[], None]) -> None:
        """Count `conn` as silent; `close()` closes it should it be evicted."""
        conns = self.by_client.get(client)
        if conns is None:
            conns = self.by_client[client] = {}
        conns[conn] = close
        if len(conns) > self.limit and client not in self._sweeps:
            self._sweeps.add(client)
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            loop.call_later(self.delay_s, self._sweep, client)

    def _sweep(self, client: str) -> None:
        """Close `client`'s oldest silent connections while it has more than the limit."""
        self._sweeps.discard(client)
        conns = self.by_client.get(client)
        while conns and len(conns) > self.limit:
            oldest = next(iter(conns))
            evict = conns.pop(oldest)
            self.evicted += 1
            self.on_evict()
            evict()
        if conns is not None and not conns:
            self.by_client.pop(client, None)

    def remove(self, client: str, conn: object) -> None:
        """`conn` sent its first byte, or went away (no-op if it was not counted)."""
        conns = self.by_client.get(client)
        if conns is not None and conns.pop(conn, None) is not None and not conns:
            del self.by_client[client]

    def count(self, client: str) -> int:
        return len(self.by_client.get(client, ()))


class BodyBudget:
    """Bytes of request bodies held at once, under `limits.max_inflight_body_bytes`; on
    the event loop only."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> bool:
        """Charge `n` bytes: False (nothing charged) when they do not fit."""
        if n > 0 and self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


def bodies_over_budget() -> web.Response:
    return json_error(
        503,
        "The router holds too many request bodies; retry later.",
        "server_error",
        "overloaded",
        retry_after_s=1.0,
        close=True,
    )


def charged_here(request: ClientExchange) -> bool:
    """Whether `Admission.read_body` charges this request's body to the body budget
    (False: `ramjet.app.fast_server` read it and charged it)."""
    return not request.budgeted


def header_bytes(request: ClientExchange) -> int:
    """Bytes of the request's header lines (name, ": ", value, CRLF)."""
    return sum(len(k) + len(v) + 4 for k, v in request.raw_headers)


class Slots:
    """`limit` forwarding slots, handed out in arrival order. `take` is the common case, a
    free slot with nobody waiting, as a plain call (no coroutine, no await: an
    `asyncio.Semaphore.acquire` cost ~1 us of interpreted code per request); `wait` queues
    for one. Each slot taken or waited for is given back once with `release`. On the
    event loop only."""

    __slots__ = ("_waiters", "free")

    def __init__(self, limit: int) -> None:
        self.free = limit
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def take(self) -> bool:
        """A slot now (True; `release` it), or False when none is free or others wait."""
        if self.free > 0 and not self._waiters:
            self.free -= 1
            return True
        return False

    async def wait(self) -> None:
        """Wait, behind every earlier waiter, for a slot (`release` it). Cancelled (or
        timed out) while waiting, it holds nothing: a slot handed to it in that moment
        goes on to the next waiter."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._hand_out()  # free slots with only given-up waiters ahead
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release()
            else:
                # still queued, unless `_hand_out` already popped and skipped it
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
            raise

    def release(self) -> None:
        self.free += 1
        if self._waiters:
            self._hand_out()

    def _hand_out(self) -> None:
        waiters = self._waiters
        while self.free > 0 and waiters:
            fut = waiters.popleft()
            if not fut.done():  # a cancelled waiter is skipped
                self.free -= 1
                fut.set_result(None)

    @property
    def waiting(self) -> int:
        """Waiters still in the queue (given-up ones included until they leave it)."""
        return len(self._waiters)


class Admission:
    """The router's forwarding slots and its per-request limits (see module docstring).
    Used on the event loop only."""

    def __init__(self, limits: LimitsConfig, body_timeout_s: float, metrics: RouterMetrics):
        self.limits = limits
        self.body_timeout_s = body_timeout_s
        self.metrics = metrics
        self._slots = Slots(limits.max_concurrent)
        self._waiting = 0
        self.bodies = BodyBudget(limits.max_inflight_body_bytes)
        """Every body held at once (the fast server charges the ones it reads)."""
        self.pending = PendingClients(limits.max_pending_per_client)
        """Connections that have not sent a whole request, by client (both servers)."""
        self.silent = SilentConnections(
            limits.max_silent_per_client,
            lambda: metrics.rejected.labels(reason="too_many_silent").inc(),
        )
        """Connections that have sent nothing since connect, by client (both servers)."""

    def refuse_early(self, request: ClientExchange, draining: bool) -> web.Response | None:
        """The refusal for a request that must not wait for a slot (steps 1-3), or None."""
        if header_bytes(request) > self.limits.max_header_bytes:
            return reject(
                self.metrics,
                "headers_too_large",
                json_error(
                    431,
                    "Request headers too large.",
                    "invalid_request_error",
                    "headers_too_large",
                    close=True,
                ),
            )
        if draining:
            return reject(
                self.metrics,
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
        lim = self.limits
        if request.content_length is not None and request.content_length > lim.max_body_bytes:
            return reject(self.metrics, "body_too_large", too_big(lim.max_body_bytes))
        return None

    def take(self) -> bool:
        """A forwarding slot now (step 4's common case): True once held (the caller must
        `release` it); False when the caller must `acquire`."""
        return self._slots.take()

    async def acquire(self) -> web.Response | None:
        """Wait for a forwarding slot (step 4): None once held (the caller must `release`
        it), else the refusal."""
        if self._slots.take():
            return None
        lim = self.limits
        if self._waiting >= lim.queue:
            return reject(self.metrics, "overload", overloaded())
        self._waiting += 1
        self.metrics.queued.set(self._waiting)
        try:
            async with asyncio.timeout(lim.queue_timeout_s):
                await self._slots.wait()
        except TimeoutError:
            return reject(self.metrics, "queue_timeout", overloaded())
        finally:
            self._waiting -= 1
            self.metrics.queued.set(self._waiting)
        return None

    def release(self) -> None:
        self._slots.release()

    async def read_body(self, request: ClientExchange) -> bytes | web.Response:
        """The whole body, or the refusal (413, 408, 400, 503, 429) if it is too big,
        late, bad, over the body budget or one pending connection too many. A body read
        here is charged to the body budget, `charged(request, body)` bytes: the caller
        gives them back (`bodies.give`) when the request ends. A refusal holds nothing."""
        limit = self.limits.max_body_bytes
        content = request.content
        if content.is_eof() and content.exception() is None:
            # The whole body arrived with the headers (the common case): no wait, no timer.
            data = content.read_nowait()
            if len(data) > limit:
                return reject(self.metrics, "body_too_large", too_big(limit))
            if not charged_here(request) or self.bodies.take(len(data)):
                return data
            return reject(self.metrics, "body_budget", bodies_over_budget())
        client = client_of(request.transport)
        if not self.pending.enter(client):
            return reject(self.metrics, "too_many_pending", too_many_pending(self.pending.limit))
        held = [0]
        ok = False
        try:
            got = await self._read_rest(request, held, limit)
            ok = isinstance(got, bytes)
            return got
        finally:
            self.pending.leave(client)
            if not ok:
                self.bodies.give(held[0])

    async def _read_rest(
        self, request: ClientExchange, held: list[int], limit: int
    ) -> bytes | web.Response:
        """The body after what came with the head, charged to the budget as it comes
        (`held[0]`, bytes charged so far)."""
        declared = request.content_length
        if declared is not None:  # charged whole, before a byte is read
            if not self.bodies.take(declared):
                return reject(self.metrics, "body_budget", bodies_over_budget())
            held[0] = declared
        parts: list[bytes] = []
        total = 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while True:
                    chunk = await request.content.readany()
                    if not chunk:
                        break
                    total += len(chunk)
                    if total > limit:
                        return reject(self.metrics, "body_too_large", too_big(limit))
                    if declared is None:  # chunked: charged as it comes
                        if not self.bodies.take(len(chunk)):
                            return reject(self.metrics, "body_budget", bodies_over_budget())
                        held[0] += len(chunk)
                    parts.append(chunk)
        except TimeoutError:
            return reject(
                self.metrics,
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
            return reject(
                self.metrics,
                "bad_body",
                json_error(
                    400,
                    f"Malformed request body: {exc}",
                    "invalid_request_error",
                    "bad_body",
                    close=True,
                ),
            )
        body = b"".join(parts)
        if held[0] != len(body):  # a short body (the client's framing): charge what came
            self.bodies.give(held[0] - len(body))
            held[0] = len(body)
        return body
