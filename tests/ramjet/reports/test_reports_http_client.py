"""Report pulls and pushes over the router's engine-facing client (`ramjet.transport`),
against real loopback servers: a pull target under a base path with a pull token, the
pull's errors (a status other than 200, an answer over the cap, a target that does not
answer in time), and a push the router refuses for now (5xx, 429) kept and sent again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry
from reports_fixtures import E0, KEYS, keyring

from ramjet.reports import transport as tp
from ramjet.reports.bodies import LoadBody
from ramjet.reports.config import PollConfig, ReportsConfig
from ramjet.reports.ingest import ReportIngest, ResponseTooLarge
from ramjet.reports.processor import ReportProcessor
from ramjet.reports.publisher import ReportPublisher
from ramjet.residency.tables import ResidencyTables

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
LOAD = LoadBody(queued_prompt_tokens=7, running_requests=1, waiting_requests=0, kv_utilization=0.5)


@asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def ingest_for(
    url: str | None, *, timeout_s: float = 2.0, pull_token: str | None = None
) -> ReportIngest:
    """An ingest pulling from `url` once started (None: no pull loop; the test pulls)."""
    reg = CollectorRegistry()
    cfg = ReportsConfig(poll=PollConfig(wait_s=0.2, timeout_s=timeout_s))
    proc = ReportProcessor(keyring(), ResidencyTables(registry=reg), cfg, reg)
    engines = {} if url is None else {E0: url}
    return ReportIngest(proc, engines, registry=reg, pull_token=pull_token)


async def test_a_pull_target_under_a_base_path_with_a_pull_token() -> None:
    pub = ReportPublisher(E0, KEYS["e0-a"], "e0-a", snapshot=lambda: ([], []), pull_token="tok")
    seen: list[tuple[str, str | None]] = []

    @web.middleware
    async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
        seen.append((request.path_qs, request.headers.get("Authorization")))
        return await handler(request)

    inner = web.Application()
    pub.add_routes(inner)
    app = web.Application(middlewares=[record])
    app.add_subapp("/eng", inner)
    async with serve(app) as url:
        pub.publish_load(LOAD)
        ingest = ingest_for(url + "/eng/", pull_token="tok")
        await ingest.start()  # its pull loop: a snapshot first, then long-polls
        try:
            deadline = time.monotonic() + 5
            while ingest.polls.get(E0, 0) < 1:
                assert time.monotonic() < deadline, f"no poll answered: {seen}"
                await asyncio.sleep(0.02)
        finally:
            await ingest.stop()
        # the load report came in the snapshot fetched first
        cursor = ingest.processor.cursor(E0)
        assert cursor is not None and cursor.epoch == pub.epoch and cursor.seq == 1
        assert seen[0] == ("/eng" + tp.SNAPSHOT_PATH, "Bearer tok")
        path_qs, auth = seen[1]
        assert auth == "Bearer tok"
        assert path_qs == f"/eng{tp.REPORTS_PATH}?after=1&wait=0.2&max=512&epoch={pub.epoch}"

        # a wrong token: the publisher's 401 is the pull's error, nothing applied
        wrong = ingest_for(None, pull_token="nope")
        await wrong.start()
        try:
            with pytest.raises(RuntimeError, match=r"^snapshot: HTTP 401$"):
                await wrong.poll_once(E0, url + "/eng")
        finally:
            await wrong.stop()
        assert wrong.processor.cursor(E0) is None


async def test_pull_errors_status_size_and_time() -> None:
    cap = ReportsConfig().max_report_bytes
    mode = {"snapshot": "big"}

    async def snapshot(request: web.Request) -> web.StreamResponse:
        if mode["snapshot"] == "slow":
            await asyncio.sleep(5)
        if mode["snapshot"] == "gone":
            return web.Response(status=404, body=b"x" * (cap + 10))  # refused unread
        # one byte over what a frame may be: cut off, not parsed
        return web.Response(body=b"x" * (cap + 2), content_type=tp.FRAME_TYPE)

    app = web.Application()
    app.router.add_get(tp.SNAPSHOT_PATH, snapshot)
    async with serve(app) as url:
        ingest = ingest_for(None, timeout_s=0.5)
        await ingest.start()
        try:
            with pytest.raises(ResponseTooLarge, match=f"more than {cap + 1} bytes"):
                await ingest.fetch_snapshot(E0, url)
            mode["snapshot"] = "gone"
            with pytest.raises(RuntimeError, match=r"^snapshot: HTTP 404$"):
                await ingest.fetch_snapshot(E0, url)
            mode["snapshot"] = "slow"
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                await ingest.fetch_snapshot(E0, url)
            assert 0.4 < time.monotonic() - t0 < 2.0  # poll.timeout_s, connect included
            assert ingest.processor.cursor(E0) is None  # nothing was submitted
        finally:
            await ingest.stop()
        with pytest.raises(AssertionError, match="start"):
            await ingest.fetch_snapshot(E0, url)  # stopped: its pools are closed


async def test_a_refused_push_is_kept_and_sent_again() -> None:
    statuses = [503, 429]
    got: list[tuple[str, str, bytes]] = []

    async def ingest_push(request: web.Request) -> web.StreamResponse:
        got.append((request.path_qs, request.content_type, await request.read()))
        return web.json_response({}, status=statuses.pop(0) if statuses else 202)

    app = web.Application()
    app.router.add_post("/in/reports", ingest_push)
    async with serve(app) as url:
        pub = ReportPublisher(E0, KEYS["e0-a"], "e0-a", push_url=url + "/in/reports?from=e0")
        await pub.start()
        try:
            pub.publish_load(LOAD)
            deadline = time.monotonic() + 5
            while pub.pushed < 1:
                assert time.monotonic() < deadline, f"not pushed: {got}"
                await asyncio.sleep(0.02)
        finally:
            await pub.stop()
        assert pub.push_failures == 2 and pub.pushed == 1
        assert len(got) == 3
        assert {(p, ct) for p, ct, _ in got} == {("/in/reports?from=e0", tp.FRAME_TYPE)}
        assert got[0][2] == got[1][2] == got[2][2]  # the same frame, sent again


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/x", "http://", "not a url", "http://h:99999/"])
def test_a_bad_push_url_is_refused_at_once(url: str) -> None:
    with pytest.raises(ValueError, match="push_url"):
        ReportPublisher(E0, KEYS["e0-a"], "e0-a", push_url=url)
