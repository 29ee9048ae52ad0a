"""Engine state: health, backpressure, ejection, and the router's own in-flight load.

State machine of one engine (all times from an injected clock, seconds):

- **Active health**: a prober GETs `health.probe_path` every `probe_interval_s`; a
  non-2xx or a failed connection marks the engine `probe_ok = False` until a probe
  succeeds. Probes never eject and never re-admit early.
- **Passive outlier detection** (Envoy style): each request outcome is classified.
  `FAILURE` (a 5xx other than 503, a refused connection, a timeout, a cut stream)
  increments a consecutive-failure count; `OK` and `CLIENT_ERROR` (any 4xx but 429)
  reset it, so a 400 "prompt too long" never penalises an engine. At
  `consecutive_failures` the engine is ejected for `ejection_base_s * 2**k`
  (k = times ejected before, capped at `ejection_max_s`), but only while the ejected
  engines stay within `max_ejected_share` of the fleet: the last engine standing is
  never ejected. After the ejection time, the next successful probe re-admits it; k
  decays by one per `ejection_max_s` spent healthy, so a flapping engine stays out
  longer each time.
- **Backpressure**: 503 and 429 are the engine saying "not now", not "broken": they set
  a hold-off (`Retry-After`, default 1 s, capped) during which the engine is skipped
  while another is routable, and never count towards ejection.
- **Panic**: when fewer than `panic_threshold` of the engines are healthy, every engine
  is routable again (a partial outage must not concentrate the whole load).

In-flight counters (requests, and prompt tokens not yet past their first byte) are the
router's own load signal; `Ticket` makes their release idempotent.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from ramjet.config import EngineConfig, HealthConfig, RetryConfig
from ramjet.runtime.tasks import cancel_and_wait
from ramjet.types import EngineId

log = logging.getLogger(__name__)

Clock = Callable[[], float]


class Outcome(enum.Enum):
    OK = "ok"
    FAILURE = "failure"
    BACKPRESSURE = "backpressure"
    CLIENT_ERROR = "client_error"


def classify_status(status: int) -> Outcome:
    """How an upstream HTTP status counts for the engine's health."""
    if status in (429, 503):
        return Outcome.BACKPRESSURE
    if status >= 500:
        return Outcome.FAILURE
    if status >= 400:
        return Outcome.CLIENT_ERROR
    return Outcome.OK


@dataclass(slots=True)
class EngineState:
    config: EngineConfig
    probe_ok: bool = True
    consecutive_failures: int = 0
    ejected_until: float | None = None
    """None while admitted; else the earliest time a good probe may re-admit it."""
    ejections: int = 0
    """Times ejected, decayed while healthy; sets the next ejection's length."""
    last_change_s: float = 0.0
    backoff_until: float = 0.0
    inflight_requests: int = 0
    inflight_prompt_tokens: int = 0
    inflight_jobs: dict[int, tuple[int, int]] = field(default_factory=dict)
    """(new tokens, context tokens) of each request counted in `inflight_prompt_tokens`,
    in send order, by ticket: the wait prices each at its own context
    (`EngineLoad.inflight_jobs`). Changed only by `Ticket`, which drops `jobs_view`."""
    jobs_view: tuple[tuple[int, int], ...] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    """`inflight_jobs`' values as a tuple (`jobs`), made once per change of the jobs: the
    same tuple in every view until then, so the cost model keeps its sum over them by
    the tuple (`PrefillCurve.jobs_seconds`). None: to be made."""
    started_at: float = float("-inf")
    """When (the fleet's clock) a request here last got its first byte: a load report
    received before then may still count work that has since started
    (`ramjet.fleet.signals.ReportSignals.load`)."""
    busy_since: float = float("inf")
    """Since when (the fleet's clock) the engine has worked on the oldest of the router's
    requests here without a first byte: that request's send, or the last first byte if
    later (the engine went on to the next). inf: none outstanding yet."""
    models: tuple[str, ...] = field(default=())
    id: EngineId = field(init=False)
    """`config.id`, kept as a field: it is read ~20 times per request."""

    def __post_init__(self) -> None:
        self.id = EngineId(self.config.id)

    def jobs(self) -> tuple[tuple[int, int], ...]:
        """`inflight_jobs`' values, oldest first, as one tuple kept until they change."""
        view = self.jobs_view
        if view is None:
            view = tuple(self.inflight_jobs.values())
            self.jobs_view = view
        return view

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def ejected(self) -> bool:
        return self.ejected_until is not None

    @property
    def healthy(self) -> bool:
        return self.probe_ok and not self.ejected


@dataclass(init=False, frozen=True, slots=True)
class Routable:
    engines: tuple[EngineState, ...]
    """Engines a request may go to now, in configuration order; empty means none."""
    panic: bool = False
    retry_after_s: float = 0.0
    """When `engines` is empty because all are backing off: seconds until the first frees."""

    def __init__(
        self,
        engines: tuple[EngineState, ...],
        panic: bool = False,
        retry_after_s: float = 0.0,
    ) -> None:
        object.__setattr__(self, "engines", engines)
        object.__setattr__(self, "panic", panic)
        object.__setattr__(self, "retry_after_s", retry_after_s)


_JOBS = itertools.count(1)
"""Ticket numbers: the keys of `EngineState.inflight_jobs`."""


class Ticket:
    """One request's share of an engine's in-flight counters; release is idempotent.
    `context_tokens`: the cached prefix its `prompt_tokens` are prefilled on."""

    __slots__ = ("_engine", "_job", "_open", "_tokens")

    def __init__(
        self,
        engine: EngineState,
        prompt_tokens: int,
        now: float | None = None,
        context_tokens: int = 0,
    ) -> None:
        self._engine = engine
        self._tokens = prompt_tokens
        self._open = True
        if now is not None and prompt_tokens > 0 and engine.inflight_prompt_tokens <= 0:
            engine.busy_since = now  # the engine starts on this one now
        engine.inflight_requests += 1
        engine.inflight_prompt_tokens += prompt_tokens
        self._job = next(_JOBS)
        if prompt_tokens > 0:
            engine.inflight_jobs[self._job] = (prompt_tokens, max(context_tokens, 0))
            engine.jobs_view = None

    def first_byte(self, now: float | None = None) -> None:
        """The engine has started answering (at `now`, the fleet's clock; None: the
        attempt ended without an answer): its prompt work is no longer outstanding."""
        if now is not None and now > self._engine.started_at:
            self._engine.started_at = now
            self._engine.busy_since = now  # and goes on to the next
        if self._tokens:
            self._engine.inflight_prompt_tokens -= self._tokens
            self._engine.inflight_jobs.pop(self._job, None)
            self._engine.jobs_view = None
            self._tokens = 0

    def close(self) -> None:
        if self._open:
            self.first_byte()
            self._engine.inflight_requests -= 1
            self._open = False


class Fleet:
    """All engines' state. Single-threaded (the event loop); no awaits inside."""

    def __init__(
        self,
        engines: Sequence[EngineConfig],
        health: HealthConfig,
        retry: RetryConfig,
        clock: Clock,
        on_eject: Callable[[EngineId, float], None] | None = None,
    ) -> None:
        self.engines = tuple(EngineState(e, models=e.models) for e in engines)
        self._by_id = {e.id: e for e in self.engines}
        self._health = health
        self._retry = retry
        self._clock = clock
        self.clock = clock
        """The fleet's clock (`Ticket.first_byte` stamps starts with it)."""
        self._on_eject = on_eject

    def get(self, engine_id: str) -> EngineState:
        return self._by_id[EngineId(engine_id)]

    def ready(self) -> bool:
        return any(e.healthy for e in self.engines)

    def routable(self) -> Routable:
        now = self._clock()
        healthy = [e for e in self.engines if e.healthy]
        panic = len(healthy) < self._health.panic_threshold * len(self.engines)
        pool = list(self.engines) if panic else healthy
        free = [e for e in pool if e.backoff_until <= now]
        if free:
            return Routable(tuple(free), panic)
        if pool:
            return Routable((), panic, min(e.backoff_until for e in pool) - now)
        return Routable((), panic)

    # -- passive outcomes -------------------------------------------------------------

    def record(
        self, engine: EngineState, outcome: Outcome, retry_after_s: float | None = None
    ) -> None:
        now = self._clock()
        if outcome is Outcome.BACKPRESSURE:
            hold = 1.0 if retry_after_s is None else retry_after_s
            hold = min(max(hold, 0.0), self._retry.max_retry_after_s)
            engine.backoff_until = max(engine.backoff_until, now + hold)
        elif outcome is Outcome.FAILURE:
            engine.consecutive_failures += 1
            if engine.consecutive_failures >= self._health.consecutive_failures:
                self._maybe_eject(engine, now)
        else:
            engine.consecutive_failures = 0

    def _maybe_eject(self, engine: EngineState, now: float) -> None:
        if engine.ejected:
            return
        ejected = sum(1 for e in self.engines if e.ejected)
        if ejected + 1 > math.floor(self._health.max_ejected_share * len(self.engines)):
            return
        duration = min(
            self._health.ejection_base_s * 2.0**engine.ejections, self._health.ejection_max_s
        )
        engine.ejections += 1
        engine.ejected_until = now + duration
        engine.last_change_s = now
        log.warning("engine %s ejected for %.1fs", engine.id, duration)
        if self._on_eject is not None:
            self._on_eject(engine.id, duration)

    # -- active probes ----------------------------------------------------------------

    def record_probe(self, engine: EngineState, ok: bool) -> None:
        now = self._clock()
        engine.probe_ok = ok
        if not ok:
            return
        if engine.ejected_until is not None:
            if now >= engine.ejected_until:
                engine.ejected_until = None
                engine.consecutive_failures = 0
                engine.last_change_s = now
                log.warning("engine %s re-admitted", engine.id)
        elif engine.ejections and now - engine.last_change_s >= self._health.ejection_max_s:
            engine.ejections -= 1
            engine.last_change_s = now


ProbeFn = Callable[["EngineState"], Awaitable[bool]]
"""Asks one engine whether it is healthy; True for yes. Any `OSError` or `TimeoutError`
counts as no. The router's goes through the engine transport seam
(`ramjet.transport.base.fetch`)."""


class HealthProber:
    """Probes every engine each `probe_interval_s` and feeds `Fleet.record_probe`."""

    def __init__(self, fleet: Fleet, probe: ProbeFn, health: HealthConfig) -> None:
        self._fleet = fleet
        self._check = probe
        self._health = health
        self._task: asyncio.Task[None] | None = None

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(e) for e in self._fleet.engines))

    async def _probe(self, engine: EngineState) -> None:
        try:
            ok = await self._check(engine)
        except (OSError, TimeoutError):
            ok = False
        self._fleet.record_probe(engine, ok)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._health.probe_interval_s)
            try:
                await self.probe_all()
            except Exception:  # a probe bug must not kill health checking
                log.exception("health probe round failed")

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait((self._task,))
            self._task = None
