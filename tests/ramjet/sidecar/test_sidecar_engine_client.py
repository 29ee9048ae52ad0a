"""The sidecar's requests to its engine (`ramjet.sidecar.engine_client`, over the router's
`EngineTransport`), against engines that are real HTTP servers on loopback and a real
ZMQ event publisher:

- the metrics scrape reads the engine's load; an engine that breaks the exchange is not
  taken for gone, one whose port refuses is (a new epoch with nothing in it); the scrape
  loop's connection closes with the sidecar;
- `POST /reset_prefix_cache` retries while vLLM answers `{"success": false}`, then nudges
  the engine until the clear arrives; an engine that keeps refusing is a 504, an error
  answer a 502 that quotes it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from zmq_endpoints import free_endpoint

from engine_stub.vllm_events import ZmqEventPublisher
from ramjet.sidecar.engine_client import engine_base
from ramjet.sidecar.runner import Sidecar, SidecarSettings
from ramjet.sidecar.wire import AllBlocksCleared, BlockStored

pytestmark = pytest.mark.timeout(30)
ROOT = Path(__file__).resolve().parents[3]
TOKEN = "s3cret-sidecar-token-0123"
METRICS = b'vllm:num_requests_running{model_name="m"} 3\nvllm:num_requests_waiting 2\n'


async def _until(cond: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


class MetricsEngine:
    """An engine's `/metrics` on a raw loopback server, keep-alive. `mode`: "ok" answers
    `METRICS`; "cut" closes the connection at each request without answering."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.requests = 0
        self.conns: set[asyncio.StreamWriter] = set()
        self.server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.conns.add(w)
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                assert head.startswith(b"GET /metrics HTTP/1.1\r\n"), head
                self.requests += 1
                if self.mode == "cut":
                    return
                w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n")
                w.write(b"Content-Length: %d\r\n\r\n%s" % (len(METRICS), METRICS))
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return  # the sidecar closed the connection
        finally:
            self.conns.discard(w)
            w.close()

    async def stop(self) -> None:
        """Stop listening and drop every connection: the port refuses from now on."""
        if self.server is not None:
            self.server.close()
            for w in list(self.conns):
                w.close()
            await self.server.wait_closed()
            self.server = None


@pytest.fixture
async def events() -> AsyncIterator[tuple[str, str, ZmqEventPublisher]]:
    ev, rp = free_endpoint(), free_endpoint()
    pub = ZmqEventPublisher(ev, rp)
    yield ev, rp, pub
    pub.close()


def _settings(ev: str, rp: str, url: str, **kw: Any) -> SidecarSettings:
    return SidecarSettings(
        engine_kind="vllm", engine_id="v0", engine_url=url, events_url=ev, replay_url=rp,
        key_id="v0-sc", model="m", block_tokens=4, profile="skip", **kw,
    )  # fmt: skip


async def _scraping(events: tuple[str, str, ZmqEventPublisher]) -> tuple[MetricsEngine, Sidecar]:
    """A started `MetricsEngine` and a started sidecar scraping it every 50 ms."""
    ev, rp, _ = events
    engine = MetricsEngine()
    await engine.start()
    sc = Sidecar(_settings(ev, rp, engine.url, load_interval_s=0.05), Ed25519PrivateKey.generate())
    await sc.start()
    return engine, sc


async def _hold_a_block(sc: Sidecar, pub: ZmqEventPublisher) -> None:
    await asyncio.sleep(0.3)  # slow joiner
    pub.publish([BlockStored((1,), None, (1, 2, 3, 4), 4, medium="GPU")])
    await _until(lambda: bool(sc.tracker.resident()), "the block to be applied")


async def test_the_scrape_tells_a_refusing_engine_from_a_failing_one(
    events: tuple[str, str, ZmqEventPublisher],
) -> None:
    pub = events[2]
    engine, sc = await _scraping(events)
    try:
        await _until(lambda: sc._load.running_requests == 3, "the engine's load")
        assert sc._load.waiting_requests == 2
        await _hold_a_block(sc, pub)
        epoch = sc.publisher.epoch

        # the engine breaks every exchange: the scrape fails, but the engine is not gone
        engine.mode = "cut"
        seen = engine.requests
        await _until(lambda: engine.requests >= seen + 5, "five cut scrapes")
        assert sc.publisher.epoch == epoch and sc.tracker.resident()

        # its port refuses: the engine is gone, and its cache with it
        await engine.stop()
        await _until(lambda: sc.publisher.epoch > epoch, "a new epoch")
        assert not sc.tracker.resident()
    finally:
        await sc.stop()
        await engine.stop()


async def test_the_scrape_connection_closes_with_the_sidecar(
    events: tuple[str, str, ZmqEventPublisher],
) -> None:
    engine, sc = await _scraping(events)
    try:
        await _until(lambda: engine.requests >= 3, "three scrapes")
        assert len(engine.conns) == 1  # kept alive between scrapes
    finally:
        await sc.stop()
    try:
        await _until(lambda: not engine.conns, "the engine to see the connection closed")
    finally:
        await engine.stop()


class ResetEngine:
    """vLLM's `POST /reset_prefix_cache` (`{"success": false}` for its first `refusals`
    calls, then an empty 200; or `status` with a text body) and `/v1/completions`, which
    records each nudge and makes the engine emit `AllBlocksCleared`."""

    def __init__(self, pub: ZmqEventPublisher, refusals: float, status: int) -> None:
        self.pub, self.refusals, self.status = pub, refusals, status
        self.resets = 0
        self.nudges: list[tuple[str, Any]] = []

    async def reset(self, request: web.Request) -> web.Response:
        self.resets += 1
        if self.status != 200:
            return web.Response(status=self.status, text="engine says no")
        if self.resets <= self.refusals:
            return web.json_response({"success": False})
        return web.Response(status=200)

    async def complete(self, request: web.Request) -> web.Response:
        self.nudges.append((request.content_type, json.loads(await request.read())))
        if self.resets > self.refusals:
            self.pub.publish([AllBlocksCleared()])
        return web.json_response({"choices": [{"text": "x"}]})


@pytest.mark.parametrize(
    ("refusals", "status", "answer", "says"),
    [
        (2, 200, 200, None),
        (float("inf"), 200, 504, "refused the reset for 0.6 s"),
        (0, 500, 502, "HTTP 500: engine says no"),
    ],
)
async def test_the_reset_retries_while_vllm_refuses_and_nudges_until_the_clear(
    events: tuple[str, str, ZmqEventPublisher],
    refusals: float,
    status: int,
    answer: int,
    says: str | None,
) -> None:
    ev, rp, pub = events
    fake = ResetEngine(pub, refusals, status)
    engine_app = web.Application()
    engine_app.router.add_post("/reset_prefix_cache", fake.reset)
    engine_app.router.add_post("/v1/completions", fake.complete)
    runners = [web.AppRunner(engine_app, access_log=None)]
    await runners[0].setup()
    site = web.TCPSite(runners[0], "127.0.0.1", 0)
    await site.start()
    engine_url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    settings = _settings(ev, rp, engine_url, scrape_metrics=False, token=TOKEN, reset_timeout_s=0.6)
    sc = Sidecar(settings, Ed25519PrivateKey.generate())
    await sc.start()
    try:
        await _hold_a_block(sc, pub)
        app = web.Application()
        sc.add_routes(app)
        runners.append(web.AppRunner(app, access_log=None))
        await runners[1].setup()
        sc_site = web.TCPSite(runners[1], "127.0.0.1", 0)
        await sc_site.start()
        port = sc_site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                f"http://127.0.0.1:{port}/reset_prefix_cache",
                headers={"Authorization": f"Bearer {TOKEN}"},
            ) as r,
        ):
            got = await r.json()
        assert r.status == answer, got
        if says is not None:
            assert says in got["error"], got
            assert sc.tracker.resident()  # nothing cleared
            return
        assert got["cleared"] is True and got["resident_blocks"] == 0, got
        assert fake.resets == refusals + 1
        assert fake.nudges and fake.nudges[0] == (
            "application/json",
            {"model": "m", "prompt": ".", "max_tokens": 1},
        )
        assert not sc.tracker.resident()
    finally:
        await sc.stop()
        for runner in reversed(runners):
            await runner.cleanup()


@pytest.mark.parametrize(
    ("url", "base"),
    [("http://127.0.0.1:8000", ""), ("http://e:8000/", ""), ("https://e/vllm/", "/vllm")],
)
def test_engine_base(url: str, base: str) -> None:
    assert engine_base(url) == base


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://e", "http://", "http://e/?a=1", ""])
def test_a_bad_engine_url_is_refused_at_once(url: str) -> None:
    with pytest.raises(ValueError, match="http"):
        engine_base(url)
    with pytest.raises(ValueError, match="http"):
        Sidecar(_settings("ipc:///nowhere", "ipc:///nowhere", url), Ed25519PrivateKey.generate())


def test_the_command_refuses_a_bad_engine_url(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "ramjet", "sidecar", "--engine-kind", "vllm",
            "--engine-id", "v0", "--engine-url", "127.0.0.1:8000", "--events", "ipc:///x",
            "--key", str(tmp_path / "none.key"), "--key-id", "v0-sc", "--model", "m",
            "--port", "0"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    bad = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert bad.returncode == 2, bad.stderr
    assert "--engine-url" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


def test_the_command_refuses_a_bad_push_url(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "ramjet", "sidecar", "--engine-kind", "vllm",
            "--engine-id", "v0", "--engine-url", "http://127.0.0.1:9", "--events", "ipc:///x",
            "--key", str(tmp_path / "none.key"), "--key-id", "v0-sc", "--model", "m",
            "--port", "0", "--push-url", "127.0.0.1:8080/ramjet/reports"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    bad = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert bad.returncode == 2, bad.stderr
    assert "--push-url" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
