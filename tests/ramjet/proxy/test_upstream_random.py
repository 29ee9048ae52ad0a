"""The engine client (`ramjet.transport.http1`) on random responses: well-formed ones (interim
heads, any status, odd but legal header bytes, Content-Length, chunked with extensions and
trailers, until-close, 204/304), the same cut short, with bytes past the body, or broken
one way each (a bare LF, a NUL, a bad name, version, status, Content-Length, chunk size or
chunk end, an unsupported Transfer-Encoding, a head past the limits). Every response is
split at random byte boundaries. Checked against what the generator knows of each: the
status, reason and headers; each read's body bytes exactly (nothing held back, nothing
invented); keep-alive reuse on one connection, response after response; and
`UpstreamClosed` (the error the relay turns into a cut) for every cut or broken one.

Most cases go through one connection's transport seam (`_Conn.data_received`, no
sockets); a smaller set goes over real loopback sockets through `EnginePool`."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import pytest

from ramjet.transport.http1 import EnginePool, UpstreamClosed, UpstreamResponse, _Conn

_TOKEN_CHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_VALUE_BYTES = bytes(range(0x21, 0x7F)) + bytes(range(0x80, 0x100))


@dataclass
class Case:
    """One response on the wire and what the client must make of it."""

    wire: bytes
    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes
    payload: list[tuple[int, int]]  # the wire's body bytes, as [start, end) ranges
    final: int  # where the final head starts
    head_end: int  # where it ends
    framing: str  # "length", "chunked", "close" (until the close) or "none"
    reusable: bool
    broken: str = ""  # how it was broken; "" for a well-formed one
    cut: int | None = None  # the engine closes after this many bytes
    extra: bool = False  # bytes past the body
    splits: list[int] = field(default_factory=list)


def _name(rng: random.Random) -> str:
    return "X-" + "".join(rng.choice(_TOKEN_CHARS) for _ in range(rng.randint(1, 12)))


def _value(rng: random.Random) -> bytes:
    inner = bytes(rng.choice(_VALUE_BYTES) for _ in range(rng.randint(0, 30)))
    if len(inner) > 2 and rng.random() < 0.3:  # inner whitespace is kept
        i = rng.randrange(1, len(inner) - 1)
        inner = inner[:i] + rng.choice([b" ", b"\t", b"  "]) + inner[i:]
    pad = (rng.choice([b"", b"", b" ", b"\t", b"  "]), rng.choice([b"", b"", b" ", b"\t"]))
    return pad[0] + inner + pad[1]


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def well_formed(rng: random.Random) -> Case:
    wire = bytearray()
    for _ in range(rng.choice([0, 0, 0, 0, 1, 2])):
        wire += rng.choice(
            [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"]
        )
    version = rng.choice(["1.1"] * 5 + ["1.0"])
    status = rng.choice([200, 200, 200, 201, 204, 304, 400, 404, 429, 500, 503])
    reason = rng.choice([b"", b"OK", b"Not Found", b"caf\xc3\xa9 \xff odd", b"A\tB"])
    framing = "none" if status in (204, 304) else rng.choice(["length", "chunked", "close"])
    body = rng.randbytes(rng.choice([0, 1, 5, 100, rng.randint(0, 5000)]))
    if framing == "none":
        body = b""
    headers: list[tuple[bytes, bytes]] = [
        (_name(rng).encode(), _value(rng)) for _ in range(rng.randint(0, 8))
    ]
    conn = rng.choice([b"", b"", b"keep-alive", b"close", b"Keep-Alive, Close"])
    if conn:
        headers.insert(rng.randint(0, len(headers)), (b"Connection", conn))
    if framing == "length":
        headers.insert(rng.randint(0, len(headers)), (b"Content-Length", b"%d" % len(body)))
    elif framing == "chunked":
        te = rng.choice([b"chunked", b"Chunked", b"gzip, chunked"])
        headers.insert(rng.randint(0, len(headers)), (b"Transfer-Encoding", te))
    elif framing == "none" and rng.random() < 0.3:  # ignored on a 204/304
        headers.append((b"Content-Length", b"7"))
    final = len(wire)
    wire += b"HTTP/%s %d%s\r\n" % (version.encode(), status, b" " + reason if reason else b"")
    for name, value in headers:
        wire += name + b":" + value + b"\r\n"
    wire += b"\r\n"
    head_end = len(wire)
    payload: list[tuple[int, int]] = []
    if framing == "chunked":
        pos = 0
        while pos < len(body):
            size = min(len(body) - pos, rng.choice([1, 3, 17, 200, 4096]))
            digits = b"%x" % size
            if rng.random() < 0.3:
                digits = digits.upper()
            if rng.random() < 0.1:
                digits = b"00" + digits
            ext = rng.choice([b"", b"", b";a=b", b";x", b';n="q"'])
            wire += digits + ext + b"\r\n"
            payload.append((len(wire), len(wire) + size))
            wire += body[pos : pos + size] + b"\r\n"
            pos += size
        wire += (
            b"0\r\n" + rng.choice([b"", b"", b"X-Trailer: 1\r\n", b"A: 1\r\nB: 2\r\n"]) + b"\r\n"
        )
    elif body:
        payload.append((len(wire), len(wire) + len(body)))
        wire += body
    return Case(
        wire=bytes(wire),
        status=status,
        reason=_text(reason),
        headers=[(_text(n), _text(v).strip()) for n, v in headers],
        body=body,
        payload=payload,
        final=final,
        head_end=head_end,
        framing=framing,
        reusable=version == "1.1" and b"close" not in conn.lower() and framing != "close",
    )


def _head_lines(case: Case) -> list[tuple[int, int]]:
    """The final head's header lines: [start, end) of each before its CRLF."""
    lines: list[tuple[int, int]] = []
    pos = case.wire.index(b"\r\n", case.final) + 2
    while pos < case.head_end - 2:
        end = case.wire.index(b"\r\n", pos)
        lines.append((pos, end))
        pos = end + 2
    return lines


def broken(rng: random.Random) -> Case:
    """A well-formed response broken one way; the client must refuse it."""
    while True:
        case = well_formed(rng)
        w = case.wire
        final = case.final
        lines = _head_lines(case)
        kinds = ["version", "status", "lines", "size"]
        if final == 0:
            kinds += ["proto"]
        if case.reason:
            kinds += ["reason_nul"]
        if lines:
            kinds += ["lf", "lf", "nul", "ctl", "name"]
        if case.framing != "none":
            kinds += ["te"]
        if case.framing == "length":
            kinds += ["length", "length2"]
        if case.framing == "chunked" and case.payload:
            kinds += ["chunk_size", "chunk_end"]
        kind = rng.choice(kinds)
        if kind in ("lf", "nul", "ctl", "name"):
            a, b = rng.choice(lines)
            if kind == "lf":  # the line ends in a bare LF: response splitting
                w = w[:b] + b"\nSet-Cookie: evil=1" + w[b:]
            elif kind == "nul":
                w = w[:b] + b"a\x00b" + w[b:]
            elif kind == "ctl":
                w = w[:b] + rng.choice([b"a\x01b", b"a\rb", b"a\x7fb"]) + w[b:]
            else:
                w = w[:a] + b"Bad Name" + w[a:]
        elif kind == "version":
            w = (
                w[:final]
                + rng.choice([b"HTTP/1.2", b"HTTP/2.0", b"HTTP/0.9", b"HTTP/1.10"])
                + w[final + 8 :]
            )
        elif kind == "proto":  # llhttp parses RTSP/ and ICE/ status lines too
            w = rng.choice([b"RTSP/", b"ICE/"]) + w[5:]
        elif kind == "reason_nul":  # llhttp takes a NUL there
            eol = w.index(b"\r\n", final)
            w = w[:eol] + b"\x00" + w[eol:]
        elif kind == "status":
            code = rng.choice([b"099", b"600", b"101", b"2000", b"20x"])
            w = w[: final + 9] + code + w[final + 12 :]
        elif kind == "te":
            w = (
                w[: case.head_end - 2]
                + b"Transfer-Encoding: chunked, gzip\r\n"
                + w[case.head_end - 2 :]
            )
        elif kind == "lines":
            w = w[: case.head_end - 2] + b"X-Many: 1\r\n" * 300 + w[case.head_end - 2 :]
        elif kind == "size":
            w = (
                w[: case.head_end - 2]
                + b"X-Big: "
                + b"b" * 70_000
                + b"\r\n"
                + w[case.head_end - 2 :]
            )
        elif kind == "length":
            w = w.replace(b"Content-Length:", b"Content-Length:1x", 1)
        elif kind == "length2":
            w = w[: case.head_end - 2] + b"Content-Length: 99\r\n" + w[case.head_end - 2 :]
        elif kind == "chunk_size":
            start, _ = case.payload[0]
            line = w.rindex(b"\r\n", 0, start - 2) + 2
            w = w[:line] + b"g" + w[line:]
        else:  # chunk_end: the chunk's data is not followed by CRLF
            _, end = case.payload[-1]
            w = w[:end] + b"XY" + w[end + 2 :]
        if w == case.wire:
            continue
        return Case(
            wire=w,
            status=0,
            reason="",
            headers=[],
            body=case.body,
            payload=[],
            final=final,
            head_end=case.head_end,
            framing=case.framing,
            reusable=False,
            broken=kind,
        )


def random_case(rng: random.Random) -> Case:
    r = rng.random()
    if r < 0.25:
        case = broken(rng)
    else:
        case = well_formed(rng)
        if r < 0.45:
            case.cut = rng.randrange(0, len(case.wire))
        elif r < 0.5 and case.framing != "close":
            case.extra = True
            case.wire += rng.choice(
                [b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", b"junk", b"0\r\n\r\n"]
            )
            case.reusable = False
    n = len(case.wire)
    if rng.random() < 0.05 and n < 400:
        case.splits = list(range(1, n))
    else:
        case.splits = sorted(set(rng.randrange(1, n) for _ in range(rng.randint(0, 10)) if n > 1))
    return case


def _payload_in(case: Case, a: int, b: int) -> bytes:
    return b"".join(case.wire[max(a, s) : min(b, e)] for s, e in case.payload if s < b and e > a)


# -- through the transport seam ----------------------------------------------------------


class _Wire:
    """One `_Conn`'s transport: takes writes, records a close."""

    def __init__(self) -> None:
        self.closed = False

    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str) -> None:
        return None

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _drain(resp: UpstreamResponse) -> tuple[bytes, BaseException | None]:
    out = b""
    try:
        while chunk := await resp.readany(1.0):
            out += chunk
    except UpstreamClosed as exc:
        return out, exc
    return out, None


async def _one(pool: EnginePool, conn: _Conn, wire: _Wire, case: Case, tag: str) -> None:
    answer = conn.send(b"GET / HTTP/1.1\r\n\r\n")
    end = len(case.wire) if case.cut is None else case.cut
    cuts = [s for s in case.splits if s < end] + [end]
    resp: UpstreamResponse | None = None
    got = b""
    pos = 0
    for stop in cuts:
        if conn._closed or stop <= pos:
            break
        conn.data_received(case.wire[pos:stop])
        if resp is None and answer.done() and answer.exception() is None:
            resp = answer.result()
        if resp is not None:
            piece = resp.read_nowait()
            if not case.broken:  # every body byte of this read, at once
                assert piece == _payload_in(case, pos, stop), tag
            got += piece
        pos = stop
    if case.cut is not None or case.framing == "close":
        conn.connection_lost(None)
    if case.broken or (
        case.cut is not None and (case.framing != "close" or case.cut < case.head_end)
    ):
        if resp is None:
            assert answer.done(), tag
            assert isinstance(answer.exception(), UpstreamClosed), tag
        else:
            rest, err = await _drain(resp)
            assert isinstance(err, UpstreamClosed), tag
            assert case.body.startswith(got + rest), tag  # nothing invented
            resp.close()
        assert conn._closed and conn not in pool._idle, tag
        return
    assert resp is not None, tag
    assert (resp.status, resp.reason) == (case.status, case.reason), tag
    assert list(resp.headers.items()) == case.headers, tag
    assert resp.content_length == (len(case.body) if case.framing == "length" else None), tag
    rest, err = await _drain(resp)
    assert err is None, tag
    expect = case.body if case.cut is None else _payload_in(case, 0, case.cut)
    assert got + rest == expect and resp.at_eof(), tag
    resp.close()
    assert (conn in pool._idle) == case.reusable and conn._closed == (not case.reusable), tag


@pytest.mark.parametrize("seed", range(8))
async def test_random_responses_through_the_seam(seed: int) -> None:
    rng = random.Random(seed)
    pool = EnginePool("http://127.0.0.1:9", limit=1, connect_s=1.0)
    kinds: dict[str, int] = {}
    try:
        for i in range(400):
            conn, wire = _Conn(pool), _Wire()
            conn.connection_made(wire)  # type: ignore[arg-type]
            pool._open.add(conn)
            while True:  # responses on one connection until it is not reusable
                case = random_case(rng)
                key = case.broken or ("cut" if case.cut is not None else case.framing)
                kinds[key] = kinds.get(key, 0) + 1
                await _one(
                    pool, conn, wire, case, f"seed {seed} case {i} {key}: {case.wire[:300]!r}"
                )
                if conn._closed:
                    break
                pool._idle.remove(conn)
    finally:
        await pool.close()
    # each kind came up: the generator is not stuck on one shape
    assert {"length", "chunked", "close", "none", "cut", "lf", "status", "proto"} <= set(kinds), (
        kinds
    )


# -- over loopback sockets ---------------------------------------------------------------


async def test_random_responses_over_loopback() -> None:
    rng = random.Random(1234)
    plan: list[Case] = []
    while len(plan) < 150:
        case = random_case(rng)
        if not case.extra and len(case.splits) < 50:
            plan.append(case)
    queue = list(plan)
    conns = [0]

    async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conns[0] += 1
        try:
            while queue:
                await r.readuntil(b"\r\n\r\n")
                case = queue.pop(0)
                end = len(case.wire) if case.cut is None else case.cut
                pos = 0
                for stop in [s for s in case.splits if s < end] + [end]:
                    w.write(case.wire[pos:stop])
                    await w.drain()
                    await asyncio.sleep(0)
                    pos = stop
                if not case.reusable or case.cut is not None:
                    return  # the close ends an until-close body, cuts a cut one
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            w.close()

    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    pool = EnginePool(f"http://127.0.0.1:{port}", limit=1, connect_s=1.0)
    fresh = 1
    try:
        async with asyncio.timeout(60):
            for i, case in enumerate(plan):
                tag = f"case {i} {case.broken or case.framing} cut {case.cut}: {case.wire[:300]!r}"
                failed = case.broken or (
                    case.cut is not None and (case.framing != "close" or case.cut < case.head_end)
                )
                try:
                    resp = await pool.request("GET", "/", [], b"")
                except UpstreamClosed:
                    assert failed, tag
                else:
                    body, err = await _drain(resp)
                    resp.close()
                    if failed:
                        assert isinstance(err, UpstreamClosed) and case.body.startswith(body), tag
                    else:
                        expect = case.body if case.cut is None else _payload_in(case, 0, case.cut)
                        assert err is None and body == expect, tag
                        assert (resp.status, resp.reason) == (case.status, case.reason), tag
                        assert list(resp.headers.items()) == case.headers, tag
                if i + 1 < len(plan) and (not case.reusable or failed or case.cut is not None):
                    fresh += 1
    finally:
        await pool.close()
        srv.close()
        await srv.wait_closed()
    assert conns[0] == fresh  # a reusable response's connection was reused, no other


# -- limits the random cases do not reach ------------------------------------------------


@pytest.mark.parametrize(
    "tail",
    [
        b"1;" + b"e" * 100_000,  # a chunk extension that never ends
        b"1\r\na\r\n0\r\nX-Trailer: " + b"t" * 100_000,  # a trailer that never ends
        b"1" * 17 + b"\r\n",  # a chunk size past 64 bits (16 hex digits stream)
    ],
)
async def test_chunk_framing_without_data_is_bounded(tail: bytes) -> None:
    pool = EnginePool("http://127.0.0.1:9", limit=1, connect_s=1.0)
    conn, wire = _Conn(pool), _Wire()
    conn.connection_made(wire)  # type: ignore[arg-type]
    answer = conn.send(b"GET / HTTP/1.1\r\n\r\n")
    conn.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    resp = answer.result()
    for i in range(0, len(tail), 8192):
        if conn._closed:
            break
        conn.data_received(tail[i : i + 8192])
    assert conn._closed and wire.closed
    body, err = await _drain(resp)
    assert isinstance(err, UpstreamClosed) and b"a".startswith(body)
    await pool.close()
