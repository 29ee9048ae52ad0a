"""The baseline policies: `round_robin`, `least_loaded`, `session_hash`, and the incumbent
`prefix_affinity`. Each is a small class with a frozen pydantic `Params` model (the
registry validates YAML parameters over its defaults; the models live in
`ramjet.policy.params`, importable from here too, so that this module compiles with
mypyc, `ramjet.native`) and a pure `pick`.

- round_robin: a cursor over the eligible engines.
- least_loaded: minimum of `inflight_requests * request_weight_tokens + outstanding prompt
  tokens` (see `candidates.outstanding_prompt_tokens`); ties rotate.
- session_hash: rendezvous (highest-random-weight) hashing of the session id over the
  eligible engines, which is a consistent hash: when an engine leaves, only its sessions
  move. Without a session id, falls back to `least_loaded` (or `round_robin`).
- prefix_affinity (the incumbent): the engine holding the request's longest resident
  prefix (`residency.global_match`, any tier), bounded by load. Engine e is *overloaded*
  when its outstanding prompt tokens exceed the least-loaded engine's by BOTH
  `abs_margin_tokens` AND a factor `rel_factor`:

      load_e - load_min > abs_margin_tokens  and  load_e > rel_factor * load_min

  Overloaded engines lose affinity; among the rest the longest match wins (ties: less
  load, then rotation). A match shorter than `min_match_tokens` counts as none, and then
  the least-loaded engine is picked. The bound is deliberately not relative to the
  fleet's mean load: with two engines a mean-relative gate trips on any queued token
  while the other engine idles and throws affinity away at low load.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from ramjet.policy.base import Decision, EngineView, FleetStats, RequestView
from ramjet.policy.candidates import eligible, outstanding_prompt_tokens
from ramjet.policy.params import LeastLoadedParams as LeastLoadedParams
from ramjet.policy.params import PrefixAffinityParams as PrefixAffinityParams
from ramjet.policy.params import RoundRobinParams as RoundRobinParams
from ramjet.policy.params import SessionHashParams as SessionHashParams
from ramjet.types import EngineId

_xxh3 = xxhash.xxh3_64_intdigest


class _Rotor:
    """A cursor that breaks ties in turn, so equal engines share load."""

    __slots__ = ("_n",)

    def __init__(self) -> None:
        self._n = 0

    def pick_min(self, engines: Sequence[EngineView], scores: Sequence[float]) -> EngineView:
        best = min(scores)
        tied = [e for e, s in zip(engines, scores, strict=True) if s == best]
        if len(tied) == 1:
            return tied[0]  # no tie: the cursor stays (else a pattern can pin it in place)
        self._n += 1
        return tied[self._n % len(tied)]


# -- round robin ----------------------------------------------------------------------


class RoundRobin:
    """Each eligible engine in turn."""

    def __init__(self, params: RoundRobinParams | None = None, name: str = "round_robin") -> None:
        self.name = name
        self.params = params or RoundRobinParams()
        self._cursor = 0

    def pick(
        self, request: RequestView, engines: Sequence[EngineView], fleet: FleetStats
    ) -> Decision:
        pool = eligible(request, engines)
        engine = pool[self._cursor % len(pool)]
        self._cursor += 1
        return Decision(engine=engine.id, policy=self.name)


# -- least loaded ---------------------------------------------------------------------


def _load_score(engine: EngineView, request_weight_tokens: int) -> int:
    load = engine.load
    return load.inflight_requests * request_weight_tokens + outstanding_prompt_tokens(load)


class LeastLoaded:
    """Minimum of in-flight requests (weighted) plus outstanding prompt tokens."""

    def __init__(self, params: LeastLoadedParams | None = None, name: str = "least_loaded") -> None:
        self.name = name
        self.params = params or LeastLoadedParams()
        self._rotor = _Rotor()

    def pick(
        self, request: RequestView, engines: Sequence[EngineView], fleet: FleetStats
    ) -> Decision:
        pool = eligible(request, engines)
        scores = [_load_score(e, self.params.request_weight_tokens) for e in pool]
        engine = self._rotor.pick_min(pool, scores)
        components = {e.id: {"load_tokens": float(s)} for e, s in zip(pool, scores, strict=True)}
        return Decision(engine=engine.id, policy=self.name, components=components)


# -- session hash ---------------------------------------------------------------------


def rendezvous_pick(session: str, engines: Sequence[EngineView]) -> EngineView:
    """Highest-random-weight hashing: each (session, engine) pair gets a 64-bit weight."""
    return max(engines, key=lambda e: (_xxh3(f"{session}\x00{e.id}".encode()), e.id))


class SessionHash:
    """Consistent hash of the session id over eligible engines."""

    def __init__(self, params: SessionHashParams | None = None, name: str = "session_hash") -> None:
        self.name = name
        self.params = params or SessionHashParams()
        self._fallback: RoundRobin | LeastLoaded
        if self.params.fallback == "round_robin":
            self._fallback = RoundRobin(name=name)
        else:
            weight = self.params.request_weight_tokens
            self._fallback = LeastLoaded(LeastLoadedParams(request_weight_tokens=weight), name=name)

    def pick(
        self, request: RequestView, engines: Sequence[EngineView], fleet: FleetStats
    ) -> Decision:
        if not request.session:
            d = self._fallback.pick(request, engines, fleet)
            return Decision(
                d.engine, self.name, d.components, (f"no_session:{self.params.fallback}",)
            )
        engine = rendezvous_pick(request.session, eligible(request, engines))
        return Decision(engine=engine.id, policy=self.name)


# -- prefix affinity (the incumbent) --------------------------------------------------


class PrefixAffinity:
    """Longest resident prefix, unless that engine is overloaded (see module docstring)."""

    def __init__(
        self, params: PrefixAffinityParams | None = None, name: str = "prefix_affinity"
    ) -> None:
        self.name = name
        self.params = params or PrefixAffinityParams()
        self._rotor = _Rotor()

    def overloaded(self, load: int, min_load: int) -> bool:
        p = self.params
        return load - min_load > p.abs_margin_tokens and load > p.rel_factor * min_load

    def pick(
        self, request: RequestView, engines: Sequence[EngineView], fleet: FleetStats
    ) -> Decision:
        pool = eligible(request, engines)
        loads = [outstanding_prompt_tokens(e.load) for e in pool]
        found = [e.residency.global_match(request.block_keys, request.block_tokens) for e in pool]
        matches = [m.total for m in found]
        min_load = min(loads)
        over = [self.overloaded(ld, min_load) for ld in loads]
        components: dict[EngineId, dict[str, float]] = {
            e.id: {
                "match_tokens": float(m.total),
                "pending_tokens": float(m.pending),
                "load_tokens": float(ld),
                "overloaded": float(o),
            }
            for e, m, ld, o in zip(pool, found, loads, over, strict=True)
        }
        allowed = [i for i in range(len(pool)) if not over[i]]
        best = max(matches[i] for i in allowed)
        lost = any(over[i] and matches[i] > best for i in range(len(pool)))
        notes: tuple[str, ...] = ("affinity_lost_to_load",) if lost else ()
        if best < self.params.min_match_tokens:
            engine = self._rotor.pick_min(pool, loads)
            notes = notes or ("no_match",)
        else:
            top = [i for i in allowed if matches[i] == best]
            engine = self._rotor.pick_min([pool[i] for i in top], [loads[i] for i in top])
        return Decision(engine=engine.id, policy=self.name, components=components, notes=notes)
