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
    """One request's picks: built once per request and never changed (not `frozen`: a
    frozen init sets each field through `object.__setattr__`, 0.1 us a field)."""

    live: Decision
    live_role: str
    """"incumbent", "candidate" or "fallback"."""
    incumbent: Decision | None
    candidate: Decision | None
    candidate_error: str | None = None
    """Why the candidate has no pick: "raised: ...", "invalid", "slow", "skipped"."""
    candidate_s: float = 0.0
    """Wall time the candidate's pick took."""

    def __init__(
        self,
        live: Decision,
        live_role: str,
        incumbent: Decision | None,
        candidate: Decision | None,
        candidate_error: str | None = None,
        candidate_s: float = 0.0,
    ) -> None:
        self.live = live
        self.live_role = live_role
        self.incumbent = incumbent
        self.candidate = candidate
        self.candidate_error = candidate_error
        self.candidate_s = candidate_s


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
    ) -> ModeOutcome:
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
        return self._observe(live, live_role, inc, request, engines, fleet)

    def _observe(
        self,
        live: Decision,
        live_role: str,
        inc: Decision | None,
        request: RequestView,
        engines: Sequence[EngineView],
        fleet: FleetStats,
    ) -> ModeOutcome:
        assert self.candidate is not None
        if self._clock() < self._skip_until:
            self._metrics.policy_errors_of("candidate", "skipped").inc()
            return ModeOutcome(live, live_role, inc, None, "skipped")
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
        return ModeOutcome(live, live_role, inc, cand, err, took)
