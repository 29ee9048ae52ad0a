"""What the policies see of the fleet for one request: one `EngineView` per engine serving
the model, the `FleetStats`, and the engine a retry goes to.

An engine's view: `healthy` means routable now (probe ok, not ejected, not backing off;
every engine when all are, the fleet's panic mode); load is the router's in-flight
counters merged with the engine's signed load report, trust and profile come from its
reports (`EngineSignals`, `ramjet.fleet.signals`), residency from the tables. The
signals and the residency source are the router's, fixed when `ramjet.app.wiring` built
it; the views read them fresh on every request.

Pools (`ramjet.config.FabricConfig`): each engine's view lists the shared tiers it is a
member of (`PoolView`), with the pool's residency (the tables' entries under the pool's
id, filled by the pool's own signed reports), the pool's trust grade, and the pull cost
into that engine (`PoolSpec`).
"""

from __future__ import annotations

from collections.abc import Mapping

from ramjet.fleet.engines import EngineState, Fleet
from ramjet.fleet.signals import EngineSignals
from ramjet.policy.base import EngineView, PoolView
from ramjet.residency.source import ResidencySource
from ramjet.types import EngineId

PoolSpec = tuple[str, str, float, float]
"""(pool id, tier, bandwidth bytes/s into the engine, latency s): one shared tier an
engine is a member of (`ramjet.config.FabricPoolConfig.cost_into`)."""


def engine_views(
    fleet: Fleet,
    signals: EngineSignals,
    residency: ResidencySource,
    model: str,
    now: float,
    pools: Mapping[EngineId, tuple[PoolSpec, ...]] | None = None,
) -> tuple[list[EngineView], list[EngineState], float]:
    """(views, the engines serving `model`, seconds until the first engine backing off
    may be tried again). `pools`: each engine's shared tiers (absent: an island)."""
    routable = fleet.routable()
    ok = {e.id for e in routable.engines}
    serving = [e for e in fleet.engines if not e.models or model in e.models]
    views = [
        EngineView(
            id=e.id,
            healthy=e.id in ok,
            load=signals.load(e, now),
            residency=residency.view(e.id, now),
            profile=signals.profile(e.id),
            trust=signals.trust(e.id),
            models=frozenset(e.models),
            pools=_pool_views(pools.get(e.id, ()), signals, residency, now) if pools else (),
        )
        for e in serving
    ]
    return views, serving, routable.retry_after_s


def _pool_views(
    specs: tuple[PoolSpec, ...], signals: EngineSignals, residency: ResidencySource, now: float
) -> tuple[PoolView, ...]:
    out = []
    for pool, tier, bandwidth, latency in specs:
        pid = EngineId(pool)
        view = residency.view(pid, now)
        out.append(PoolView(pool, tier, bandwidth, latency, view, signals.trust(pid)))
    return tuple(out)


def retry_engine(fleet: Fleet, model: str, tried: set[EngineId]) -> EngineState | None:
    """The least-loaded routable engine serving `model` not tried yet (None: none left)."""
    pool = [
        e
        for e in fleet.routable().engines
        if e.id not in tried and (not e.models or model in e.models)
    ]
    if not pool:
        return None
    return min(pool, key=lambda e: (e.inflight_prompt_tokens, e.inflight_requests))
