"""The report push listener (`ramjet.reports.push`): its own port, real Ed25519 frames,
a per-source token bucket that refuses frames before they are read or verified, and the
HTTP forms it refuses. Frames are signed by a real `ReportPublisher` with real keys; the
listener is a real socket on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry
from reports_fixtures import E0, KEYS, keyring

from ramjet.reports.bodies import DeltaBody, TierKeys
from ramjet.reports.config import PushConfig, ReportsConfig
from ramjet.reports.ingest import ReportIngest
from ramjet.reports.processor import ReportProcessor
from ramjet.reports.publisher import ReportPublisher
from ramjet.reports.push import PushLimiter
from ramjet.residency.tables import ResidencyTables
from ramjet.types import PrefixKey, Tier

# -- the limiter -------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_bucket_allows_the_burst_then_the_rate() -> None:
    clock = Clock()
    lim = PushLimiter(rate_per_s=10, burst=5, max_sources=8, clock=clock)
    assert [lim.allow("a") for _ in range(6)] == [True] * 5 + [False]
    assert lim.allow("b")  # another source has its own bucket
    clock.t += 0.15  # one and a half tokens back
    assert lim.allow("a") and not lim.allow("a")
    clock.t += 10  # refills to the burst, never past it
    assert sum(lim.allow("a") for _ in range(10)) == 5


def test_sources_beyond_the_table_share_one_bucket() -> None:
    clock = Clock()
    lim = PushLimiter(rate_per_s=1, burst=2, max_sources=2, clock=clock)
    assert lim.allow("a") and lim.allow("b")
    # the table is full: new addresses draw from one shared bucket, no fresh bursts
    assert [lim.allow(f"x{i}") for i in range(4)] == [True, True, False, False]
    clock.t += 5  # a and b have refilled: they are pruned, new sources get buckets again
    assert lim.allow("c") and lim.allow("c") and not lim.allow("c")


# -- the listener ------------------------------------------------------------------------


class Rig:
    def __init__(self, push: PushConfig) -> None:
        self.registry = CollectorRegistry()
        self.tables = ResidencyTables(registry=self.registry)
        cfg = ReportsConfig(push=push)
        self.processor = ReportProcessor(keyring(), self.tables, cfg, self.registry)
        self.ingest = ReportIngest(self.processor, {}, registry=self.registry)
        self.pub = ReportPublisher(E0, KEYS["e0-a"], "e0-a", epoch=7)
        self.port = 0

    def frame(self, *keys: int) -> bytes:
        ks = tuple(PrefixKey(k) for k in keys)
        self.pub.publish_delta(DeltaBody(stored=[TierKeys(tier=Tier.HBM.label, keys=ks)]))
        return self.pub.frames_after(0)[-1]

    def sample(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def rig(request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    push = getattr(request, "param", None) or PushConfig(port=0, rate_per_s=0.01, burst=5)
    r = Rig(push)
    await r.ingest.start()
    assert r.ingest.push is not None and r.ingest.push.port
    r.port = r.ingest.push.port
    try:
        yield r
    finally:
        await r.ingest.stop()


def post(frame: bytes, path: str = "/ramjet/reports", extra: bytes = b"") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(frame)}\r\n".encode()
        + extra
        + b"\r\n"
        + frame
    )


async def exchange(port: int, data: bytes, responses: int = 1) -> list[tuple[int, bytes]]:
    """Send `data` on one connection; read `responses` answers (status, body), or fewer
    when the listener closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    out: list[tuple[int, bytes]] = []
    try:
        writer.write(data)
        await writer.drain()
        for _ in range(responses):
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            except asyncio.IncompleteReadError:
                break
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ")[1])
            length = next(
                int(v)
                for k, _, v in (h.partition(": ") for h in lines[1:])
                if k == "Content-Length"
            )
            out.append((status, await reader.readexactly(length)))
    finally:
        writer.close()
    return out


async def test_real_frames_are_accepted_and_forged_ones_refused(rig: Rig) -> None:
    good = rig.frame(1, 2, 3)
    forged = bytearray(rig.frame(4))
    forged[-1] ^= 1
    answers = await exchange(rig.port, post(good) + post(bytes(forged)), responses=2)
    assert answers[0][0] == 202 and b'"accepted":1' in answers[0][1]
    assert answers[1] == (400, b'{"rejected":"bad_signature"}')
    assert rig.sample("ramjet_reports_accepted_total", engine="e0", kind="delta") == 1
    assert rig.sample("ramjet_reports_rejected_total", engine="e0", reason="bad_signature") == 1


async def test_frames_over_the_source_limit_are_refused_before_verifying(rig: Rig) -> None:
    """A flood of forged frames from one address: the burst (5) is verified and refused
    as bad signatures, the rest are answered 429 with their bodies passed over unread,
    so the verify count stops at the burst however long the flood goes on (the bucket
    refills at 0.01/s here). The connection stays usable."""
    forged = bytearray(rig.frame(9))
    forged[-1] ^= 1
    statuses = []
    for _ in range(10):
        answers = await exchange(rig.port, post(bytes(forged)) * 4, responses=4)
        statuses += [s for s, _ in answers]
    assert statuses == [400] * 5 + [429] * 35
    assert rig.sample("ramjet_reports_rejected_total", engine="e0", reason="bad_signature") == 5
    assert rig.sample("ramjet_reports_push_limited_total") == 35
    # a limited frame's body is skipped exactly: the next head on the connection parses
    answers = await exchange(rig.port, post(bytes(forged)) * 2 + post(b"x" * 3000), responses=3)
    assert answers == [(429, b'{"rejected":"push_rate_limited"}')] * 3
    # a genuine engine on another address is not held back by the flood
    assert rig.ingest.push is not None
    assert rig.ingest.push.limiter.allow("10.0.0.7")


@pytest.mark.parametrize(
    "data, status, reason",
    [
        (b"GET /ramjet/reports HTTP/1.1\r\nHost: x\r\n\r\n", 405, "not_found"),
        (post(b"abc", path="/v1/chat/completions"), 404, "not_found"),
        (b"POST /ramjet/reports HTTP/1.1\r\nHost: x\r\n\r\n", 411, "length_required"),
        (
            b"POST /ramjet/reports HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
            411,
            "length_required",
        ),
        (b"POST /ramjet/reports HTTP/1.1\r\nContent-Length: x1\r\n\r\n", 400, "bad_request"),
        (b"POST /ramjet/reports\r\n\r\n", 400, "bad_request"),
        (b"POST /ramjet/reports HTTP/1.1\r\n" + b"X: y\r\n" * 2000, 400, "bad_request"),
    ],
)
async def test_bad_requests_are_refused_and_change_nothing(
    rig: Rig, data: bytes, status: int, reason: str
) -> None:
    answers = await exchange(rig.port, data, responses=2)
    assert [s for s, _ in answers] == [status]  # and the connection closed after it
    assert rig.sample("ramjet_reports_push_refused_total", reason=reason) == 1
    assert rig.sample("ramjet_reports_push_limited_total") == 0
    assert rig.processor.cursor(E0) is None  # nothing reached the processor


async def test_oversize_body_is_refused_from_its_length(rig: Rig) -> None:
    cap = rig.processor.config.max_report_bytes
    head = f"POST /ramjet/reports HTTP/1.1\r\nContent-Length: {cap + 1}\r\n\r\n".encode()
    answers = await exchange(rig.port, head, responses=1)  # the body is never sent
    assert answers == [(413, b'{"rejected":"oversize"}')]
    assert rig.sample("ramjet_reports_rejected_total", engine="unknown", reason="oversize") == 1


@pytest.mark.parametrize("rig", [PushConfig(port=0, idle_s=0.2)], indirect=True)
async def test_an_idle_connection_is_closed(rig: Rig) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", rig.port)
    writer.write(b"POST /ramjet/reports HTTP/1.1\r\n")  # and never the rest
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 3) == b""
    writer.close()
    assert rig.sample("ramjet_reports_push_refused_total", reason="idle") == 1


@pytest.mark.parametrize("rig", [PushConfig(port=0, max_connections=2)], indirect=True)
async def test_connections_beyond_the_cap_are_closed_at_accept(rig: Rig) -> None:
    held = [await asyncio.open_connection("127.0.0.1", rig.port) for _ in range(2)]
    await asyncio.sleep(0.05)
    reader, writer = await asyncio.open_connection("127.0.0.1", rig.port)
    assert await asyncio.wait_for(reader.read(), 3) == b""
    writer.close()
    assert rig.sample("ramjet_reports_push_refused_total", reason="connections") == 1
    assert rig.sample("ramjet_reports_push_connections") == 2
    for _, w in held:
        w.close()


async def test_replays_pushed_from_many_sources_do_not_drain_the_engine_budget() -> None:
    """Issue 29: an authentic frame replayed from more than 10 source addresses (each
    within its own push bucket) drained the engine's bucket, because the bucket was
    charged before the replay check; the engine's next report was then rate limited."""
    r = Rig(PushConfig(port=0, rate_per_s=0.01, burst=5))
    cfg = ReportsConfig(push=r.processor.config.push, rate_per_s=0.01, burst=10)
    r.registry = CollectorRegistry()
    r.tables = ResidencyTables(registry=r.registry)
    r.processor = ReportProcessor(keyring(), r.tables, cfg, r.registry)
    r.ingest = ReportIngest(r.processor, {}, registry=r.registry)
    await r.ingest.start()
    assert r.ingest.push is not None
    port = r.ingest.push.port
    try:
        first = r.frame(1)
        assert (await exchange(port, post(first)))[0][0] == 202
        for i in range(2, 14):  # 12 sources, 4 replays each: 48 > the engine's burst of 10
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, local_addr=(f"127.0.0.{i}", 0)
            )
            writer.write(post(first) * 4)
            await writer.drain()
            for _ in range(4):
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                assert b" 400 " in head.split(b"\r\n")[0], head
                length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                assert b"replayed" in await reader.readexactly(length)
            writer.close()
        assert r.sample("ramjet_reports_rejected_total", engine="e0", reason="replayed") == 48
        assert r.sample("ramjet_reports_rejected_total", engine="e0", reason="rate_limited") == 0
        assert (await exchange(port, post(r.frame(2))))[0][0] == 202  # the engine's next one
    finally:
        await r.ingest.stop()
