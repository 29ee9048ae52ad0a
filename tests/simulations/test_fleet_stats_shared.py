"""Router and simulator measure λ, W and the engines' routed work rates with one
implementation and one set of constants."""

from __future__ import annotations

import math
from typing import Any

import pytest
from sim_helpers import req, spec, workload

from ramjet.app.wiring import build
from ramjet.config import FleetStatsConfig, parse_policy
from ramjet.policy.base import FleetStats
from ramjet.policy.fleet_stats import (
    ArrivalRate,
    DecayingSum,
    FleetEstimators,
    MeanWait,
    WorkRates,
    fleet_stats,
)
from ramjet.policy.registry import create_policy
from ramjet.types import EngineId
from simulations.engine import Job
from simulations.simulator import Simulation
from simulations.workload import Request

POLICY = {
    "engines": [
        {"id": "e0", "url": "http://127.0.0.1:9"},
        {"id": "e1", "url": "http://127.0.0.1:9"},
    ],
    "incumbent": {"name": "tier_aware"},
}


def _workload() -> list[Request]:
    # bursts of 3 arrivals every 0.05 s on two prefixes: queues build, waits vary
    reqs = []
    for i in range(60):
        t = (i // 3) * 0.05
        reqs.append(req(t, [i % 2, 100 + i, 200 + i, 300 + i], out=4))
    return workload(reqs)


class RecordingEstimators:
    """The simulator's estimators, logging every routed (time, engine, work); the rest
    goes to them (a wrapper: the compiled `FleetEstimators` is not subclassed)."""

    def __init__(self, inner: FleetEstimators) -> None:
        self.inner = inner
        self.routes: list[tuple[float, str, float]] = []

    def routed(self, now: float, engine: EngineId, work_s: float) -> None:
        self.routes.append((now, engine, work_s))
        self.inner.routed(now, engine, work_s)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Recording(Simulation):
    """A simulation that logs every (time, kind, value) its estimators are fed."""

    def __init__(self, *a: object, **kw: object) -> None:
        super().__init__(*a, **kw)  # type: ignore[arg-type]
        self.fed: list[tuple[float, str, float]] = []
        e = self.estimators
        self.estimators = RecordingEstimators(  # type: ignore[assignment]
            FleetEstimators(e.arrivals.tau_s, e.waits.tau_s, e.work.tau_s)
        )

    @property
    def routes(self) -> list[tuple[float, str, float]]:
        assert isinstance(self.estimators, RecordingEstimators)
        return self.estimators.routes

    def _on_start(self, job: Job, now: float) -> None:
        super()._on_start(job, now)
        self.fed.append((now, "wait", now - job.arrival))


@pytest.mark.parametrize("taus", [None, (7.0, 3.0)])
def test_router_and_simulator_give_the_same_lambda_and_w(taus: tuple[float, float] | None) -> None:
    data = dict(POLICY)
    if taus is not None:
        data["fleet_stats"] = {"arrival_tau_s": taus[0], "wait_tau_s": taus[1]}
    config = parse_policy(data)
    router = build(config).router
    reqs = _workload()
    sim = Recording(
        reqs,
        spec(),
        create_policy("tier_aware", {}),
        block_tokens=64,
        fleet_stats=config.fleet_stats,
    )
    sim.run()
    # the same sequence through the router's objects: arrivals, then waits as they came
    events = [(r.arrival_s, "arrive", 0.0) for r in reqs] + sim.fed
    events.sort(key=lambda e: (e[0], e[1] != "arrive"))
    assert sum(1 for e in events if e[1] == "wait") == len(reqs)
    for t, kind, value in events:
        if kind == "arrive":
            router.arrivals.arrive(t)
        else:
            router.accounting.waits.add(t, value)
    assert len(sim.routes) == len(reqs)  # tier_aware records its work for every pick
    for t, engine, work in sim.routes:
        router.work_rates.routed(t, engine, work)  # type: ignore[arg-type]
    end = events[-1][0] + 0.5
    routed = fleet_stats(end, router.arrivals, router.accounting.waits, router.work_rates)
    simulated = sim.estimators.stats(end)
    assert routed == simulated
    assert isinstance(routed, FleetStats)
    assert routed.arrival_rate_per_s > 0 and routed.mean_wait_s > 0
    assert set(routed.work_rate) == {"e0", "e1"} and min(routed.work_rate.values()) > 0
    want = taus or (10.0, 10.0)
    assert (router.arrivals.tau_s, router.accounting.waits.tau_s) == want
    assert (sim.estimators.arrivals.tau_s, sim.estimators.waits.tau_s) == want


def test_the_router_defaults_are_the_policy_file_defaults() -> None:
    cfg = FleetStatsConfig()
    assert ArrivalRate().tau_s == cfg.arrival_tau_s
    assert MeanWait().tau_s == cfg.wait_tau_s
    assert WorkRates().tau_s == cfg.work_tau_s


def test_work_rates_are_a_per_engine_utilisation() -> None:
    w = WorkRates(2.0)
    for i in range(400):  # 0.05 s of work every 0.1 s on e0, for 40 s: about 50% busy
        w.routed(0.1 * i, "e0", 0.05)  # type: ignore[arg-type]
    w.routed(39.9, "e1", 0.0)  # type: ignore[arg-type]
    r = w.rates(40.0)
    assert r["e0"] == pytest.approx(0.5, rel=0.05) and r["e1"] == 0.0
    assert w.rates(46.0)["e0"] == pytest.approx(r["e0"] * math.exp(-3.0))  # 3 tau later


def test_work_rates_decay_exactly_as_the_arrival_rate() -> None:
    """One decay (`DecayingSum`): a unit of work per request on one engine is the arrival
    rate, read at any time, with repeated and out-of-order times too (an out-of-order
    sample adds without decay and the later time stays: the router's requests reach
    `routed` in another order than they arrived)."""
    tau = 2.0
    a, w = ArrivalRate(tau), WorkRates(tau)
    e0 = EngineId("e0")
    last = 0.0
    for t in (0.5, 1.0, 1.0, 3.25, 3.0, 7.5, 7.4, 12.0):
        a.arrive(t)
        w.routed(t, e0, 1.0)
        last = max(last, t)
        assert w.rates(t)[e0] == a.rate(t)
        assert w.rates(t + 5.0)[e0] == pytest.approx(a.rate(t) * math.exp(-(t + 5.0 - last) / tau))
    # 3.0 counts as at 3.25 and 7.4 as at 7.5, the later times already seen
    stamped = (0.5, 1.0, 1.0, 3.25, 3.25, 7.5, 7.5, 12.0)
    want = sum(math.exp(-(20.0 - t) / tau) for t in stamped) / tau
    assert a.rate(20.0) == pytest.approx(want) and w.rates(20.0)[e0] == pytest.approx(want)
    assert DecayingSum(tau).at(5.0) == 0.0
    with pytest.raises(ValueError):
        DecayingSum(0.0)


def test_a_bad_time_constant_is_refused() -> None:
    with pytest.raises(ValueError):
        parse_policy({**POLICY, "fleet_stats": {"arrival_tau_s": 0}})
    with pytest.raises(ValueError):
        ArrivalRate(0.0)


def test_the_simulator_calibrates_as_the_router_does() -> None:
    """The simulator feeds the router's calibration (`ramjet.policy.calibration`) every
    simulated TTFT of a tier_aware pick, with the raw terms the pick recorded; its
    engines run the profile the cost model prices, so the predictions it learns are
    close. With `fleet_stats.calibrate: false` there is none."""
    config = parse_policy(POLICY)
    reqs = _workload()
    sim = Simulation(
        reqs, spec(), create_policy("tier_aware", {}), block_tokens=64,
        fleet_stats=config.fleet_stats,
    )  # fmt: skip
    out = sim.run()
    cal = sim.estimators.calibration
    assert cal is not None
    weights = cal.weights()
    assert set(weights) == {"e0", "e1"}
    assert sum(w.samples for w in weights.values()) == len(reqs)
    assert all(not math.isnan(t) for t in out.ttft)
    off = parse_policy(POLICY | {"fleet_stats": {"calibrate": False}}).fleet_stats
    sim = Simulation(
        reqs, spec(), create_policy("tier_aware", {}), block_tokens=64, fleet_stats=off
    )
    sim.run()
    assert sim.estimators.calibration is None
