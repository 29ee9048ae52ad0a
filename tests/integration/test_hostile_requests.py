"""Hostile, unusual and long requests (issue 29, the request path) against the real
router in front of two reference engines on loopback: one client must not stall, lock
out or eject anyone else."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from engines import EngineProcess, start_engine
from router_rig import Records, router_config

from ramjet.app.server import RouterServer

MODEL = "mini-v4"


@pytest.fixture(scope="module")
def engines() -> Iterator[list[EngineProcess]]:
    with start_engine("e0") as e0, start_engine("e1") as e1:
        yield [e0, e1]


@pytest.fixture
async def make_router(
    engines: list[EngineProcess],
) -> AsyncIterator[Any]:
    started: list[RouterServer] = []

    async def make(sink: Any = None, fast_path: bool = True, **overrides: Any) -> RouterServer:
        overrides.setdefault("health", {"probe_interval_s": 0.2})
        cfg = router_config([e.url for e in engines], **overrides)
        server = RouterServer(cfg, sink=sink, fast_path=fast_path)
        await server.start()
        started.append(server)
        return server

    try:
        yield make
    finally:
        for s in started:
            await s.stop(drain_s=0.5)


def _chat(max_tokens: int, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell a long story"}],
        "max_tokens": max_tokens,
        "stream": stream,
        **extra,
    }


async def _post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any] | bytes
) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(
        url + "/v1/chat/completions", data=data, headers={"Content-Type": "application/json"}
    ) as r:
        return r.status, await r.read()


def _ejections(server: RouterServer) -> float:
    total = 0.0
    for metric in server.router.metrics.registry.collect():
        for s in metric.samples:
            if s.name == "ramjet_engine_ejections_total":
                total += s.value
    return total


# -- deadlines that match the request --------------------------------------------------


async def test_long_non_stream_generations_answer_200_with_no_retry_or_ejection(
    make_router: Any,
) -> None:
    """Non-stream generations far longer than `first_byte_s` (whose first byte comes at
    the end): each is answered once, by one engine, and no engine is ejected."""
    records = Records()
    router = await make_router(
        sink=records,
        timeouts={"first_byte_s": 0.5, "token_s": 1.0, "idle_s": 30.0},
        health={"probe_interval_s": 0.2, "consecutive_failures": 1},
    )
    async with aiohttp.ClientSession() as s:
        replies = await asyncio.gather(*(_post(s, router.url, _chat(12)) for _ in range(4)))
    for status, body in replies:
        assert status == 200, body[:300]
        assert json.loads(body)["usage"]["completion_tokens"] == 12
    assert len(records.records) == 4
    assert all(len(r.attempts) == 1 for r in records.records), "no request was re-run"
    assert _ejections(router) == 0
    assert not any(e.ejected for e in router.router.fleet.engines)


async def test_a_generation_past_its_deadline_is_504_not_retried_not_an_engine_fault(
    make_router: Any,
) -> None:
    records = Records()
    router = await make_router(
        sink=records,
        timeouts={"first_byte_s": 0.3, "token_s": 0.01, "idle_s": 30.0},
        health={"probe_interval_s": 0.2, "consecutive_failures": 1},
    )
    async with aiohttp.ClientSession() as s:
        status, body = await _post(s, router.url, _chat(40))  # deadline 0.7 s, takes longer
    assert status == 504, body[:300]
    assert json.loads(body)["error"]["code"] == "upstream_timeout"
    (record,) = records.records
    assert [a.error for a in record.attempts] == ["generation_timeout"]
    assert record.end == "upstream_generation_timeout"
    assert _ejections(router) == 0
    assert all(e.consecutive_failures == 0 for e in router.router.fleet.engines)


# -- a killed engine loses no request that has received no byte ------------------------


async def test_killing_an_engine_under_load_loses_no_request_without_a_byte(
    make_router: Any,
) -> None:
    """32 streams at a time, each on a new connection; one engine is SIGKILLed midway.
    A stream the client got bytes of may end with an error event; one that got no byte
    must have been retried on the other engine, never answered 503."""
    import os
    import signal

    with start_engine("k0") as k0, start_engine("k1") as k1:
        cfg = router_config(
            [k0.url, k1.url],
            timeouts={"first_byte_s": 30.0, "idle_s": 30.0},
            health={"probe_interval_s": 0.2},
        )
        records = Records()
        router = RouterServer(cfg, sink=records)
        await router.start()
        try:
            statuses: list[tuple[int, bool, bytes]] = []

            async def one(i: int) -> None:
                body = json.dumps(_chat(6 + i % 5, stream=True)).encode()
                async with (
                    aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
                    s.post(
                        router.url + "/v1/chat/completions",
                        data=body,
                        headers={"Content-Type": "application/json"},
                    ) as r,
                ):
                    got = b""
                    with contextlib.suppress(aiohttp.ClientPayloadError):
                        async for chunk in r.content.iter_any():
                            got += chunk
                    statuses.append((r.status, bool(got) and r.status == 200, got))

            async def client(start: int) -> None:
                for j in range(4):
                    await one(start + j)

            load = asyncio.gather(*(client(i * 4) for i in range(32)))
            await asyncio.sleep(1.5)
            assert k1.proc is not None
            os.kill(k1.proc.pid, signal.SIGKILL)
            await asyncio.wait_for(load, 240)
        finally:
            await router.stop(drain_s=0.5)
    lost = [
        (r.status, [(a.engine, a.status, a.error) for a in r.attempts])
        for r in records.records
        if r.status != 200
    ]
    assert len(statuses) == 128
    assert not lost, lost
    assert all(st == 200 for st, _, _ in statuses)
