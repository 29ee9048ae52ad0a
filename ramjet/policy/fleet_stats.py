"""The fleet estimators the cost model reads: λ (arrival rate) and W (mean wait before
prefill start), the one implementation the router and the simulator both run.

The externality term of `ramjet.policy.cost` is λ·W·Δ: what one more second of prefill
on an engine costs the requests that arrive behind it. Its edge over selfish routing was
measured in the simulator, so the simulator must measure λ and W exactly as the router
does, with the same time constants, taken from the policy file's `fleet_stats:` section
(`ramjet.config.FleetStatsConfig`, defaults 10 s and 10 s).

- `ArrivalRate`: each arrival adds 1/τ to a value that decays as exp(-dt/τ); for a
  steady Poisson stream of rate r its expectation is r, and it forgets a burst in ~3 τ.
- `MeanWait`: a time-weighted EWMA of wait samples: each sample x moves the mean by
  (1 - exp(-dt/τ)) of the way to x, dt since the previous sample (at least 1/64, so a
  burst of samples at one instant still moves it); the first sample sets it. With no
  samples it holds its value (no traffic, no λ·W).
- `WorkRates`: per engine, the predicted prompt work routed to it per second (seconds of
  work per second: a utilisation), the same decaying sum as `ArrivalRate` (one
  implementation, `DecayingSum`) with each arrival weighted by its work. A packing engine (vLLM) puts the prompts that arrive
  while one waits into that one's step, so the cost model reads it as the share of its
  wait and work that later arrivals add (`ramjet.policy.cost`, `per_job=False`).
- `FleetEstimators`: λ, W, the work rates and (optionally) the TTFT calibration
  (`ramjet.policy.calibration.Calibrations`), fed `arrive(now)` per request,
  `routed(now, engine, work_s)` per routed request and `wait(now, s)` per measured
  wait, read as a `FleetStats` snapshot by `stats(now)`.
- `KeyedQueues`: per engine that serves by the priority hint's key, the router's
  requests queued there with their keys (`FleetStats.keyed`, the cost model's
  priority-aware wait).

Where the samples come from differs only in what each side can observe: the router
learns a request's wait from the engine's usage report when its response ends
(`ramjet.decisions.accounting`); the simulator at the moment the request's prefill
starts (`simulations.simulator`). The arithmetic is this module's in both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ramjet.policy.base import Decision, FleetStats, KeyedQueue
from ramjet.policy.calibration import Calibrations
from ramjet.types import EngineId

DEFAULT_ARRIVAL_TAU_S = 10.0
DEFAULT_WAIT_TAU_S = 10.0
DEFAULT_WORK_TAU_S = 2.0


class DecayingSum:
    """A sum whose every term decays as exp(-dt/τ): the one decay `ArrivalRate` and
    `WorkRates` share. `add(now, x)` decays the sum to `now` and adds x; a `now` earlier
    than the last one (samples out of order) adds x without decay and keeps the later
    time, so time never runs backwards for the sum."""

    __slots__ = ("_last", "_value", "tau_s")

    def __init__(self, tau_s: float) -> None:
        if not tau_s > 0:
            raise ValueError("tau_s must be > 0")
        self.tau_s = tau_s
        self._value = 0.0
        self._last = 0.0

    def decay(self, now: float) -> float:
        """Decay the sum to `now` (kept) and return it."""
        if now > self._last:
            self._value *= math.exp(-(now - self._last) / self.tau_s)
            self._last = now
        return self._value

    def at(self, now: float) -> float:
        """The sum as of `now`, leaving it as it is."""
        v = self._value
        return v * math.exp(-(now - self._last) / self.tau_s) if now > self._last else v

    def add(self, now: float, x: float) -> None:
        self.decay(now)
        self._value += x


class ArrivalRate:
    """Exponentially weighted arrival rate (requests/s) with time constant `tau_s`: a
    `DecayingSum` to which each arrival adds 1/τ."""

    __slots__ = ("_sum",)

    def __init__(self, tau_s: float = DEFAULT_ARRIVAL_TAU_S) -> None:
        self._sum = DecayingSum(tau_s)

    @property
    def tau_s(self) -> float:
        return self._sum.tau_s

    def arrive(self, now: float) -> None:
        self._sum.add(now, 1.0 / self._sum.tau_s)

    def rate(self, now: float) -> float:
        return self._sum.decay(now)


class MeanWait:
    """Time-weighted EWMA of wait samples in seconds (see module docstring)."""

    __slots__ = ("_last", "_value", "tau_s")

    def __init__(self, tau_s: float = DEFAULT_WAIT_TAU_S) -> None:
        if not tau_s > 0:
            raise ValueError("tau_s must be > 0")
        self.tau_s = tau_s
        self._value = 0.0
        self._last: float | None = None

    def add(self, now: float, sample_s: float) -> None:
        if self._last is None:
            self._value = sample_s
        else:
            dt = max(now - self._last, 0.0)
            alpha = max(1.0 - math.exp(-dt / self.tau_s), 1.0 / 64)
            self._value += alpha * (sample_s - self._value)
        self._last = now if self._last is None else max(now, self._last)

    def mean(self) -> float:
        return self._value


class WorkRates:
    """Per engine: predicted prompt work routed per second, a `DecayingSum` (the one
    `ArrivalRate` uses) to which every routed request adds its work / τ (see module
    docstring)."""

    __slots__ = ("_rates", "tau_s")

    def __init__(self, tau_s: float = DEFAULT_WORK_TAU_S) -> None:
        if not tau_s > 0:
            raise ValueError("tau_s must be > 0")
        self.tau_s = tau_s
        self._rates: dict[EngineId, DecayingSum] = {}

    def routed(self, now: float, engine: EngineId, work_s: float) -> None:
        r = self._rates.get(engine)
        if r is None:
            r = self._rates[engine] = DecayingSum(self.tau_s)
        r.add(now, max(work_s, 0.0) / self.tau_s)

    def rates(self, now: float) -> dict[EngineId, float]:
        return {e: r.at(now) for e, r in self._rates.items()}


def decided_work(
    engine: EngineId, live: Decision, candidate: Decision | None, incumbent: Decision | None
) -> float | None:
    """Predicted prompt work on `engine` (`ramjet.policy.cost`'s `work_s`) as a request's
    decisions recorded it: the live pick's figure, else the candidate's, else the
    incumbent's; None when none recorded one (a baseline policy records no work). What
    the request adds to `WorkRates` for its engine, and a priority hint's work."""
    for d in (live, candidate, incumbent):
        if d is not None:
            comp = d.components.get(engine)
            if comp is not None and "work_s" in comp:
                return float(comp["work_s"])
    return None


def fleet_stats(
    now: float,
    arrivals: ArrivalRate,
    waits: MeanWait,
    work: WorkRates | None = None,
    keyed: Mapping[EngineId, KeyedQueue] | None = None,
    calibration: Calibrations | None = None,
    calibration_decides: bool = False,
) -> FleetStats:
    """The snapshot a policy is given: λ, W and the engines' work rates as of `now`, the
    engines that serve by key (`FleetStats.keyed`) and the calibrated weights of the cost
    model's terms (`FleetStats.calibration`) where the caller has them."""
    return FleetStats(
        now_s=now,
        arrival_rate_per_s=arrivals.rate(now),
        mean_wait_s=waits.mean(),
        work_rate=work.rates(now) if work is not None else {},
        keyed=keyed if keyed is not None else {},
        calibration=calibration.weights() if calibration is not None else None,
        calibration_decides=calibration_decides,
    )


class FleetEstimators:
    """λ, W and the work rates together, for a caller that owns all three (the simulator)."""

    __slots__ = ("arrivals", "calibration", "calibration_decides", "waits", "work")

    def __init__(
        self,
        arrival_tau_s: float = DEFAULT_ARRIVAL_TAU_S,
        wait_tau_s: float = DEFAULT_WAIT_TAU_S,
        work_tau_s: float = DEFAULT_WORK_TAU_S,
        calibration: Calibrations | None = None,
        calibration_decides: bool = False,
    ) -> None:
        self.arrivals = ArrivalRate(arrival_tau_s)
        self.waits = MeanWait(wait_tau_s)
        self.work = WorkRates(work_tau_s)
        self.calibration = calibration
        """None: the profile as probed (no online calibration)."""
        self.calibration_decides = calibration_decides

    def arrive(self, now: float) -> None:
        self.arrivals.arrive(now)

    def routed(self, now: float, engine: EngineId, work_s: float) -> None:
        self.work.routed(now, engine, work_s)

    def wait(self, now: float, sample_s: float) -> None:
        self.waits.add(now, sample_s)

    def stats(self, now: float) -> FleetStats:
        return fleet_stats(
            now, self.arrivals, self.waits, self.work, None, self.calibration,
            self.calibration_decides,
        )  # fmt: skip


class KeyedQueues:
    """The router's side of `FleetStats.keyed`: per engine that serves by the priority
    hint's key (a pool in mode `on`), the requests this router sent there with a key and
    whose first byte has not come. The simulator reads its engines' queues instead
    (`simulations.engine.Engine.keyed_queue`); the cost model reads both the same way.

    The router learns of a first byte only through the engine's in-flight prompt tokens
    (`EngineLoad.inflight_prompt_tokens`, released at the first byte). An engine that
    serves the lowest key first starts the lowest keys first, so `queue` drops the
    lowest-keyed entries while the entries hold more tokens than are in flight there;
    `done` drops a request when its response ends (or fails). No entry is known to have
    started (the router cannot tell), so each counts in full or not at all."""

    __slots__ = ("_entries", "_params")

    def __init__(self, params: Mapping[EngineId, tuple[float, float | None, bool, bool]]) -> None:
        self._params = dict(params)
        """engine -> (aging, horizon_s, preemptive, charge_jumps)"""
        self._entries: dict[EngineId, dict[str, tuple[float, int]]] = {e: {} for e in params}

    def __bool__(self) -> bool:
        return bool(self._params)

    def add(self, engine: EngineId, request: str, key_s: float, tokens: int) -> None:
        entries = self._entries.get(engine)
        if entries is not None:
            entries[request] = (key_s, max(tokens, 0))

    def done(self, engine: EngineId, request: str) -> None:
        entries = self._entries.get(engine)
        if entries is not None:
            entries.pop(request, None)

    def queue(self, engine: EngineId, inflight_tokens: int) -> KeyedQueue | None:
        """The engine's `KeyedQueue` (None: it does not serve by key)."""
        params = self._params.get(engine)
        if params is None:
            return None
        entries = self._entries[engine]
        held = sum(t for _, t in entries.values())
        if held > inflight_tokens:  # the lowest keys have had their first byte
            for rid, (_, t) in sorted(entries.items(), key=lambda kv: kv[1][0]):
                if held <= inflight_tokens:
                    break
                del entries[rid]
                held -= t
        aging, horizon_s, preemptive, charge_jumps = params
        rows = tuple(sorted((k, t, False) for k, t in entries.values()))
        return KeyedQueue(aging, horizon_s, preemptive, rows, charge_jumps)
