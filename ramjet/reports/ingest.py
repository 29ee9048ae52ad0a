"""The router side of the transport: pull each engine's reports, accept pushes.

Pull, per engine (`engines`: id -> base URL): a long-poll loop on
`GET /ramjet/reports?epoch=E&after=SEQ&wait=S`, the cursor (E, SEQ) being the
processor's last accepted (epoch, seq) for that engine. When the engine answers
"snapshot needed" (unknown epoch, cursor older than its ring) or the processor saw a
gap, or refused a pulled frame (too old, rate limited...), the loop fetches
`GET /ramjet/snapshot` first. Every frame goes through
`ReportProcessor.submit_async(frame, expected_engine=engine)` (a large snapshot is
applied in pieces that yield to the loop): a pulled frame that claims another engine is
rejected. With a shared store (`store.kind: redis`) the runtime passes
`SharedReports.submit` as `submit` instead, so every frame is also claimed against the
cursor all replicas share (`ramjet.reports.redis_cursors`); a snapshot that another
replica's claim has made unnecessary is then no error. Errors back off exponentially with jitter
(`poll.backoff_min_s` .. `poll.backoff_max_s`); a response bigger than a batch may be
is cut off unread.

The pulls go through the router's engine-facing client (`ramjet.transport`): one
`EnginePool` per pull target (its base URL, whose path every request is put under), made
at its first pull and closed by `stop()`. Each request, connect included, is bounded by
`poll.timeout_s` in all and carries `Authorization: Bearer <pull_token>` when one is set;
a status other than 200 is an error (`RuntimeError`, the body unread), an answer over the
cap is `ResponseTooLarge`.

Push: `POST /ramjet/reports` on the push listener (`ramjet.reports.push`), never on the
client port, and only when `reports.push.port` is set (off by default); each frame is
counted against its source address's token bucket before it is read, then goes through
the same `submit`. `push_url` is the listener's base URL once started.

Fault injection (tests): `drop`, when set, is asked about every pulled frame before it
is submitted; a frame it returns True for is discarded as if lost in transit.

`start()` launches the pull loops, a 1 s tick (staleness, expiry) and the push listener
when configured; `stop()` cancels them, closes the listener and the pull targets' pools.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from urllib.parse import urlencode

from multidict import CIMultiDictProxy
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from yarl import URL

from ramjet.errors import ReportError
from ramjet.metric_catalogue import counter, family
from ramjet.reports import transport as tp
from ramjet.reports.processor import ReportProcessor
from ramjet.reports.push import PushListener
from ramjet.reports.verify import Accepted, Reason, Rejected
from ramjet.runtime.tasks import cancel_and_wait
from ramjet.transport.base import exchange
from ramjet.transport.http1 import EnginePool
from ramjet.types import EngineId

SubmitFn = Callable[[bytes, EngineId | None], Awaitable[Accepted | Rejected]]
"""The door frames go through: `ReportProcessor.submit_async` or `SharedReports.submit`."""

log = logging.getLogger(__name__)


class ResponseTooLarge(ReportError):
    """An engine's reports response exceeded the size cap; nothing of it was parsed."""


PULL_CONNECTIONS = 4
"""Connections kept open to one pull target at most (a pull loop uses one at a time)."""


PULL_WARN_EVERY_S = 60.0
"""A silent pull target is warned about on its first failure, then once per this long."""


class _PullSilence(Collector):
    def __init__(self, ingest: ReportIngest) -> None:
        self._ingest = ingest

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fam = family("ramjet_reports_pull_silent_seconds")
        if self._ingest.started:
            for engine in self._ingest.engines:
                fam.add_metric([engine], self._ingest.pull_silent_s(engine))
        yield fam


class ReportIngest:
    def __init__(
        self,
        processor: ReportProcessor,
        engines: Mapping[EngineId, str] | None = None,
        *,
        tick_interval_s: float = 1.0,
        seed: int | None = None,
        submit: SubmitFn | None = None,
        registry: CollectorRegistry | None = None,
        pull_token: str | None = None,
    ) -> None:
        """`pull_token`: sent as `Authorization: Bearer` with every pull."""
        self.processor = processor
        self._headers: tuple[tuple[str, str], ...] = (
            () if pull_token is None else (("Authorization", f"Bearer {pull_token}"),)
        )
        self.submit: SubmitFn = submit if submit is not None else processor.submit_async
        cfg = processor.config
        self.engines: dict[EngineId, str] = (
            dict(engines)
            if engines is not None
            else {EngineId(e): url for e, url in cfg.engines.items()}
        )
        self._poll = cfg.poll
        self._batch_limit = (16 << 20) + cfg.max_report_bytes
        self._tick_interval = tick_interval_s
        self._rng = random.Random(seed)
        self._pools: dict[str, tuple[EnginePool, str]] | None = None
        """Pull target (base URL) -> its pool and base path; None until `start()`."""
        self._tasks: list[asyncio.Task[None]] = []
        self.polls: dict[EngineId, int] = {}
        self.drop: Callable[[EngineId, bytes], bool] | None = None
        """Test seam: pulled frames it returns True for are discarded (lost in transit)."""
        reg = registry if registry is not None else CollectorRegistry()
        self.push: PushListener | None = None
        if cfg.push.port is not None:
            self.push = PushListener(
                cfg.push,
                self.submit,
                reg,
                max_report_bytes=cfg.max_report_bytes,
                count_oversize=lambda: processor.count_rejected(Reason.OVERSIZE),
            )
        self.clock: Callable[[], float] = time.monotonic
        self._started: float | None = None
        self._answered: dict[EngineId, float] = {}
        """Engine -> when its pull target last answered a poll."""
        self._warned: dict[EngineId, float] = {}
        """Engine -> the silence (seconds) its last warning reported."""
        self._pull_failures = counter(reg, "ramjet_reports_pull_failures_total")
        for engine in self.engines:
            self._pull_failures.labels(engine)
        reg.register(_PullSilence(self))

    @property
    def started(self) -> bool:
        return self._started is not None

    def pull_silent_s(self, engine: EngineId) -> float:
        """Seconds since `engine`'s pull target last answered (since start: never has)."""
        since = self._answered.get(engine, self._started)
        return 0.0 if since is None else max(0.0, self.clock() - since)

    @property
    def push_url(self) -> str:
        """`http://host:port/ramjet/reports` of the started push listener."""
        assert self.push is not None, "reports.push.port is not set: no push listener"
        return self.push.url + tp.REPORTS_PATH

    # -- pull -----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._started is None:
            self._started = self.clock()
        if self.push is not None:
            await self.push.start()
        if self._pools is None:
            self._pools = {}
        for engine, url in self.engines.items():
            self._tasks.append(asyncio.create_task(self._pull_loop(engine, url.rstrip("/"))))
        self._tasks.append(asyncio.create_task(self._tick_loop()))

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        await cancel_and_wait(tasks)
        if self.push is not None:
            await self.push.stop()
        if self._pools is not None:
            pools, self._pools = self._pools, None
            for pool, _ in pools.values():
                await pool.close()

    async def _tick_loop(self) -> None:
        while True:
            # a sweep left (a step is ~2 ms of CPU): its next step the next loop turn,
            # so a large pass ends in about its CPU time, not a step per interval
            more = self.processor.tick()
            await asyncio.sleep(0 if more else self._tick_interval)

    async def _pull_loop(self, engine: EngineId, base: str) -> None:
        backoff = self._poll.backoff_min_s
        while True:
            try:
                await self.poll_once(engine, base)
                backoff = self._poll.backoff_min_s
                self._pulled(engine, base)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure of one poll: back off, never die
                self._pull_failed(engine, base, exc)
                await asyncio.sleep(backoff * (0.5 + self._rng.random() / 2))
                backoff = min(backoff * 2, self._poll.backoff_max_s)

    def _pulled(self, engine: EngineId, base: str) -> None:
        silent = self.pull_silent_s(engine)
        self._answered[engine] = self.clock()
        if self._warned.pop(engine, None) is not None:
            log.warning(
                "reports pull from %s (%s) answers again after %.0f s", engine, base, silent
            )

    def _pull_failed(self, engine: EngineId, base: str, exc: Exception) -> None:
        """Count it; warn on the first failure and then once per minute of silence: until
        the target answers, the router routes on its own guesses for this engine."""
        self._pull_failures.labels(engine).inc()
        silent = self.pull_silent_s(engine)
        warned = self._warned.get(engine)
        if warned is not None and silent - warned < PULL_WARN_EVERY_S:
            log.info("reports pull from %s failed: %r", engine, exc)
            return
        self._warned[engine] = silent
        since = (
            f"has not answered for {silent:.0f} s"
            if engine in self._answered
            else f"has never answered since the router started ({silent:.0f} s ago)"
        )
        log.warning(
            "reports pull target of %s (%s) %s: %r. Without its reports the router prices "
            "%s with its own routing and the policy's default profile "
            "(ramjet_reports_pull_silent_seconds, alert RamjetReportPullSilent)",
            engine, base, since, exc, engine,
        )  # fmt: skip

    async def _get(
        self, base: str, path_qs: str, limit: int, what: str
    ) -> tuple[CIMultiDictProxy[str], bytes]:
        """GET `path_qs` under the pull target `base`, within `poll.timeout_s` in all:
        the answer's headers and body. RuntimeError for a status other than 200 (the body
        unread), `ResponseTooLarge` for a body over `limit` bytes."""
        assert self._pools is not None, "start() first"
        target = self._pools.get(base)
        if target is None:  # ValueError for a URL that is not http(s)://host[:port][/path]
            pool = EnginePool(base, limit=PULL_CONNECTIONS, connect_s=self._poll.timeout_s)
            target = self._pools[base] = (pool, URL(base).raw_path.rstrip("/"))
        pool, prefix = target
        status, headers, data = await exchange(
            pool, "GET", prefix + path_qs, timeout_s=self._poll.timeout_s,
            headers=self._headers, max_bytes=limit, read_status=200,
        )  # fmt: skip
        if status != 200:
            raise RuntimeError(f"{what}: HTTP {status}")
        if data is None:
            raise ResponseTooLarge(f"more than {limit} bytes")
        return headers, data

    async def fetch_snapshot(self, engine: EngineId, base: str) -> bool:
        """Fetch and submit one snapshot; True when it was accepted, False when it was
        refused as replayed but none is needed any more."""
        assert self._pools is not None, "start() first"
        cap = self.processor.config.max_report_bytes
        _, frame = await self._get(base, tp.SNAPSHOT_PATH, cap + 1, "snapshot")
        self.processor.metrics.snapshots_fetched.labels(engine).inc()
        outcome = await self.submit(frame, engine)
        if isinstance(outcome, Rejected):
            if outcome.reason is Reason.REPLAYED and not self.processor.snapshot_needed(engine):
                return False  # a newer state was accepted meanwhile (by another replica)
            raise RuntimeError(f"snapshot rejected: {outcome.reason.value} ({outcome.detail})")
        return True

    async def poll_once(self, engine: EngineId, base: str, wait_s: float | None = None) -> int:
        """One long-poll (after a snapshot when one is needed); returns the number of
        frames accepted."""
        assert self._pools is not None, "start() first"
        if self.processor.snapshot_needed(engine):
            await self.fetch_snapshot(engine, base)
        cursor = self.processor.cursor(engine)
        params = {
            "after": str(cursor.seq if cursor else 0),
            "wait": str(self._poll.wait_s if wait_s is None else wait_s),
            "max": str(self._poll.max_batch),
        }
        if cursor is not None:
            params["epoch"] = str(cursor.epoch)
        path_qs = f"{tp.REPORTS_PATH}?{urlencode(params)}"
        headers, data = await self._get(base, path_qs, self._batch_limit, "reports")
        snapshot_needed = headers.get(tp.H_SNAPSHOT) == "1"
        self.polls[engine] = self.polls.get(engine, 0) + 1
        if snapshot_needed:
            await self.fetch_snapshot(engine, base)
            return 0
        accepted = 0
        for i, frame in enumerate(tp.iter_frames(data)):
            if i and i % 32 == 0:
                await asyncio.sleep(0)  # a full batch (~0.15 ms a frame) must not stall routing
            if self.drop is not None and self.drop(engine, frame):
                continue
            outcome = await self.submit(frame, engine)
            if not isinstance(outcome, Rejected):
                accepted += 1
            elif outcome.reason is not Reason.REPLAYED:
                # a report the engine published is lost to us: heal by snapshot (and never
                # spin on refusing the same frames from an unmoving cursor)
                self.processor.request_snapshot(engine)
        return accepted
