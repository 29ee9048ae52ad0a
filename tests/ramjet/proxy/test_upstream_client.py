"""The lean engine client (`ramjet.transport.http1`) against raw loopback servers: framing
(Content-Length, chunked split anywhere, until-close), keep-alive reuse, cut bodies,
refused connects and the pool's connection limit."""

from __future__ import annotations

import asyncio
import errno
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from ramjet.transport.http1 import EnginePool, UpstreamClosed, UpstreamConnectError, _refused

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _serve(handler: Handler) -> tuple[asyncio.Server, str, list[int]]:
    """A server that counts its connections (list of one int)."""
    conns = [0]

    async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conns[0] += 1
        try:
            await handler(r, w)
        finally:
            w.close()

    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    return srv, f"http://127.0.0.1:{port}", conns


async def _read_request(r: asyncio.StreamReader) -> bytes:
    head = await r.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await r.readexactly(length)


async def _body(pool: EnginePool, body: bytes = b"x") -> tuple[int, bytes]:
    resp = await pool.request("POST", "/p", [("X-A", "1")], body)
    out = b""
    try:
        while chunk := await resp.readany():
            out += chunk
    finally:
        resp.close()
    return resp.status, out


@pytest.fixture
async def closing() -> AsyncIterator[list[object]]:
    things: list[object] = []
    yield things
    for t in things:
        if isinstance(t, EnginePool):
            await t.close()
        elif isinstance(t, asyncio.Server):
            t.close()
            await t.wait_closed()


async def test_chunked_body_split_anywhere_is_dechunked_and_the_connection_reused(
    closing: list[object],
) -> None:
    payload = b"data: one\n\ndata: two\n\n"
    wire = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
        b"b;ext=1\r\ndata: one\n\n\r\nb\r\ndata: two\n\n\r\n0\r\nX-T: 1\r\n\r\n"
    )
    seen: list[bytes] = []

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        for split in range(1, len(wire)):
            seen.append(await _read_request(r))
            w.write(wire[:split])
            await w.drain()
            await asyncio.sleep(0)
            w.write(wire[split:])
            await w.drain()

    srv, url, conns = await _serve(handler)
    pool = EnginePool(url, limit=4, connect_s=1.0)
    closing += [pool, srv]
    for _ in range(1, len(wire)):
        status, body = await _body(pool, b"hello")
        assert (status, body) == (200, payload)
    assert conns[0] == 1
    assert seen[0].startswith(b"POST /p HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nX-A: 1\r\n" in seen[0] and seen[0].endswith(b"Content-Length: 5\r\n\r\nhello")


async def test_content_length_and_connection_close(closing: list[object]) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await _read_request(r)
            w.write(b"HTTP/1.1 201 Created\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabc")
            await w.drain()

    srv, url, conns = await _serve(handler)
    pool = EnginePool(url, limit=4, connect_s=1.0)
    closing += [pool, srv]
    assert await _body(pool) == (201, b"abc")
    assert await _body(pool) == (201, b"abc")
    assert conns[0] == 2  # the engine asked to close: not reused


async def test_body_without_length_runs_to_close(closing: list[object]) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\n\r\nuntil")
        await w.drain()
        w.write(b" close")

    srv, url, _ = await _serve(handler)
    pool = EnginePool(url, limit=4, connect_s=1.0)
    closing += [pool, srv]
    assert await _body(pool) == (200, b"until close")


async def test_cut_body_and_silent_close_raise(closing: list[object]) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        req = await _read_request(r)
        if req.endswith(b"cut"):
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
            await w.drain()

    srv, url, _ = await _serve(handler)
    pool = EnginePool(url, limit=4, connect_s=1.0)
    closing += [pool, srv]
    with pytest.raises(UpstreamClosed):
        await _body(pool, b"cut")
    with pytest.raises(UpstreamClosed):
        await _body(pool, b"silent")


async def test_refused_connect() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pool = EnginePool(f"http://127.0.0.1:{port}", limit=4, connect_s=1.0)
    with pytest.raises(UpstreamConnectError):
        await pool.request("POST", "/", [], b"")
    await pool.close()


async def test_a_refused_connect_says_refused_and_a_cut_one_is_no_connect_error(
    closing: list[object],
) -> None:
    # the sidecar takes a refused port for a gone engine (ramjet.sidecar.runner)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pool = EnginePool(f"http://127.0.0.1:{port}", limit=1, connect_s=1.0)
    closing.append(pool)
    with pytest.raises(UpstreamConnectError) as refused:
        await pool.request("GET", "/", [], b"")
    assert refused.value.refused is True

    async def hang_up(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)

    srv, url, _ = await _serve(hang_up)
    cut = EnginePool(url, limit=1, connect_s=1.0)
    closing += [cut, srv]
    with pytest.raises(UpstreamClosed):
        await _body(cut)
    assert UpstreamConnectError("x").refused is False


async def test_pool_limit_queues_requests_and_close_aborts(closing: list[object]) -> None:
    release = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await _read_request(r)
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nab")
            await w.drain()
            await release.wait()
            w.write(b"cd")
            await w.drain()

    srv, url, conns = await _serve(handler)
    pool = EnginePool(url, limit=1, connect_s=1.0)
    closing += [pool, srv]
    first = await pool.request("POST", "/", [], b"")
    assert await first.readany() == b"ab"
    second = asyncio.create_task(_body(pool))
    await asyncio.sleep(0.05)
    assert not second.done()  # waiting for the one connection
    release.set()
    assert await first.readany() == b"cd" and await first.readany() == b""
    assert await second == (200, b"abcd")
    assert conns[0] == 1
    release.clear()
    third = await pool.request("POST", "/", [], b"")
    assert await third.readany() == b"ab"
    third.close()  # mid-body: the connection is closed, a reader is told
    with pytest.raises(UpstreamClosed):
        await third.readany()
    release.set()
    assert await _body(pool) == (200, b"abcd")
    assert conns[0] == 2


async def test_idle_limit_applies_to_each_wait(closing: list[object]) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n")
        for piece in (b"ab", b"cd"):  # each within the limit, together past it
            await asyncio.sleep(0.12)
            w.write(piece)
            await w.drain()
        await asyncio.sleep(5)

    srv, url, _ = await _serve(handler)
    pool = EnginePool(url, limit=4, connect_s=1.0)
    closing += [pool, srv]
    resp = await pool.request("POST", "/", [], b"")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await resp.readany(0.2) == b"ab"
    assert await resp.readany(0.2) == b"cd"
    t1 = loop.time()
    with pytest.raises(TimeoutError):
        await resp.readany(0.2)
    assert t1 - t0 > 0.2  # the limit is per wait, not per response
    assert 0.15 < loop.time() - t1 < 1.0
    resp.close()


# -- a hostile or buggy engine ------------------------------------------------------------


def _answer_with(wire: bytes) -> Handler:
    """Answers each request on a connection with `wire`."""

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            try:
                await _read_request(r)
                w.write(wire)
                await w.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                return

    return handler


_OK_TAIL = b"Content-Length: 2\r\n\r\nok"


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\nX-A: a\nSet-Cookie: evil=1\r\n",  # bare LF: response splitting
        b"HTTP/1.1 200 OK\r\nX-A: a\rSet-Cookie: evil=1\r\n",  # bare CR
        b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\n",  # NUL
        b"HTTP/1.1 200 OK\nSet-Cookie: evil=1\r\n",  # LF in the reason
        b"HTTP/1.1 200 OK\r\nX A: 1\r\n",  # not a token
        b"HTTP/1.1 099 Low\r\n",
        b"HTTP/1.1 600 High\r\n",
        b"HTTP/1.10 200 OK\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\nHTTP/1.1 200 OK\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: gzip\r\n",
        b"HTTP/1.1 200 OK\r\n" + b"X-B: 1\r\n" * 1000,  # too many header lines
        b"HTTP/1.1 200 OK\r\nX-Big: " + b"b" * 70_000 + b"\r\n",  # head past the limit
    ],
)
async def test_a_malformed_head_is_refused(head: bytes, closing: list[object]) -> None:
    srv, url, _ = await _serve(_answer_with(head + _OK_TAIL))
    pool = EnginePool(url, limit=4, connect_s=1.0)
    closing += [pool, srv]
    with pytest.raises(UpstreamClosed):
        await _body(pool)


async def test_many_interim_responses_in_one_read(closing: list[object]) -> None:
    wire = b"HTTP/1.1 100 Continue\r\n\r\n" * 20_000 + b"HTTP/1.1 200 OK\r\n" + _OK_TAIL
    srv, url, _ = await _serve(_answer_with(wire))
    pool = EnginePool(url, limit=4, connect_s=1.0)
    closing += [pool, srv]
    assert await _body(pool) == (200, b"ok")


@pytest.mark.parametrize(
    "head",
    [
        # Both framings: chunked wins, and the connection is not trusted again.
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nConnection: close\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n",
    ],
)
async def test_a_suspect_connection_is_not_reused(head: bytes, closing: list[object]) -> None:
    srv, url, conns = await _serve(_answer_with(head + b"2\r\nok\r\n0\r\n\r\n"))
    pool = EnginePool(url, limit=4, connect_s=1.0)
    closing += [pool, srv]
    assert await _body(pool) == (200, b"ok")
    assert await _body(pool) == (200, b"ok")
    assert conns[0] == 2


async def test_a_huge_chunk_size_streams_and_a_cut_is_an_error(closing: list[object]) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        # 2**64 - 1, the largest llhttp takes (a longer size is refused: test_upstream_random)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"f" * 16 + b"\r\nab")
        await w.drain()

    srv, url, _ = await _serve(handler)
    pool = EnginePool(url, limit=4, connect_s=1.0)
    closing += [pool, srv]
    resp = await pool.request("POST", "/", [], b"")
    try:
        assert await resp.readany() == b"ab"
        with pytest.raises(UpstreamClosed):
            await resp.readany(2.0)
    finally:
        resp.close()


async def test_an_answer_before_the_body_was_sent_retires_the_connection(
    closing: list[object],
) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readuntil(b"\r\n\r\n")  # the head only: answers before taking the body
        w.write(b"HTTP/1.1 413 Too Large\r\nContent-Length: 2\r\n\r\nno")
        await w.drain()
        while await r.read(1 << 20):  # then drains what it is sent, answering nothing more
            pass

    srv, url, conns = await _serve(handler)
    pool = EnginePool(url, limit=4, connect_s=1.0)
    closing += [pool, srv]
    async with asyncio.timeout(5):
        # More than loopback's socket buffers hold: part of it is still ours to write.
        assert await _body(pool, b"x" * (32 << 20)) == (413, b"no")
        assert await _body(pool) == (413, b"no")  # not queued behind the first body
    assert conns[0] == 2


class _Wire:
    """The transport seam of one `_Conn`: takes writes, holds nothing."""

    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str) -> None:
        return None

    def get_write_buffer_size(self) -> int:
        return 0


async def test_a_head_sent_a_byte_at_a_time_costs_linear_cpu() -> None:
    from ramjet.transport.http1 import _Conn

    pool = EnginePool("http://127.0.0.1:9", limit=1, connect_s=1.0)
    conn = _Conn(pool)
    conn.connection_made(_Wire())  # type: ignore[arg-type]
    head = b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * 60_000 + b"\r\nContent-Length: 2\r\n\r\n"
    answer = conn.send(b"")
    t0 = time.process_time()
    for i in range(len(head)):
        conn.data_received(head[i : i + 1])
    cpu_s = time.process_time() - t0
    resp = answer.result()
    conn.data_received(b"ok")
    assert (resp.status, len(resp.headers["X-Pad"]), resp.read_nowait()) == (200, 60_000, b"ok")
    assert cpu_s < 0.4  # ~0.04 s; copying and scanning the whole head per byte: ~1 s
    await pool.close()


async def test_a_sink_takes_pieces_from_the_callback_in_order(closing: list[object]) -> None:
    """`set_sink`: a piece the sink takes is not buffered and wakes no reader; one it
    declines, any piece after it while buffered, and the body's last piece are read as
    before; the body arrives whole and in order either way, and the idle limit counts a
    taken piece as data (pieces 0.15 s apart under a 0.25 s idle limit, 0.75 s in all)."""
    pieces = [b"data: %d\n\n" % i for i in range(6)]
    go = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        w.write(b"%x\r\n%b\r\n" % (len(pieces[0]), pieces[0]))
        await w.drain()
        await go.wait()
        for i, p in enumerate(pieces[1:], 1):
            await asyncio.sleep(0.15)
            end = b"0\r\n\r\n" if i == len(pieces) - 1 else b""  # the last ends the body
            w.write(b"%x\r\n%b\r\n%b" % (len(p), p, end))
            await w.drain()

    srv, url, _ = await _serve(handler)
    pool = EnginePool(url, limit=1, connect_s=1.0)
    closing += [pool, srv]
    resp = await pool.request("POST", "/p", [], b"x")
    assert await resp.readany() == pieces[0]
    taken: list[bytes] = []
    declined: list[bytes] = []

    def sink(data: bytes) -> bool:
        if len(taken) == 2 and not declined:  # the third piece is declined
            declined.append(data)
            return False
        taken.append(data)
        return True

    resp.set_sink(sink)
    go.set()
    read: list[bytes] = []
    while chunk := await resp.readany(0.25):
        read.append(chunk)
    resp.close()
    # taken, in order; the declined one read; then (buffered ahead of it or not) the rest
    assert taken[:2] == pieces[1:3] and declined == [pieces[3]]
    assert read[0] == pieces[3]
    assert b"".join(taken[:2] + read[:1] + taken[2:] + read[1:]) == b"".join(pieces[1:])
    assert read[-1] == pieces[-1]  # the last piece is never given to the sink
    assert pieces[-1] not in taken


def test_a_name_refused_at_every_address_counts_as_refused() -> None:
    # Python 3.11's asyncio folds a multi-address name's connect errors (localhost as ::1
    # and 127.0.0.1) into one plain OSError; its message is built as asyncio builds it
    refused = [
        ConnectionRefusedError(errno.ECONNREFUSED, f"Connect call failed ({a!r}, 8000)")
        for a in ("::1", "127.0.0.1")
    ]
    unreachable = OSError(errno.ENETUNREACH, "Connect call failed ('::1', 8000)")

    def folded(errors: list[OSError]) -> OSError:
        return OSError("Multiple exceptions: {}".format(", ".join(str(e) for e in errors)))

    assert _refused(refused[0])
    assert _refused(folded(refused))
    assert not _refused(folded([unreachable, refused[1]]))  # some host may still listen
    assert not _refused(unreachable)
    assert not _refused(OSError("Multiple exceptions: "))
