"""Hostile, unusual and long requests (issue 29, the request path) against the real
router in front of two reference engines on loopback: one client must not stall, lock
out or eject anyone else."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from engines import EngineProcess, start_engine
from router_rig import Records, router_config

from ramjet.app.server import RouterServer
from ramjet.keys.tokens import ByteTokenizer

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
        # engines on a busy CI machine: seconds per request, not the rig's tens of ms
        overrides["timeouts"] = {
            "first_byte_s": 30.0,
            "idle_s": 30.0,
            **overrides.get("timeouts", {}),
        }
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
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    data = io.BytesIO(raw) if len(raw) > 1 << 20 else raw  # aiohttp warns on large bytes
    async with session.post(
        url + "/v1/chat/completions", data=data, headers={"Content-Type": "application/json"}
    ) as r:
        return r.status, await r.read()


async def _stream_served_while_held(
    url: str, big: dict[str, Any], held: threading.Event, release: threading.Event
) -> tuple[int, bytes]:
    """Send `big`; once its work is held (`held` set by the test's stand-in), a small
    stream must be answered in full meanwhile. Then release the held work and return the
    big request's status and body."""
    async with aiohttp.ClientSession() as s:
        task = asyncio.ensure_future(_post(s, url, big))
        for _ in range(200):
            if held.is_set():
                break
            await asyncio.sleep(0.05)
        assert held.is_set()
        try:
            async with s.post(url + "/v1/chat/completions", json=_chat(3, True)) as r:
                got = await r.read()
                assert r.status == 200, got[:300]
                assert got.rstrip().endswith(b"data: [DONE]")
            assert not release.is_set() and not task.done()
        finally:
            release.set()
        return await task


def _metric(server: RouterServer, name: str, labels: dict[str, str]) -> float:
    total = 0.0
    for metric in server.router.metrics.registry.collect():
        for s in metric.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


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
        replies = await asyncio.gather(*(_post(s, router.url, _chat(12)) for _ in range(5)))
    for status, body in replies:
        assert status == 200, body[:300]
        assert json.loads(body)["usage"]["completion_tokens"] == 12
    assert len(records.records) == 5
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


# -- bounded work per request and in total ---------------------------------------------


def _messages(n: int, size: int = 1) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "w" * size}] * n,
        "max_tokens": 1,
    }


@pytest.mark.parametrize("fast_path", [True, False])
async def test_message_count_and_nesting_limits_refuse_with_400(
    make_router: Any, engines: list[EngineProcess], fast_path: bool
) -> None:
    router = await make_router(
        fast_path=fast_path,
        limits={"max_body_bytes": 8 << 20, "max_messages": 50, "max_json_depth": 8},
    )
    deep: Any = "x"
    for _ in range(10):
        deep = [deep]
    cases = [
        (_messages(51), "too_many_messages"),  # a small body: checked after decoding
        (_messages(30_000), "too_many_messages"),  # a large one: before, on a thread
        (_messages(150_000), "too_many_messages"),  # over 4 MiB: counted in a child process
        ({**_messages(1), "metadata": deep}, "nesting_too_deep"),
    ]
    async with aiohttp.ClientSession() as s:
        for body, code in cases:
            status, raw = await _post(s, router.url, body)
            assert status == 400, raw[:300]
            err = json.loads(raw)["error"]
            assert err["code"] == code and err["type"] == "invalid_request_error"
        status, raw = await _post(s, router.url, _messages(50))
        assert status == 200, raw[:300]
    for code in ("too_many_messages", "nesting_too_deep"):
        assert _metric(router, "ramjet_rejected_requests_total", {"reason": code}) >= 1


async def _engine_requests(engines: list[EngineProcess]) -> float:
    """Requests the engines have received (their `engine_requests_total`)."""
    total = 0.0
    async with aiohttp.ClientSession() as s:
        for e in engines:
            async with s.get(e.url + "/metrics") as r:
                for line in (await r.text()).splitlines():
                    if line.startswith("engine_requests_total"):
                        total += float(line.rsplit(" ", 1)[1])
    return total


def _parts(n_messages: int, parts_each: int, pad: int = 1) -> dict[str, Any]:
    part = {"type": "text", "text": "w" * pad}
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": [part] * parts_each}] * n_messages,
        "max_tokens": 1,
    }


def _prompt(prompt: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 1}


@pytest.mark.parametrize("fast_path", [True, False])
async def test_content_part_and_prompt_array_limits_refuse_with_400(
    make_router: Any, engines: list[EngineProcess], fast_path: bool
) -> None:
    """Chat `content` arrays and completion `prompt` arrays are bounded in count and
    nesting as messages are: a small body after its decode, a large one before it (on a
    parse thread), one over 4 MiB in the child process. Each refusal is a 400 OpenAI
    error naming the field, reaches no engine and holds nothing; a body at the limits
    passes."""
    router = await make_router(
        fast_path=fast_path,
        limits={
            "max_body_bytes": 8 << 20,
            "max_content_parts": 40,
            "max_prompt_items": 100,
            "max_json_depth": 8,
        },
    )
    deep: Any = {"type": "image_url", "image_url": {"url": "x"}}
    for _ in range(8):
        deep = {"nested": deep}
    chat = "/v1/chat/completions"
    comp = "/v1/completions"
    cases: list[tuple[str, dict[str, Any], str, str | None]] = [
        (chat, _parts(1, 41), "too_many_content_parts", "messages"),  # decoded, small
        (chat, _parts(3, 14), "too_many_content_parts", "messages"),  # summed over messages
        (chat, _parts(1, 30_000), "too_many_content_parts", "messages"),  # over 256 KiB
        (chat, _parts(1, 200_000), "too_many_content_parts", "messages"),  # over 4 MiB
        (chat, _parts(1, 200_000, 0), "too_many_content_parts", "messages"),
        (comp, _prompt(list(range(101))), "too_many_prompt_items", "prompt"),
        (comp, _prompt([list(range(100))]), "too_many_prompt_items", "prompt"),  # nested
        (comp, _prompt(["a"] * 101), "too_many_prompt_items", "prompt"),  # a batch of strings
        (comp, _prompt([7] * 200_000), "too_many_prompt_items", "prompt"),  # over 256 KiB
        (comp, _prompt([[7] * 1_500_000]), "too_many_prompt_items", "prompt"),  # over 4 MiB
        (comp, _prompt(["ab"] * 1_000_000), "too_many_prompt_items", "prompt"),  # over 4 MiB
        (chat, {**_parts(1, 1), "messages": [{"role": "user", "content": [deep]}]},
         "nesting_too_deep", None),
        (comp, _prompt([[[[[[[[[1]]]]]]]]]), "nesting_too_deep", None),
    ]  # fmt: skip
    before = await _engine_requests(engines)
    async with aiohttp.ClientSession() as s:
        for path, body, code, param in cases:
            raw_body = json.dumps(body).encode()
            data = io.BytesIO(raw_body) if len(raw_body) > 1 << 20 else raw_body
            async with s.post(
                router.url + path, data=data, headers={"Content-Type": "application/json"}
            ) as r:
                status, raw = r.status, await r.read()
            assert status == 400, (path, code, raw[:300])
            err = json.loads(raw)["error"]
            assert (err["code"], err["param"], err["type"]) == (
                code,
                param,
                "invalid_request_error",
            ), err
            assert router.router.admission.bodies.used == 0
        assert await _engine_requests(engines) == before, "a refused request reached an engine"
        for path, body in [
            (chat, _parts(2, 20)),
            (comp, _prompt([list(range(99))])),
            (comp, _prompt(list(range(100)))),
        ]:
            async with s.post(router.url + path, json=body) as r:
                assert r.status == 200, await r.read()
    for code in ("too_many_content_parts", "too_many_prompt_items"):
        assert _metric(router, "ramjet_rejected_requests_total", {"reason": code}) >= 4


@pytest.mark.parametrize("fast_path", [True, False])
async def test_a_large_body_with_too_many_values_in_any_field_is_refused_before_its_decode(
    make_router: Any, engines: list[EngineProcess], fast_path: bool
) -> None:
    """A large body whose values are in a field no count limit names (metadata, tools,
    stop, ...) is refused with 400 `too_many_values` before the decode that would make
    them (on a parse thread, or over 4 MiB in the child), and reaches no engine; commas
    in text do not count."""
    router = await make_router(
        fast_path=fast_path, limits={"max_body_bytes": 8 << 20, "max_json_values": 100_000}
    )
    one = _messages(1)
    cases = [
        {**one, "metadata": [7] * 300_000},  # over 256 KiB: counted on a parse thread
        {**one, "metadata": [7] * 2_000_000},  # over 4 MiB: counted in the child
        {**one, "stop": ["s"] * 150_000},
        {**one, "tools": [{"type": "function"}] * 60_000},
    ]
    before = await _engine_requests(engines)
    async with aiohttp.ClientSession() as s:
        for body in cases:
            status, raw = await _post(s, router.url, body)
            assert status == 400, raw[:300]
            err = json.loads(raw)["error"]
            assert (err["code"], err["type"]) == ("too_many_values", "invalid_request_error")
            assert router.router.admission.bodies.used == 0
        # 200,000 commas, all in text: counted, parsed, then 404 for its model
        prose = {**_messages(1), "model": "not-served"}
        prose["messages"] = [{"role": "user", "content": "a, " * 200_000}]
        status, raw = await _post(s, router.url, prose)
        assert status == 404 and json.loads(raw)["error"]["code"] == "model_not_found", raw
    assert await _engine_requests(engines) == before
    assert _metric(router, "ramjet_rejected_requests_total", {"reason": "too_many_values"}) == 4


async def test_a_huge_body_is_counted_off_the_event_loop(
    make_router: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body over 4 MiB goes to the counting child from a worker thread: a small stream
    is served while that exchange is held, then the body is refused for its count."""
    from ramjet.request import precheck

    held = threading.Event()
    release = threading.Event()
    timed_out: list[bool] = []
    count = precheck._Child.count

    def slow(
        self: precheck._Child, body: bytes, limits: precheck.CountLimits
    ) -> precheck.BodyCounts:
        held.set()
        timed_out.append(not release.wait(10))
        return count(self, body, limits)

    monkeypatch.setattr(precheck._Child, "count", slow)
    router = await make_router(limits={"max_body_bytes": 8 << 20, "max_messages": 50})
    big = _messages(150_000)  # over 4 MiB
    status, raw = await _stream_served_while_held(router.url, big, held, release)
    assert status == 400 and json.loads(raw)["error"]["code"] == "too_many_messages", raw[:300]
    assert timed_out == [False], "the count held the event loop"


async def test_a_large_body_is_parsed_off_the_event_loop(
    make_router: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body over `limits.parse_thread_bytes` is decoded, rendered and keyed on a parse
    thread: a small stream is served while that parse is held (on the event loop the
    parse would hold the loop, and its wait would time out)."""
    import ramjet.app.router as router_module

    held = threading.Event()
    release = threading.Event()
    timed_out: list[bool] = []
    parse = router_module.parse_request

    def slow(path: str, body: bytes, *args: Any) -> Any:
        if len(body) > 300_000:  # the large body only
            held.set()
            timed_out.append(not release.wait(10))
        return parse(path, body, *args)

    monkeypatch.setattr(router_module, "parse_request", slow)
    router = await make_router(limits={"max_body_bytes": 1 << 20})
    big = {**_messages(1, 400_000), "model": "not-served"}  # 404 once parsed
    status, raw = await _stream_served_while_held(router.url, big, held, release)
    assert status == 404 and json.loads(raw)["error"]["code"] == "model_not_found", raw[:300]
    assert timed_out == [False], "the parse held the event loop"


async def test_token_keying_of_a_large_body_runs_off_the_event_loop(
    make_router: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token-keyed pool (`key_pools`): a large body's chat template and tokenizer run
    on a parse thread, so a small stream is served while they work. The pool's
    tokenizer is held until the stream has ended; on the event loop it would hold the
    loop, and its wait would time out."""
    held = threading.Event()
    release = threading.Event()
    timed_out: list[bool] = []
    encode = ByteTokenizer.encode_chat

    def slow(self: ByteTokenizer, messages: Any, tools: Any) -> list[int]:
        if len(str(messages[0].get("content"))) > 16_000:  # the large body only
            held.set()
            timed_out.append(not release.wait(10))
        return encode(self, messages, tools)

    monkeypatch.setattr(ByteTokenizer, "encode_chat", slow)
    pool = {"name": "ref", "engines": ["e0", "e1"], "keys_mode": "tokens"}
    router = await make_router(
        key_pools=[{**pool, "tokenizer": "bytes", "block_tokens": 256}],
        limits={"max_body_bytes": 1 << 20},
    )
    big = {**_chat(1), "messages": [{"role": "user", "content": "w" * 16_500}]}
    status, raw = await _stream_served_while_held(router.url, big, held, release)
    assert status == 200, raw[:300]
    assert timed_out == [False], "the tokenizer held the event loop"


async def _open_idle_chunked(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    await writer.drain()
    return reader, writer


@pytest.mark.parametrize("fast_path", [True, False])
async def test_idle_chunked_bodies_do_not_lock_out_a_normal_request(
    make_router: Any, fast_path: bool
) -> None:
    """1,100 connections send chunked headers and then nothing: they hold no forwarding
    slot, at most `max_pending_per_client` of them wait, and a normal request still gets
    200 at once."""
    router = await make_router(
        fast_path=fast_path,
        timeouts={"body_s": 60.0, "header_deadline_s": 60.0},
        limits={"max_body_bytes": 64 * 1024},
    )
    conns = []
    try:
        for _ in range(1100):
            conns.append(await _open_idle_chunked(router.url))
        await asyncio.sleep(0.5)
        async with aiohttp.ClientSession() as s:
            status, raw = await asyncio.wait_for(_post(s, router.url, _chat(2)), 30)
        assert status == 200, raw[:300]
        pending = router.router.admission.pending
        assert sum(pending.counts.values()) <= pending.limit == 256
        refused = 0
        for reader, _ in conns[-100:]:  # the last ones found the client's pending full
            head = await asyncio.wait_for(reader.read(4096), 5)
            if head.startswith(b"HTTP/1.1 429"):
                assert b"too_many_pending" in head
                refused += 1
        assert refused == 100
    finally:
        for _, writer in conns:
            writer.close()


@pytest.mark.parametrize("fast_path", [True, False])
async def test_connections_that_send_nothing_do_not_lock_out_a_normal_request(
    make_router: Any, fast_path: bool
) -> None:
    """1,100 connections connect and send nothing: the client keeps at most
    `max_silent_per_client` of them (past it, its oldest are closed), and a normal
    request from the same address, on a new connection, is answered 200 at once."""
    router = await make_router(fast_path=fast_path, timeouts={"header_deadline_s": 60.0})
    host, port = router.url.removeprefix("http://").split(":")
    conns = [await asyncio.open_connection(host, int(port)) for _ in range(1100)]
    try:
        await asyncio.sleep(0.3)
        async with aiohttp.ClientSession() as s:
            status, raw = await asyncio.wait_for(_post(s, router.url, _chat(2)), 30)
        assert status == 200, raw[:300]
        silent = router.router.admission.silent
        limit = silent.limit
        assert limit == 256 and silent.count("127.0.0.1") <= limit
        # the oldest were closed, the newest are still open (the normal request's
        # connection, silent from its connect until its request was read, may in a
        # slow moment have closed one more)
        evicted = 1100 - limit
        for reader, _ in conns[:evicted]:
            assert await asyncio.wait_for(reader.read(), 5) == b""
        for reader, _ in conns[evicted + 1 :]:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(reader.read(1), 0.001)
        closed = _metric(router, "ramjet_rejected_requests_total", {"reason": "too_many_silent"})
        assert closed in (evicted, evicted + 1)
    finally:
        for _, writer in conns:
            writer.close()


async def test_a_burst_of_connections_that_bring_requests_is_not_cut_as_silent(
    make_router: Any,
) -> None:
    """300 connections from one address connect at once, past `max_silent_per_client`
    (100 here), and only then send their requests: every one is answered (404, a model
    not served: the router's own answer), none is closed as silent (a burst is accepted before any request on it is read)."""
    router = await make_router(limits={"max_silent_per_client": 100})
    host, port = router.url.removeprefix("http://").split(":")
    body = json.dumps({**_chat(1), "model": "not-served"}).encode()  # 404: no engine work
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
    )
    conns = await asyncio.gather(*(asyncio.open_connection(host, int(port)) for _ in range(300)))
    try:
        for _, writer in conns:
            writer.write(request)
        replies = await asyncio.gather(
            *(asyncio.wait_for(reader.read(), 120) for reader, _ in conns)
        )
    finally:
        for _, writer in conns:
            writer.close()
    assert all(r.startswith(b"HTTP/1.1 404") for r in replies), [
        r[:100] for r in replies if not r.startswith(b"HTTP/1.1 404")
    ][:3]
    assert router.router.admission.silent.evicted == 0


@pytest.mark.parametrize("fast_path", [True, False])
async def test_a_connection_that_sends_nothing_gets_408_at_the_header_deadline(
    make_router: Any, fast_path: bool
) -> None:
    router = await make_router(fast_path=fast_path, timeouts={"header_deadline_s": 0.5})
    host, port = router.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        raw = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    assert raw.startswith(b"HTTP/1.1 408"), raw[:200]
    assert json.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert router.router.admission.silent.count("127.0.0.1") == 0


@pytest.mark.parametrize("fast_path", [True, False])
async def test_bodies_in_flight_share_one_budget(make_router: Any, fast_path: bool) -> None:
    """A body that would take the bodies held at once past
    `limits.max_inflight_body_bytes` is refused with 503 `overloaded`; once the first is
    gone, the same request passes."""
    router = await make_router(
        fast_path=fast_path,
        timeouts={"body_s": 60.0},
        limits={"max_body_bytes": 64 * 1024, "max_inflight_body_bytes": 100 * 1024},
    )
    host, port = router.url.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 60000\r\n\r\n{"
    )
    await writer.drain()
    await asyncio.sleep(0.3)
    body = {**_messages(1, 45_000), "model": "not-served"}  # 404 once past the budget
    try:
        async with aiohttp.ClientSession() as s:
            status, raw = await _post(s, router.url, body)
            assert status == 503, raw[:300]  # 60,000 held + 45,000 > 100 KiB
            assert json.loads(raw)["error"]["code"] == "overloaded"
            writer.close()
            await asyncio.sleep(0.3)
            assert router.router.admission.bodies.used == 0
            status, raw = await _post(s, router.url, body)
            assert status == 404, raw[:300]
            assert json.loads(raw)["error"]["code"] == "model_not_found"
        assert router.router.admission.bodies.used == 0
    finally:
        writer.close()


async def test_a_head_in_small_segments_is_scanned_once(make_router: Any) -> None:
    """A 760 KB head sent in 1460-byte segments: the fast server searches each byte for
    the head's end about once (it searched the whole head again per segment)."""
    router = await make_router(
        limits={"max_headers": 100, "max_header_line_bytes": 8190},
        timeouts={"header_deadline_s": 60.0},
    )
    host, port = router.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    lines = [b"POST /v1/chat/completions HTTP/1.1", b"Host: x", b"Content-Length: 2"]
    lines += [b"X-Pad-%d: %s" % (i, b"p" * 8000) for i in range(95)]
    head = b"\r\n".join(lines) + b"\r\n\r\n"
    assert len(head) > 750_000
    head += b"{}"
    for i in range(0, len(head), 1460):
        writer.write(head[i : i + 1460])
        await writer.drain()
        await asyncio.sleep(0)
    reply = await asyncio.wait_for(reader.read(4096), 30)
    writer.close()
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]  # headers over max_header_bytes
    fast = router.fast
    assert fast is not None
    assert fast.head_scanned <= 2 * len(head), fast.head_scanned
