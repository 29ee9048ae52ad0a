"""Where sessions live and how much work they will still bring: the session term of
`tier_aware`.

A multi-turn session stays where its prefix is: once placed, its later turns follow it
unless moving pays for recomputing the prefix. So placing (or moving) a session decides
not one request's queue but the queue its next R turns will meet, and each engine's
future load is the work its resident sessions will still send. `SessionLoad` keeps,
inside the policy (updated only from `pick`, as the policy contract allows):

- per active session: its home engine (where its last turn went), turns seen k, its
  per-turn work w (EWMA of the predicted prompt work of its turns), last seen time;
- the distribution of session lengths, learned online: a session not seen for
  `idle_s` has ended, and its turn count is recorded. Expected remaining turns after k
  seen: E[n - k | n > k] over the recorded lengths (`remaining_turns`); with fewer than
  `min_sessions` recorded, the prior R = k (a session that has lasted k turns is
  expected to last about as long again);
- per engine, the committed session work C_e = sum over its active sessions of R_s · w_s
  (seconds of prompt work still to come there).

The term (`session_cost`): each of this session's R later turns waits about the fleet's
mean wait W, scaled by how far the engine's share of committed work is from a fair
share: R · W · (C_e / C_fair - 1), C_fair = sum C / engines (the session's own work
excluded). First-order (queueing delay taken linear in an engine's share of the load);
it is zero when the session is new and the fleet is balanced, and it prices a move by
what the remaining turns gain against the prefix the move recomputes once (which the
externality term already charges).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ramjet.types import EngineId


@dataclass(slots=True)
class _Session:
    home: EngineId
    turns: int
    work_s: float
    last_s: float
    committed_s: float = 0.0
    """R · w as last added to its home's total."""


class SessionLoad:
    """See the module docstring. Not thread-safe (one event loop, like the policy)."""

    def __init__(self, idle_s: float = 60.0, min_sessions: int = 20, max_turns: int = 4096) -> None:
        if idle_s <= 0:
            raise ValueError("idle_s must be > 0")
        self.idle_s = idle_s
        self.min_sessions = min_sessions
        self.max_turns = max_turns
        self.sessions: dict[str, _Session] = {}
        self.committed: dict[EngineId, float] = {}
        self.lengths = [0] * (max_turns + 1)
        """lengths[n]: ended sessions of n turns (n capped at max_turns)."""
        self.ended = 0
        self._remaining: dict[int, float] = {}
        self._pruned_s = 0.0

    # -- learned session length -------------------------------------------------------

    def remaining_turns(self, seen: int) -> float:
        """Expected later turns of a session seen `seen` times (see module docstring)."""
        if self.ended < self.min_sessions:
            return float(seen)
        cached = self._remaining.get(seen)
        if cached is not None:
            return cached
        longer = total = 0
        for n in range(seen + 1, len(self.lengths)):
            c = self.lengths[n]
            longer += c
            total += c * (n - seen)
        value = total / longer if longer else 0.0
        self._remaining[seen] = value
        return value

    def _end(self, key: str, s: _Session) -> None:
        self._uncommit(s)
        del self.sessions[key]
        self.lengths[min(s.turns, self.max_turns)] += 1
        self.ended += 1
        self._remaining.clear()

    def prune(self, now: float) -> None:
        """End sessions idle past `idle_s` (at most once per idle_s / 4)."""
        if now - self._pruned_s < self.idle_s / 4:
            return
        self._pruned_s = now
        old = now - self.idle_s
        for key in [k for k, s in self.sessions.items() if s.last_s < old]:
            self._end(key, self.sessions[key])

    # -- committed work ---------------------------------------------------------------

    def _uncommit(self, s: _Session) -> None:
        left = self.committed.get(s.home, 0.0) - s.committed_s
        self.committed[s.home] = max(left, 0.0)
        s.committed_s = 0.0

    def session_cost(
        self, session: str | None, engines: Sequence[EngineId], mean_wait_s: float
    ) -> dict[EngineId, float]:
        """Per engine, R · W · (C_e / C_fair - 1) for the request's session (all 0 when
        it has no session, nothing is committed, or W is 0)."""
        zero = dict.fromkeys(engines, 0.0)
        if session is None or mean_wait_s <= 0 or len(engines) < 2:
            return zero
        own = self.sessions.get(session)
        seen = own.turns if own is not None else 0
        remaining = self.remaining_turns(seen + 1)
        loads = {e: self.committed.get(e, 0.0) for e in engines}
        if own is not None and own.home in loads:
            loads[own.home] = max(loads[own.home] - own.committed_s, 0.0)
        fair = sum(loads.values()) / len(engines)
        if fair <= 0 or remaining <= 0:
            return zero
        scale = remaining * mean_wait_s
        return {e: scale * (loads[e] / fair - 1.0) for e in engines}

    def routed(self, session: str | None, engine: EngineId, work_s: float, now: float) -> None:
        """Record that a turn of `session` went to `engine` with predicted work `work_s`."""
        self.prune(now)
        if session is None:
            return
        s = self.sessions.get(session)
        if s is None:
            s = self.sessions[session] = _Session(engine, 0, work_s, now)
        else:
            self._uncommit(s)
            s.home = engine
            s.work_s += 0.5 * (work_s - s.work_s)
            s.last_s = now
        s.turns += 1
        s.committed_s = self.remaining_turns(s.turns) * s.work_s
        self.committed[engine] = self.committed.get(engine, 0.0) + s.committed_s
