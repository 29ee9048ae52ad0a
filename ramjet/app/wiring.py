"""Wiring: the one place that builds a `Router` from a policy file.

Wiring: `attach_reports(app, router, config, policy_path)` builds a `ReportsRuntime`
when the policy lists engine keys (`keys.engines`) or pull targets (`reports.engines`);
it gives the router `ResidencyTables` if it had none, mounts `POST /ramjet/reports`,
sets `router.signals`, and starts and stops the runtime with the app (after the router
starts, before it stops). Public key files named in `keys:` resolve against the policy
file's directory.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from ramjet.app.router import Router
from ramjet.config import PolicyConfig
from ramjet.fleet.signals import REPORTS_KEY, ReportSignals
from ramjet.reports.runtime import ReportsRuntime
from ramjet.residency.source import NoResidency
from ramjet.residency.tables import ResidencyTables


def wants_reports(config: PolicyConfig) -> bool:
    """True when the policy names engine keys or engines to pull reports from."""
    return bool(config.keys.engines) or bool(config.reports.engines)


def attach_reports(
    app: web.Application,
    router: Router,
    config: PolicyConfig,
    policy_path: str | Path | None = None,
) -> ReportsRuntime | None:
    """Build and mount the report runtime for `router` (see the module docstring);
    None when the policy configures no reports. Raises `ramjet.reports.keys.KeyError_`
    for a key that does not load, ValueError when the router's residency source is not
    `ResidencyTables` (reports can only feed the tables)."""
    if not wants_reports(config):
        return None
    tables = router.residency
    if isinstance(router.residency, NoResidency):
        tables = ResidencyTables(
            config.residency, clock=router.clock, registry=router.metrics.registry
        )
        router.residency = tables
    if not isinstance(tables, ResidencyTables):
        raise ValueError(
            f"signed reports feed ResidencyTables; the router's residency is "
            f"{type(tables).__name__}"
        )
    base_dir = Path(policy_path).resolve().parent if policy_path is not None else None
    runtime = ReportsRuntime.build(
        config.reports,
        config.keys,
        tables,
        router.metrics.registry,
        engine_urls={e.id: e.url for e in config.engines},
        base_dir=base_dir,
    )
    runtime.add_routes(app)
    app[REPORTS_KEY] = runtime
    router.signals = ReportSignals(runtime.processor)

    async def run(_: web.Application) -> AsyncIterator[None]:
        await runtime.start()
        yield
        await runtime.stop()

    app.cleanup_ctx.append(run)
    return runtime
