"""Wiring: the one place that builds the router and every part it runs with, from a
policy file (`build`). `Router(...)` only receives built parts; nothing is set on it
afterwards, and a reload (`ramjet.app.reload`) builds a new mode runner here
(`build_modes`) and swaps it in. Built here:

- the metrics registry (`RouterMetrics`, over the caller's `CollectorRegistry` if any),
  its per-engine series, and the profile collector (`ProfileSources`);
- the fleet (`Fleet`: engine state, ejections counted), the proxy (`Proxy`) and the
  engine transports of every use (`transports`: HTTP/1.1 pools, `http1_transports`,
  unless the caller gives others, e.g. `MemoryTransport`s in a unit test);
- the mode runner and its policies (`build_modes`), the accounting (`Accounting`,
  with its calibration and decision log, passing records on to the caller's `sink`),
  admission (`Admission`), priority hints (`PriorityHints`), the fleet estimators
  (arrivals, routed work), the parse limits, the trusted networks and the message
  counter for large bodies (`Prechecker`);
- the residency tables: the caller's (`residency=`, e.g. a test's, or replicas sharing
  one Redis), else for `store.kind: redis` a `ResidencyRuntime` over a `RedisStore`
  (`ramjet.residency.factory`; its sync starts and stops with the app, a dead Redis is
  not fatal), else `ResidencyTables` in memory when reports are configured, else
  `NoResidency` (a router without reports or a shared store keeps no residency);
- the report runtime (`ReportsRuntime`) when the policy lists engine keys
  (`keys.engines`) or pull targets (`reports.engines`), and the router's
  `EngineSignals` from it (`ReportSignals`; `NoSignals` without reports). Public key
  files named in `keys:` resolve against the policy file's directory;
- the key pools (`KeyPools`, from `key_pools:`);
- the completion routes' own server (`fast_server`, `ramjet.app.fast_server`), given to
  aiohttp's server when it is made (`ramjet.app.server`).

`mount(app, wired)` then adds what rides on the aiohttp app: `app[REPORTS_KEY]` and the
start and stop of the residency sync and the report runtime (in that order; stopped in
reverse). Report pushes have a listener of their own (`reports.push`), never the client
port.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from aiohttp.web_log import AccessLogger
from prometheus_client import CollectorRegistry

from ramjet.app.fast_server import FastServer
from ramjet.app.modes import ArrivalRate, ModeRunner
from ramjet.app.priority import PriorityHints
from ramjet.app.profile_source import ProfileSources
from ramjet.app.router import Router
from ramjet.config import PolicyConfig
from ramjet.decisions.accounting import Accounting
from ramjet.decisions.record import DecisionSink
from ramjet.fleet.engines import EngineState, Fleet
from ramjet.fleet.signals import (
    REPORTS_KEY,
    EngineSignals,
    GroupedProfiles,
    NoSignals,
    ReportSignals,
)
from ramjet.fleet.views import PoolSpec
from ramjet.keys.pools import KeyPools
from ramjet.metrics import RouterMetrics
from ramjet.policy.base import RoutingPolicy
from ramjet.policy.calibration import Calibrations
from ramjet.policy.fleet_stats import WorkRates
from ramjet.policy.registry import create_policy
from ramjet.proxy.forward import Proxy, Transports
from ramjet.reports.runtime import ReportsRuntime
from ramjet.request.admission import Admission
from ramjet.request.parse import ParseLimits
from ramjet.request.precheck import Prechecker
from ramjet.residency.factory import ResidencyRuntime, build_residency
from ramjet.residency.source import NoResidency, ResidencySource
from ramjet.residency.tables import ResidencyTables
from ramjet.transport.base import EngineTransport
from ramjet.transport.http1 import EnginePool
from ramjet.types import EngineId


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


def http1_transports(config: PolicyConfig) -> Transports:
    """HTTP/1.1 pools (`ramjet.transport.http1.EnginePool`) for each use of an engine: the
    proxy's (`limits.connections_per_engine`), and small pools of their own for health
    probes (4) and `/v1/models` (2), so that neither queues behind forwards nor a flood
    of one starves the other."""
    t, lim = config.timeouts, config.limits

    def make(e: EngineState, use: str) -> EngineTransport:
        if use == "forward":
            return EnginePool(
                e.url,
                limit=lim.connections_per_engine,
                connect_s=t.connect_s,
                keepalive_s=30.0,
                read_high=64 * 1024,
            )
        return EnginePool(e.url, limit=4 if use == "probe" else 2, connect_s=t.connect_s)

    return make


def build_modes(
    config: PolicyConfig,
    metrics: RouterMetrics,
    clock: Callable[[], float] = time.monotonic,
    *,
    keep: tuple[PolicyConfig, ModeRunner] | None = None,
) -> ModeRunner:
    """The mode runner for `config`'s mode and policies. `keep`: the config and runner
    in force (a reload): a policy whose `{name, params}` did not change keeps its object,
    so its state (a round-robin cursor) carries on, and so does the candidate's
    slow-pick cool-down while the candidate is the same object. Raises
    `ramjet.policy.registry.PolicyConfigError` for parameters that do not validate."""
    inc_spec, cand_spec = config.incumbent, config.candidate
    if keep is not None and inc_spec == keep[0].incumbent:
        inc = keep[1].incumbent
    else:
        inc = create_policy(inc_spec.name, inc_spec.params, path="incumbent.params")
    cand: RoutingPolicy | None = None
    if cand_spec is not None:
        if keep is not None and cand_spec == keep[0].candidate and keep[1].candidate is not None:
            cand = keep[1].candidate
        else:
            cand = create_policy(cand_spec.name, cand_spec.params, path="candidate.params")
    if keep is not None:
        return keep[1].replaced(config.mode, inc, cand)
    return ModeRunner(config.mode, inc, cand, metrics, clock=clock)


def build(
    config: PolicyConfig,
    *,
    registry: CollectorRegistry | None = None,
    residency: ResidencyTables | None = None,
    sink: DecisionSink | None = None,
    policy_path: str | Path | None = None,
    clock: Callable[[], float] = time.monotonic,
    transports: Transports | None = None,
) -> Wired:
    """Build the router for `config` and everything it runs with (see the module
    docstring). Raises `ramjet.reports.keys.KeyError_` for a configured key that does not
    load."""
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
    groups = profile_groups(config)
    if groups:
        signals = GroupedProfiles(signals, groups)
    source: ResidencySource = tables if tables is not None else NoResidency()
    router = _router(config, metrics, source, signals, sink, clock, transports)
    return Wired(router, reports, runtime)


def _router(
    config: PolicyConfig,
    metrics: RouterMetrics,
    residency: ResidencySource,
    signals: EngineSignals,
    sink: DecisionSink | None,
    clock: Callable[[], float],
    transports: Transports | None,
) -> Router:
    """The router's own parts, built from `config`, and the router over them."""
    lg, fs, lim = config.logging, config.fleet_stats, config.limits
    calibration = (
        Calibrations(fs.calibration_forgetting, fs.calibration_clip) if fs.calibrate else None
    )
    accounting = Accounting(
        metrics.registry,
        log_path=lg.decisions_path,
        log_max_bytes=lg.decisions_max_bytes,
        log_backups=lg.decisions_backups,
        log_queue=lg.decisions_queue,
        downstream=sink,
        clock=clock,
        wait_tau_s=fs.wait_tau_s,
        calibration=calibration,
    )

    def ejected(engine: EngineId, duration_s: float) -> None:
        metrics.ejections.labels(engine=engine).inc()

    fleet = Fleet(config.engines, config.health, config.retry, clock, on_eject=ejected)
    metrics.init_engines(e.id for e in config.engines)
    make = transports or http1_transports(config)
    proxy = Proxy(config, fleet, metrics, lambda e: make(e, "forward"))
    modes = build_modes(config, metrics, clock)
    pools: dict[EngineId, tuple[PoolSpec, ...]] = {
        EngineId(e.id): tuple(
            (p.id, p.tier, *p.cost_into(e.id)) for p in config.fabric.pools_of(e.id)
        )
        for e in config.engines
        if config.fabric.pools_of(e.id)
    }
    router = Router(
        config,
        metrics=metrics,
        residency=residency,
        signals=signals,
        key_pools=KeyPools(config.key_pools, registry=metrics.registry),
        accounting=accounting,
        calibration=calibration,
        fleet=fleet,
        proxy=proxy,
        modes=modes,
        pools=pools,
        arrivals=ArrivalRate(fs.arrival_tau_s),
        work_rates=WorkRates(fs.work_tau_s),
        parse_limits=ParseLimits(
            max_body_bytes=lim.max_body_bytes,
            max_depth=lim.max_json_depth,
            max_messages=lim.max_messages,
            max_content_parts=lim.max_content_parts,
            max_prompt_items=lim.max_prompt_items,
            max_json_values=lim.max_json_values,
        ),
        trusted_networks=tuple(
            ipaddress.ip_network(n, strict=False) for n in lim.priority_trusted_networks
        ),
        prechecker=Prechecker(),
        priority=PriorityHints(config.priority, metrics.registry),
        admission=Admission(lim, config.timeouts.body_s, metrics),
        transports=make,
        clock=clock,
    )
    profiles = ProfileSources(
        [EngineId(e.id) for e in config.engines],
        lambda: router.signals,
        lambda: router.modes.policies(),
    )
    metrics.registry.register(profiles)
    return router


FastServerFactory = Callable[[Callable[[], asyncio.Protocol]], FastServer]
"""Builds the completion routes' server over aiohttp's handler factory (its fallback)."""


def fast_server(router: Router) -> FastServerFactory:
    """The completion routes' own server (`ramjet.app.fast_server`) over `router`: its
    handler, its limits from the policy, and the body budget, pending and silent
    connections it shares with the router's admission."""
    cfg, metrics, admission = router.config, router.metrics, router.admission

    def make(fallback: Callable[[], asyncio.Protocol]) -> FastServer:
        return FastServer(
            router.handle_completion,
            fallback,
            header_deadline_s=cfg.timeouts.header_deadline_s,
            body_timeout_s=cfg.timeouts.body_s,
            max_headers=cfg.limits.max_headers,
            max_line_bytes=cfg.limits.max_header_line_bytes,
            max_body_bytes=cfg.limits.max_body_bytes,
            on_body_timeout=lambda: metrics.rejected.labels(reason="body_timeout").inc(),
            bodies=admission.bodies,
            pending=admission.pending,
            on_refused=lambda reason: metrics.rejected.labels(reason=reason).inc(),
            silent=admission.silent,
            access_log=access_logger() if cfg.logging.access_log else None,
        )

    return make


def access_logger() -> AccessLogger:
    """aiohttp's access logger, as its server makes it (default format) for
    `logging.access_log`, on logger `ramjet.access`: both servers log the same lines."""
    return AccessLogger(logging.getLogger("ramjet.access"), AccessLogger.LOG_FORMAT)


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


def profile_groups(config: PolicyConfig) -> dict[EngineId, tuple[EngineId, ...]]:
    """Each engine of a profile group (`EngineConfig.profile_group`) -> the group's
    engines, in configuration order; ungrouped engines are absent."""
    groups: dict[str, tuple[EngineId, ...]] = {}
    for e in config.engines:
        if e.profile_group is not None:
            groups[e.profile_group] = (*groups.get(e.profile_group, ()), EngineId(e.id))
    return {
        EngineId(e.id): groups[e.profile_group]
        for e in config.engines
        if e.profile_group is not None
    }
