"""Modes: which policy's pick a request uses, and how the other pick is observed.

- **observe**: the incumbent decides. The candidate's pick is computed after the live
  pick is fixed, under a time budget; whatever it does (raise, return an engine that is
  not offered, run slow) is caught, counted and recorded, and cannot change the live
  decision. After three slow picks in a row the candidate is skipped for a cool-down, so
  a slow scorer cannot keep taxing the event loop.
- **canary**: a share of sessions (deterministic: xxh3 of the session key, so a session
  never flips between policies) uses the candidate; the rest the incumbent.
- **enforce**: the candidate decides (the incumbent still picks, for the accounting
  only: agreement and estimated gain; its pick cannot change the live one).

The accounting-only pick (observe's candidate, enforce's incumbent) changes nothing the
request needs, so the router defers it past the forward (`decide(..., defer=True)`): the
outcome comes back with that pick pending, and `settle` makes it, on the same views, once
the request is on its way to the engine (the router schedules it with `call_soon`, so it
runs while the engine works, off the request's latency). The views keep one answer per
residency lookup (`ResidencyView`), and `decide` makes every lookup a pick can make
before it returns, so the deferred pick reads the residency as it was at decide time,
not the forward's own pending blocks; loads, profiles and the fleet figures are values.
A live pick is never deferred, nor is the incumbent's when the candidate failed (then it
is the live fallback).

Every contained failure of a pick, live or accounting-only, is counted in
`ramjet_policy_errors_total{role, kind}` (role: candidate or incumbent; kind: raised,
invalid, slow, skipped). Agreement is counted by the accounting for every mode
(`ramjet_policy_compared_total` / `ramjet_policy_agreed_total`), not here.

Whichever policy is live, a failing live pick falls back to the other policy and then to
the least-loaded healthy engine, so a policy bug never fails a request.

`ArrivalRate` (the EWMA arrival rate given to policies as `FleetStats`) lives in
`ramjet.policy.fleet_stats`, shared with the simulator; re-exported here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from ramjet.config import ModeConfig
from ramjet.metrics import RouterMetrics
from ramjet.policy.base import Decision, EngineView, FleetStats, RequestView, RoutingPolicy
from ramjet.policy.fleet_stats import ArrivalRate as ArrivalRate

Clock = Callable[[], float]


@dataclass(init=False, slots=True)
class ModeOutcome:
    """One request's picks: built once per request, and changed only by `ModeRunner.settle`,
    which fills in a deferred accounting-only pick once (not `frozen`: a frozen init sets
    each field through `object.__setattr__`, 0.1 us a field)."""

    live: Decision
    live_role: str
    """"incumbent", "candidate" or "fallback"."""
    incumbent: Decision | None
    candidate: Decision | None
    candidate_error: str | None = None
    """Why the candidate has no pick: "raised: ...", "invalid", "slow", "skipped"."""
    candidate_s: float = 0.0
    """Wall time the candidate's pick took."""
    deferred: DeferredPick | None = None
    """The accounting-only pick still to make (`ModeRunner.settle`), None once made or
    when none was deferred; until then its fields (`candidate` or `incumbent`) are None."""

    def __init__(
        self,
        live: Decision,
        live_role: str,
        incumbent: Decision | None,
        candidate: Decision | None,
        candidate_error: str | None = None,
        candidate_s: float = 0.0,
        deferred: DeferredPick | None = None,
    ) -> None:
        self.live = live
        self.live_role = live_role
        self.incumbent = incumbent
        self.candidate = candidate
        self.candidate_error = candidate_error
        self.candidate_s = candidate_s
        self.deferred = deferred


@dataclass(init=False, slots=True)
class DeferredPick:
    """An accounting-only pick left for `ModeRunner.settle`: what it is given, the views
    already pinned (`pin_views`). Whose it is follows from the live pick: the incumbent's
    when the candidate's is live, else the candidate's. Never changed after its init
    (not `frozen`, as `ModeOutcome`: it is made per request)."""

    request: RequestView
    engines: Sequence[EngineView]
    fleet: FleetStats

    def __init__(
        self, request: RequestView, engines: Sequence[EngineView], fleet: FleetStats
    ) -> None:
        self.request = request
        self.engines = engines
        self.fleet = fleet


def pin_views(request: RequestView, engines: Sequence[EngineView]) -> None:
    """Make now every residency lookup a pick of `request` can make, so that a pick made
    later on the same views reads them as they are at this instant (a view keeps one
    answer per keys object: `ramjet.policy.views.ResidencyView`). Policies look up only
    the request's own `block_keys`/`block_tokens` and `boundary_keys`."""
    for e in engines:
        e.residency.global_match(request.block_keys, request.block_tokens)
        if request.boundary_keys:
            e.residency.swa_match(request.boundary_keys)


def fallback_pick(engines: Sequence[EngineView]) -> Decision:
    """Least in-flight work among healthy engines (all if none is healthy)."""
    pool = [e for e in engines if e.healthy] or list(engines)
    best = min(pool, key=lambda e: (e.load.inflight_prompt_tokens, e.load.inflight_requests))
    return Decision(engine=best.id, policy="fallback")


def _offered(engine: object, engines: Sequence[EngineView]) -> bool:
    """Whether a pick names an engine it was offered: a healthy one, or any one when none
    is healthy. (One pass, no sets: this runs for every pick.)"""
    seen = any_healthy = False
    for e in engines:
        if e.healthy:
            if e.id == engine:
                return True
            any_healthy = True
        elif e.id == engine:
            seen = True
    return seen and not any_healthy


def canary_share_of(session_key: str) -> float:
    """Deterministic position of a session in [0, 1)."""
    return xxhash.xxh3_64_intdigest(session_key.encode("utf-8")) / 2.0**64


class ModeRunner:
    def __init__(
        self,
        mode: ModeConfig,
        incumbent: RoutingPolicy,
        candidate: RoutingPolicy | None,
        metrics: RouterMetrics,
        clock: Clock = time.monotonic,
        timer: Clock = time.perf_counter,
    ) -> None:
        self.mode = mode
        self.incumbent = incumbent
        self.candidate = candidate
        self._metrics = metrics
        self._clock = clock
        self._timer = timer
        self._slow_streak = 0
        self._skip_until = 0.0

    def replaced(
        self, mode: ModeConfig, incumbent: RoutingPolicy, candidate: RoutingPolicy | None
    ) -> ModeRunner:
        """A runner for a reload (`ramjet.app.reload`): `mode` and the policies given, the
        same metrics and clocks; the candidate's slow-pick streak and cool-down carry on
        while the candidate is the same object."""
        new = ModeRunner(mode, incumbent, candidate, self._metrics, self._clock, self._timer)
        if candidate is not None and candidate is self.candidate:
            new._slow_streak, new._skip_until = self._slow_streak, self._skip_until
        return new

    def policies(self) -> tuple[RoutingPolicy, ...]:
        """The policies this runner asks: the candidate (if any), then the incumbent."""
        if self.candidate is None:
            return (self.incumbent,)
        return (self.candidate, self.incumbent)

    def _try(
        self,
        policy: RoutingPolicy,
        request: RequestView,
        engines: Sequence[EngineView],
        fleet: FleetStats,
        role: str,
    ) -> tuple[Decision | None, str | None]:
        """The policy's pick, or None and why; a failure is counted under `role`."""
        try:
            d = policy.pick(request, engines, fleet)
        except Exception as exc:  # contained: a policy bug never fails a request
            self._metrics.policy_errors_of(role, "raised").inc()
            return None, f"raised: {type(exc).__name__}: {exc}"[:200]
        if not isinstance(d, Decision) or not _offered(d.engine, engines):
            self._metrics.policy_errors_of(role, "invalid").inc()
            return None, "invalid"
        return d, None

    def decide(
        self,
        request: RequestView,
        engines: Sequence[EngineView],
        fleet: FleetStats,
        session_key: str,
        defer: bool = False,
    ) -> ModeOutcome:
        """The request's picks. `defer`: leave the accounting-only pick to `settle` (see
        the module docstring); the live pick and everything the request needs are made
        here either way."""
        kind = self.mode.kind
        cand_live = self.candidate is not None and (
            kind == "enforce"
            or (kind == "canary" and canary_share_of(session_key) < self.mode.share)
        )
        if cand_live:
            assert self.candidate is not None
            t0 = self._timer()
            cand, err = self._try(self.candidate, request, engines, fleet, "candidate")
            took = self._timer() - t0
            if cand is not None and defer:
                pin_views(request, engines)
                later = DeferredPick(request, engines, fleet)
                return ModeOutcome(cand, "candidate", None, cand, None, took, later)
            # The incumbent's pick too: for the accounting only (agreement, estimated
            # gain) when the candidate picked, else as the live fallback. Contained and
            # counted like any pick; it cannot change the candidate's live decision.
            inc, _ = self._try(self.incumbent, request, engines, fleet, "incumbent")
            if cand is not None:
                return ModeOutcome(cand, "candidate", inc, cand, None, took)
            live = inc or fallback_pick(engines)
            return ModeOutcome(live, "incumbent" if inc else "fallback", inc, None, err, took)

        inc, _ = self._try(self.incumbent, request, engines, fleet, "incumbent")
        live_role = "incumbent" if inc is not None else "fallback"
        live = inc or fallback_pick(engines)
        if self.candidate is None:
            return ModeOutcome(live, live_role, inc, None)
        if defer:
            pin_views(request, engines)
            later = DeferredPick(request, engines, fleet)
            return ModeOutcome(live, live_role, inc, None, None, 0.0, later)
        cand, err, took = self._observe(request, engines, fleet)
        return ModeOutcome(live, live_role, inc, cand, err, took)

    def settle(self, outcome: ModeOutcome) -> bool:
        """Make `outcome`'s deferred pick, if it still has one (True), and fill its fields
        as `decide` without `defer` would have; False when there was none."""
        later = outcome.deferred
        if later is None:
            return False
        outcome.deferred = None
        if outcome.live_role == "candidate":  # the incumbent's pick was deferred
            outcome.incumbent, _ = self._try(
                self.incumbent, later.request, later.engines, later.fleet, "incumbent"
            )
        else:
            cand, err, took = self._observe(later.request, later.engines, later.fleet)
            outcome.candidate, outcome.candidate_error, outcome.candidate_s = cand, err, took
        return True

    def _observe(
        self, request: RequestView, engines: Sequence[EngineView], fleet: FleetStats
    ) -> tuple[Decision | None, str | None, float]:
        """The candidate's accounting-only pick, under its budget and cool-down: (the
        pick, why there is none, its wall time)."""
        assert self.candidate is not None
        if self._clock() < self._skip_until:
            self._metrics.policy_errors_of("candidate", "skipped").inc()
            return None, "skipped", 0.0
        t0 = self._timer()
        cand, err = self._try(self.candidate, request, engines, fleet, "candidate")
        took = self._timer() - t0
        if err is None and took > self.mode.candidate_budget_s:
            cand, err = None, "slow"
            self._metrics.policy_errors_of("candidate", "slow").inc()
        if err == "slow":
            self._slow_streak += 1
            if self._slow_streak >= 3:
                self._skip_until = self._clock() + self.mode.slow_cooldown_s
                self._slow_streak = 0
        else:
            self._slow_streak = 0
        return cand, err, took
