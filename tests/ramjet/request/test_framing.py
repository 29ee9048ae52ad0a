"""`ramjet.request.framing.BodyFramer`: the head once, chunked and length framing, no body
for 1xx/204/304, and when a relayed piece may be written at once (the transport is a
recording stand-in: the seam this unit owns; the fast server's tests run it on sockets)."""

from __future__ import annotations

from dataclasses import dataclass, field

from multidict import CIMultiDict

from ramjet.request.framing import FRAMING_BYTES, BodyFramer, serialize_head


@dataclass
class _Transport:
    closing: bool = False
    buffered: int = 0
    wrote: list[bytes] = field(default_factory=list)

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def write(self, data: bytes) -> None:
        self.wrote.append(data)


@dataclass
class _Conn:
    transport: _Transport | None = field(default_factory=_Transport)
    writing_paused: bool = False
    response_started: bool = False

    async def drain(self) -> None:
        return None


def _framer(status: int, length: int | None) -> BodyFramer:
    f = BodyFramer(status, length)
    f.set_head(*serialize_head(status, "OK", CIMultiDict(), length, True))
    return f


def test_chunked_pieces_follow_the_head_once_and_end_with_the_terminator() -> None:
    f = _framer(200, None)
    assert f.chunked and f.head is not None and b"Transfer-Encoding: chunked" in f.head
    first = f.frame(b"data: 1\n\n", False)
    assert first == f.head + b"9\r\ndata: 1\n\n\r\n" and f.started
    assert f.frame(b"x" * 26, False) == b"1a\r\n" + b"x" * 26 + b"\r\n"
    assert f.frame(b"", False) == b""  # an empty piece is no chunk (it would end the body)
    assert f.frame(b"", True) == b"0\r\n\r\n"


def test_chunk_size_lines_are_hex_at_every_size() -> None:
    # sizes framed from the table of size lines, at its edge, and past it (formatted)
    f = _framer(200, None)
    f.frame(b"", False)
    for n in (1, 15, 16, 255, 4095, 4096, 4097, 70_000):
        assert f.frame(b"y" * n, False) == b"%x\r\n" % n + b"y" * n + b"\r\n"
    assert f.frame(b"z" * 4096, True) == b"1000\r\n" + b"z" * 4096 + b"\r\n0\r\n\r\n"


def test_a_length_framed_body_never_exceeds_its_length() -> None:
    f = _framer(200, 5)
    assert not f.chunked and b"Content-Length: 5" in (f.head or b"")
    assert f.frame(b"abc", False).endswith(b"\r\n\r\nabc")
    assert f.frame(b"defgh", True) == b"de" and f.left == 0
    assert f.frame(b"more", False) == b""


def test_no_body_statuses_write_the_head_alone() -> None:
    for status in (204, 304, 101):
        f = _framer(status, None)
        assert f.empty and f.frame(b"ignored", True) == f.head


def test_write_now_writes_only_what_cannot_wait() -> None:
    f, conn = _framer(200, None), _Conn()
    t = conn.transport
    assert t is not None
    assert not f.write_now(conn, b"a", 1024)  # the head has not gone: the first piece waits
    f.frame(b"first", False)
    assert f.write_now(conn, b"abc", 1024) and t.wrote == [b"3\r\nabc\r\n"]
    t.buffered = 1024 - FRAMING_BYTES - 3  # with this piece at the limit: still at once
    assert f.write_now(conn, b"abc", 1024)
    t.buffered += 1  # one byte over: it waits
    assert not f.write_now(conn, b"abc", 1024)
    t.buffered = 0
    conn.writing_paused = True
    assert not f.write_now(conn, b"abc", 1024)
    conn.writing_paused, t.closing = False, True
    assert not f.write_now(conn, b"abc", 1024)
    t.closing = False
    assert not f.write_now(_Conn(transport=None), b"abc", 1024)
    f.eof_sent = True
    assert not f.write_now(conn, b"abc", 1024)
    assert len(t.wrote) == 2  # nothing written by a refusal
