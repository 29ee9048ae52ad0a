"""`python -m simulations.probes`: the session-placement probes of
docs/results/history-results.md's ablation, averaged over seeds (run to run the mean moves by about 2%). Traces with
sessions and turns replay closed-loop (`simulations.sessions`), others open-loop at the
rate that makes `--load` the floor's share of capacity, as `simulations run` does.

Sessions stick to the engine that holds their prefix, so where a session's first turn
goes decides which queue its later turns meet. `tier_aware` places a first turn (cold
on every engine) on the engine with the shortest predicted wait now. Each probe is
`tier_aware` with one change to first turns only (later turns are priced as usual):

- `first:hash`: first turns by a hash of the session id (no load signal at all);
- `place:count:W`: cost + W seconds per active session above the engines' mean;
- `place:rate:W`: cost + W · (load rate − mean), load rate = Σ over the engine's
  active sessions of their per-turn engine time (predicted prompt work plus the
  profile's fixed per-job overhead and a decode step, EWMA) / their inter-turn time;
- `place:future:W:H` (clairvoyant, no router can have it): cost + W · (C − mean),
  C = Σ over the engine's sessions of the trace's floor work of their next H turns.
  How much better placement could do if it knew every session's future work.

and one probe of the move price, on every turn:

- `ext:busy`: the externality derived from FCFS busy periods instead of λ·W. In FCFS the
  requests queued now are ahead of r; its wasted work Δ_e delays the ones that arrive at
  e until e's backlog clears, about λ_e · (wait_e + S_e) / (1 − ρ_e) of them (M/G/1: a
  backlog x clears in x / (1 − ρ)), S_e = r's work plus the fixed per-job cost, λ_e =
  λ / engines, ρ_e the engine time the policy has sent to e per second (EWMA, 10 s;
  1 − ρ_e at least 0.05).
- `ext:social:W`: the same, pricing W times r's own work (work + fixed cost) as well as
  Δ_e, by the arrivals at e itself (λ_e: the requests the policy sent to e per second,
  EWMA, 10 s): r's own work also delays the later arrivals of the engine it joins, and
  fewer of them on the emptier engine. W = 1 is the full social cost of r's work.

`--cross` replays each routing's decisions, request by request, on the other cache
model: a policy's on one shared cache (`oracle:as:NAME`: what the shared cache alone
would give that routing) and each oracle routing's on the partitioned caches
(`partitioned:as:NAME`: what its moves cost once each pays its recompute). `--goal P`
prints issue 17's goal figures for P on the seeds' means: ÷ the best peer's mean and
p99 (peers as `simulations compare` counts them), prefill ÷ floor, ÷ the oracle (each
seed's best oracle routing or replay), and the oracle ÷ the best peer: the least ratio
any router the oracle bounds can reach.

A session is active until it has not been seen for 3 of its inter-turn times. The
probes keep their state inside `pick`, as the policy contract allows. Each wraps a
`TierAware` (`policy`) and calls its `estimates`, `decide` and `pick`, rather than
subclassing it (the compiled class allows no interpreted subclass).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial

from ramjet.config import FleetStatsConfig
from ramjet.policy.base import Decision, EngineView, FleetStats, RequestView, RoutingPolicy
from ramjet.policy.cost import EngineEstimate
from ramjet.policy.tier_aware import TierAware
from ramjet.types import EngineId
from simulations.__main__ import (
    RunSetup,
    checked_rows,
    closed_loop_wanted,
    open_loop_scale,
    run_row,
)
from simulations.bounds import floor
from simulations.checks import REPLAY, Replay, violations, with_oracle
from simulations.compare import is_peer
from simulations.lineup import ENTRANTS, Entrant, variant
from simulations.preset import engine_spec
from simulations.sessions import closed_loop_plan, scale_for_load, scaled
from simulations.simulator import Knowledge
from simulations.summary import Row
from simulations.workload import Request, TraceError, load_trace, scale_rate

IDLE_CYCLES = 3.0
"""A session not seen for this many of its inter-turn times has ended."""


@dataclass(slots=True)
class _Seen:
    home: EngineId
    last_s: float
    cycle_s: float
    turn_s: float
    turns: int = 1


class Placement:
    """`tier_aware` with an extra first-turn cost per engine (module docstring)."""

    def __init__(
        self,
        name: str,
        measure: str,
        weight: float,
        future: Mapping[str, Sequence[float]] | None = None,
        horizon: int = 3,
    ) -> None:
        self.name = name
        self.policy = TierAware(name=name)
        if measure not in ("count", "rate", "future", "hash"):
            raise ValueError(f"unknown placement measure {measure!r}")
        if measure == "future" and future is None:
            raise ValueError("the future measure needs the sessions' future work")
        self.measure, self.weight, self.horizon = measure, weight, horizon
        self.future = future or {}
        self.seen: dict[str, _Seen] = {}
        self.cycle_s = 2.0
        """Mean inter-turn time of the sessions seen (the first guess for a new one)."""

    def _measure(self, now: float, ids: Sequence[EngineId]) -> dict[EngineId, float]:
        load = dict.fromkeys(ids, 0.0)
        for key in [k for k, s in self.seen.items() if now - s.last_s > IDLE_CYCLES * s.cycle_s]:
            del self.seen[key]
        for key, s in self.seen.items():
            if s.home not in load:
                continue
            if self.measure == "count":
                load[s.home] += 1.0
            elif self.measure == "rate":
                load[s.home] += s.turn_s / s.cycle_s
            else:
                load[s.home] += sum(self.future.get(key, ())[s.turns : s.turns + self.horizon])
        return load

    def _first_turn(
        self, request: RequestView, ests: Sequence[EngineEstimate], now: float
    ) -> EngineEstimate:
        if self.measure == "hash":
            assert request.session is not None
            return ests[zlib.crc32(request.session.encode()) % len(ests)]
        load = self._measure(now, [s.engine for s in ests])
        mean = sum(load.values()) / len(load)
        keyed = [(s.cost_s + self.weight * (load[s.engine] - mean), s.wait_s) for s in ests]
        tied = [s for s, k in zip(ests, keyed, strict=True) if k == min(keyed)]
        best = tied[self.policy._ties % len(tied)]  # tier_aware's tie cursor
        if len(tied) > 1:
            self.policy._ties += 1
        return best

    def pick(
        self, request: RequestView, engines: Sequence[EngineView], fleet: FleetStats
    ) -> Decision:
        session = request.session
        if session is None or session in self.seen:
            decision = self.policy.pick(request, engines, fleet)
            best = decision.components[decision.engine]
            self._saw(session, decision.engine, best["work_s"], engines, fleet.now_s)
            return decision
        ests = self.policy.estimates(request, engines, fleet)
        chosen = self._first_turn(request, ests, fleet.now_s)
        self._saw(session, chosen.engine, chosen.work.work_s, engines, fleet.now_s)
        return Decision(chosen.engine, self.name, {s.engine: s.components() for s in ests})

    def _saw(
        self,
        session: str | None,
        engine: EngineId,
        work_s: float,
        engines: Sequence[EngineView],
        now: float,
    ) -> None:
        if session is None:
            return
        profile = next((e.profile for e in engines if e.id == engine and e.profile), None)
        p = profile or self.policy.params.default_profile
        turn_s = work_s + p.prefill_overhead_s + p.decode_step_s
        s = self.seen.get(session)
        if s is None:
            self.seen[session] = _Seen(engine, now, self.cycle_s, turn_s)
            return
        cycle = now - s.last_s
        s.cycle_s = cycle if s.turns == 1 else s.cycle_s + 0.5 * (cycle - s.cycle_s)
        self.cycle_s += 0.02 * (cycle - self.cycle_s)
        s.turn_s += 0.5 * (turn_s - s.turn_s)
        s.home, s.last_s, s.turns = engine, now, s.turns + 1


class BusyPeriod:
    """`tier_aware` with the busy-period externality (`ext:busy`, module docstring)."""

    def __init__(
        self, name: str, tau_s: float = 10.0, slack: float = 0.05, own: float = 0.0
    ) -> None:
        self.name = name
        self.policy = TierAware(name=name)
        self.params = self.policy.params
        self.tau_s, self.slack, self.own = tau_s, slack, own
        self.rho: dict[EngineId, float] = {}
        self.lam: dict[EngineId, float] = {}
        self._last_s = 0.0
        self._fixed_s = 0.0

    def estimates(
        self, request: RequestView, engines: Sequence[EngineView], fleet: FleetStats
    ) -> list[EngineEstimate]:
        ests = self.policy.estimates(request, engines, fleet)
        if fleet.now_s > self._last_s:
            decay = math.exp(-(fleet.now_s - self._last_s) / self.tau_s)
            self.rho = {e: v * decay for e, v in self.rho.items()}
            self.lam = {e: v * decay for e, v in self.lam.items()}
            self._last_s = fleet.now_s
        p = next((e.profile for e in engines if e.profile), None) or self.params.default_profile
        self._fixed_s = p.prefill_overhead_s + p.decode_step_s
        lam = max(fleet.arrival_rate_per_s, 0.0) / max(len(ests), 1)
        out = []
        for s in ests:
            idle = max(1.0 - self.rho.get(s.engine, 0.0), self.slack)
            backlog = s.wait_s + s.work.work_s + self._fixed_s
            lam_e = self.lam.get(s.engine, 0.0) if self.own > 0 else lam
            priced = s.delta_s + self.own * (s.work.work_s + self._fixed_s)
            out.append(replace(s, externality_s=priced * lam_e * backlog / idle))
        return out

    def pick(
        self, request: RequestView, engines: Sequence[EngineView], fleet: FleetStats
    ) -> Decision:
        decision = self.policy.decide(request, self.estimates(request, engines, fleet), fleet)
        sent = decision.components[decision.engine]["work_s"] + self._fixed_s
        self.rho[decision.engine] = self.rho.get(decision.engine, 0.0) + sent / self.tau_s
        self.lam[decision.engine] = self.lam.get(decision.engine, 0.0) + 1.0 / self.tau_s
        return decision


def future_work(requests: Sequence[Request], work_s: Sequence[float]) -> dict[str, list[float]]:
    """Per session, the floor work of each turn in turn order (the clairvoyant probe's)."""
    turns: dict[str, list[tuple[int, float]]] = {}
    for r, w in zip(requests, work_s, strict=True):
        if r.session is not None:
            turns.setdefault(r.session, []).append((r.turn or 0, w))
    return {k: [w for _, w in sorted(v)] for k, v in turns.items()}


Future = Mapping[str, Sequence[float]]
Maker = Callable[[int, Future], RoutingPolicy]
"""Builds a run's policy from the seed and the sessions' future work."""


def _entrant(ent: Entrant) -> Maker:
    return lambda seed, fut: ent.make(seed)


def probe(spec: str) -> Maker:
    """`first:hash`, `place:count:W`, `place:rate:W`, `place:future:W:H` or `ext:busy`."""
    if spec == "ext:busy":
        return lambda seed, fut: BusyPeriod(spec)
    parts = spec.split(":")
    try:
        if len(parts) == 3 and parts[:2] == ["ext", "social"]:
            own = float(parts[2])
            return lambda seed, fut: BusyPeriod(spec, own=own)
        if parts == ["first", "hash"]:
            return lambda seed, fut: Placement(spec, "hash", 0.0)
        if len(parts) == 3 and parts[0] == "place" and parts[1] in ("count", "rate"):
            measure, weight = parts[1], float(parts[2])
            return lambda seed, fut: Placement(spec, measure, weight)
        if len(parts) == 4 and parts[:2] == ["place", "future"]:
            weight, horizon = float(parts[2]), int(parts[3])
            return lambda seed, fut: Placement(spec, "future", weight, fut, horizon)
    except ValueError as exc:  # a number that does not parse: the same error, with why
        why = f": {exc}"
    else:
        why = ""
    raise ValueError(
        f"unknown probe {spec!r} (first:hash, place:count|rate:W, place:future:W:H, ext:busy)" + why
    )


def cross_rows(
    rows: Sequence[Row],
    lineup: Sequence[tuple[str, Maker]],
    flags: Mapping[str, tuple[Knowledge, bool]],
    decisions: Mapping[str, list[int]],
    setup: RunSetup,
    figures: dict[str, list[tuple[float, float, float]]],
) -> list[Row]:
    """`--cross`: each routing's decisions, request by request, on the other cache model.
    A policy's decisions on one shared cache (`oracle:as:NAME`) show what the shared cache
    alone gives that routing; an oracle routing's decisions on the partitioned caches
    (`partitioned:as:NAME`) show what its moves would cost if each paid its recompute."""
    out: list[Row] = []
    have = {r.policy for r in rows}
    for name, _ in lineup:
        shared = flags[name][1]
        label = ("partitioned:as:" if shared else REPLAY) + name
        if label in have:
            continue
        row = run_row(
            label, Replay(name, decisions[name]), setup, shared_cache=not shared,
            knowledge=Knowledge(),
        )  # fmt: skip
        out.append(row)
        figures.setdefault(label, []).append((row.ttft_mean_s, row.ttft_p99_s, row.floor_ratio))
        print(
            f"  {label:26s} mean {row.ttft_mean_s:.4f} p99 {row.ttft_p99_s:.3f} "
            f"prefill/floor {row.floor_ratio:.3f}",
            flush=True,
        )
    return out


Runs = Sequence[tuple[float, float, float]]


def goal_lines(policy: str, figures: Mapping[str, Runs], oracle: Runs, load: float) -> str:
    """The goal table's rows for `policy` (mean over seeds of mean TTFT, p99, prefill /
    floor): against the best peer by mean and by p99 in each knowledge mode
    (`simulations.compare`'s peers), ÷ the oracle (each seed's best oracle routing), and
    the oracle ÷ the best peer, the least ratio any router the oracle bounds can have."""
    if policy not in figures:
        raise ValueError(f"--goal {policy!r} is not in the lineup")

    def avg(runs: Runs, i: int) -> float:
        return statistics.mean(r[i] for r in runs)

    mine = figures[policy]
    lines = [
        f"\ngoal, {policy}, load {load:g} (means over seeds):",
        "| load | peers | best mean peer | mean ratio | best p99 peer | p99 ratio "
        "| prefill / floor | ÷ oracle | oracle ÷ best peer (mean, p99) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in ("exact", "real"):
        peers = {n: r for n, r in figures.items() if is_peer(n, mode) and ":as:" not in n}
        if not peers:
            continue
        bm = min(peers, key=lambda n: avg(peers[n], 0))
        bp = min(peers, key=lambda n: avg(peers[n], 1))
        om, op = (avg(oracle, i) if oracle else math.nan for i in (0, 1))
        lines.append(
            f"| {load:.0%} | {mode} | {bm} | {avg(mine, 0) / avg(peers[bm], 0):.3f} | {bp} "
            f"| {avg(mine, 1) / avg(peers[bp], 1):.3f} | {avg(mine, 2):.3f} "
            f"| {avg(mine, 0) / om:.3f} | {om / avg(peers[bm], 0):.3f}, "
            f"{op / avg(peers[bp], 1):.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m simulations.probes", description=__doc__)
    p.add_argument("--trace", required=True)
    p.add_argument("--policies", default="tier_aware,session_hash,oracle:tier_aware")
    p.add_argument("--probe", action="append", default=[], help="repeatable, see above")
    p.add_argument(
        "--variant", action="append", default=[], help="NAME=JSON tier_aware params, repeatable"
    )
    p.add_argument("--load", type=float, default=0.6)
    p.add_argument("--sessions", type=int, default=300)
    p.add_argument("--fanout", type=int, default=1)
    p.add_argument("--seeds", default="0,1,2,3")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument(
        "--goal",
        metavar="POLICY[,POLICY]",
        help="print each POLICY against the best peer on the seeds' means (issue 17's goal): "
        "mean and p99 ratios, prefill / floor, ÷ oracle, and the oracle ÷ the best peer",
    )
    p.add_argument(
        "--cross",
        action="store_true",
        help="also replay each policy's decisions on one shared cache (oracle:as:NAME) and "
        "each oracle routing's on the partitioned caches (partitioned:as:NAME)",
    )
    a = p.parse_args(argv)
    spec = engine_spec()
    try:
        seeds = [int(x) for x in a.seeds.split(",")]
        lineup: list[tuple[str, Maker]] = []
        flags: dict[str, tuple[Knowledge, bool]] = {}
        for name in [n.strip() for n in a.policies.split(",") if n.strip()]:
            if name not in ENTRANTS or name in flags:
                raise ValueError(f"unknown policy or named twice: {name!r}")
            lineup.append((name, _entrant(ENTRANTS[name].on(spec))))
            flags[name] = (ENTRANTS[name].knowledge, ENTRANTS[name].shared_cache)
        for text in a.variant:
            ent = variant(text)
            if ent.name in flags:
                raise ValueError(f"{ent.name!r} named twice")
            lineup.append((ent.name, _entrant(ent.on(spec))))
            flags[ent.name] = (ent.knowledge, False)
        for name in a.probe:
            if name in flags:
                raise ValueError(f"{name!r} named twice")
            lineup.append((name, probe(name)))
            flags[name] = (ENTRANTS["tier_aware"].knowledge, False)
        goals = [n.strip() for n in (a.goal or "").split(",") if n.strip()]
        for name in goals:
            if name not in flags:
                raise ValueError(f"--goal {name!r} is not in the lineup")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    problems: list[str] = []
    oracle_runs: list[tuple[float, float, float]] = []
    figures: dict[str, list[tuple[float, float, float]]] = {n: [] for n, _ in lineup}
    for seed in seeds:
        try:
            reqs, block = load_trace(a.trace, seed=seed)
        except TraceError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        loop = None
        if closed_loop_wanted("auto", reqs):
            plan = closed_loop_plan(reqs, block, sessions=a.sessions, fanout=a.fanout, seed=seed)
            fl = floor(plan.requests, spec.profile)
            scale = round(scale_for_load(plan, fl.work_s, a.load, a.engines), 4)
            run_reqs, loop = scaled(plan, scale), plan.loop
        else:  # open loop (no sessions with turns), as `simulations run` replays it
            fl = floor(reqs, spec.profile)
            scale = open_loop_scale(reqs, fl.work_s, a.load, a.engines)
            run_reqs = scale_rate(reqs, scale)
        fut = future_work(run_reqs, fl.work_s)
        rows: list[Row] = []
        decisions: dict[str, list[int]] = {}
        setup = RunSetup(
            run_reqs, spec, scale, block, a.engines, fl, 2.0, a.load, FleetStatsConfig(), loop
        )
        for name, make in lineup:
            knowledge, shared = flags[name]
            out = setup.simulation(make(seed, fut), knowledge, shared).run()
            decisions[name] = out.engine
            row = setup.row(name, out)
            rows.append(row)
            figures[name].append((row.ttft_mean_s, row.ttft_p99_s, row.floor_ratio))
            print(
                f"seed {seed} {name:26s} mean {row.ttft_mean_s:.4f} p99 {row.ttft_p99_s:.3f} "
                f"prefill/floor {row.floor_ratio:.3f}",
                flush=True,
            )
        if a.cross:
            rows += cross_rows(rows, lineup, flags, decisions, setup, figures)
        rows += checked_rows(
            rows,
            setup,
            decisions=decisions,
            policies={
                name: (partial(make, seed, fut), flags[name][0])
                for name, make in lineup
                if not flags[name][1]
            },
        )
        bounded = with_oracle(rows)
        problems += [f"seed {seed}: {v}" for v in violations(bounded)]
        best = next((r for r in bounded if r.policy == "oracle"), None)
        if best is not None:  # the per-seed oracle: the best oracle routing or replay
            oracle_runs.append((best.ttft_mean_s, best.ttft_p99_s, best.floor_ratio))
    base = figures.get("tier_aware")
    print(f"\nload {a.load:g}, mean over seeds {a.seeds}:")
    for name, runs in figures.items():
        mean, p99, fl_ratio = (statistics.mean(r[i] for r in runs) for i in range(3))
        rel = f"  {mean / statistics.mean(r[0] for r in base):.3f}x tier_aware" if base else ""
        print(f"{name:26s} mean {mean:.4f}  p99 {p99:.3f}  prefill/floor {fl_ratio:.3f}{rel}")
    for name in goals:
        print(goal_lines(name, figures, oracle_runs, a.load))
    if problems:  # as `simulations run`: a run where a policy beats a bound has failed
        print("FAILED: a policy beats the oracle or a strict bound:", file=sys.stderr)
        for line in problems:
            print(f"  {line}", file=sys.stderr)
        return 3
    print("self-check: no policy beats the oracle (with replays) or a strict bound in any seed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
