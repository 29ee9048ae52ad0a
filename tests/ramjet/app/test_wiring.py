"""`ramjet.app.wiring`: the router is built whole from the policy file, and what it runs
beside it (report runtime, the Redis store's sync) rides on the app's lifecycle."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers"))
from redis_server import redis_server

from ramjet.app.wiring import build, mount, wants_reports
from ramjet.config import PolicyConfig, parse_policy
from ramjet.fleet.signals import REPORTS_KEY, NoSignals, ReportSignals
from ramjet.reports.keys import public_key_b64
from ramjet.residency.source import NoResidency
from ramjet.residency.tables import ResidencyTables

KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
ENGINES = [{"id": "e0", "url": "http://127.0.0.1:9"}, {"id": "e1", "url": "http://127.0.0.1:10"}]


def policy(**extra: Any) -> PolicyConfig:
    return parse_policy({"engines": ENGINES, "incumbent": {"name": "round_robin"}, **extra})


def with_keys(**extra: Any) -> PolicyConfig:
    key = {"key_id": "e0-a", "public_key": public_key_b64(KEY.public_key())}
    return policy(keys={"engines": {"e0": [key]}}, **extra)


def test_bare_policy_no_residency_no_signals_no_runtimes() -> None:
    wired = build(policy())
    assert isinstance(wired.router.residency, NoResidency)
    assert isinstance(wired.router.signals, NoSignals)
    assert wired.reports is None and wired.residency is None
    app = web.Application()
    mount(app, wired)
    assert REPORTS_KEY not in app and not app.cleanup_ctx


def test_reports_get_tables_and_signals_before_the_router_exists() -> None:
    cfg = with_keys()
    assert wants_reports(cfg)
    wired = build(cfg)
    assert wired.reports is not None
    router = wired.router
    # the router holds the runtime's processor and tables from construction on
    assert isinstance(router.signals, ReportSignals)
    assert router.signals.processor is wired.reports.processor
    assert isinstance(router.residency, ResidencyTables)
    assert router.residency is wired.reports.processor.tables
    # one registry: the report metrics sit beside the router's
    assert (
        router.metrics.registry.get_sample_value("ramjet_reports_gaps_total", {"engine": "e0"}) == 0
    )
    app = web.Application()
    mount(app, wired)
    assert app[REPORTS_KEY] is wired.reports and len(app.cleanup_ctx) == 1


def test_given_tables_are_the_routers() -> None:
    cfg = with_keys()
    tables = ResidencyTables(cfg.residency)
    wired = build(cfg, residency=tables)
    assert wired.router.residency is tables
    assert wired.reports is not None and wired.reports.processor.tables is tables
    assert wired.residency is None  # the caller runs its own store


@pytest.mark.redis
async def test_redis_store_is_built_and_runs_with_the_app() -> None:
    with redis_server() as server:
        cfg = policy(store={"kind": "redis", "url": server.url, "timeout_ms": 500})
        wired = build(cfg)
        runtime = wired.residency
        assert runtime is not None and runtime.store is not None
        assert wired.router.residency is runtime.tables
        assert runtime.tables.store.shared() is runtime.store
        app = web.Application()
        mount(app, wired)
        runner = web.AppRunner(app)
        await runner.setup()  # startup: the store's warm sync and its task
        try:
            assert runtime._task is not None and not runtime._task.done()
        finally:
            await runner.cleanup()
        assert runtime._task is None
