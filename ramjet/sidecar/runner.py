"""The sidecar: one engine's KV events in, Ramjet's signed reports out.

    engine PUB/ROUTER --(EventStream thread)--> ResidencyTracker --> DeltaBuilder
        --> ReportPublisher (signed with the sidecar's own Ed25519 key, as the engine id)
        --> GET /ramjet/reports, /ramjet/snapshot (routers pull) or POST (push)

Control: `--token-file` holds a bearer token. With it, `POST /reset_prefix_cache` takes
`Authorization: Bearer <token>` (without it the reset is off, 403) and so do the pull
endpoints (routers send it from `reports.pull_token_file`; without a token they are open:
what they serve is signed). A snapshot over HTTP is signed at most once per
`snapshot_min_interval_s` (`ReportPublisher.served_snapshot`), whoever asks.

The publisher is the shared `ramjet.reports.publisher.ReportPublisher`, so a router
trusts a sidecar exactly as it trusts the reference engine: by the key id listed under
the engine in its `keys:` section. Each burst of events becomes one delta. A restart of
the engine or lost history starts a new epoch (`ReportPublisher.new_epoch`): routers
purge what the sidecar said before and take its snapshot. Load comes from scraping the
engine's `/metrics` (`ramjet.sidecar.scrape`), the profile from timed probe requests
(`ramjet.sidecar.probe`) or a JSON file. Every request to the engine goes through the
router's engine-facing client (`ramjet.sidecar.engine_client`).

Tolerance: events the decoder could not take (`ramjet.sidecar.wire`: unknown fields and
types, malformed events) are counted (`ramjet.sidecar.metrics`, served on `/metrics`);
a batch whose dropped event may have removed blocks (`EventBatch.resync_from`) starts a
new epoch, as lost history does, and only its events after the drop are applied.

Event-path liveness: the stream runs in a thread; any exception that escapes it (a bug
in the tracker, a ZMQ error) ends it. `_supervise` notices within a second and the path
is *down*: logged with the error, `ramjet_sidecar_events_down` 1, `/health` answers 503
with `events.alive: false`, the residency is forgotten with a new epoch (routers purge
what the sidecar said: frozen residency must not steer), and load reports pause, so
routers see the engine go silent and degrade its trust (DEGRADED after
`reports.stale_after_s`, residency off after `stale_ttl_s`) rather than trusting a view
that no longer moves. The path is restarted (a new stream, replay from seq 0) after
`event_restart_min_s`, doubling up to `event_restart_max_s` while it keeps dying; once
the new stream has caught up it is up again and load reports resume.

Locks: the tracker and the delta builder are guarded by `_lock`; the publisher has its
own. `_lock` is never held while calling into the publisher except through its snapshot
callback (which takes `_lock` under the publisher's lock), so the order is always
publisher -> sidecar.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client import CollectorRegistry, generate_latest

from ramjet.policy.profile import EngineProfile, TierCost
from ramjet.reports.bodies import DeltaBuilder, LoadBody, SwaStates, TierKeys
from ramjet.reports.publisher import ReportPublisher
from ramjet.runtime.probe_lock import async_host_lock
from ramjet.runtime.tasks import cancel_and_wait
from ramjet.sidecar.engine_client import engine_base, engine_client
from ramjet.sidecar.metrics import SidecarMetrics
from ramjet.sidecar.probe import probe_profile
from ramjet.sidecar.scrape import LoadScraper
from ramjet.sidecar.stream import EventStream
from ramjet.sidecar.tracker import MEDIA, ResidencyTracker
from ramjet.sidecar.wire import Message
from ramjet.transport.base import UpstreamConnectError
from ramjet.types import EngineId

log = logging.getLogger(__name__)

EngineKind = Literal["vllm", "sglang"]
RESET_PATHS: dict[str, str] = {"vllm": "/reset_prefix_cache", "sglang": "/flush_cache"}
"""Each engine's cache-reset endpoint (vLLM needs VLLM_SERVER_DEV_MODE=1 for it)."""


@dataclass(frozen=True)
class SidecarSettings:
    engine_kind: EngineKind
    engine_id: str
    engine_url: str
    events_url: str
    replay_url: str | None
    key_id: str
    model: str
    block_tokens: int = 16
    topic: bytes = b""
    push_url: str | None = None
    load_interval_s: float = 1.0
    scrape_metrics: bool = True
    profile: Literal["skip", "probe"] = "probe"
    profile_file: str | None = None
    probe_sizes: tuple[int, ...] | None = None
    """Prompt sizes in tokens; None: up to the engine's max model length."""
    probe_lock: str | None = None
    """The host's probe lock (`ramjet.runtime.probe_lock`); None: probe without one."""
    global_kv_bytes_per_token: float = 1.0
    tiers: dict[str, TierCost] = field(default_factory=dict)
    replay_timeout_s: float = 2.0
    reset_timeout_s: float = 10.0
    events_warn_after_s: float = 30.0
    """Warn (log, `ramjet_sidecar_events_silent`) when no event arrived by then."""
    event_restart_min_s: float = 1.0
    """A dead event path is restarted after this long, doubling while it keeps dying..."""
    event_restart_max_s: float = 30.0
    """... up to this long."""
    token: str | None = None
    """Bearer token (`--token-file`) that `POST /reset_prefix_cache`, `GET /ramjet/reports`
    and `GET /ramjet/snapshot` require; None: the reset is off (403) and pulls are open."""
    snapshot_min_interval_s: float = 0.5
    """Snapshots served over HTTP are signed at most once per this long."""


class Sidecar:
    def __init__(
        self,
        settings: SidecarSettings,
        private_key: Ed25519PrivateKey,
        registry: CollectorRegistry | None = None,
    ) -> None:
        engine_base(settings.engine_url)  # a bad URL fails here, not in each request
        self.settings = settings
        self.metrics = SidecarMetrics(CollectorRegistry() if registry is None else registry)
        self.tracker = ResidencyTracker(
            settings.model, MEDIA[settings.engine_kind], settings.block_tokens
        )
        self._builder = DeltaBuilder()
        self._lock = threading.Lock()
        self._load = LoadBody(
            queued_prompt_tokens=0, running_requests=0, waiting_requests=0, kv_utilization=0.0
        )
        self.publisher = ReportPublisher(
            EngineId(settings.engine_id),
            private_key,
            settings.key_id,
            snapshot=self._snapshot,
            load=lambda: self._load,
            load_interval_s=settings.load_interval_s,
            push_url=settings.push_url,
            pull_token=settings.token,
            snapshot_min_interval_s=settings.snapshot_min_interval_s,
        )
        self.stream = self._new_stream()
        self.profile: EngineProfile | None = None
        self._oldest_unsigned: float | None = None
        """Engine timestamp of the oldest batch applied since the last signed delta."""
        self.last_batch_ts: float | None = None
        """The engine's timestamp of the last batch applied (benchmarks read it)."""
        self.flushed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._probing: asyncio.Task[None] | None = None
        """The profile probe started with the sidecar, while it runs (a reset waits for it)."""
        self.events_error: str | None = None
        """Why the event path died, while it is down (None: up)."""
        self._down_since: float | None = None
        self.event_path_restarts = 0
        self._stopping = False

    def _new_stream(self) -> EventStream:
        s = self.settings
        return EventStream(
            s.events_url,
            s.replay_url,
            on_batch=self._on_batch,
            on_reset=self._on_reset,
            on_flush=self.flush,
            topic=s.topic,
            replay_timeout_s=s.replay_timeout_s,
        )

    def _run_stream(self, stream: EventStream) -> None:
        """The event thread's body: record why it ends, when that is not a stop."""
        try:
            stream.run()
        except BaseException as exc:
            self.events_error = f"{type(exc).__name__}: {exc}"
            log.exception("KV-event path died")
            return
        if not self._stopping:
            self.events_error = "event stream ended"

    def _start_stream(self) -> None:
        self._thread = threading.Thread(
            target=self._run_stream, args=(self.stream,), name="kv-events", daemon=True
        )
        self._thread.start()

    @property
    def events_alive(self) -> bool:
        return self._down_since is None and (self._thread is None or self._thread.is_alive())

    # -- events (stream thread) ------------------------------------------------------------

    def _on_batch(self, msg: Message) -> None:
        batch = msg.batch
        self.metrics.observe(batch)
        events = batch.events
        cut = batch.resync_from
        if cut is not None:
            # a removal (or clear) was lost: what we hold may be stale; start over from the
            # events after it (outside _lock: new_epoch takes the publisher's lock)
            self._on_reset(f"malformed event in batch {msg.seq}")
            events = events[cut:]
        with self._lock:
            self.tracker.apply(events, self._builder)
            self.last_batch_ts = batch.ts
            if self._oldest_unsigned is None:
                self._oldest_unsigned = batch.ts

    def _on_reset(self, reason: str) -> None:
        with self._lock:
            self.tracker.reset()
            self._builder = DeltaBuilder()
        epoch = self.publisher.new_epoch()
        log.warning("%s: new epoch %d", reason, epoch)

    def flush(self) -> int | None:
        """Sign the events applied since the last flush as one delta; its seq."""
        with self._lock:
            oldest, self._oldest_unsigned = self._oldest_unsigned, None
            if not len(self._builder):
                return None
            body = self._builder.build()
        seq = self.publisher.publish_delta(body)
        if oldest is not None:
            self.metrics.event_to_report.observe(max(0.0, time.time() - oldest))
        with self.flushed:
            self.flushed.notify_all()
        return seq

    def _snapshot(self) -> tuple[list[TierKeys], list[SwaStates]]:
        with self._lock:
            return self.tracker.snapshot(), []

    # -- lifecycle -------------------------------------------------------------------------

    def add_routes(self, app: web.Application) -> None:
        self.publisher.add_routes(app)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        """Reset the engine's prefix cache and answer once the sidecar has applied (and
        signed) the clear. vLLM answers `POST /reset_prefix_cache` at once but emits
        `AllBlocksCleared` only at its next engine step, which an idle engine does not
        take: reading the sidecar right after resetting the engine directly shows stale
        blocks. So the sidecar sends the reset, then nudges the engine with a one-token
        request (no full block: it stores nothing) until the clear arrives.

        Needs `Authorization: Bearer <token>` (`--token-file`); off (403) without one: a
        reset empties the engine's cache for every client.

        A profile probe still running (the sidecar's start) is finished first: its
        prompts fill blocks, and a reset answered in the middle of it would leave the
        engine holding the probe's later blocks after "cleared"."""
        s = self.settings
        if s.token is None:
            return web.json_response(
                {"error": "cache reset is off: start the sidecar with --token-file"}, status=403
            )
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {s.token}".encode()):
            return web.json_response({"error": "bad or missing token"}, status=401)
        if self._probing is not None and not self._probing.done():
            log.info("cache reset waits for the profile probe to finish")
            await asyncio.wait([self._probing])
        path = RESET_PATHS[s.engine_kind]
        with self._lock:
            before = self.tracker.stats["cleared"]
        deadline = time.monotonic() + s.reset_timeout_s
        async with engine_client(s.engine_url, s.reset_timeout_s) as engine:
            # vLLM refuses the reset while any block is still held (a request that has
            # just answered frees its blocks at the engine's next step) and says so only
            # in the body, {"success": false}, with status 200: retry until it succeeds.
            while True:
                try:
                    status, body = await engine.request("POST", path)
                except (OSError, TimeoutError) as exc:
                    return web.json_response(
                        {"error": f"engine {path}: unreachable: {exc!r}"}, status=502
                    )
                text = body.decode("utf-8", "replace")
                if status != 200:
                    return web.json_response(
                        {"error": f"engine {path}: HTTP {status}: {text[:300]}"}, status=502
                    )
                if not _reset_refused(text):
                    break
                log.info("engine %s refused the cache reset (blocks still held); retrying", path)
                if time.monotonic() > deadline:
                    return web.json_response(
                        {"error": f"engine {path} refused the reset for {s.reset_timeout_s:g} s "
                                  "(blocks still held by running requests)"},
                        status=504,
                    )  # fmt: skip
                await asyncio.sleep(0.1)
            next_nudge = time.monotonic() + 0.2
            while True:
                with self._lock:
                    cleared = self.tracker.stats["cleared"] > before
                if cleared:
                    break
                now = time.monotonic()
                if now > deadline:
                    return web.json_response(
                        {"error": f"no AllBlocksCleared within {s.reset_timeout_s:g} s"},
                        status=504,
                    )
                if now >= next_nudge:
                    next_nudge = now + 1.0
                    nudge = {"model": s.model, "prompt": ".", "max_tokens": 1}
                    with contextlib.suppress(OSError, TimeoutError):
                        await engine.request("POST", "/v1/completions", nudge)
                await asyncio.sleep(0.02)
        seq = self.flush()
        with self._lock:
            resident = len(self.tracker.resident())
        return web.json_response(
            {"cleared": True, "epoch": self.publisher.epoch, "seq": seq or self.publisher.seq,
             "resident_blocks": resident}
        )  # fmt: skip

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": "text/plain; version=0.0.4"},
        )

    async def _health(self, request: web.Request) -> web.Response:
        with self._lock:
            resident = len(self.tracker.resident())
            stats = dict(self.tracker.stats)
        alive = self.events_alive
        down = self._down_since
        return web.json_response(
            {
                "engine_id": self.settings.engine_id,
                "events": {
                    "alive": alive,
                    "error": None if alive else self.events_error or "event thread not running",
                    "down_s": None if down is None else round(time.monotonic() - down, 3),
                    "restarts": self.event_path_restarts,
                },
                "epoch": self.publisher.epoch,
                "seq": self.publisher.seq,
                "last_event_seq": self.stream.last,
                "resident_blocks": resident,
                "tracker": stats,
                "stream": dict(self.stream.stats),
                "decoder": dict(self.metrics.stats),
                "groups": {str(k): v for k, v in self.tracker.group_kinds().items()},
                "profile": None if self.profile is None else self.profile.model_dump(),
            },
            status=200 if alive else 503,
        )

    async def start(self) -> None:
        await self.publisher.start()
        self._stopping = False
        self._start_stream()
        await asyncio.get_running_loop().run_in_executor(None, self.stream.connected.wait, 5.0)
        self._tasks.append(asyncio.create_task(self._supervise()))
        if self.settings.scrape_metrics:
            self._tasks.append(asyncio.create_task(self._scrape_loop()))
        self._tasks.append(asyncio.create_task(self._watch_silence()))
        if self.settings.profile_file is not None:
            with open(self.settings.profile_file, encoding="utf-8") as f:
                self.profile = EngineProfile.model_validate_json(f.read())
            self.publisher.publish_profile(self.profile)
        elif self.settings.profile == "probe":
            self._probing = asyncio.create_task(self._probe())
            self._tasks.append(self._probing)

    async def stop(self) -> None:
        self._stopping = True
        await cancel_and_wait(self._tasks)
        self._tasks.clear()
        self.stream.stop()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 5.0)
        self.flush()
        await self.publisher.stop()

    async def _supervise(self) -> None:
        """Watch the event thread; a dead path goes down and is restarted (module doc)."""
        s = self.settings
        loop = asyncio.get_running_loop()
        backoff = s.event_restart_min_s
        while True:
            await asyncio.sleep(0.2)
            thread = self._thread
            if thread is None or thread.is_alive():
                continue
            self._path_down()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, s.event_restart_max_s)
            self.stream = self._new_stream()
            self.events_error = None
            self.event_path_restarts += 1
            self.metrics.event_path_restarts.inc()
            log.warning("restarting the KV-event path (restart %d)", self.event_path_restarts)
            self._start_stream()
            await loop.run_in_executor(None, self.stream.connected.wait, 5.0)
            if (
                self.stream.connected.is_set()
                and self._thread is not None
                and self._thread.is_alive()
            ):
                self._path_up()
                backoff = s.event_restart_min_s

    def _path_down(self) -> None:
        if self._down_since is not None:
            return
        self._down_since = time.monotonic()
        why = self.events_error or "event thread not running"
        self.metrics.events_down.set(1)
        self.publisher.load_paused = True
        log.error(
            "KV-event path down (%s): residency forgotten with a new epoch and load reports "
            "paused until it is back, so routers stop trusting this engine's view",
            why,
        )
        self._on_reset(f"KV-event path down ({why})")

    def _path_up(self) -> None:
        down = self._down_since
        self._down_since = None
        self.metrics.events_down.set(0)
        self.publisher.load_paused = False
        if down is not None:
            log.warning("KV-event path up again after %.1f s", time.monotonic() - down)

    async def _probe(self) -> None:
        s = self.settings
        try:
            async with async_host_lock(s.probe_lock) as waited_s:
                if waited_s > 1.0:
                    log.info("waited %.1f s for another engine's probe on this host", waited_s)
                self.profile = await probe_profile(
                    s.engine_url,
                    s.model,
                    sizes=s.probe_sizes,
                    global_kv_bytes_per_token=s.global_kv_bytes_per_token,
                    tiers=s.tiers,
                )
        except (OSError, RuntimeError, ValueError, TimeoutError) as exc:
            log.error("profile probe failed: %s", exc)
            return
        self.publisher.publish_profile(self.profile)
        log.info("profile published: %s", self.profile.model_dump_json())

    async def _watch_silence(self) -> None:
        """A sidecar that hears nothing looks healthy (`last_event_seq: null`) while the
        router prices the engine on guesses: say so, loudly, once, and keep the gauge up
        until the first event."""
        s = self.settings
        await asyncio.sleep(s.events_warn_after_s)
        warned = False
        while self.stream.last is None:
            if not warned:
                warned = True
                self.metrics.events_silent.set(1)
                log.warning(
                    "no KV event from %s within %.0f s of start (replay %s). Check: the "
                    "engine must BIND this endpoint (vLLM and SGLang bind ipc://, inproc://, "
                    "tcp://* and tcp://[::] endpoints but CONNECT to any other tcp:// one, "
                    "and two connecting ends never meet: use ipc:// beside the engine or "
                    "tcp://*:PORT); events on (vLLM enable_kv_cache_events, SGLang "
                    "publisher zmq); the topic (--topic %r)",
                    s.events_url,
                    s.events_warn_after_s,
                    "answered" if self.stream.stats["replay_answers"] else "did not answer",
                    s.topic.decode(errors="replace"),
                )
            await asyncio.sleep(1.0)
        self.metrics.events_silent.set(0)
        if warned:
            log.info("KV events arriving from %s", s.events_url)

    def _engine_gone(self, why: str) -> None:
        """The engine's port refuses connections: the process is gone and its cache with
        it. Start a new epoch with nothing in it at once, rather than at the restarted
        engine's first event (until then routers would count hits on a dead cache)."""
        with self._lock:
            held = bool(self.tracker.resident())
        if held:
            self._on_reset(f"engine unreachable ({why}): its cache is gone")

    async def _scrape_loop(self) -> None:
        scraper = LoadScraper()
        interval = self.settings.load_interval_s
        down = False
        async with engine_client(self.settings.engine_url, max(1.0, interval)) as engine:
            while True:
                try:
                    status, body = await engine.request("GET", "/metrics")
                    if status == 200:
                        text = body.decode("utf-8", "replace")
                        self._load = scraper.load(text, time.monotonic())
                    down = False
                except UpstreamConnectError as exc:
                    log.debug("metrics scrape failed: %s", exc)
                    if exc.refused and not down:
                        down = True
                        self._engine_gone(str(exc))
                except (OSError, TimeoutError, ValueError) as exc:
                    log.debug("metrics scrape failed: %s", exc)
                await asyncio.sleep(interval)


def _reset_refused(body: str) -> bool:
    """Whether an engine's answer to a cache reset says it did not reset: vLLM answers
    `{"success": false}` while blocks are held; SGLang's `/flush_cache` answers text."""
    try:
        data = json.loads(body)
    except ValueError:
        return False
    return isinstance(data, dict) and data.get("success") is False
