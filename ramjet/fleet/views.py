"""What the policies see of the fleet for one request: one `EngineView` per engine serving
the model, the `FleetStats`, and the engine a retry goes to.

An engine's view: `healthy` means routable now (probe ok, not ejected, not backing off;
every engine when all are, the fleet's panic mode); load is the router's in-flight
counters merged with the engine's signed load report, trust and profile come from its
reports (`EngineSignals`, `ramjet.fleet.signals`), residency from the tables. The
signals and the residency source are the router's, fixed when `ramjet.app.wiring` built
it; the views read them fresh on every request.
"""

from __future__ import annotations

from ramjet.fleet.engines import EngineState, Fleet
from ramjet.fleet.signals import EngineSignals
from ramjet.policy.base import EngineView
from ramjet.residency.source import ResidencySource
from ramjet.types import EngineId


def engine_views(
    fleet: Fleet,
    signals: EngineSignals,
    residency: ResidencySource,
    model: str,
    now: float,
) -> tuple[list[EngineView], list[EngineState], float]:
    """(views, the engines serving `model`, seconds until the first engine backing off
    may be tried again)."""
    routable = fleet.routable()
    ok = {e.id for e in routable.engines}
    serving = [e for e in fleet.engines if not e.models or model in e.models]
    views = [
        EngineView(
            id=e.id,
            healthy=e.id in ok,
            load=signals.load(e),
            residency=residency.view(e.id, now),
            profile=signals.profile(e.id),
            trust=signals.trust(e.id),
            models=frozenset(e.models),
        )
        for e in serving
    ]
    return views, serving, routable.retry_after_s


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
