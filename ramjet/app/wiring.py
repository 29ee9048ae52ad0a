"""Wiring: the one place that builds a `Router` from a policy file.

Everything the router holds is built here first and handed to its constructor; nothing
is set on it afterwards:

- the metrics registry (`RouterMetrics`, over the caller's `CollectorRegistry` if any);
- the residency tables: the caller's (`residency=`, e.g. a test's, or replicas sharing
  one Redis), else for `store.kind: redis` a `ResidencyRuntime` over a `RedisStore`
  (`ramjet.residency.factory`; its sync starts and stops with the app, a dead Redis is
  not fatal), else `ResidencyTables` in memory when reports are configured, else
  `NoResidency` (a router without reports or a shared store keeps no residency);
- the report runtime (`ReportsRuntime`) when the policy lists engine keys
  (`keys.engines`) or pull targets (`reports.engines`), and the router's
  `EngineSignals` from it (`ReportSignals`; `NoSignals` without reports). Public key
  files named in `keys:` resolve against the policy file's directory;
- the key pools (`KeyPools`, from `key_pools:`).

`mount(app, wired)` then adds what rides on the aiohttp app: `app[REPORTS_KEY]` and the
start and stop of the residency sync and the report runtime (in that order; stopped in
reverse). Report pushes have a listener of their own (`reports.push`), never the client
port.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry

from ramjet.app.router import Router
from ramjet.config import PolicyConfig
from ramjet.decisions.record import DecisionSink
from ramjet.fleet.signals import REPORTS_KEY, EngineSignals, NoSignals, ReportSignals
from ramjet.keys.pools import KeyPools
from ramjet.metrics import RouterMetrics
from ramjet.reports.runtime import ReportsRuntime
from ramjet.residency.factory import ResidencyRuntime, build_residency
from ramjet.residency.source import NoResidency, ResidencySource
from ramjet.residency.tables import ResidencyTables


def wants_reports(config: PolicyConfig) -> bool:
    """True when the policy names engine keys or engines to pull reports from."""
    return bool(config.keys.engines) or bool(config.reports.engines)


@dataclass(frozen=True)
class Wired:
    """A router and the runtimes built with it (see the module docstring)."""

    router: Router
    reports: ReportsRuntime | None = None
    residency: ResidencyRuntime | None = None
    """Set when the wiring built the shared store itself (`store.kind: redis`)."""


def build_router(
    config: PolicyConfig,
    *,
    registry: CollectorRegistry | None = None,
    residency: ResidencyTables | None = None,
    sink: DecisionSink | None = None,
    policy_path: str | Path | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Wired:
    """Build the router for `config` (see the module docstring). Raises
    `ramjet.reports.keys.KeyError_` for a configured key that does not load."""
    metrics = RouterMetrics(registry)
    runtime: ResidencyRuntime | None = None
    tables = residency
    if tables is None and config.store.kind == "redis":
        runtime = build_residency(config, metrics.registry, clock)
        tables = runtime.tables
    reports: ReportsRuntime | None = None
    signals: EngineSignals = NoSignals()
    if wants_reports(config):
        if tables is None:
            tables = ResidencyTables(config.residency, clock=clock, registry=metrics.registry)
        base_dir = Path(policy_path).resolve().parent if policy_path is not None else None
        reports = ReportsRuntime.build(
            config.reports,
            config.keys,
            tables,
            metrics.registry,
            engine_urls={e.id: e.url for e in config.engines},
            base_dir=base_dir,
        )
        signals = ReportSignals(reports.processor)
    source: ResidencySource = tables if tables is not None else NoResidency()
    router = Router(
        config,
        metrics=metrics,
        residency=source,
        signals=signals,
        key_pools=KeyPools(config.key_pools, registry=metrics.registry),
        sink=sink,
        clock=clock,
    )
    return Wired(router, reports, runtime)


def mount(app: web.Application, wired: Wired) -> None:
    """Add the wired runtimes to `app`: the report routes and key, and their start and
    stop with the app's lifecycle."""
    reports, runtime = wired.reports, wired.residency
    if reports is not None:
        app[REPORTS_KEY] = reports
    if reports is None and runtime is None:
        return

    async def run(_: web.Application) -> AsyncIterator[None]:
        if runtime is not None:
            await runtime.start()
        if reports is not None:
            await reports.start()
        yield
        if reports is not None:
            await reports.stop()
        if runtime is not None:
            await runtime.stop()

    app.cleanup_ctx.append(run)
