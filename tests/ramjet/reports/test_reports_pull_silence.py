"""A pull target that never answers says so: a warning naming the engine and its URL on
the first failure (then once a minute), `ramjet_reports_pull_failures_total` and
`ramjet_reports_pull_silent_seconds` on /metrics, and a note when it answers again.
Real sockets: first a loopback port nobody listens on, then a real signing publisher on
that same port."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from reports_fixtures import E0, KEYS, keyring

from ramjet.reports.config import PollConfig, ReportsConfig
from ramjet.reports.ingest import ReportIngest
from ramjet.reports.processor import ReportProcessor
from ramjet.reports.publisher import ReportPublisher
from ramjet.residency.tables import ResidencyTables


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sample(reg: CollectorRegistry, name: str) -> float | None:
    return reg.get_sample_value(name, {"engine": "e0"})


async def test_a_silent_pull_target_is_logged_counted_and_exported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reg = CollectorRegistry()
    tables = ResidencyTables(registry=reg)
    cfg = ReportsConfig(
        poll=PollConfig(wait_s=0.2, timeout_s=1.0, backoff_min_s=0.05, backoff_max_s=0.1)
    )
    proc = ReportProcessor(keyring(), tables, cfg, reg)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ingest = ReportIngest(proc, {E0: url}, registry=reg)
    assert sample(reg, "ramjet_reports_pull_failures_total") == 0  # exported from the start
    assert sample(reg, "ramjet_reports_pull_silent_seconds") is None  # not started yet
    caplog.set_level(logging.INFO, logger="ramjet.reports.ingest")
    runner: web.AppRunner | None = None
    pub = ReportPublisher(E0, KEYS["e0-a"], "e0-a", snapshot=lambda: ([], []))
    await ingest.start()
    try:
        deadline = time.monotonic() + 5
        while (sample(reg, "ramjet_reports_pull_failures_total") or 0) < 3:
            assert time.monotonic() < deadline, "no failures counted"
            await asyncio.sleep(0.05)
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]  # once, not per poll
        msg = warnings[0].getMessage()
        assert "e0" in msg and url in msg and "never answered" in msg
        silent = sample(reg, "ramjet_reports_pull_silent_seconds")
        assert silent is not None and silent > 0.1
        assert b"ramjet_reports_pull_silent_seconds" in generate_latest(reg)

        # the engine comes up on that port: the pulls answer, the silence ends, and it
        # is said so
        app = web.Application()
        pub.add_routes(app)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await pub.start()
        deadline = time.monotonic() + 5
        while not any("answers again" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "the answering target was not noticed"
            await asyncio.sleep(0.05)
        after = sample(reg, "ramjet_reports_pull_silent_seconds")
        assert after is not None and after < silent + 1.0 and after < 1.0
        assert proc.cursor(E0) is not None  # its snapshot was pulled and accepted
    finally:
        await ingest.stop()
        await pub.stop()
        if runner is not None:
            await runner.cleanup()
