"""Per-engine report state, and applying accepted reports to the residency tables.

`ReportProcessor.submit(frame, expected_engine)` is the one door every report goes
through, pulled or pushed: verify (`verify.py`), then commit. A rejected frame changes
nothing (but the rate bucket) and is counted by reason.

Commit, per engine:
- a report of another epoch than the engine's current one (higher, or lower but issued
  later: `verify.epoch_change`) purges all the engine's residency first (it restarted and
  lost its volatile state), resets its cursor and counts an epoch change;
- a delta/load/profile with seq > last + 1 is a gap: the report is still applied (it is
  authentic and newer), the engine's view turns DEGRADED and a snapshot is requested
  (`snapshot_needed`); the puller fetches one, a pushing engine sends one periodically;
- a snapshot replaces the engine's exact residency and clears the gap;
- TTLs in a report count from its issue time: the time it spent in transit is deducted.

Large frames without stalling the loop: `await submit_async(frame)` (what the ingest
uses) verifies and parses a frame of `ramjet.reports.verify.OFFLOAD_BYTES` or more in a
worker thread (`ReportVerifier.check_async`), and applies a snapshot of more than
`snapshot_chunk_keys` keys in pieces, yielding to the event loop between pieces, into a
staged copy of the engine's tables (sized once for the snapshot) that replaces the live
one in one step (`ResidencyTables.stage_snapshot`), so routing keeps reading the
old, whole view meanwhile. The snapshot's cursor is taken at acceptance, so a report of
the same engine accepted during the apply is newer than the snapshot: it is applied to
the live tables at once and replayed onto the staged copy before the swap (deltas set a
key's state, so replaying is exact). A new epoch or a newer snapshot abandons the apply.
While it runs, the engine's trust is DEGRADED. The sync `submit` applies in one step.

Trust grade (`trust(engine)`): APPROXIMATE until the engine's first accepted report;
then DEGRADED while a snapshot is pending or no report came for `stale_after_s`, else
EXACT. After `stale_ttl_s` without a report the engine's residency stops steering
(`ViewMode.SILENT`) until a report arrives (RELIABILITY row 9). `tick()` applies the
staleness rules and sweeps expired residency; the ingest loop calls it every second.
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import cast

from prometheus_client import CollectorRegistry

from ramjet.policy.profile import EngineProfile
from ramjet.reports.bodies import DeltaBody, LoadBody, PackedKeys, ProfileBody, SnapshotBody
from ramjet.reports.config import ReportsConfig
from ramjet.reports.keys import KeyRing
from ramjet.reports.metrics import EngineFigures, ReportMetrics
from ramjet.reports.verify import Accepted, Cursor, Reason, Rejected, ReportVerifier
from ramjet.residency.tables import ResidencyTables, SnapshotStaging, ViewMode
from ramjet.types import EngineId, PrefixKey, Tier, TrustGrade

log = logging.getLogger(__name__)

_Piece = tuple[Sequence[PrefixKey], Tier | None, float | None]
Steps = Iterator[int]
"""An apply cut in steps: each step applies some keys and yields how many."""

DEFAULT_SNAPSHOT_CHUNK_KEYS = 1024
"""Keys applied per event-loop turn by `submit_async`: 1-2 ms into the compact index
(`ramjet.residency.index`), so a turn stays well under the 10 ms it may take even where
a piece grows many shards at once (their first touch of memory is page faults)."""


@dataclass(slots=True)
class EngineReportState:
    cursor: Cursor | None = None
    last_report_at: float | None = None
    """Monotonic time of the last accepted report."""
    snapshot_needed: bool = True
    """True before the first report and after a gap, until a snapshot is applied."""
    gap: bool = False
    load: LoadBody | None = None
    load_at: float | None = None
    profile: EngineProfile | None = None
    applying: SnapshotApply | None = None
    """A large snapshot being applied in pieces (`submit_async`)."""
    signers: set[str] = field(default_factory=set)
    """Key ids that signed the reports the engine's current view is built from (since its
    last purge): revoking one of them purges the view (`replace_keyring`)."""
    held_hbm: int = 0
    """Global blocks in HBM by the engine's last snapshot; with `held_other` (host and
    SSD) and the load's `kv_utilization`, its reported capacity (`_report_capacity`)."""
    held_other: int = 0
    capacity: int = 0
    """The largest capacity the engine's reports have shown (blocks, all tiers)."""
    parts: PartsApply | None = None
    """A snapshot sent in parts, part 0 accepted, the last one not yet."""
    gen: int = 0
    """Bumped by every snapshot (or part 0) and purge: a queued apply of an older
    generation stops (the snapshot already includes what it was setting)."""
    lane: asyncio.Lock | None = None
    """Orders the engine's applies cut in steps (`submit_async`): a report waits for the
    engine's reports accepted before it."""
    queued: int = 0
    """Applies waiting for or holding `lane`: while any, a new report queues behind them."""


@dataclass(slots=True)
class SnapshotApply:
    """A snapshot accepted, its cursor taken, its residency not yet swapped in."""

    body: SnapshotBody
    now: float
    transit_s: float
    replay: list[tuple[DeltaBody, float, float]] = field(default_factory=list)
    """Deltas accepted meanwhile: (body, now, transit_s), replayed onto the staged copy."""
    abandoned: bool = False


@dataclass(slots=True)
class QueuedApply:
    """A report's apply cut in steps, waiting for (or holding) the engine's lane."""

    steps: Steps
    gen: int


Job = SnapshotApply | QueuedApply | None


STEP_BUDGET_S = 0.002
"""CPU seconds a step of an apply cut in steps aims at (`_Pacer`); `run_job` also yields
to the loop once a turn has taken half of this."""
MIN_PIECE_KEYS = 64


def _packed(keys: Sequence[PrefixKey]) -> Sequence[PrefixKey] | None:
    """The `array('Q')` behind a parsed long key list (`PackedKeys`), else None. Read,
    never written: the body stays immutable."""
    if type(keys) is not PackedKeys:
        return None
    packed: array[int] = keys._a
    return cast(Sequence[PrefixKey], packed)


class _Pacer:
    """Piece sizes for an apply in steps: `snapshot_chunk_keys` at most, halved after a
    piece that took over `STEP_BUDGET_S` of CPU (down to `MIN_PIECE_KEYS`), doubled back
    after one under a third of it. A piece's cost is not its size alone: one that
    grows many index shards at once pays their rehash and the first touch of their
    memory (a new index's first pieces, a cluster of shards crossing their load)."""

    __slots__ = ("_t0", "most", "pace", "size")

    def __init__(self, most: int, pace: bool = True) -> None:
        self.most = max(1, most)
        self.size = self.most
        self.pace = pace
        self._t0 = 0.0

    def slices(self, keys: Sequence[PrefixKey]) -> Iterator[Sequence[PrefixKey]]:
        """`keys` in pieces of the current size. A long parsed list (`PackedKeys`) is cut
        from the `array('Q')` behind it: a piece is an array slice (one copy in C), and
        the index's per-run key list takes it with another (`BlockIndex.put_many`'s
        `extend`), where a tuple slice made an int object per key and the extend
        converted each back (put_many 1.38M -> 1.61M keys/CPU-s, 2M keys, compiled)."""
        n = len(keys)
        if n <= self.size:
            if n:
                yield keys
            return
        packed = _packed(keys)
        src: Sequence[PrefixKey] = keys if packed is None else packed
        i = 0
        while i < n:
            size = self.size
            yield src[i : i + size]
            i += size

    def start(self) -> None:
        if self.pace:
            self._t0 = time.thread_time()

    def stop(self) -> None:
        if not self.pace:
            return
        took = time.thread_time() - self._t0
        if took > STEP_BUDGET_S:
            self.size = max(MIN_PIECE_KEYS, self.size // 2)
        elif took < STEP_BUDGET_S / 3 and self.size < self.most:
            self.size = min(self.most, self.size * 2)


@dataclass(slots=True)
class PartsApply:
    """A snapshot sent in parts (`SnapshotBody.parts` > 1): each part is applied to the
    live tables (additive) and to its `staging` (`ResidencyTables.stage_snapshot`); when
    the last part is applied, every part having arrived in order, the staging's commit
    makes the parts the engine's whole content (in process: the live global index was
    marked at part 0 and the blocks no part named are dropped in steps; SWA is staged
    and swapped in)."""

    epoch: int
    parts: int
    next_part: int
    next_seq: int
    staging: SnapshotStaging
    now: float
    """Clock time of part 0 (the staged copy's expiries count from it)."""
    held_hbm: int = 0
    held_other: int = 0


async def _yield_to_loop() -> None:
    await asyncio.sleep(0)


class ReportProcessor:
    def __init__(
        self,
        keyring: KeyRing,
        tables: ResidencyTables,
        config: ReportsConfig | None = None,
        registry: CollectorRegistry | None = None,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] | None = None,
        snapshot_chunk_keys: int = DEFAULT_SNAPSHOT_CHUNK_KEYS,
    ) -> None:
        """`snapshot_chunk_keys`: keys per piece of a snapshot applied by `submit_async`
        (0: in one step, as `submit` does)."""
        self.config = config or ReportsConfig()
        self.snapshot_chunk_keys = snapshot_chunk_keys
        self.piece_pause: Callable[[], Awaitable[None]] = _yield_to_loop
        """Awaited between snapshot pieces; tests replace it to hold an apply mid-way."""
        self.keyring = keyring
        self.tables = tables
        self._clock = clock or tables.clock
        self._wall = wall_clock
        self._states: dict[EngineId, EngineReportState] = {}
        self.verifier = ReportVerifier(
            keyring, self.config, self._cursor_of, wall_clock, self._clock, self._last_report_of
        )
        self.metrics = ReportMetrics(registry or CollectorRegistry())
        self.metrics.watch(self._figures)
        self._known = set(keyring.engines()) | {EngineId(e) for e in self.config.engines}
        self.metrics.init_engines(self._known)
        self.on_purged: list[Callable[[list[EngineId]], None]] = []
        """Called with the engines `replace_keyring` purged (the shared cursors drop them)."""

    # -- the door -----------------------------------------------------------------------

    def submit(self, frame: bytes, expected_engine: EngineId | None = None) -> Accepted | Rejected:
        outcome = self.verifier.check(frame, expected_engine)
        if isinstance(outcome, Rejected):
            self.count_rejected(outcome.reason, outcome.engine)
            return outcome
        self._commit(outcome)
        return outcome

    async def submit_async(
        self, frame: bytes, expected_engine: EngineId | None = None
    ) -> Accepted | Rejected:
        """`submit`, but a snapshot over `snapshot_chunk_keys` keys is applied in pieces
        that yield to the event loop (see the module docstring), and a large frame is
        verified and parsed off the loop (`ReportVerifier.check_async`). Returns once
        applied."""
        outcome = await self.verifier.check_async(frame, expected_engine)
        if isinstance(outcome, Rejected):
            self.count_rejected(outcome.reason, outcome.engine)
            return outcome
        job = self._commit(outcome, defer=self.snapshot_chunk_keys > 0)
        await self.run_job(outcome.envelope.engine_id, job)
        return outcome

    def in_parts(self, engine: EngineId) -> bool:
        """Whether a snapshot of the engine sent in parts is incomplete here."""
        st = self._states.get(engine)
        return st is not None and st.parts is not None

    def pass_over(self, accepted: Accepted) -> None:
        """Move the engine's cursor past an accepted report without applying it (a part
        of a snapshot another replica applies: `SharedReports.submit`)."""
        env = accepted.envelope
        st = self.state(env.engine_id)
        if st.cursor is None or st.cursor.epoch != env.epoch:
            return  # nothing to move past: the next report starts the epoch here
        st.cursor = Cursor(env.epoch, env.seq, max(env.issued_at_ms, st.cursor.issued_at_ms))
        st.last_report_at = self._clock()
        self.metrics.accepted.labels(env.engine_id, env.kind).inc()

    def count_rejected(self, reason: Reason, engine: EngineId | None = None) -> None:
        """Count a rejection decided before `submit` (a push body over the cap)."""
        label = engine if engine in self._known else "unknown"
        self.metrics.rejected.labels(label, reason.value).inc()

    def replace_keyring(self, ring: KeyRing) -> dict[str, list[str]]:
        """Use `ring` from now on (a policy or key-file reload). Every engine whose current
        view a revoked key (`KeyRing.revoked_by`) signed any part of is purged and its
        report state forgotten: its next report, or the snapshot the puller fetches,
        starts it over, whatever its epoch. Returns the revoked key ids and purged engines."""
        revoked = self.keyring.revoked_by(ring)
        self.keyring = ring
        self.verifier.keyring = ring
        purged: list[EngineId] = []
        for engine, st in self._states.items():
            if st.signers & revoked:
                self._abandon(st)
                self.tables.purge_engine(engine)
                self._states[engine] = EngineReportState()
                self.metrics.revoked_purges.labels(engine).inc()
                purged.append(engine)
        self._known |= set(ring.engines())
        self.metrics.init_engines(self._known)
        for hook in self.on_purged:
            hook(purged)
        return {"revoked": sorted(revoked), "purged": sorted(purged)}

    def request_snapshot(self, engine: EngineId) -> None:
        """The view has a hole (a pulled report was refused): DEGRADED until a snapshot."""
        self.state(engine).snapshot_needed = True

    # -- reading --------------------------------------------------------------------------

    def state(self, engine: EngineId) -> EngineReportState:
        st = self._states.get(engine)
        if st is None:
            st = self._states[engine] = EngineReportState()
        return st

    def cursor(self, engine: EngineId) -> Cursor | None:
        return self._cursor_of(engine)

    def snapshot_needed(self, engine: EngineId) -> bool:
        return self.state(engine).snapshot_needed

    def trust(self, engine: EngineId, now: float | None = None) -> TrustGrade:
        st = self._states.get(engine)
        if st is None or st.last_report_at is None:
            return TrustGrade.APPROXIMATE
        t = self._clock() if now is None else now
        stale = t - st.last_report_at > self.config.stale_after_s
        busy = st.applying is not None or st.parts is not None
        if st.gap or st.snapshot_needed or busy or stale:
            return TrustGrade.DEGRADED
        return TrustGrade.EXACT

    def load(self, engine: EngineId) -> LoadBody | None:
        """The engine's last reported load; None once it is older than stale_after_s."""
        st = self._states.get(engine)
        if st is None or st.load is None or st.load_at is None:
            return None
        if self._clock() - st.load_at > self.config.stale_after_s:
            return None
        return st.load

    def load_received_at(self, engine: EngineId) -> float | None:
        """When (this processor's clock, the router's) the engine's last load report was
        received; None before one."""
        st = self._states.get(engine)
        return None if st is None else st.load_at

    def profile(self, engine: EngineId) -> EngineProfile | None:
        st = self._states.get(engine)
        return None if st is None else st.profile

    def engines(self) -> frozenset[EngineId]:
        return frozenset(self._known | set(self._states))

    def tick(self, now: float | None = None) -> bool:
        """Apply staleness (view modes) and sweep expired residency, one bounded step
        (`ResidencyTables.expire_step`); True while more is left to sweep."""
        t = self._clock() if now is None else now
        for engine, st in self._states.items():
            if st.last_report_at is None:
                continue
            silent = t - st.last_report_at > self.config.stale_ttl_s
            self.tables.set_mode(engine, ViewMode.SILENT if silent else ViewMode.REPORTED)
        return self.tables.expire_step(t)

    # -- commit -----------------------------------------------------------------------------

    def _last_report_of(self, engine: EngineId) -> float | None:
        st = self._states.get(engine)
        return None if st is None else st.last_report_at

    def _cursor_of(self, engine: EngineId) -> Cursor | None:
        st = self._states.get(engine)
        return None if st is None else st.cursor

    def _commit(self, accepted: Accepted, defer: bool = False) -> Job:
        """Apply an accepted report. With `defer`, a report over `snapshot_chunk_keys`
        keys (or any report that modifies residency while one of the engine's is still
        being applied) is not applied here: its bookkeeping is, and the returned job is
        for `run_job`."""
        env, body = accepted.envelope, accepted.body
        engine = env.engine_id
        self._known.add(engine)
        st = self.state(engine)
        now = self._clock()
        job: Job = None
        if st.cursor is None or env.epoch != st.cursor.epoch:
            if st.cursor is not None:
                self.metrics.epoch_changes.labels(engine).inc()
            self._abandon(st)
            st.parts = None  # the purge supersedes an incomplete snapshot in parts
            self.tables.purge_engine(engine)
            st.signers.clear()
            # the epoch starts empty: report 1 onwards is complete without a snapshot
            st.cursor = Cursor(env.epoch, 0, 0)
            st.snapshot_needed = False
            st.gap = False
        in_parts = isinstance(body, SnapshotBody) and (body.parts > 1 or body.part > 0)
        if env.seq > st.cursor.seq + 1 and (
            env.kind != "snapshot" or (in_parts and isinstance(body, SnapshotBody) and body.part)
        ):
            self.metrics.gaps.labels(engine).inc()
            st.gap = True
        if st.parts is not None and not in_parts:
            # a report between the parts of a snapshot: they cannot be consecutive
            self._abandon_parts(
                engine, st, "restarted" if env.kind == "snapshot" else "interrupted"
            )
        # seconds the report spent between signing and now: deducted from its TTLs
        transit_s = max(0.0, self._wall() - env.issued_at_ms / 1000.0)
        if isinstance(body, SnapshotBody) and in_parts:
            job = self._commit_part(engine, st, env.epoch, env.seq, body, now, transit_s, defer)
        elif isinstance(body, SnapshotBody):
            st.gen += 1
            self._abandon(st)
            st.held_hbm = sum(len(g.keys) for g in body.residency if g.tier_enum is Tier.HBM)
            st.held_other = sum(len(g.keys) for g in body.residency) - st.held_hbm
            self._report_capacity(engine, st)
            if defer and body.key_count() > self.snapshot_chunk_keys:
                job = st.applying = SnapshotApply(body, now, transit_s)
            else:
                self._apply_snapshot(engine, body, now, transit_s)
            st.snapshot_needed = False
            st.gap = False
            if body.profile is not None:
                st.profile = body.profile
        elif isinstance(body, DeltaBody):
            job = self._steps_or_now(
                st, body.key_count(), self._delta_steps(engine, body, now, transit_s), defer
            )
            if st.applying is not None:
                st.applying.replay.append((body, now, transit_s))
        elif isinstance(body, LoadBody):
            st.load, st.load_at = body, now
            self._report_capacity(engine, st)
        elif isinstance(body, ProfileBody):
            st.profile = body
        if st.gap:
            st.snapshot_needed = True
        st.cursor = Cursor(env.epoch, env.seq, max(env.issued_at_ms, st.cursor.issued_at_ms))
        st.signers.add(env.key_id)
        st.last_report_at = now
        self.tables.set_mode(engine, ViewMode.REPORTED)
        self.metrics.accepted.labels(engine, env.kind).inc()
        return job

    def _report_capacity(self, engine: EngineId, st: EngineReportState) -> None:
        """What the reports say of the engine's capacity in global blocks: its last
        snapshot's blocks per tier, HBM scaled up by the HBM share in use its last load
        reports (`kv_utilization`). The bodies carry no capacity field: this reads what
        is there. The largest figure seen sizes its share of the residency cap."""
        hbm = st.held_hbm
        util = st.load.kv_utilization if st.load is not None else 0.0
        if util >= 0.01:
            hbm = max(hbm, int(hbm / util))
        cap = hbm + st.held_other
        if cap > st.capacity:
            st.capacity = cap
            self.tables.set_capacity(engine, cap)

    @staticmethod
    def _abandon(st: EngineReportState) -> None:
        st.gen += 1  # queued applies of the engine stop: what replaces them includes them
        if st.applying is not None:
            st.applying.abandoned = True
            st.applying = None

    def _abandon_parts(self, engine: EngineId, st: EngineReportState, reason: str) -> None:
        """Give up an incomplete snapshot in parts: what its parts added stays (the engine
        vouched for it), nothing else is removed; counted and logged. Unless a new
        snapshot replaces it (`restarted`), the engine needs a snapshot again."""
        mp = st.parts
        if mp is None:
            return
        st.parts = None
        if reason != "restarted":
            st.snapshot_needed = True
        self.metrics.snapshots_abandoned.labels(engine, reason).inc()
        log.warning(
            "snapshot of %s in %d parts abandoned after part %d (%s): its parts' keys stay, "
            "nothing else is removed",
            engine, mp.parts, mp.next_part - 1, reason,
        )  # fmt: skip

    def _steps_or_now(self, st: EngineReportState, keys: int, steps: Steps, defer: bool) -> Job:
        """Apply `steps` now, or (`defer`, and large or behind another queued apply of
        the engine) return them as a job for `run_job`."""
        if defer and (st.queued > 0 or keys > self.snapshot_chunk_keys):
            st.queued += 1
            return QueuedApply(steps, st.gen)
        deque(steps, maxlen=0)  # every step, now
        return None

    async def run_job(self, engine: EngineId, job: Job) -> None:
        """Finish what `_commit(defer=True)` left: a staged snapshot, or steps run in the
        engine's order (its lane), yielding to the event loop every `snapshot_chunk_keys`
        keys. Steps of an older generation (a snapshot or purge came since) stop."""
        if job is None:
            return
        if isinstance(job, SnapshotApply):
            await self._apply_in_pieces(engine, job)
            return
        st = self.state(engine)
        if st.lane is None:
            st.lane = asyncio.Lock()
        chunk = max(1, self.snapshot_chunk_keys)
        try:
            async with st.lane:
                done = 0
                turn = time.thread_time()
                while job.gen == st.gen and self._states.get(engine) is st:
                    n = next(job.steps, None)
                    if n is None:
                        break
                    done += n
                    # a turn runs on past one step only while it is short: a slow step
                    # (a cluster of rehashes) then never lands on top of another
                    if done >= chunk or time.thread_time() - turn >= STEP_BUDGET_S / 2:
                        done = 0
                        await self.piece_pause()
                        turn = time.thread_time()
        except BaseException:
            # cancelled mid-apply: the view misses the rest of the report
            st.snapshot_needed = True
            raise
        finally:
            st.queued -= 1

    def _apply_delta(self, engine: EngineId, d: DeltaBody, now: float, transit_s: float) -> None:
        deque(self._delta_steps(engine, d, now, transit_s), maxlen=0)  # every step, now

    def _delta_steps(self, engine: EngineId, d: DeltaBody, now: float, transit_s: float) -> Steps:
        """A delta applied in steps of at most `snapshot_chunk_keys` keys, in its order."""
        t = self.tables
        chunked = self.snapshot_chunk_keys > 0
        pacer = _Pacer(self.snapshot_chunk_keys if chunked else 1 << 30, chunked)
        for group in (*d.stored, *d.moved):
            ttl = None if group.ttl_ms is None else group.ttl_ms / 1000.0 - transit_s
            tier = group.tier_enum
            for keys in pacer.slices(group.keys):
                pacer.start()
                if ttl is not None and ttl <= 0:
                    t.evict_global(engine, keys)
                else:
                    t.store_global(engine, keys, tier, now, ttl)
                pacer.stop()
                yield len(keys)
        for keys in pacer.slices(d.evicted):
            pacer.start()
            t.evict_global(engine, keys)
            pacer.stop()
            yield len(keys)
        for swa in d.swa_created:
            ttl_s = swa.ttl_ms / 1000.0 - transit_s
            for keys in pacer.slices(swa.keys):
                if ttl_s <= 0:
                    t.expire_swa(engine, keys)
                else:
                    t.store_swa(engine, keys, now, ttl_s)
                yield len(keys)
        for keys in pacer.slices(d.swa_expired):
            t.expire_swa(engine, keys)
            yield len(keys)

    # -- snapshots in parts ---------------------------------------------------------------

    def _commit_part(
        self,
        engine: EngineId,
        st: EngineReportState,
        epoch: int,
        seq: int,
        body: SnapshotBody,
        now: float,
        transit_s: float,
        defer: bool,
    ) -> Job:
        """A part of a snapshot in parts (see `PartsApply`). Part 0 starts it (abandoning
        an incomplete one); the next part in order continues it; any other part abandons
        an incomplete one and is applied additively alone."""
        mp = st.parts
        if body.part == 0:
            self._abandon_parts(engine, st, "restarted")
            st.gen += 1
            self._abandon(st)
            staging = self.tables.stage_snapshot(engine, now, additive=True)
            # sized once, for as many keys in every part as in this one (parts are full
            # but the last): its index then fills without rehashing at every doubling
            staging.reserve_global(body.parts * sum(len(g.keys) for g in body.residency))
            mp = st.parts = PartsApply(epoch, body.parts, 0, seq, staging, now)
            st.snapshot_needed = False
            if body.profile is not None:
                st.profile = body.profile
        elif mp is not None and (
            epoch != mp.epoch
            or seq != mp.next_seq
            or body.part != mp.next_part
            or body.parts != mp.parts
        ):
            self._abandon_parts(engine, st, "gap" if seq > mp.next_seq else "out_of_order")
            mp = None
        if mp is not None:
            mp.next_part += 1
            mp.next_seq += 1
            hbm = sum(len(g.keys) for g in body.residency if g.tier_enum is Tier.HBM)
            mp.held_hbm += hbm
            mp.held_other += sum(len(g.keys) for g in body.residency) - hbm
        last = mp is not None and mp.next_part == mp.parts
        steps = self._part_steps(engine, st, mp, body, now, transit_s, last)
        return self._steps_or_now(st, body.key_count(), steps, defer)

    def _part_steps(
        self,
        engine: EngineId,
        st: EngineReportState,
        mp: PartsApply | None,
        body: SnapshotBody,
        now: float,
        transit_s: float,
        last: bool,
    ) -> Steps:
        """The part's keys into the live tables and (when it continues a snapshot in
        parts) its staging; the last part's commit replaces the engine's content, in
        steps."""
        t = self.tables
        chunked = self.snapshot_chunk_keys > 0
        pacer = _Pacer(self.snapshot_chunk_keys if chunked else 1 << 30, chunked)
        shift = 0.0 if mp is None else now - mp.now
        for keys, tier, ttl in self._pieces(body, transit_s, pacer):
            pacer.start()
            staged = None if ttl is None else ttl + shift
            if tier is None:
                t.store_swa(engine, keys, now, ttl)
                if mp is not None and st.parts is mp:
                    mp.staging.add_swa(keys, staged)
            else:
                t.store_global(engine, keys, tier, now, ttl)
                if mp is not None and st.parts is mp:
                    mp.staging.add_global(keys, tier, staged)
            pacer.stop()
            yield len(keys)
        if last and mp is not None and st.parts is mp:
            # in steps where the store cannot stage (Redis): the entries no part named go
            yield from mp.staging.commit_steps()
            if st.parts is not mp:
                return  # abandoned meanwhile (a purge, a new snapshot)
            st.parts = None
            st.gap = False
            st.snapshot_needed = False
            st.held_hbm, st.held_other = mp.held_hbm, mp.held_other
            self._report_capacity(engine, st)
            yield 0

    @staticmethod
    def _pieces(s: SnapshotBody, transit_s: float, pacer: _Pacer) -> Iterator[_Piece]:
        """(keys, tier, ttl_s) pieces of `pacer`'s sizes, tier None for SWA states;
        groups whose TTL ran out in transit are left out."""
        for g in s.residency:
            ttl = None if g.ttl_ms is None else g.ttl_ms / 1000.0 - transit_s
            if ttl is not None and ttl <= 0:
                continue
            tier = g.tier_enum
            for keys in pacer.slices(g.keys):
                yield keys, tier, ttl
        for w in s.swa:
            ttl_s = w.ttl_ms / 1000.0 - transit_s
            if ttl_s <= 0:
                continue
            for keys in pacer.slices(w.keys):
                yield keys, None, ttl_s

    @staticmethod
    def _add_piece(staging: SnapshotStaging, piece: _Piece) -> None:
        keys, tier, ttl_s = piece
        if tier is None:
            staging.add_swa(keys, ttl_s)
        else:
            staging.add_global(keys, tier, ttl_s)

    def _apply_snapshot(
        self, engine: EngineId, s: SnapshotBody, now: float, transit_s: float
    ) -> None:
        staging = self.tables.stage_snapshot(engine, now)
        staging.reserve_global(sum(len(g.keys) for g in s.residency))
        for piece in self._pieces(s, transit_s, _Pacer(1 << 30, pace=False)):
            self._add_piece(staging, piece)
        staging.commit()

    async def _apply_in_pieces(self, engine: EngineId, job: SnapshotApply) -> None:
        st = self.state(engine)
        staging = self.tables.stage_snapshot(engine, job.now)
        staging.reserve_global(sum(len(g.keys) for g in job.body.residency))
        try:
            pacer = _Pacer(self.snapshot_chunk_keys)
            for piece in self._pieces(job.body, job.transit_s, pacer):
                pacer.start()
                self._add_piece(staging, piece)
                pacer.stop()
                await self.piece_pause()
                if job.abandoned:
                    return
            staging.commit()
            for delta, now, transit_s in job.replay:
                self._apply_delta(engine, delta, now, transit_s)
            st.applying = None
        except BaseException:
            # cancelled mid-apply: the live tables are the old content plus newer deltas
            if st.applying is job:
                st.applying = None
                st.snapshot_needed = True
            raise

    def _figures(self) -> Iterator[EngineFigures]:
        now = self._clock()
        for engine in sorted(self.engines()):
            st = self._states.get(engine)
            cursor = None if st is None else st.cursor
            last = None if st is None else st.last_report_at
            yield EngineFigures(
                engine,
                None if cursor is None else cursor.epoch,
                int(self.trust(engine, now)),
                None if last is None else now - last,
            )
