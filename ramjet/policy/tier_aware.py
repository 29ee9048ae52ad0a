"""The candidate policy `tier_aware`: the engine of least cost, where cost is predicted
TTFT (wait + restore + replay + prefill) plus the delay the choice's wasted work imposes
on later arrivals. The model is `ramjet.policy.cost` (read its docstring); this module
picks the minimum and records every component. Its parameters are `TierAwareParams`
(`ramjet.policy.params`, importable from here too: pydantic models stay interpreted, this
module is compiled, `ramjet.native`).

Decision.components[engine] holds every figure of `EngineEstimate.components()`
(`wait_s`, `work_s`, `restore_s`, `replay_s`, `prefill_s`, `delta_s`, `externality_s`,
`session_s`, `cost_s`, tokens by tier, ...). Notes: `default_profile:<engine>` when an
engine has not reported a profile, `degraded:<engine>` when its view is degraded,
`estimate_profile:<engine>` for each of those priced with the built-in
`V41_FLASH_TP4_ESTIMATE` (the default unless `params.default_profile` is set: an
estimate, not a measurement of the engine), `beyond_profile:<engine>` when the prompt is
longer than the largest context the engine's profile was probed at (its prefill is
extrapolated), `profile_off:<engine>` when the online calibration finds its probed prefill
more than 2x off (`profile_off`), `externality_off` while the fleet has no measured
arrival rate or wait yet.
"""

from __future__ import annotations

from collections.abc import Sequence

from ramjet.policy.base import Decision, EngineView, FleetStats, RequestView
from ramjet.policy.calibration import TtftWeights
from ramjet.policy.candidates import eligible
from ramjet.policy.cost import V41_FLASH_TP4_ESTIMATE, EngineEstimate, estimate
from ramjet.policy.params import TierAwareParams as TierAwareParams
from ramjet.policy.session_load import SessionLoad

PROFILE_OFF_SAMPLES = 16
PROFILE_OFF_FACTOR = 2.0


def profile_off(w: TtftWeights) -> bool:
    """The calibration, after `PROFILE_OFF_SAMPLES` samples, finds the engine's probed
    prefill more than `PROFILE_OFF_FACTOR` off (a profile probed while the host was busy,
    or on other hardware): calibration has taken over; the note says to re-probe."""
    if w.samples < PROFILE_OFF_SAMPLES:
        return False
    lo, hi = 1.0 / PROFILE_OFF_FACTOR, PROFILE_OFF_FACTOR
    return not (lo <= w.prefill <= hi)


class TierAware:
    """Least `cost_s` among eligible engines; ties to the shorter wait, then in turn (a
    cursor that moves only on a tie, so idle engines share the new sessions that reach
    them one at a time instead of all going to the first)."""

    def __init__(self, params: TierAwareParams | None = None, name: str = "tier_aware") -> None:
        self.name = name
        self.params = params or TierAwareParams()
        self._builtin_default = self.params.default_profile == V41_FLASH_TP4_ESTIMATE
        self._ties = 0
        self.sessions = SessionLoad(self.params.session_idle_s)

    def estimates(
        self, request: RequestView, engines: Sequence[EngineView], fleet: FleetStats
    ) -> list[EngineEstimate]:
        p = self.params
        pool = eligible(request, engines)
        session = None
        if p.session_scale > 0 and request.session is not None:
            terms = self.sessions.session_cost(
                request.session, [e.id for e in pool], fleet.mean_wait_s
            )
            session = {e: p.session_scale * v for e, v in terms.items()}
        return estimate(
            request,
            pool,
            fleet,
            default_profile=p.default_profile,
            chunk_tokens=p.chunk_tokens,
            externality_scale=p.externality_scale,
            session_s=session,
            per_job=p.per_job_prefill,
        )

    def pick(
        self, request: RequestView, engines: Sequence[EngineView], fleet: FleetStats
    ) -> Decision:
        return self.decide(request, self.estimates(request, engines, fleet), fleet)

    def decide(
        self, request: RequestView, ests: Sequence[EngineEstimate], fleet: FleetStats
    ) -> Decision:
        """`pick` from given estimates: the least cost, its notes and session bookkeeping
        (a probe that prices engines its own way composes `estimates` and this)."""
        ranks = [(s.cost_s, s.wait_s) for s in ests]
        low = min(ranks)
        tied = [s for s, r in zip(ests, ranks, strict=True) if r == low]
        best = tied[self._ties % len(tied)]
        if len(tied) > 1:
            self._ties += 1
        if self.params.session_scale > 0:
            self.sessions.routed(request.session, best.engine, best.work.work_s, fleet.now_s)
        # default_profile, then estimate_profile (the default is the hard-coded estimate,
        # not a measurement), then degraded notes, each in engine order; one pass
        notes: list[str] = []
        estimated: list[str] = []
        degraded: list[str] = []
        for s in ests:
            if s.degraded:
                degraded.append(f"degraded:{s.engine}")
            if s.default_profile:
                if not s.degraded:
                    notes.append(f"default_profile:{s.engine}")
                if s.stand_in is None and self._builtin_default:
                    estimated.append(f"estimate_profile:{s.engine}")
        notes += estimated
        notes += degraded
        notes += [f"beyond_profile:{s.engine}" for s in ests if s.beyond_profile]
        notes += [f"profile_off:{s.engine}" for s in ests if profile_off(s.weights)]
        if fleet.arrival_rate_per_s <= 0 or fleet.mean_wait_s <= 0:
            notes.append("externality_off")
        return Decision(
            engine=best.engine,
            policy=self.name,
            components={s.engine: s.components() for s in ests},
            notes=tuple(notes),
        )
