"""Fixtures for the proxy integration tests: two fault-controllable upstreams on
loopback (`tests/helpers/fake_upstream.py`) and a factory for real routers in front of
them, with timeouts in tens of milliseconds so the whole matrix runs in seconds."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from fake_upstream import FakeUpstream

from ramjet.app.server import RouterServer
from ramjet.config import PolicyConfig, parse_policy
from ramjet.decisions.record import DecisionRecord

FAST: dict[str, Any] = {
    "timeouts": {
        "connect_s": 0.5,
        "first_byte_s": 0.4,
        "idle_s": 0.3,
        "send_s": 0.3,
        "header_deadline_s": 0.3,
        "body_s": 1.0,
        "drain_s": 1.0,
        "linger_s": 0.1,
        "probe_s": 0.3,
    },
    "health": {
        "probe_interval_s": 0.05,
        "consecutive_failures": 2,
        "ejection_base_s": 0.3,
        "ejection_max_s": 2.0,
    },
    "limits": {"max_body_bytes": 64 * 1024, "max_headers": 30, "max_header_line_bytes": 1024},
}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def router_config(urls: list[str], **overrides: Any) -> PolicyConfig:
    data: dict[str, Any] = {
        "engines": [{"id": f"e{i}", "url": u} for i, u in enumerate(urls)],
        "incumbent": {"name": "round_robin"},
        **FAST,
    }
    return parse_policy(_merge(data, overrides))


class Records:
    """A DecisionSink that keeps every record."""

    def __init__(self) -> None:
        self.records: list[DecisionRecord] = []

    def on_decision(self, record: DecisionRecord) -> None:
        self.records.append(record)


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


RouterFactory = Callable[..., Awaitable[RouterServer]]


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
