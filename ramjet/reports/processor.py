"""Per-engine report state, and applying accepted reports to the residency tables.

`ReportProcessor.submit(frame, expected_engine)` is the one door every report goes
through, pulled or pushed: verify (`verify.py`), then commit. A rejected frame changes
nothing (but the rate bucket) and is counted by reason.

Commit, per engine:
- a report with a higher epoch than the engine's current one purges all the engine's
  residency first (it restarted and lost its volatile state), resets its cursor and
  counts an epoch change;
- a delta/load/profile with seq > last + 1 is a gap: the report is still applied (it is
  authentic and newer), the engine's view turns DEGRADED and a snapshot is requested
  (`snapshot_needed`); the puller fetches one, a pushing engine sends one periodically;
- a snapshot replaces the engine's exact residency and clears the gap;
- TTLs in a report count from its issue time: the time it spent in transit is deducted.

Trust grade (`trust(engine)`): APPROXIMATE until the engine's first accepted report;
then DEGRADED while a snapshot is pending or no report came for `stale_after_s`, else
EXACT. After `stale_ttl_s` without a report the engine's residency stops steering
(`ViewMode.SILENT`) until a report arrives (RELIABILITY row 9). `tick()` applies the
staleness rules and sweeps expired residency; the ingest loop calls it every second.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import chain, repeat

from prometheus_client import CollectorRegistry

from ramjet.profile import EngineProfile
from ramjet.reports.bodies import DeltaBody, LoadBody, ProfileBody, SnapshotBody
from ramjet.reports.config import ReportsConfig
from ramjet.reports.keys import KeyRing
from ramjet.reports.metrics import EngineFigures, ReportMetrics
from ramjet.reports.verify import Accepted, Cursor, Reason, Rejected, ReportVerifier
from ramjet.residency.tables import ResidencyTables, ViewMode
from ramjet.types import EngineId, TrustGrade


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


class ReportProcessor:
    def __init__(
        self,
        keyring: KeyRing,
        tables: ResidencyTables,
        config: ReportsConfig | None = None,
        registry: CollectorRegistry | None = None,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.config = config or ReportsConfig()
        self.keyring = keyring
        self.tables = tables
        self._clock = clock or tables.clock
        self._wall = wall_clock
        self._states: dict[EngineId, EngineReportState] = {}
        self.verifier = ReportVerifier(
            keyring, self.config, self._cursor_of, wall_clock, self._clock
        )
        self.metrics = ReportMetrics(registry or CollectorRegistry())
        self.metrics.watch(self._figures)
        self._known = set(keyring.engines()) | {EngineId(e) for e in self.config.engines}
        self.metrics.init_engines(self._known)

    # -- the door -----------------------------------------------------------------------

    def submit(self, frame: bytes, expected_engine: EngineId | None = None) -> Accepted | Rejected:
        outcome = self.verifier.check(frame, expected_engine)
        if isinstance(outcome, Rejected):
            self.count_rejected(outcome.reason, outcome.engine)
            return outcome
        self._commit(outcome)
        return outcome

    def count_rejected(self, reason: Reason, engine: EngineId | None = None) -> None:
        """Count a rejection decided before `submit` (a push body over the cap)."""
        label = engine if engine in self._known else "unknown"
        self.metrics.rejected.labels(label, reason.value).inc()

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
        if st.gap or st.snapshot_needed or t - st.last_report_at > self.config.stale_after_s:
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
        self.tables.expire(t)

    # -- commit -----------------------------------------------------------------------------

    def _cursor_of(self, engine: EngineId) -> Cursor | None:
        st = self._states.get(engine)
        return None if st is None else st.cursor

    def _commit(self, accepted: Accepted) -> None:
        env, body = accepted.envelope, accepted.body
        engine = env.engine_id
        self._known.add(engine)
        st = self.state(engine)
        now = self._clock()
        if st.cursor is None or env.epoch > st.cursor.epoch:
            if st.cursor is not None:
                self.metrics.epoch_changes.labels(engine).inc()
            self.tables.purge_engine(engine)
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
            self._apply_snapshot(engine, body, now, transit_s)
            st.snapshot_needed = False
            st.gap = False
        elif isinstance(body, DeltaBody):
            self._apply_delta(engine, body, now, transit_s)
        elif isinstance(body, LoadBody):
            st.load, st.load_at = body, now
        elif isinstance(body, ProfileBody):
            st.profile = body
        if st.gap:
            st.snapshot_needed = True
        st.cursor = Cursor(env.epoch, env.seq, max(env.issued_at_ms, st.cursor.issued_at_ms))
        st.last_report_at = now
        self.tables.set_mode(engine, ViewMode.REPORTED)
        self.metrics.accepted.labels(engine, env.kind).inc()

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

    def _apply_snapshot(
        self, engine: EngineId, s: SnapshotBody, now: float, transit_s: float
    ) -> None:
        live = [
            (g, None if g.ttl_ms is None else g.ttl_ms / 1000.0 - transit_s) for g in s.residency
        ]
        global_entries = chain.from_iterable(
            zip(g.keys, repeat(g.tier_enum), repeat(ttl), strict=False)
            for g, ttl in live
            if ttl is None or ttl > 0
        )
        swa = [
            (k, g.ttl_ms / 1000.0 - transit_s)
            for g in s.swa
            if g.ttl_ms / 1000.0 > transit_s
            for k in g.keys
        ]
        self.tables.replace_engine(engine, global_entries, swa, now)

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
