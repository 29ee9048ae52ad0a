"""The forward path up to the first byte (`Proxy.open`: attempts, retries, error kinds,
in-flight counts, aborts), `fetch` and the health prober over in-memory engines
(`ramjet.transport.base.MemoryTransport`): no sockets. The same path over real sockets is tests/integration/test_proxy_faults.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from ramjet.config import PolicyConfig, parse_policy
from ramjet.fleet.engines import EngineState, Fleet, HealthProber
from ramjet.fleet.views import retry_engine
from ramjet.metrics import RouterMetrics
from ramjet.proxy.exchange import Exchange, ForwardResult
from ramjet.proxy.forward import Opened, Proxy
from ramjet.transport.base import (
    EngineTransport,
    MemoryReply,
    MemoryRequest,
    MemoryResponse,
    MemoryTransport,
    UpstreamClosed,
    UpstreamConnectError,
    fetch,
)
from ramjet.transport.http1 import EnginePool

BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
REPLY = b'{"id":"x","choices":[]}'
Engine = Callable[[MemoryRequest], Awaitable[MemoryReply]]


def _config(n: int = 2, **retry: object) -> PolicyConfig:
    return parse_policy(
        {
            "engines": [{"id": f"e{i}", "url": f"http://127.0.0.1:{9000 + i}"} for i in range(n)],
            "incumbent": {"name": "round_robin"},
            "timeouts": {"first_byte_s": 0.2},
            "retry": {"max_attempts": 2, **retry},
        }
    )


async def ok(req: MemoryRequest) -> MemoryReply:
    return MemoryReply(200, {"Content-Type": "application/json"}, REPLY)


async def refused(req: MemoryRequest) -> MemoryReply:
    raise UpstreamConnectError("connect refused")


class Rig:
    """A real Proxy and Fleet whose engines are coroutines."""

    def __init__(self, engines: list[Engine], **retry: object) -> None:
        self.config = _config(len(engines), **retry)
        self.fleet = Fleet(
            self.config.engines, self.config.health, self.config.retry, time.monotonic
        )
        self.metrics = RouterMetrics()
        self.transports = {f"e{i}": MemoryTransport(h) for i, h in enumerate(engines)}
        self.proxy = Proxy(
            self.config, self.fleet, self.metrics, transports=lambda e: self.transports[e.id]
        )

    def engine(self, i: int) -> EngineState:
        return self.fleet.get(f"e{i}")

    async def open(self, res: ForwardResult, exchange: Exchange | None = None) -> Opened | None:
        return await self.proxy.open(
            "POST",
            "/v1/chat/completions?x=1",
            [("Content-Type", "application/json"), ("X-Request-Id", "r1")],
            BODY,
            self.engine(0),
            120,
            lambda tried: retry_engine(self.fleet, "m", tried),
            exchange or Exchange(),
            res,
        )

    def metric(self, name: str, labels: dict[str, str]) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def started() -> AsyncIterator[Callable[..., Awaitable[Rig]]]:
    rigs: list[Rig] = []

    async def make(engines: list[Engine], **retry: object) -> Rig:
        rig = Rig(engines, **retry)
        await rig.proxy.start()
        rigs.append(rig)
        return rig

    yield make
    for r in rigs:
        await r.proxy.close()
        assert all(t.closed for t in r.transports.values())


async def test_request_reaches_the_engine_whole_and_first_bytes_come_back(
    started: Callable[..., Awaitable[Rig]],
) -> None:
    rig = await started([ok, ok])
    res = ForwardResult()
    opened = await rig.open(res)
    assert opened is not None and opened.engine.id == "e0" and opened.first == REPLY
    assert opened.upstream.status == 200 and opened.upstream.at_eof()
    (sent,) = rig.transports["e0"].requests
    assert (sent.method, sent.path_qs, sent.body) == ("POST", "/v1/chat/completions?x=1", BODY)
    assert ("X-Request-Id", "r1") in sent.headers
    assert not rig.transports["e1"].requests
    e0 = rig.engine(0)
    # From the first byte the prompt is no longer outstanding; the request still is.
    assert (e0.inflight_requests, e0.inflight_prompt_tokens) == (1, 0)
    rig.proxy.finish(opened)
    rig.proxy.finish(opened)  # idempotent
    assert (e0.inflight_requests, e0.inflight_prompt_tokens) == (0, 0)
    assert [(a.engine, a.status, a.error) for a in res.attempts] == [("e0", 200, None)]


async def test_refused_connection_is_retried_on_the_other_engine(
    started: Callable[..., Awaitable[Rig]],
) -> None:
    rig = await started([refused, ok])
    res = ForwardResult()
    opened = await rig.open(res)
    assert opened is not None and opened.engine.id == "e1" and opened.retried
    assert [(a.engine, a.error) for a in res.attempts] == [("e0", "connect"), ("e1", None)]
    assert rig.metric("ramjet_retries_total", {"reason": "connect"}) == 1
    assert rig.engine(0).consecutive_failures == 1
    assert rig.proxy.budget.retrying == 1  # held until the exchange is finished
    rig.proxy.finish(opened)
    assert rig.proxy.budget.retrying == 0
    assert rig.engine(0).inflight_requests == rig.engine(1).inflight_requests == 0


async def test_backpressure_is_retried_and_honours_retry_after(
    started: Callable[..., Awaitable[Rig]],
) -> None:
    async def busy(req: MemoryRequest) -> MemoryReply:
        return MemoryReply(503, {"Retry-After": "30"}, b'{"error":"busy"}')

    rig = await started([busy, ok])
    res = ForwardResult()
    opened = await rig.open(res)
    assert opened is not None and opened.engine.id == "e1"
    assert [(a.engine, a.status, a.error) for a in res.attempts] == [
        ("e0", 503, "backpressure"),
        ("e1", 200, None),
    ]
    assert rig.transports["e0"].aborted == 0  # the 503 body had ended: nothing to abort
    assert rig.engine(0).id not in {e.id for e in rig.fleet.routable().engines}
    rig.proxy.finish(opened)


async def test_retryable_status_passes_through_when_no_retry_is_possible(
    started: Callable[..., Awaitable[Rig]],
) -> None:
    async def busy(req: MemoryRequest) -> MemoryReply:
        return MemoryReply(429, {"Retry-After": "1"}, b'{"error":"slow down"}')

    rig = await started([busy])
    res = ForwardResult()
    opened = await rig.open(res)
    assert opened is not None and opened.upstream.status == 429
    assert opened.first == b'{"error":"slow down"}'
    rig.proxy.finish(opened)


async def test_first_byte_timeout_is_retried_and_aborts_the_slow_engine(
    started: Callable[..., Awaitable[Rig]],
) -> None:
    async def stalls() -> AsyncIterator[bytes]:
        await asyncio.sleep(10)
        yield b"never"

    async def slow_body(req: MemoryRequest) -> MemoryReply:
        return MemoryReply(200, {"Content-Type": "text/event-stream"}, stalls())

    rig = await started([slow_body, ok])
    res = ForwardResult()
    opened = await rig.open(res)
    assert opened is not None and opened.engine.id == "e1"
    assert res.attempts[0].error == "first_byte_timeout"
    assert rig.transports["e0"].aborted == 1  # its response was closed before its end
    rig.proxy.finish(opened)


async def test_every_engine_failing_gives_up_with_503(
    started: Callable[..., Awaitable[Rig]],
) -> None:
    async def broken(req: MemoryRequest) -> MemoryReply:
        raise UpstreamClosed("reset before the head")

    rig = await started([broken, refused])
    res = ForwardResult()
    assert await rig.open(res) is None
    assert [(a.engine, a.error) for a in res.attempts] == [("e0", "disconnect"), ("e1", "connect")]
    resp = rig.proxy._give_up(res)
    assert resp.status == 503 and resp.headers["Retry-After"] == "1"
    assert res.end == "upstream_connect"
    assert rig.engine(0).inflight_requests == rig.engine(1).inflight_requests == 0
    assert rig.proxy.budget.retrying == 0


async def test_no_retry_when_the_budget_is_spent(
    started: Callable[..., Awaitable[Rig]],
) -> None:
    rig = await started([refused, ok], budget_ratio=0.0, min_retries=0)
    res = ForwardResult()
    assert await rig.open(res) is None
    assert [a.engine for a in res.attempts] == ["e0"]
    assert rig.metric("ramjet_retries_denied_total", {}) == 1
    assert not rig.transports["e1"].requests


async def test_cancelled_client_aborts_the_engine_request(
    started: Callable[..., Awaitable[Rig]],
) -> None:
    heard = asyncio.Event()

    async def stalls() -> AsyncIterator[bytes]:
        heard.set()
        await asyncio.sleep(10)
        yield b"never"

    async def slow(req: MemoryRequest) -> MemoryReply:
        return MemoryReply(200, {}, stalls())

    rig = await started([slow, ok])
    task = asyncio.ensure_future(rig.open(ForwardResult()))
    await heard.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert rig.transports["e0"].aborted == 1
    assert not rig.transports["e1"].requests, "a client that left is not retried"
    assert rig.engine(0).inflight_requests == 0


async def test_shutdown_ends_an_exchange_without_blaming_the_engine(
    started: Callable[..., Awaitable[Rig]],
) -> None:
    exchange = Exchange()

    async def stalls() -> AsyncIterator[bytes]:
        exchange.abort()  # shutdown arrives while the engine thinks
        await asyncio.sleep(10)
        yield b"never"

    async def slow(req: MemoryRequest) -> MemoryReply:
        return MemoryReply(200, {}, stalls())

    rig = await started([slow, ok])
    res = ForwardResult()
    assert await rig.open(res, exchange) is None
    assert [(a.engine, a.error) for a in res.attempts] == [("e0", "shutdown")]
    assert rig.engine(0).consecutive_failures == 0


async def test_memory_response_keeps_the_contract() -> None:
    aborted: list[int] = []

    async def pieces() -> AsyncIterator[bytes]:
        yield b"a"
        yield b"b"
        raise UpstreamClosed("cut")

    r = MemoryResponse(MemoryReply(200, {}, pieces()), lambda: aborted.append(1))
    assert r.content_length is None and r.read_nowait() == b""
    got = b""
    with pytest.raises(UpstreamClosed):  # every byte before the cut, then the cut
        while True:
            got += await r.readany(1.0)
    assert got == b"ab" and not r.at_eof()
    r.close()
    assert aborted == [], "a body that already ended (cut) has nothing to abort"

    async def stall() -> AsyncIterator[bytes]:
        await asyncio.sleep(10)
        yield b""

    s = MemoryResponse(MemoryReply(200, {}, stall()), lambda: aborted.append(1))
    with pytest.raises(TimeoutError):
        await s.readany(0.01)
    s.close()
    assert aborted == [1]
    with pytest.raises(UpstreamClosed):
        await s.readany(0.01)
    whole = MemoryResponse(MemoryReply(200, {}, b"xyz"), lambda: aborted.append(1))
    assert whole.content_length == 3 and await whole.readany() == b"xyz" and whole.at_eof()


async def test_the_http1_pool_is_an_engine_transport() -> None:
    pool: EngineTransport = EnginePool("http://127.0.0.1:9", limit=1, connect_s=0.2)
    with pytest.raises(UpstreamConnectError):
        await pool.request("GET", "/health", [], b"")
    await pool.close()


async def test_fetch_reads_a_whole_answer_within_its_limits() -> None:
    async def models(req: MemoryRequest) -> MemoryReply:
        return MemoryReply(200, {}, _pieces(b'{"data":', b"[]}"))

    t = MemoryTransport(models)
    assert await fetch(t, "GET", "/v1/models", timeout_s=1.0) == (200, b'{"data":[]}')
    assert t.requests[0].method == "GET" and t.requests[0].body == b""
    with pytest.raises(UpstreamClosed, match="over 4 bytes"):
        await fetch(t, "GET", "/v1/models", timeout_s=1.0, max_bytes=4)

    async def endless(req: MemoryRequest) -> MemoryReply:
        return MemoryReply(200, {}, _pieces(b"x" * 8, stall_s=10))

    big = MemoryTransport(endless)
    with pytest.raises(UpstreamClosed, match="over 4 bytes"):
        await fetch(big, "GET", "/v1/models", timeout_s=1.0, max_bytes=4)
    assert big.aborted == 1  # an unfinished answer cut by the cap is aborted, not left open

    async def stalls(req: MemoryRequest) -> MemoryReply:
        return MemoryReply(200, {}, _pieces(b"{", stall_s=10))

    slow = MemoryTransport(stalls)
    with pytest.raises(TimeoutError):
        await fetch(slow, "GET", "/health", timeout_s=0.05)
    assert slow.aborted == 1


async def test_prober_over_the_seam_marks_unhealthy_and_readmits() -> None:
    cfg = _config(2)
    fleet = Fleet(cfg.engines, cfg.health, cfg.retry, time.monotonic)
    status = {"e0": 200, "e1": 503}

    def engine(name: str) -> MemoryTransport:
        async def health(req: MemoryRequest) -> MemoryReply:
            return MemoryReply(status[name], {}, b"ok")

        return MemoryTransport(health)

    transports = {e.id: engine(e.id) for e in fleet.engines}

    async def probe(e: EngineState) -> bool:
        code, _ = await fetch(transports[e.id], "GET", cfg.health.probe_path, timeout_s=0.5)
        return 200 <= code < 300

    prober = HealthProber(fleet, probe, cfg.health)
    await prober.probe_all()
    assert (fleet.get("e0").probe_ok, fleet.get("e1").probe_ok) == (True, False)
    assert transports["e1"].requests[0].path_qs == cfg.health.probe_path
    status["e1"] = 200
    await prober.probe_all()
    assert fleet.get("e1").probe_ok

    async def refused_probe(e: EngineState) -> bool:
        raise UpstreamConnectError("refused")

    await HealthProber(fleet, refused_probe, cfg.health).probe_all()
    assert not fleet.get("e0").probe_ok, "a probe that cannot connect is a failed probe"


async def _pieces(*parts: bytes, stall_s: float = 0.0) -> AsyncIterator[bytes]:
    for p in parts:
        yield p
    if stall_s:
        await asyncio.sleep(stall_s)
