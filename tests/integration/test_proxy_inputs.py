"""Bad input never reaches an engine and never gets a 500: RELIABILITY.md rows 13-15
(slowloris, size limits, smuggling) over raw sockets, and malformed bodies."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from fake_upstream import FakeUpstream
from proxy_client import post
from router_rig import RouterFactory

from ramjet.app.server import RouterServer

PATH = b"/v1/chat/completions"
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


async def _raw(router: RouterServer, data: bytes, timeout: float = 2.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


def _status(raw: bytes) -> int:
    return int(raw.split(b"\r\n", 1)[0].split(b" ")[1])


def _error(raw: bytes) -> dict[str, object]:
    err: dict[str, object] = json.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]
    assert {"message", "type", "code"} <= set(err)
    return err


def _nothing_forwarded(upstreams: list[FakeUpstream]) -> bool:
    return all(not u.generation_requests() for u in upstreams)


async def test_row13_slowloris_gets_408_and_others_are_unaffected(
    upstreams: list[FakeUpstream], make_router: RouterFactory
) -> None:
    router = await make_router()
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    t0 = time.monotonic()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")

    async def trickle() -> None:
        for i in range(20):
            await asyncio.sleep(0.05)
            writer.write(b"X-Slow-%d: 1\r\n" % i)

    trickling = asyncio.ensure_future(trickle())
    ok = await post(router.url)  # an honest client meanwhile
    assert ok.status == 200
    raw = await asyncio.wait_for(reader.read(), 2)
    took = time.monotonic() - t0
    trickling.cancel()
    writer.close()
    assert _status(raw) == 408 and _error(raw)["code"] == "request_timeout"
    assert 0.25 <= took < 0.8
    assert sum(len(u.generation_requests()) for u in upstreams) == 1


async def test_keepalive_connection_is_not_cut_by_the_header_deadline(
    upstreams: list[FakeUpstream], make_router: RouterFactory
) -> None:
    router = await make_router()
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.post(router.url + "/v1/chat/completions", data=BODY) as r:
                assert r.status == 200
                await r.read()
            await asyncio.sleep(0.15)  # 3 x 0.15 s > header deadline, on one connection


@pytest.mark.parametrize(
    ("name", "request_bytes", "status"),
    [
        (
            "content_length_over_limit",
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n" % PATH,
            413,
        ),
        (
            "cl_and_te",
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
            % PATH,
            400,
        ),
        (
            "duplicate_cl",
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nContent-Length: %d\r\n\r\n%s"
            % (PATH, len(BODY), len(BODY), BODY),
            400,
        ),
        (
            "bare_lf",
            b"POST %s HTTP/1.1\nHost: x\nContent-Length: %d\n\n%s" % (PATH, len(BODY), BODY),
            400,
        ),
        (
            "too_many_headers",
            b"POST %s HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n%s"
            % (PATH, b"".join(b"X-H%d: v\r\n" % i for i in range(40)), len(BODY), BODY),
            431,
        ),
        (
            "huge_header_line",
            b"POST %s HTTP/1.1\r\nX-Big: %s\r\nContent-Length: %d\r\n\r\n%s"
            % (PATH, b"a" * 5000, len(BODY), BODY),
            400,
        ),
    ],
)
async def test_rows14_15_refused_before_forwarding(
    upstreams: list[FakeUpstream],
    make_router: RouterFactory,
    name: str,
    request_bytes: bytes,
    status: int,
) -> None:
    router = await make_router()
    raw = await _raw(router, request_bytes)
    assert _status(raw) == status, raw[:200]
    _error(raw)
    assert b"Connection: close" in raw or raw.startswith(b"HTTP/1.0")
    assert _nothing_forwarded(upstreams)


async def test_row14_chunked_body_over_limit_is_cut_off(
    upstreams: list[FakeUpstream], make_router: RouterFactory
) -> None:
    router = await make_router()  # max_body_bytes = 64 KiB
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    writer.write(b"POST %s HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" % PATH)
    chunk = b"a" * 16384
    for _ in range(6):
        writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 2)
    writer.close()
    assert _status(raw) == 413 and _error(raw)["code"] == "request_too_large"
    assert _nothing_forwarded(upstreams)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', "model"),
        (b'{"model": 7, "messages": []}', "model"),
        (b'{"model": "m"}', "messages"),
        (b'{"model": "m", "messages": "hello"}', "messages"),
        (b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', "messages"),
        (b"", None),
    ],
)
async def test_malformed_bodies_get_openai_errors(
    upstreams: list[FakeUpstream], make_router: RouterFactory, body: bytes, param: str | None
) -> None:
    router = await make_router()
    async with (
        aiohttp.ClientSession() as s,
        s.post(router.url + "/v1/chat/completions", data=body) as r,
    ):
        assert r.status == 400
        err = (await r.json())["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] is not None and str(err["param"]).startswith(param)
    assert _nothing_forwarded(upstreams)


async def test_unknown_model_and_route(
    upstreams: list[FakeUpstream], make_router: RouterFactory
) -> None:
    router = await make_router(engines=[{"id": "e0", "url": upstreams[0].url, "models": ["m"]}])
    r = await post(
        router.url, body={"model": "nope", "messages": [{"role": "user", "content": "x"}]}
    )
    assert r.status == 404 and json.loads(r.body)["error"]["code"] == "model_not_found"
    async with aiohttp.ClientSession() as s, s.get(router.url + "/v1/nothing") as resp:
        assert resp.status == 404 and "error" in await resp.json()
    assert _nothing_forwarded(upstreams)
