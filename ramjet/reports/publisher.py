"""The engine side of the reports: sign, sequence, keep, serve and push.

The reference engine creates one `ReportPublisher` with its engine id, Ed25519 private
key and key id, and feeds it:

    pub = ReportPublisher(EngineId("e0"), load_private_key("keys/e0-a.key"), "e0-a",
                          snapshot=cache_state, load=load_figures)
    pub.add_routes(app)            # GET /ramjet/reports (long-poll), GET /ramjet/snapshot
    await pub.start()              # periodic load reports, optional push
    pub.publish_delta(builder.build())       # whenever the caches changed
    pub.publish_profile(profile)             # after profiling
    await pub.stop()

Rules the publisher keeps (the router relies on them):
- epoch: by default the wall-clock start time in ms, so a restart gets a higher one;
- seq: 1, 2, 3... within the epoch for delta, load and profile reports, each kept in a
  bounded ring (`ring_size` reports, `ring_bytes` bytes); a snapshot takes no number of
  its own: it carries the seq of the last report it includes;
- issued_at_ms strictly increases within the epoch (the router uses it to refuse a
  replayed snapshot);
- a snapshot of more than `snapshot_part_keys` keys is cut in parts
  (`ramjet.reports.bodies.split_snapshot`): part 0 carries the seq of the last report,
  as a whole snapshot does, and parts 1.. take the next seqs and go into the ring (and
  the push queue) right behind it, all signed under one hold of the lock, so nothing
  comes between them. `GET /ramjet/snapshot` answers part 0; a puller reads the rest
  from `GET /ramjet/reports`: the ring's caps grow by the newest snapshot's later parts
  (about 10.7 bytes a key) so that they stay in it.

Snapshot consistency: `snapshot()` (the engine's callback) returns its residency and
live SWA states. Deltas set a key's state (they never add or subtract), so a snapshot
that already contains changes not yet published in a delta is safe: the next delta
repeats them. Publishing methods are thread-safe (the engine's cache events arrive on
its worker thread); the HTTP handlers run on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ramjet.policy.profile import EngineProfile
from ramjet.reports import transport as tp
from ramjet.reports.bodies import (
    Body,
    DeltaBody,
    LoadBody,
    SwaStates,
    TierKeys,
    encode_body,
    profile_body,
    split_snapshot,
)
from ramjet.reports.envelope import Envelope, ReportKind, sign
from ramjet.runtime.tasks import cancel_and_wait
from ramjet.transport.base import fetch, http_url
from ramjet.transport.http1 import EnginePool
from ramjet.types import EngineId

log = logging.getLogger(__name__)

SnapshotSource = Callable[[], tuple[Sequence[TierKeys], Sequence[SwaStates]]]
SNAPSHOT_PART_KEYS = 1 << 18
"""Keys per snapshot part by default: the router's default `reports.max_keys` (a part of
262,144 keys is a 2.8 MB frame, under the default `reports.max_report_bytes`)."""
LoadSource = Callable[[], LoadBody]
PUSH_TIMEOUT_S = 10.0
"""One push (connect, the POST and its whole answer) within this long, else it failed."""
_PUSH_HEADERS = (("Content-Type", tp.FRAME_TYPE),)


def push_path(url: str) -> str:
    """The path and query a push to `url` is POSTed to; ValueError when `url` is not
    http(s)://host[:port]/path (`ramjet.transport.base.http_url`)."""
    return http_url(url).raw_path_qs


class ReportPublisher:
    def __init__(
        self,
        engine_id: EngineId,
        private_key: Ed25519PrivateKey,
        key_id: str,
        *,
        epoch: int | None = None,
        snapshot: SnapshotSource | None = None,
        load: LoadSource | None = None,
        load_interval_s: float = 1.0,
        ring_size: int = 4096,
        ring_bytes: int = 64 << 20,
        push_url: str | None = None,
        push_snapshot_interval_s: float = 30.0,
        push_queue: int = 1024,
        wall_clock: Callable[[], float] = time.time,
        pull_token: str | None = None,
        snapshot_min_interval_s: float = 0.5,
        snapshot_part_keys: int = SNAPSHOT_PART_KEYS,
    ) -> None:
        """`pull_token`: when set, `GET /ramjet/reports` and `GET /ramjet/snapshot` need
        `Authorization: Bearer <it>` (routers send `reports.pull_token_file`), else 401.
        `snapshot_min_interval_s`: snapshots served over HTTP are signed at most once per
        this long; a request meanwhile gets the last one if nothing changed since, else
        waits for the interval to pass (the signing holds the publisher's lock).
        `snapshot_part_keys`: a snapshot of more keys is sent in parts of at most this
        many (set it to the routers' `reports.max_keys` or less)."""
        if snapshot_part_keys < 1:
            raise ValueError("snapshot_part_keys must be at least 1")
        if push_url is not None:
            try:
                push_path(push_url)
            except ValueError as exc:
                raise ValueError(f"push_url: {exc}") from None
        self.snapshot_part_keys = snapshot_part_keys
        self.engine_id = engine_id
        self.key_id = key_id
        self._key = private_key
        self._wall = wall_clock
        self.epoch = int(wall_clock() * 1000) if epoch is None else epoch
        self._snapshot = snapshot
        self._load = load
        self._load_interval = load_interval_s
        self._ring: deque[tuple[int, bytes]] = deque()
        self._ring_size, self._ring_bytes_cap, self._ring_bytes = ring_size, ring_bytes, 0
        self._ring_size_base, self._ring_bytes_base = ring_size, ring_bytes
        self._dropped_through = 0
        """Highest seq that left the ring: a cursor below it needs a snapshot."""
        self._seq = 0
        self._issued_ms = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self._push_url = push_url
        self._push_snapshot_interval = push_snapshot_interval_s
        self._push_q: deque[bytes] = deque(maxlen=push_queue)
        self._tasks: list[asyncio.Task[None]] = []
        self.pushed = 0
        self.push_failures = 0
        self._closing = False
        self._profile: EngineProfile | None = None
        """The last published profile: carried by every snapshot, re-sent in a new epoch."""
        self._pull_token = pull_token
        self._snapshot_every = snapshot_min_interval_s
        self._served: tuple[float, int, int, bytes] | None = None
        """The last snapshot served over HTTP: (monotonic time, epoch, seq, frame)."""
        self._snapshot_lock: asyncio.Lock | None = None
        self.snapshots_signed = 0
        self.load_paused = False
        """While True the periodic load reports are not sent (a sidecar whose event path
        is down: routers then see the engine go silent and degrade its trust)."""

    # -- signing ---------------------------------------------------------------------------

    @property
    def seq(self) -> int:
        return self._seq

    def _sign(self, kind: ReportKind, body: Body, seq: int) -> bytes:
        # caller holds the lock
        self._issued_ms = max(int(self._wall() * 1000), self._issued_ms + 1)
        env = Envelope(
            self.engine_id, self.key_id, self.epoch, seq, self._issued_ms, kind, encode_body(body)
        )
        return sign(env, self._key)

    def _keep(self, seq: int, frame: bytes) -> None:
        # caller holds the lock
        self._ring.append((seq, frame))
        self._ring_bytes += len(frame)
        while len(self._ring) > self._ring_size or self._ring_bytes > self._ring_bytes_cap:
            old_seq, old = self._ring.popleft()
            self._ring_bytes -= len(old)
            self._dropped_through = old_seq

    def _publish(self, kind: ReportKind, body: Body) -> int:
        with self._lock:
            self._seq += 1
            frame = self._sign(kind, body, self._seq)
            self._keep(self._seq, frame)
            seq = self._seq
            if self._push_url is not None:
                self._push_q.append(frame)
        self._wake()
        return seq

    def _sign_snapshot(self) -> list[bytes]:
        """The engine's state now as signed snapshot frames, part 0 first (caller holds
        the lock): one frame, or parts whose later ones take the next seqs and go into
        the ring (not the push queue: the caller queues every part)."""
        assert self._snapshot is not None
        residency, swa = self._snapshot()
        bodies = split_snapshot(
            self._seq, list(residency), list(swa), self._profile, self.snapshot_part_keys
        )
        frames = [self._sign("snapshot", bodies[0], bodies[0].seq)]
        later = [(b.seq, self._sign("snapshot", b, b.seq)) for b in bodies[1:]]
        if later:
            # the ring holds the newest snapshot's later parts beside its own caps (a
            # puller that fetched part 0 reads them from it): one snapshot's worth more
            self._ring_size = self._ring_size_base + len(later)
            self._ring_bytes_cap = self._ring_bytes_base + sum(len(f) for _, f in later)
        for seq, frame in later:
            self._seq = seq
            self._keep(seq, frame)
            frames.append(frame)
        return frames

    def publish_delta(self, body: DeltaBody) -> int:
        """Sign and keep a delta; returns its seq."""
        return self._publish("delta", body)

    def publish_load(self, body: LoadBody) -> int:
        return self._publish("load", body)

    def publish_profile(self, profile: EngineProfile) -> int:
        self._profile = profile
        return self._publish("profile", profile_body(profile))

    def new_epoch(self, epoch: int | None = None) -> int:
        """Start a new epoch (a sidecar whose engine restarted or whose history was lost):
        seq restarts at 1, the ring empties, and routers, seeing a higher epoch, purge
        the engine's residency and fetch a snapshot. Returns the new epoch."""
        with self._lock:
            wanted = int(self._wall() * 1000) if epoch is None else epoch
            self.epoch = max(wanted, self.epoch + 1)
            self._seq = 0
            self._ring.clear()
            self._ring_bytes = 0
            self._dropped_through = 0
            self._push_q.clear()
            if self._push_url is not None and self._snapshot is not None:
                self._push_q.extend(self._sign_snapshot())
            epoch_now = self.epoch
        self._wake()
        if self._profile is not None:  # the new epoch's report 1: a measured profile again
            self.publish_profile(self._profile)
        return epoch_now

    def snapshot_frames(self) -> list[bytes]:
        """A signed snapshot of the engine's state now, at the current seq: one frame, or
        its parts (the later ones also kept in the ring; see the module docstring)."""
        if self._snapshot is None:
            raise RuntimeError("this publisher has no snapshot source")
        with self._lock:
            frames = self._sign_snapshot()
        if len(frames) > 1:
            self._wake()  # long-polls wait for the parts in the ring
        return frames

    def snapshot_frame(self) -> bytes:
        """`snapshot_frames`' first frame: the whole snapshot, or its part 0."""
        return self.snapshot_frames()[0]

    def frames_after(self, after: int, limit: int = 512, max_bytes: int = 16 << 20) -> list[bytes]:
        with self._lock:
            if not self._ring:
                return []
            first = self._ring[0][0]
            start = max(0, after + 1 - first)
            out: list[bytes] = []
            size = 0
            for i in range(start, min(len(self._ring), start + limit)):
                frame = self._ring[i][1]
                if out and size + len(frame) > max_bytes:
                    break
                out.append(frame)
                size += len(frame)
            return out

    # -- waking long-polls --------------------------------------------------------------------

    def _wake(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._fire()
        else:
            with contextlib.suppress(RuntimeError):  # loop closing
                loop.call_soon_threadsafe(self._fire)

    def _fire(self) -> None:
        ev, self._event = self._event, asyncio.Event()
        if ev is not None:
            ev.set()

    def _bind_loop(self) -> asyncio.Event:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if self._event is None:
            self._event = asyncio.Event()
        return self._event

    # -- HTTP ---------------------------------------------------------------------------------

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(tp.REPORTS_PATH, self._handle_reports)
        app.router.add_get(tp.SNAPSHOT_PATH, self._handle_snapshot)

    def authorized(self, request: web.Request) -> bool:
        """Whether a pull request carries the pull token (always, when none is set)."""
        if self._pull_token is None:
            return True
        given = request.headers.get("Authorization", "").encode()
        return hmac.compare_digest(given, f"Bearer {self._pull_token}".encode())

    async def _handle_reports(self, request: web.Request) -> web.Response:
        if not self.authorized(request):
            return web.json_response({"error": "bad or missing pull token"}, status=401)
        q = request.query
        try:
            epoch = int(q["epoch"]) if "epoch" in q else None
            after = int(q.get("after", "0"))
            wait = min(max(float(q.get("wait", "0")), 0.0), tp.MAX_WAIT_S)
            limit = min(max(int(q.get("max", "512")), 1), 10_000)
        except ValueError:
            return web.json_response(
                {"error": "epoch, after, max: integers; wait: seconds"}, status=400
            )
        deadline = time.monotonic() + wait
        while True:
            event = self._bind_loop()
            with self._lock:
                head, dropped = self._seq, self._dropped_through
            if epoch != self.epoch or after < dropped or after > head or after < 0:
                return self._batch([], head, snapshot_needed=True)
            frames = self.frames_after(after, limit)
            remaining = deadline - time.monotonic()
            # stopping: answer long-polls now (a process exits promptly on SIGTERM, not
            # after the longest wait a router asked for)
            if frames or remaining <= 0 or self._closing:
                return self._batch(frames, head, snapshot_needed=False)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await event.wait()

    def _batch(self, frames: list[bytes], head: int, snapshot_needed: bool) -> web.Response:
        headers = {
            tp.H_EPOCH: str(self.epoch),
            tp.H_HEAD: str(head),
            tp.H_SNAPSHOT: "1" if snapshot_needed else "0",
        }
        return web.Response(
            body=tp.pack_frames(frames), content_type=tp.BATCH_TYPE, headers=headers
        )

    async def _handle_snapshot(self, request: web.Request) -> web.Response:
        if not self.authorized(request):
            return web.json_response({"error": "bad or missing pull token"}, status=401)
        if self._snapshot is None:
            return web.json_response({"error": "no snapshot source"}, status=404)
        return web.Response(body=await self.served_snapshot(), content_type=tp.FRAME_TYPE)

    async def served_snapshot(self) -> bytes:
        """A snapshot for an HTTP request, signed at most once per `snapshot_min_interval_s`
        (one at a time; the last one again while the epoch and seq have not moved)."""
        if self._snapshot_lock is None:
            self._snapshot_lock = asyncio.Lock()
        async with self._snapshot_lock:
            last = self._served
            if last is not None:
                at, epoch, seq, frame = last
                if (epoch, seq) == (self.epoch, self._seq):
                    return frame
                wait = at + self._snapshot_every - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
            with self._lock:
                epoch, seq = self.epoch, self._seq
            frames = self.snapshot_frames()
            self.snapshots_signed += 1
            # a snapshot in parts is never served again: its part 0 is older than its parts
            self._served = (time.monotonic(), epoch, seq, frames[0]) if len(frames) == 1 else None
            return frames[0]

    # -- background: load reports, push --------------------------------------------------------

    async def start(self) -> None:
        self._closing = False
        self._bind_loop()
        if self._load is not None:
            self._tasks.append(asyncio.create_task(self._load_loop()))
        if self._push_url is not None:
            self._tasks.append(asyncio.create_task(self._push_loop(self._push_url)))

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        await cancel_and_wait(tasks)
        # then answer parked long-polls (after the cancel: the wake ends the push loop's
        # idle wait, which would otherwise race the cancellation)
        self._closing = True
        self._wake()

    async def _load_loop(self) -> None:
        assert self._load is not None
        while True:
            try:
                if not self.load_paused:
                    self.publish_load(self._load())
            except Exception:  # a broken load figure must not stop the reports
                log.exception("load report failed")
            await asyncio.sleep(self._load_interval)

    async def _push_loop(self, url: str) -> None:
        """POST every new report, in order; a periodic snapshot heals what a router
        missed (pushes lost while it was down, a full push queue). The POSTs go through
        the router's engine-facing client (`ramjet.transport`), one connection kept to
        `url` while the loop runs, each within `PUSH_TIMEOUT_S`."""
        backoff = 0.2
        next_snapshot = time.monotonic()
        path_qs = push_path(url)
        pool = EnginePool(url, limit=1, connect_s=PUSH_TIMEOUT_S)
        try:
            while True:
                if self._snapshot is not None and time.monotonic() >= next_snapshot:
                    self._push_q.extend(self.snapshot_frames())
                    next_snapshot = time.monotonic() + self._push_snapshot_interval
                if not self._push_q:
                    event = self._bind_loop()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(0.5):
                            await event.wait()
                    continue
                frame = self._push_q[0]
                try:
                    status, _ = await fetch(
                        pool,
                        "POST",
                        path_qs,
                        timeout_s=PUSH_TIMEOUT_S,
                        headers=_PUSH_HEADERS,
                        body=frame,
                    )
                    # 429: over the router's per-source push limit; keep the frame
                    failed = status >= 500 or status == 429
                except (OSError, TimeoutError):  # the transport's errors are OSErrors
                    failed = True
                if failed:
                    self.push_failures += 1
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                backoff = 0.2
                if self._push_q and self._push_q[0] is frame:
                    self._push_q.popleft()
                self.pushed += 1
        finally:
            await pool.close()
