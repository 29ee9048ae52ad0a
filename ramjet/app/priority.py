"""Priority hints: the router tells an engine how much prompt work a request costs.

Per engine pool (`PriorityConfig`, the policy file's `priority:` list), for a request
routed to an engine of the pool:

- The hint is the cost model's predicted prompt work on the engine actually chosen
  (`ramjet.policy.cost`: `work_s` = restore + replay + prefill): the live decision's
  figure for that engine, else the other pick's, else the cost model run for that engine
  alone (a baseline policy records no components).
- The key is `round(1000 * (min(work_s, aging * horizon_s) + aging * arrival_unix_s))`,
  integer milliseconds of wall-clock time (`ramjet.policy.priority_key`): an engine that
  serves the least key first without aging of its own serves "least work first,
  forgiving `aging` seconds of work per second waited", no request is overtaken by one
  that arrived more than `horizon_s` after it, and router replicas with synchronised
  clocks compute the same key for the same request.
- Convention: vLLM (`--scheduling-policy priority`) and the reference engine run the
  lowest `priority` first, so the key is sent as is; SGLang
  (`--enable-priority-scheduling`) runs the highest first, so `-key` is sent.
- A client's own integer `priority`: `keep` leaves the request alone (no hint), `override`
  replaces it with the hint, `combine` makes it a class above the hint:
  `client * CLASS_STRIDE + key` (low-first) or `client * CLASS_STRIDE - key` (SGLang), so
  every request of a better client class runs before any of a worse one. A client value
  that is not an integer, or whose magnitude is over `MAX_CLIENT_CLASS`, is left alone.
- Modes: `off` does nothing; `observe` computes, logs and counts the would-be hint and
  sends nothing; `on` sends it, for the `share` of sessions selected by the same session
  hash as routing's canary (`ramjet.app.modes.canary_share_of`); the rest are observed.

The body is rewritten only when a hint is sent, and then only by inserting
`"priority":N,` after the opening brace (or replacing the value of an existing top-level
`priority`): every other byte is the client's. Retries of the request carry the same body.

Routing that knows the engine serves by key: for a pool in mode `on` (and a session
inside its share), the policy's `FleetStats.keyed` holds each engine's hinted requests
still without a first byte, with their keys (`KeyedQueues`; `track` at routing,
`untrack` when the response ends), so the cost model prices a request's wait by the
work queued there with a lower key (`ramjet.policy.cost.keyed_wait`).

Every hint computed (sent or not) is counted in `ramjet_priority_hints_total{pool,
outcome}` and its work in `ramjet_priority_hint_work_seconds{pool}`, and goes into the
decision log's `priority` field (`ramjet explain` prints it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ramjet.app.modes import ModeOutcome, canary_share_of
from ramjet.config import PriorityConfig
from ramjet.metric_catalogue import counter, histogram
from ramjet.policy.base import EngineView, FleetStats, KeyedQueue, RequestView
from ramjet.policy.cost import estimate
from ramjet.policy.fleet_stats import KeyedQueues, decided_work
from ramjet.policy.priority_key import hint_key_s
from ramjet.request.parse import ParsedRequest
from ramjet.types import EngineId

CLASS_STRIDE = 10**15
"""Key span of one client class under `combine`: more than any key until the year 2286
at aging <= 100 (aging * arrival in ms < 2e14 * 5)."""
MAX_CLIENT_CLASS = 1000
"""Largest |client priority| combined: keeps the value inside a signed 64-bit integer."""


@dataclass(init=False, frozen=True, slots=True)
class PriorityHint:
    """One request's hint, sent or not."""

    pool: str
    mode: str
    """The pool's mode: "observe" or "on"."""
    outcome: str
    """"sent"; or why not: "observe", "canary_out", "client_kept", "client_invalid"."""
    engine: str
    work_s: float
    """Predicted prompt work on `engine` (the hint)."""
    key_ms: int
    """round(1000 * (min(work_s, aging * horizon_s) + aging * arrival_unix_s)); lower
    runs first."""
    value: int | None
    """The `priority` sent (outcome "sent") or that would have been sent."""
    client: Any = None
    """The client's own `priority`, if the body had one."""

    def __init__(
        self,
        pool: str,
        mode: str,
        outcome: str,
        engine: str,
        work_s: float,
        key_ms: int,
        value: int | None,
        client: Any = None,
    ) -> None:
        object.__setattr__(self, "pool", pool)
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "outcome", outcome)
        object.__setattr__(self, "engine", engine)
        object.__setattr__(self, "work_s", work_s)
        object.__setattr__(self, "key_ms", key_ms)
        object.__setattr__(self, "value", value)
        object.__setattr__(self, "client", client)

    @property
    def sent(self) -> bool:
        return self.outcome == "sent"

    def to_json(self) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "mode": self.mode,
            "outcome": self.outcome,
            "sent": self.sent,
            "engine": self.engine,
            "work_s": float(f"{self.work_s:.6g}"),
            "key_ms": self.key_ms,
            "value": self.value,
            "client": self.client if isinstance(self.client, int | float | str) else None,
        }


def hint_key_ms(
    work_s: float, aging: float, arrival_unix_s: float, horizon_s: float | None = None
) -> int:
    """The static key, integer milliseconds: lower runs first (`hint_key_s`)."""
    return round(1000.0 * hint_key_s(work_s, aging, arrival_unix_s, horizon_s))


def priority_value(key_ms: int, convention: str, client: int | None) -> int:
    """The `priority` field for an engine of `convention`, `client` the combined class."""
    low_first = key_ms if convention != "sglang" else -key_ms
    if client is None:
        return low_first
    return client * CLASS_STRIDE + low_first


def _members(text: str) -> tuple[int, list[tuple[str, int, int, int]], int]:
    """The top-level members of a JSON object text: (index just after its `{`, each
    member's (key, start, value start, value end), index where the walk stopped: the
    closing `}` or the end). One walk for `_priority_span` and `without_priority`."""
    dec = json.JSONDecoder()
    ws = " \t\n\r"
    open_at = text.index("{")
    i = open_at + 1
    out: list[tuple[str, int, int, int]] = []
    n = len(text)
    while i < n:
        while i < n and text[i] in ws:
            i += 1
        if i >= n or text[i] == "}":
            break
        if text[i] == ",":
            i += 1
            continue
        start = i
        key, i = dec.raw_decode(text, i)
        while text[i] in ws:
            i += 1
        i += 1  # ':'
        while text[i] in ws:
            i += 1
        value_at = i
        _, i = dec.raw_decode(text, i)
        out.append((key, start, value_at, i))
    return open_at + 1, out, i


def _priority_span(text: str) -> tuple[int, int] | None:
    """Character span of the last top-level `"priority"` value of a JSON object text."""
    spans = [(v, e) for key, _, v, e in _members(text)[1] if key == "priority"]
    return spans[-1] if spans else None


def without_priority(body: bytes) -> bytes:
    """`body` (a JSON object) with every top-level `priority` member removed; the other
    members are the client's bytes (the whitespace between members may change)."""
    text = body.decode("utf-8")
    inside, members, end = _members(text)
    kept = [text[start:e] for key, start, _, e in members if key != "priority"]
    return (text[:inside] + ",".join(kept) + text[end:]).encode("utf-8")


def with_priority(body: bytes, value: int, replace: bool) -> bytes:
    """`body` (a JSON object) with top-level `priority` set to `value`; all other bytes
    unchanged. `replace`: the body already has the key (its last value is replaced)."""
    if replace:
        text = body.decode("utf-8")
        span = _priority_span(text)
        if span is not None:
            return (text[: span[0]] + str(value) + text[span[1] :]).encode("utf-8")
    i = body.index(b"{") + 1
    rest = body[i:].lstrip(b" \t\n\r")
    sep = b"" if rest.startswith(b"}") else b","
    return body[:i] + b'"priority":' + str(value).encode("ascii") + sep + body[i:]


class PriorityHints:
    """The router's hint maker for every priority pool; see the module docstring."""

    def __init__(
        self,
        pools: Sequence[PriorityConfig],
        registry: Any,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._by_engine: dict[str, PriorityConfig] = {}
        for p in pools:
            if p.mode == "off":
                continue
            for e in p.engines:
                self._by_engine[e] = p
        self._wall = wall
        self.queues = KeyedQueues(
            {
                EngineId(e): (p.aging, p.horizon_s, p.convention != "vllm", p.charge_jumps)
                for p in pools
                if p.mode == "on" and p.keyed_wait
                for e in p.engines
            }
        )
        """The hinted requests queued per engine of a pool in mode `on`: the cost model's
        priority-aware wait (`FleetStats.keyed`)."""
        self.hints = counter(registry, "ramjet_priority_hints_total")
        self.work = histogram(registry, "ramjet_priority_hint_work_seconds")

    def __bool__(self) -> bool:
        return bool(self._by_engine)

    def keyed(self, views: Sequence[EngineView], session_key: str) -> dict[EngineId, KeyedQueue]:
        """`FleetStats.keyed` for a request of `session_key`: the engines of pools in mode
        `on` whose hint this session gets (its canary hash is inside the pool's share)."""
        out: dict[EngineId, KeyedQueue] = {}
        share: float | None = None  # the session's canary hash, once per request
        for v in views:
            pool = self._by_engine.get(v.id)
            if pool is None or pool.mode != "on" or not pool.keyed_wait:
                continue
            if pool.share < 1.0:
                if share is None:
                    share = canary_share_of(session_key)
                if share >= pool.share:
                    continue
            q = self.queues.queue(v.id, v.load.inflight_prompt_tokens)
            if q is not None:
                out[v.id] = q
        return out

    def track(self, hint: PriorityHint, request_id: str, now: float, tokens: int) -> None:
        """A sent hint's request is queued on its engine with its key (in the clock of
        `now`, the policy's) and its predicted uncached tokens, until `untrack`."""
        pool = self._by_engine.get(hint.engine)
        if pool is not None and hint.sent:
            key = hint_key_s(hint.work_s, pool.aging, now, pool.horizon_s)
            self.queues.add(EngineId(hint.engine), request_id, key, tokens)

    def untrack(self, hint: PriorityHint, request_id: str) -> None:
        self.queues.done(EngineId(hint.engine), request_id)

    def work_on(
        self,
        rv: RequestView,
        view: EngineView,
        outcome: ModeOutcome,
        fleet: FleetStats,
    ) -> float:
        """Predicted prompt work on `view`'s engine: the live pick's figure, else the
        other picks', else the cost model for that engine alone."""
        w = decided_work(view.id, outcome.live, outcome.candidate, outcome.incumbent)
        return w if w is not None else estimate(rv, [view], fleet)[0].work.work_s

    def apply(
        self,
        parsed: ParsedRequest,
        rv: RequestView,
        view: EngineView | None,
        outcome: ModeOutcome,
        fleet: FleetStats,
        session_key: str,
        age_s: float = 0.0,
        work_s: float | None = None,
    ) -> tuple[bytes, PriorityHint | None]:
        """The body to forward and the hint (None: the engine is in no active pool).
        `age_s`: seconds since the request arrived (the key uses the arrival time).
        `work_s`: the predicted work on `view`'s engine where the caller already read it
        (`decided_work`); None: `work_on` finds it."""
        if view is None:
            return parsed.body, None
        pool = self._by_engine.get(view.id)
        if pool is None:
            return parsed.body, None
        work = work_s if work_s is not None else self.work_on(rv, view, outcome, fleet)
        key = hint_key_ms(work, pool.aging, self._wall() - age_s, pool.horizon_s)
        has_client = "priority" in parsed.json
        client = parsed.json.get("priority") if has_client else None
        combine: int | None = None
        outcome_s = "sent"
        if has_client and pool.client == "keep":
            outcome_s = "client_kept"
        elif has_client and pool.client == "combine":
            if (
                isinstance(client, int)
                and not isinstance(client, bool)
                and abs(client) <= MAX_CLIENT_CLASS
            ):
                combine = client
            else:
                outcome_s = "client_invalid"
        value = priority_value(key, pool.convention, combine)
        if outcome_s == "sent":
            if pool.mode == "observe":
                outcome_s = "observe"
            elif pool.share < 1.0 and canary_share_of(session_key) >= pool.share:
                outcome_s = "canary_out"
        hint = PriorityHint(pool.name, pool.mode, outcome_s, view.id, work, key, value, client)
        self.hints.labels(pool=pool.name, outcome=outcome_s).inc()
        self.work.labels(pool=pool.name).observe(work)
        if not hint.sent:
            return parsed.body, hint
        return with_priority(parsed.body, value, has_client), hint
