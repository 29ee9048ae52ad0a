"""Fixtures for the proxy integration tests: two fault-controllable upstreams on
loopback (`tests/helpers/fake_upstream.py`) and a factory for real routers in front of
them, with timeouts in tens of milliseconds so the whole matrix runs in seconds."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from fake_upstream import FakeUpstream
from router_rig import RouterFactory, router_config

from ramjet.app.server import RouterServer


@pytest.fixture
async def upstreams() -> AsyncIterator[list[FakeUpstream]]:
    ups = [FakeUpstream("e0"), FakeUpstream("e1")]
    for u in ups:
        await u.start()
    try:
        yield ups
    finally:
        for u in ups:
            await u.stop()


@pytest.fixture
async def make_router(upstreams: list[FakeUpstream]) -> AsyncIterator[RouterFactory]:
    started: list[RouterServer] = []

    async def make(sink: Any = None, **overrides: Any) -> RouterServer:
        cfg = router_config([u.url for u in upstreams], **overrides)
        server = RouterServer(cfg, sink=sink)
        await server.start()
        started.append(server)
        return server

    try:
        yield make
    finally:
        for s in started:
            await s.stop(drain_s=0.2)
