"""The completion routes' own server (`ramjet.app.fast_server`) in front of aiohttp on
one port: which requests it serves, the hand-over of everything else to aiohttp on the
same connection, and that its answers are aiohttp's (same head, same framing)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
from typing import Any

import aiohttp
import pytest
from fake_upstream import Behavior, FakeUpstream
from proxy_client import CHAT
from router_rig import RouterFactory, router_config

from ramjet.app.fast_server import FastServer
from ramjet.app.server import RouterServer

PATH = b"/v1/chat/completions"
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
STREAM_BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
).encode()


def _post(body: bytes = BODY, path: bytes = PATH, extra: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: x\r\n%sContent-Length: %d\r\n\r\n%s" % (
        path,
        extra,
        len(body),
        body,
    )


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One whole response (Content-Length or chunked) off a keep-alive connection."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
    lines = head.decode().split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            k, v = line.split(": ", 1)
            headers[k.lower()] = v
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            parts.append(data[:-2])
        body = b"".join(parts)
    else:
        body = await reader.read()
    return status, headers, body


def _fast(router: RouterServer) -> FastServer:
    assert router.fast is not None
    return router.fast


async def test_plain_completion_requests_are_served_here_and_pipelined_in_order(
    upstreams: list[FakeUpstream], make_router: RouterFactory
) -> None:
    router = await make_router()
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    try:
        writer.write(_post() + _post(STREAM_BODY) + _post())  # three in one write
        got = [await _read_response(reader) for _ in range(3)]
    finally:
        writer.close()
    assert [s for s, _, _ in got] == [200, 200, 200]
    assert got[1][1]["content-type"].startswith("text/event-stream")
    assert got[1][1]["transfer-encoding"] == "chunked"
    assert got[1][2].endswith(b"data: [DONE]\n\n")
    assert json.loads(got[0][2])["object"] == "chat.completion"
    fast = _fast(router)
    assert fast.served == 3 and fast.handed_over == 0
    assert sum(len(u.generation_requests()) for u in upstreams) == 3


async def test_other_routes_are_handed_to_aiohttp_on_the_same_connection(
    upstreams: list[FakeUpstream], make_router: RouterFactory
) -> None:
    router = await make_router()
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    try:
        writer.write(_post())
        first = await _read_response(reader)
        writer.write(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
        ready = await _read_response(reader)
        writer.write(_post())  # aiohttp keeps the connection from here on
        after = await _read_response(reader)
    finally:
        writer.close()
    assert first[0] == 200 and after[0] == 200
    assert ready[0] == 200 and json.loads(ready[2])["ready"] is True
    fast = _fast(router)
    assert fast.served == 1 and fast.handed_over == 1
    assert sum(len(u.generation_requests()) for u in upstreams) == 2


@pytest.mark.parametrize(
    ("name", "request_bytes"),
    [
        ("query", _post(path=PATH + b"?x=1")),
        ("http10", _post().replace(b"HTTP/1.1", b"HTTP/1.0", 1)),
        ("expect", _post(extra=b"Expect: 100-continue\r\n")),
        (
            "chunked",
            b"POST %s HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
            % (PATH, len(BODY), BODY),
        ),
    ],
)
async def test_unusual_but_valid_completion_requests_go_to_aiohttp_and_succeed(
    upstreams: list[FakeUpstream], make_router: RouterFactory, name: str, request_bytes: bytes
) -> None:
    router = await make_router()
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    try:
        writer.write(request_bytes)
        if name == "expect":
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 100")
        status, _, body = await _read_response(reader)
    finally:
        writer.close()
    assert status == 200, body[:200]
    assert _fast(router).served == 0 and _fast(router).handed_over == 1
    [seen] = [r for u in upstreams for r in u.generation_requests()]
    assert seen.body == BODY


async def test_a_head_split_over_many_writes_is_served_here(
    upstreams: list[FakeUpstream], make_router: RouterFactory
) -> None:
    router = await make_router()
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    raw = _post()
    try:
        for i in range(0, len(raw), 7):
            writer.write(raw[i : i + 7])
            await writer.drain()
            await asyncio.sleep(0.002)
        status, _, body = await _read_response(reader)
    finally:
        writer.close()
    assert status == 200 and json.loads(body)["object"] == "chat.completion"
    assert _fast(router).served == 1 and _fast(router).handed_over == 0


async def test_a_late_body_gets_408_and_nothing_is_forwarded(
    upstreams: list[FakeUpstream], make_router: RouterFactory
) -> None:
    router = await make_router(timeouts={"body_s": 0.2})
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    try:
        writer.write(_post()[:-5])  # the last bytes of the body never come
        raw = await asyncio.wait_for(reader.read(), 2)
    finally:
        writer.close()
    assert raw.startswith(b"HTTP/1.1 408") and b"Connection: close" in raw
    assert json.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert all(not u.generation_requests() for u in upstreams)
    metrics = router.router.metrics.render().decode()
    assert 'ramjet_rejected_requests_total{reason="body_timeout"} 1.0' in metrics


async def test_connection_close_is_honoured(
    upstreams: list[FakeUpstream], make_router: RouterFactory
) -> None:
    router = await make_router()
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    try:
        writer.write(_post(extra=b"Connection: close\r\n"))
        status, headers, _ = await _read_response(reader)
        rest = await asyncio.wait_for(reader.read(), 2)  # the router closes
    finally:
        writer.close()
    assert status == 200 and headers["connection"] == "close" and rest == b""


async def _heads(router: RouterServer, raw: bytes) -> list[tuple[int, list[str], bytes]]:
    """Status, header names in order (Date's value aside) and body of each answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    out = []
    try:
        writer.write(raw)
        for _ in range(raw.count(b"POST ")):
            status, headers, body = await _read_response(reader)
            out.append((status, [f"{k}={v}" for k, v in headers.items() if k != "date"], body))
    finally:
        writer.close()
    return out


async def test_answers_are_the_same_as_aiohttps(upstreams: list[FakeUpstream]) -> None:
    """The same requests through a router with the fast server and one without: the same
    status, headers (names, order, values but Date) and body, for JSON, SSE, a refusal
    and an error the router answers itself."""
    bad_model = json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    raw = (
        _post()
        + _post(STREAM_BODY)
        + _post(b"{not json")
        + _post(bad_model.encode())
        + _post(extra=b"X-Request-Id: fixed\r\n")
    )
    got: dict[bool, Any] = {}
    for fast_path in (True, False):
        cfg = router_config(
            [u.url for u in upstreams],
            engines=[{"id": "e0", "url": upstreams[0].url, "models": ["m"]}],
        )
        server = RouterServer(cfg, fast_path=fast_path)
        await server.start()
        try:
            got[fast_path] = await _heads(server, raw)
            assert (server.fast is not None) == fast_path
            if server.fast is not None:
                assert server.fast.served == 5
        finally:
            await server.stop(drain_s=0.2)
    assert got[True] == got[False]
    assert [s for s, _, _ in got[True]] == [200, 200, 400, 404, 200]


async def test_access_log_keeps_the_fast_path_and_logs_as_aiohttp_does(
    upstreams: list[FakeUpstream], caplog: pytest.LogCaptureFixture
) -> None:
    """`logging.access_log`: the fast server still serves, and writes aiohttp's lines
    (time aside; a stream's byte count aside, its chunks follow the engine's pieces)."""
    raw = _post(extra=b"User-Agent: ua/1\r\nReferer: r\r\n") + _post(STREAM_BODY) + _post(b"{")
    lines: dict[bool, list[str]] = {}
    for fast_path in (True, False):
        cfg = router_config([upstreams[0].url], logging={"access_log": True})
        server = RouterServer(cfg, fast_path=fast_path)
        await server.start()
        caplog.clear()
        try:
            with caplog.at_level(logging.INFO, logger="ramjet.access"):
                await _heads(server, raw)
                await asyncio.sleep(0.05)  # aiohttp logs after its write
            assert (server.fast.served if server.fast else 0) == (3 if fast_path else 0)
        finally:
            await server.stop(drain_s=0.2)
        got = [r.getMessage() for r in caplog.records if r.name == "ramjet.access"]
        lines[fast_path] = [re.sub(r"\[[^]]*\] ", "", line) for line in got]
    assert len(lines[True]) == 3 and lines[True][0].endswith('"r" "ua/1"')
    assert lines[True][1].split(" 200 ")[0] == lines[False][1].split(" 200 ")[0]
    del lines[True][1], lines[False][1]
    assert lines[True] == lines[False]


async def test_openai_style_client_reuses_the_connection(
    upstreams: list[FakeUpstream], make_router: RouterFactory
) -> None:
    router = await make_router()
    conn = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=conn) as s:
        for stream in (False, True, False, True):
            body = STREAM_BODY if stream else BODY
            async with s.post(router.url + "/v1/chat/completions", data=body) as r:
                assert r.status == 200
                await r.read()
        async with s.get(router.url + "/metrics") as r:
            assert r.status == 200
        async with s.post(router.url + "/v1/chat/completions", data=BODY) as r:
            assert r.status == 200
    fast = _fast(router)
    assert fast.served == 4 and fast.handed_over == 1


async def test_idle_keepalive_connections_close_and_busy_ones_stay(
    upstreams: list[FakeUpstream], make_router: RouterFactory
) -> None:
    router = await make_router()
    _fast(router).keepalive_s = 0.2
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    try:
        for _ in range(6):  # 0.5 s of requests 0.1 s apart: never idle for 0.2 s
            writer.write(_post())
            assert (await _read_response(reader))[0] == 200
            await asyncio.sleep(0.1)
        t0 = asyncio.get_running_loop().time()
        rest = await asyncio.wait_for(reader.read(), 2)  # now idle: closed
        took = asyncio.get_running_loop().time() - t0
    finally:
        writer.close()
    assert rest == b"" and 0.05 <= took < 0.6
    assert _fast(router).served == 6


async def test_keepalive_requests_share_one_deadline_timer(
    upstreams: list[FakeUpstream], make_router: RouterFactory
) -> None:
    """The idle deadline armed after each answer and dropped at the next request moves
    no timer: 20 requests on one connection start one (the head deadline's, at
    connect) or two (that one fired early and re-armed at the idle deadline), not one
    per request; a partial head still gets its own deadline."""
    router = await make_router(timeouts={"header_deadline_s": 1.0})
    fast = _fast(router)
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    try:
        for _ in range(20):
            writer.write(_post())
            assert (await _read_response(reader))[0] == 200
        assert fast.served == 20 and fast.timers <= 2
        writer.write(_post()[:20])  # a head that never ends: the head deadline still holds
        raw = await asyncio.wait_for(reader.read(), 3)
    finally:
        writer.close()
    assert raw.startswith(b"HTTP/1.1 408")
    assert json.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


async def test_a_stream_read_in_fits_and_starts_arrives_whole_and_in_order(
    upstreams: list[FakeUpstream], make_router: RouterFactory
) -> None:
    """The SSE relay from the engine's callback (`ramjet.proxy.stream._Relay`) end to end:
    600 pieces of 4 KiB, the client stopping twice for 0.2 s (within the rig's send
    deadline). The pieces go by the engine connection's callback, and by the coroutine
    whenever the client's buffer is full (the unit test and the slow-reader test force
    that path). Every byte arrives, in the engine's order, ending with [DONE], and the
    connection carries the next request."""
    router = await make_router(limits={"stream_buffer_bytes": 16 * 1024})
    for u in upstreams:
        u.behavior = Behavior(chunks=600, chunk_bytes=4096, chunk_delay_s=0.0002)
    body = json.dumps({**CHAT, "stream": True}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port, limit=1 << 20)
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    post_ = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )
    writer.write(post_)
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    data, reads = bytearray(), 0
    while not data.endswith(b"0\r\n\r\n"):
        piece = await asyncio.wait_for(reader.read(65536), 5.0)
        assert piece, f"the router ended the stream after {len(data)} bytes"
        data += piece
        reads += 1
        if reads in (5, 60):  # stop reading for a while (within the rig's 0.3 s send_s)
            await asyncio.sleep(0.2)
    # de-chunk, then check every event in order
    out, pos = bytearray(), 0
    while True:
        eol = data.index(b"\r\n", pos)
        size = int(data[pos:eol], 16)
        if size == 0:
            break
        out += data[eol + 2 : eol + 2 + size]
        pos = eol + 2 + size + 2
    events = [e for e in out.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and len(events) == 600 + 2
    tokens = [json.loads(e[6:])["choices"][0]["delta"].get("content", "") for e in events[:-2]]
    assert [t.split(" ", 1)[0] for t in tokens] == [f"tok{i}" for i in range(600)]
    plain = json.dumps(CHAT).encode()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + b"Content-Length: %d\r\n\r\n" % len(plain)
        + plain
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
    assert head.startswith(b"HTTP/1.1 200")  # the same connection carries the next one
    writer.close()


async def test_long_bodies_kept_in_pieces_arrive_whole_byte_exact_and_in_order(
    upstreams: list[FakeUpstream], make_router: RouterFactory
) -> None:
    """Bodies of 1 MiB or more are kept as the pieces they came in and joined off the
    loop (`PIECES_BYTES`): one sent whole with a request pipelined behind it, and one
    trickled in 64 KiB writes, each reach the engine byte for byte, in order, and the
    connection serves the request after them."""
    from ramjet.app.fast_server import PIECES_BYTES

    router = await make_router(limits={"max_body_bytes": 8 << 20})
    big = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "x" * (3 << 19)}]}
    ).encode()
    assert len(big) > PIECES_BYTES
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    try:
        writer.write(_post(big) + _post())  # one write: the next request behind the body
        got = [await _read_response(reader) for _ in range(2)]
        trickled = _post(big)
        for i in range(0, len(trickled), 64 << 10):
            writer.write(trickled[i : i + (64 << 10)])
            await writer.drain()
            await asyncio.sleep(0.002)
        got.append(await _read_response(reader))
        writer.write(_post())
        got.append(await _read_response(reader))
    finally:
        writer.close()
    assert [s for s, _, _ in got] == [200, 200, 200, 200]
    bodies = [r.body for u in upstreams for r in u.generation_requests()]
    assert sorted(bodies, key=len) == [BODY, BODY, big, big]
    fast = _fast(router)
    assert fast.served == 4 and fast.handed_over == 0
    assert router.router.admission.bodies.used == 0
