"""HTTP transport shared by the publisher (engine) and the ingest (router).

Endpoints on the engine (`publisher.py`):

    GET /ramjet/reports?epoch=E&after=SEQ&wait=S&max=N
        200, Content-Type application/x-ramjet-reports, body: frames with seq > SEQ in
        order, each as u32be(len) || frame. Waits up to S seconds (capped at 30) when
        there is none yet. Headers: X-Ramjet-Epoch (the engine's current epoch),
        X-Ramjet-Head-Seq (its last seq), X-Ramjet-Snapshot-Needed: 1 when E is not the
        current epoch (or absent) or SEQ is older than the ring or ahead of the head;
        the body is then empty and the client fetches a snapshot.
    GET /ramjet/snapshot
        200, Content-Type application/x-ramjet-report, body: one signed snapshot frame.

Endpoint on the router's push listener (`push.py`, `reports.push.port`; off by default,
never the client port):

    POST /ramjet/reports   body: one frame. 202 accepted; 400 {"rejected": reason}
        (413 when oversize, 429 when rate limited, per source before verifying or per
        engine after). Authenticated by the frame's signature, exactly as pulled frames are.

The headers are not signed: a party that forges them can at most make the router
fetch a (signed) snapshot early or poll again. Nothing unsigned reaches the tables.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator

from ramjet.errors import ReportError

REPORTS_PATH = "/ramjet/reports"
SNAPSHOT_PATH = "/ramjet/snapshot"
BATCH_TYPE = "application/x-ramjet-reports"
FRAME_TYPE = "application/x-ramjet-report"
H_EPOCH = "X-Ramjet-Epoch"
H_HEAD = "X-Ramjet-Head-Seq"
H_SNAPSHOT = "X-Ramjet-Snapshot-Needed"
MAX_WAIT_S = 30.0

_U32 = struct.Struct(">I")


def pack_frames(frames: Iterable[bytes]) -> bytes:
    out = bytearray()
    for f in frames:
        out += _U32.pack(len(f))
        out += f
    return bytes(out)


class BatchError(ReportError, ValueError):
    """A batch whose framing is broken (truncated length or frame)."""


def iter_frames(data: bytes) -> Iterator[bytes]:
    """Frames of a batch, unparsed (the verifier checks each one's size first)."""
    view = memoryview(data)
    pos = 0
    while pos < len(view):
        if pos + 4 > len(view):
            raise BatchError("batch ends inside a length prefix")
        (n,) = _U32.unpack_from(view, pos)
        pos += 4
        if pos + n > len(view):
            raise BatchError("batch ends inside a frame")
        yield bytes(view[pos : pos + n])
        pos += n
