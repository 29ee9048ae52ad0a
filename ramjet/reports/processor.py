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
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from ramjet.policy.profile import EngineProfile
from ramjet.reports.bodies import DeltaBody, LoadBody, ProfileBody, SnapshotBody
from ramjet.reports.config import ReportsConfig
from ramjet.reports.keys import KeyRing
from ramjet.reports.metrics import EngineFigures, ReportMetrics
from ramjet.reports.verify import Accepted, Cursor, Reason, Rejected, ReportVerifier
from ramjet.residency.tables import ResidencyTables, SnapshotStaging, ViewMode
from ramjet.types import EngineId, PrefixKey, Tier, TrustGrade

_Piece = tuple[Sequence[PrefixKey], Tier | None, float | None]

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


@dataclass(slots=True)
class SnapshotApply:
    """A snapshot accepted, its cursor taken, its residency not yet swapped in."""

    body: SnapshotBody
    now: float
    transit_s: float
    replay: list[tuple[DeltaBody, float, float]] = field(default_factory=list)
    """Deltas accepted meanwhile: (body, now, transit_s), replayed onto the staged copy."""
    abandoned: bool = False


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
        if job is not None:
            await self._apply_in_pieces(outcome.envelope.engine_id, job)
        return outcome

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
        if st.gap or st.snapshot_needed or st.applying is not None or stale:
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

    def tick(self, now: float | None = None) -> None:
        """Apply staleness (view modes) and sweep expired residency."""
        t = self._clock() if now is None else now
        for engine, st in self._states.items():
            if st.last_report_at is None:
                continue
            silent = t - st.last_report_at > self.config.stale_ttl_s
            self.tables.set_mode(engine, ViewMode.SILENT if silent else ViewMode.REPORTED)
        self.tables.expire_step(t)

    # -- commit -----------------------------------------------------------------------------

    def _last_report_of(self, engine: EngineId) -> float | None:
        st = self._states.get(engine)
        return None if st is None else st.last_report_at

    def _cursor_of(self, engine: EngineId) -> Cursor | None:
        st = self._states.get(engine)
        return None if st is None else st.cursor

    def _commit(self, accepted: Accepted, defer: bool = False) -> SnapshotApply | None:
        """Apply an accepted report. With `defer`, a snapshot over `snapshot_chunk_keys`
        keys is not applied here: its bookkeeping is, and the returned job is for
        `_apply_in_pieces`."""
        env, body = accepted.envelope, accepted.body
        engine = env.engine_id
        self._known.add(engine)
        st = self.state(engine)
        now = self._clock()
        job = None
        if st.cursor is None or env.epoch != st.cursor.epoch:
            if st.cursor is not None:
                self.metrics.epoch_changes.labels(engine).inc()
            self._abandon(st)
            self.tables.purge_engine(engine)
            st.signers.clear()
            # the epoch starts empty: report 1 onwards is complete without a snapshot
            st.cursor = Cursor(env.epoch, 0, 0)
            st.snapshot_needed = False
            st.gap = False
        if env.kind != "snapshot" and env.seq > st.cursor.seq + 1:
            self.metrics.gaps.labels(engine).inc()
            st.gap = True
        # seconds the report spent between signing and now: deducted from its TTLs
        transit_s = max(0.0, self._wall() - env.issued_at_ms / 1000.0)
        if isinstance(body, SnapshotBody):
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
            self._apply_delta(engine, body, now, transit_s)
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
        if st.applying is not None:
            st.applying.abandoned = True
            st.applying = None

    def _apply_delta(self, engine: EngineId, d: DeltaBody, now: float, transit_s: float) -> None:
        t = self.tables
        for group in (*d.stored, *d.moved):
            ttl = None if group.ttl_ms is None else group.ttl_ms / 1000.0 - transit_s
            if ttl is not None and ttl <= 0:
                t.evict_global(engine, group.keys)
            else:
                t.store_global(engine, group.keys, group.tier_enum, now, ttl)
        t.evict_global(engine, d.evicted)
        for swa in d.swa_created:
            ttl_s = swa.ttl_ms / 1000.0 - transit_s
            if ttl_s <= 0:
                t.expire_swa(engine, swa.keys)
            else:
                t.store_swa(engine, swa.keys, now, ttl_s)
        t.expire_swa(engine, d.swa_expired)

    @staticmethod
    def _pieces(s: SnapshotBody, transit_s: float, size: int) -> Iterator[_Piece]:
        """(keys, tier, ttl_s) pieces of at most `size` keys, tier None for SWA states;
        groups whose TTL ran out in transit are left out."""
        step = max(1, size)
        for g in s.residency:
            ttl = None if g.ttl_ms is None else g.ttl_ms / 1000.0 - transit_s
            if ttl is not None and ttl <= 0:
                continue
            tier = g.tier_enum
            for i in range(0, len(g.keys), step):
                yield g.keys[i : i + step], tier, ttl
        for w in s.swa:
            ttl_s = w.ttl_ms / 1000.0 - transit_s
            if ttl_s <= 0:
                continue
            for i in range(0, len(w.keys), step):
                yield w.keys[i : i + step], None, ttl_s

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
        for piece in self._pieces(s, transit_s, 1 << 30):
            self._add_piece(staging, piece)
        staging.commit()

    async def _apply_in_pieces(self, engine: EngineId, job: SnapshotApply) -> None:
        st = self.state(engine)
        staging = self.tables.stage_snapshot(engine, job.now)
        staging.reserve_global(sum(len(g.keys) for g in job.body.residency))
        try:
            for piece in self._pieces(job.body, job.transit_s, self.snapshot_chunk_keys):
                self._add_piece(staging, piece)
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
