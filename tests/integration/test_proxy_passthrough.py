"""Happy path and byte-exactness: non-streaming and SSE passthrough, header hygiene
(row 16), /v1/models union, readiness, metrics, and the official openai client."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
from fake_upstream import FakeUpstream, completion_body
from router_rig import Records, RouterFactory

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def test_non_streaming_body_and_headers_pass_byte_exact(
    upstreams: list[FakeUpstream], make_router: RouterFactory
) -> None:
    sink = Records()
    router = await make_router(sink=sink)
    # Odd spacing, unicode escapes and key order: an engine must see these exact bytes.
    body = b'{ "messages":[{"role":"user","content":"caf\\u00e9 \xe2\x9c\x93"}],\n "model" : "m", "x_extra": [1, 2.50]}'
    headers = {
        "Content-Type": "application/json",
        "Connection": "keep-alive, X-Secret-Hop",
        "X-Secret-Hop": "must-not-pass",
        "Keep-Alive": "timeout=9",
        "TE": "trailers",
        "Proxy-Authorization": "Basic Zm9vOmJhcg==",
        "X-Ramjet-Engine": "forged",
        "x-ramjet-trust": "exact",
        "X-Client-Header": "kept",
        "Authorization": "Bearer sk-test",
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(router.url + "/v1/chat/completions", data=body, headers=headers) as r,
    ):
        got = await r.read()
        assert r.status == 200
        engine = r.headers["X-Ramjet-Engine"]
        assert "Keep-Alive" not in r.headers
        assert "X-Ramjet-Cached-Tokens" not in r.headers
        assert r.headers["X-Upstream"] == engine
    up = upstreams[int(engine[1])]
    assert got == completion_body(up.name, "m")
    [seen] = up.generation_requests()
    assert seen.body == body
    h = seen.headers
    for gone in ("X-Secret-Hop", "Keep-Alive", "TE", "Proxy-Authorization", "x-ramjet-trust"):
        assert gone not in h
    assert h.getall("X-Ramjet-Engine", []) == []
    assert h["X-Client-Header"] == "kept" and h["Authorization"] == "Bearer sk-test"
    assert h["X-Ramjet-Request-Id"]
    [rec] = sink.records
    assert (
        rec.engine == engine
        and rec.status == 200
        and rec.engine_headers == {"x-ramjet-cached-tokens": "3"}
    )


async def test_crlf_injection_is_refused(
    make_router: RouterFactory, upstreams: list[FakeUpstream]
) -> None:
    router = await make_router()
    r, w = await asyncio.open_connection("127.0.0.1", router.port)
    body = json.dumps(CHAT).encode()
    w.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-A: a\rX-Injected: 1\r\n"
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )
    data = await asyncio.wait_for(r.read(), 2)
    w.close()
    assert data.split(b"\r\n")[0].split(b" ")[1] == b"400"
    assert all(not u.generation_requests() for u in upstreams)


async def test_sse_passthrough_chunk_by_chunk(
    upstreams: list[FakeUpstream], make_router: RouterFactory
) -> None:
    for u in upstreams:
        u.behavior.chunks = 8
    router = await make_router()
    async with (
        aiohttp.ClientSession() as s,
        s.post(router.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r,
    ):
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        raw = await r.read()
    events = raw.split(b"\n\n")
    assert events[-2] == b"data: [DONE]" and len(events) == 8 + 3


async def test_models_union_readyz_and_metrics(
    upstreams: list[FakeUpstream], make_router: RouterFactory
) -> None:
    upstreams[1].model = "other"
    router = await make_router()
    async with aiohttp.ClientSession() as s:
        async with s.get(router.url + "/v1/models") as r:
            ids = sorted(m["id"] for m in (await r.json())["data"])
        assert ids == ["m", "other"]
        async with s.get(router.url + "/readyz") as r:
            assert r.status == 200
        async with s.get(router.url + "/healthz") as r:
            assert r.status == 200
        async with s.post(router.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200
        async with s.get(router.url + "/metrics") as r:
            text = await r.text()
    for name in (
        "ramjet_requests_total",
        "ramjet_ttft_seconds_bucket",
        "ramjet_decisions_total",
        "ramjet_engine_healthy",
    ):
        assert name in text
    for u in upstreams:
        u.behavior.health_status = 500
    await asyncio.sleep(0.2)
    async with aiohttp.ClientSession() as s, s.get(router.url + "/readyz") as r:
        assert r.status == 503


async def test_openai_client_unchanged(
    upstreams: list[FakeUpstream], make_router: RouterFactory
) -> None:
    router = await make_router()
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="sk-test", max_retries=0)
    try:
        resp = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )
        assert resp.choices[0].message.content in ("hello from e0 ✓", "hello from e1 ✓")
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        parts = [
            c.choices[0].delta.content
            async for c in stream
            if c.choices and c.choices[0].delta.content
        ]
        assert parts == [f"tok{i} " for i in range(4)]
        models = await client.models.list()
        assert [m.id for m in models.data] == ["m"]
    finally:
        await client.close()
