"""The discrete-event loop: arrivals are routed by a policy object, engines serve them.

Events are `(time, seq, callback)` in a heapq; arrivals are merged in from the sorted
request list instead of being pushed (half the heap traffic). `seq` breaks ties in
insertion order, so a run is a pure function of (requests, spec, policy, seed).

At each arrival the simulator builds the same views the router builds: a `RequestView`
(built once per request and cached on it), one `EngineView` per engine (its load from
engine state: queued prompt tokens still to prefill, requests in flight and decoding,
HBM utilization; residency from the `Knowledge` in use; the engine's profile; trust
EXACT), and `FleetStats` from `ramjet.policy.fleet_stats.FleetEstimators`, the router's
own estimators with the router's time constants (`FleetStatsConfig`, the policy file's
`fleet_stats:` section): λ from every arrival, W from every request's wait before its
prefill started, sampled when it starts, and the online TTFT calibration
(`ramjet.policy.calibration`, on unless `fleet_stats.calibrate` is false) from every
simulated TTFT of a request whose policy recorded the cost model's raw terms, as the
router feeds it from its realised ones. With `keyed_wait` on a priority scheduler,
`FleetStats.keyed` also holds each engine's queue by key (`Engine.keyed_queue`), as the
router's does for a pool in mode `on`, so the cost model prices waits as the engine will
serve them (and, with `charge_jumps`, charges the jumps; `KeyedQueue.charge_jumps`). Then it calls `policy.pick` and enqueues the request on the engine it names.

Knowledge (what residency the policy sees): "exact" (the caches), "hbm_only",
"routed" (a `RoutedIndex` per engine fed by this run's decisions), or "none". The
oracle shares one cache and one SWA pool between all engines (`shared_cache`).

Closed loop (`loop`, a `simulations.sessions.ClosedLoop`): only requests without parents
(sessions' first turns) arrive at their `arrival_s`; every other request is released
when the last of its parents has finished (last token) plus its think time, so no turn
starts before the previous turn of its session has ended. `Outcome.arrival` and
`Outcome.finish` record when each request was sent and when it ended.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from ramjet.config import FleetStatsConfig
from ramjet.policy.base import EngineLoad, EngineView, GlobalMatch, RequestView, RoutingPolicy
from ramjet.policy.calibration import Calibrations, features_of
from ramjet.policy.cost import prompt_work
from ramjet.policy.fleet_stats import FleetEstimators
from ramjet.types import EngineId, TrustGrade
from simulations.cache import SwaPool, TieredCache
from simulations.engine import Engine, Job
from simulations.fabric import ISLANDS, Fabric, FabricCache, Pools
from simulations.preset import EngineSpec
from simulations.sessions import ClosedLoop
from simulations.views import (
    Clock,
    ExactResidency,
    HbmOnlyResidency,
    LocalResidency,
    RoutedIndex,
)
from simulations.workload import Request

WARMUP_SHARE = 0.15
"""Closed loop: the first 15% of the session-start span is warm-up (sessions ramping up);
the window ends at the last session start (after it, load drains)."""


@dataclass(frozen=True)
class Knowledge:
    kind: str = "exact"
    """"exact", "local", "hbm_only", "routed" or "none". "local": the engine's own
    caches only; on the shared fabric its own HBM (and queue), not the pools (a peer
    that knows no tiers); on islands the same as "exact"."""
    capacity_tokens: int | None = None
    ttl_s: float | None = None
    max_match_tokens: int | None = None


@dataclass
class Outcome:
    """Per-request results of one run (index = request index)."""

    engine: list[int] = field(default_factory=list)
    arrival: list[float] = field(default_factory=list)
    finish: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    wait: list[float] = field(default_factory=list)
    hit: list[tuple[int, int, int]] = field(default_factory=list)
    resume: list[str] = field(default_factory=list)
    replay: list[bool] = field(default_factory=list)
    new_tokens: list[int] = field(default_factory=list)
    busy_s: list[float] = field(default_factory=list)
    window: tuple[float, float] | None = None
    """Closed loop: the steady-state window (summaries count requests sent inside it and
    busy time inside it); None: the whole run."""
    busy_window_s: list[float] = field(default_factory=list)
    span_s: float = 0.0
    demotions: int = 0
    evictions: int = 0
    peak_tier_blocks: list[list[int]] = field(default_factory=list)
    tier_capacity_blocks: list[list[int]] = field(default_factory=list)
    decisions: int = 0


def request_view(req: Request) -> RequestView:
    cached = req.view
    if cached is None:
        cached = req.view = RequestView(
            request_id=str(req.index),
            model="sim",
            prompt_tokens=req.prompt_tokens,
            block_keys=req.block_keys,
            block_tokens=req.block_tokens,
            boundary_keys=req.boundaries,
            session=req.session,
            max_output_tokens=req.output_tokens,
        )
    assert isinstance(cached, RequestView)
    return cached


class Simulation:
    def __init__(
        self,
        requests: Sequence[Request],
        spec: EngineSpec,
        policy: RoutingPolicy,
        *,
        block_tokens: int,
        engines: int = 2,
        knowledge: Knowledge = Knowledge(),
        shared_cache: bool = False,
        check_capacity: bool = False,
        progress: Callable[[int], None] | None = None,
        fleet_stats: FleetStatsConfig = FleetStatsConfig(),
        loop: ClosedLoop | None = None,
        keyed_wait: bool = False,
        charge_jumps: bool = True,
        fabric: Fabric = ISLANDS,
    ) -> None:
        self.requests = requests
        self.keyed_wait = keyed_wait and spec.scheduler in ("priority", "vllm-priority")
        """The policy is told that the engines serve by the hint's key (`FleetStats.keyed`,
        as the router does for a pool in mode `on`): the cost model's priority-aware wait."""
        self.charge_jumps = charge_jumps
        """With `keyed_wait`: the cost charges each jump (`KeyedQueue.charge_jumps`), as the
        router does for a pool with `charge_jumps: true`."""
        self.spec = spec
        self.policy = policy
        self.clock = Clock()
        self._events: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = 0
        self.check_capacity = check_capacity
        self.progress = progress
        n = len(requests)
        self.out = Outcome(
            engine=[-1] * n,
            arrival=[math.nan] * n,
            finish=[math.nan] * n,
            ttft=[math.nan] * n,
            wait=[math.nan] * n,
            hit=[(0, 0, 0)] * n,
            resume=[""] * n,
            replay=[False] * n,
            new_tokens=[0] * n,
        )

        def make_cache() -> tuple[TieredCache, SwaPool]:
            k = engines if shared_cache else 1
            cache = TieredCache(
                spec.hbm_tokens * k, spec.host_tokens * k, spec.ssd_tokens * k, block_tokens
            )
            return cache, SwaPool(spec.swa_sequences * k, spec.swa_ttl_s)

        shared = make_cache() if shared_cache else None
        self.pools: Pools | None = None
        if fabric.shared and not shared_cache:  # the oracle's one cache stays the bound
            self.pools = Pools(
                fabric,
                spec.profile,
                engines=engines,
                hbm_tokens=spec.hbm_tokens,
                host_tokens=spec.host_tokens,
                ssd_tokens=spec.ssd_tokens,
                swa_sequences=spec.swa_sequences,
                swa_ttl_s=spec.swa_ttl_s,
                block_tokens=block_tokens,
                schedule=self._schedule,
            )
        self.engines: list[Engine] = []
        for i in range(engines):
            pools = self.pools
            cache: TieredCache | FabricCache
            if pools is not None:
                cache, swa = pools.cache(), pools.swa
            else:
                cache, swa = shared or make_cache()
            self.engines.append(
                Engine(
                    i,
                    spec,
                    cache,
                    swa,
                    self._schedule,
                    self._on_start,
                    self._on_first_token,
                    self._on_finish,
                    pools,
                )
            )
        self.index_of = {e.id: e.index for e in self.engines}
        self.knowledge = knowledge
        self.routed: list[RoutedIndex] = []
        self.residency: list[Any] = []
        for e in self.engines:
            if knowledge.kind == "exact" or (knowledge.kind == "local" and self.pools is None):
                self.residency.append(ExactResidency(e.cache, e.swa, self.clock, e.pending))
            elif knowledge.kind == "local":
                assert isinstance(e.cache, FabricCache)
                self.residency.append(LocalResidency(e.cache, e.pending))
            elif knowledge.kind == "hbm_only":
                self.residency.append(HbmOnlyResidency(e.cache))
            elif knowledge.kind in ("routed", "none"):
                idx = RoutedIndex(
                    self.clock,
                    block_tokens,
                    capacity_tokens=knowledge.capacity_tokens,
                    ttl_s=knowledge.ttl_s,
                    max_match_tokens=knowledge.max_match_tokens,
                )
                self.routed.append(idx)
                self.residency.append(idx)
            else:
                raise ValueError(f"unknown knowledge {knowledge.kind!r}")
        if knowledge.kind == "none":
            self.routed = []
        calibration = None
        if fleet_stats.calibrate:  # the router's online TTFT calibration, fed as it is
            calibration = Calibrations(
                fleet_stats.calibration_forgetting, fleet_stats.calibration_clip
            )
        self.estimators = FleetEstimators(
            fleet_stats.arrival_tau_s,
            fleet_stats.wait_tau_s,
            fleet_stats.work_tau_s,
            calibration,
            fleet_stats.calibrated_decisions,
        )
        self._features: dict[int, list[float]] = {}
        """Per request routed by a policy that records the cost model's raw terms: those
        on the engine it chose, the calibration's sample at its first token."""
        self.peak = [[0, 0, 0] for _ in self.engines]
        if loop is not None and len(loop.parents) != n:
            raise ValueError("the closed loop does not match the requests")
        self.loop = loop
        self._unfinished = list(loop.parents) if loop is not None else []
        self._ready = [0.0] * n if loop is not None else []
        self._arrived = 0

    # -- events ----------------------------------------------------------------------

    def _schedule(self, t: float, fn: Callable[[float], None]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, fn))

    def _on_start(self, job: Job, now: float) -> None:
        wait = now - job.arrival
        self.out.wait[job.req.index] = wait
        self.estimators.wait(now, wait)

    def _on_first_token(self, job: Job, now: float) -> None:
        i = job.req.index
        out = self.out
        out.ttft[i] = now - job.arrival
        features = self._features.pop(i, None)
        cal = self.estimators.calibration
        if features is not None and cal is not None:
            cal.observe(self.engines[job.engine].id, features, out.ttft[i])
        out.hit[i] = job.hit
        out.resume[i] = job.resume
        out.replay[i] = job.replay
        out.new_tokens[i] = job.req.prompt_tokens - (job.hit[0] + job.hit[1] + job.hit[2])
        if self.check_capacity:
            cache = self.engines[job.engine].cache
            for t in range(3):
                used = cache.used_blocks(t)
                if used > cache.capacity[t]:
                    raise AssertionError(f"tier {t} over capacity: {used} > {cache.capacity[t]}")
                peak = self.peak[job.engine]
                peak[t] = max(peak[t], used)

    def _on_finish(self, job: Job, now: float) -> None:
        i = job.req.index
        self.out.finish[i] = now
        loop = self.loop
        if loop is None:
            return
        reqs = self.requests
        for c in loop.children[i]:
            self._unfinished[c] -= 1
            self._ready[c] = max(self._ready[c], now)
            if self._unfinished[c] == 0:
                self._schedule(self._ready[c] + loop.think_s[c], partial(self._arrive, reqs[c]))

    # -- routing ---------------------------------------------------------------------

    def _views(self, now: float) -> list[EngineView]:
        views = []
        for e, res in zip(self.engines, self.residency, strict=True):
            q = e.queued_tokens
            load = EngineLoad(
                inflight_requests=e.inflight,
                inflight_prompt_tokens=q,
                queued_prompt_tokens=q,
                running_requests=e.decoding,
                kv_utilization=e.cache.utilization(),
                waiting_requests=e.waiting,
                decode_tokens=e.decode_tokens,
            )
            views.append(EngineView(e.id, True, load, res, e.profile, TrustGrade.EXACT))
        return views

    def _arrive(self, req: Request, now: float) -> None:
        self.estimators.arrive(now)
        fleet = self.estimators.stats(now)
        if self.keyed_wait:
            charge = self.charge_jumps
            fleet = replace(fleet, keyed={e.id: e.keyed_queue(charge) for e in self.engines})
        decision = self.policy.pick(request_view(req), self._views(now), fleet)
        idx = self.index_of[decision.engine]
        engine = self.engines[idx]
        comp = decision.components.get(decision.engine)
        if comp is not None and "work_s" in comp:  # the packing term's ρ, as the router
            self.estimators.routed(now, decision.engine, float(comp["work_s"]))
        features = features_of(comp) if comp is not None else None
        if features is not None:
            self._features[req.index] = features
        if self.routed:
            self.routed[idx].routed(req.block_keys)
        # the router's prediction on the chosen engine: its in-flight tokens and the hint
        hbm, host, ssd = engine.cache.match(req.block_keys, req.block_tokens)
        g = hbm + host + ssd
        q = engine.swa.match_upto(req.boundaries, now, g) if req.boundaries else 0
        work = prompt_work(engine.profile, req.prompt_tokens, GlobalMatch(hbm, host, ssd), q)
        self.out.engine[req.index] = idx
        self.out.arrival[req.index] = now
        self.out.decisions += 1
        job = Job(req, idx, max(req.prompt_tokens - work.resume_tokens, 0), work.work_s)
        job.arrival = now
        engine.submit(job, now)
        self._arrived += 1
        if self.progress is not None and self._arrived % 256 == 0:
            self.progress(256)

    def run(self) -> Outcome:
        reqs = self.requests
        if self.loop is not None:
            reqs = sorted((reqs[i] for i in self.loop.roots()), key=lambda r: r.arrival_s)
            if reqs:
                first, last = reqs[0].arrival_s, reqs[-1].arrival_s
                self.out.window = (first + WARMUP_SHARE * (last - first), last)
                for e in self.engines:
                    e.window = self.out.window
        events = self._events
        clock = self.clock
        i, n = 0, len(reqs)
        pop = heapq.heappop
        while i < n or events:
            if i < n and (not events or reqs[i].arrival_s <= events[0][0]):
                req = reqs[i]
                i += 1
                clock.now = req.arrival_s
                self._arrive(req, req.arrival_s)
            else:
                t, _, fn = pop(events)
                clock.now = t
                fn(t)
        if self.progress is not None:
            self.progress(self._arrived % 256)
        out = self.out
        if self._arrived != len(self.requests):
            raise AssertionError(f"{len(self.requests) - self._arrived} requests never arrived")
        out.busy_s = [e.busy_s for e in self.engines]
        out.busy_window_s = [e.busy_window_s for e in self.engines]
        out.span_s = (max(out.arrival) - min(out.arrival)) if out.arrival else 0.0
        if self.pools is not None:
            pool = self.pools.pool
            fab = [e.cache for e in self.engines if isinstance(e.cache, FabricCache)]
            out.demotions = sum(c.demoted for c in fab) + pool.demotions
            out.evictions = pool.evictions
        else:
            caches = {id(e.cache): e.cache for e in self.engines}.values()
            out.demotions = sum(c.demotions for c in caches)
            out.evictions = sum(c.evictions for c in caches)
        out.peak_tier_blocks = self.peak
        out.tier_capacity_blocks = [list(e.cache.capacity) for e in self.engines]
        return out


def simulate(
    requests: Sequence[Request],
    spec: EngineSpec,
    policy: RoutingPolicy,
    *,
    block_tokens: int,
    **kwargs: Any,
) -> Outcome:
    return Simulation(requests, spec, policy, block_tokens=block_tokens, **kwargs).run()


__all__ = ["EngineId", "Knowledge", "Outcome", "Simulation", "simulate"]
