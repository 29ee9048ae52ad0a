"""Report verification state shared by router replicas through Redis.

Problem: with several replicas each pulling (or being pushed) the same engine's reports,
each replica's own cursor would let it apply a report another replica already applied,
and accept a report replayed to it that another replica had seen. So the cursor (epoch,
sequence, issue time of the last accepted report) lives in Redis, one hash per engine
(`{P:E}:vc`, same hash tag as the engine's residency keys), and acceptance is claimed
there atomically.

`SharedReports.submit(frame)` is the async door replacing `ReportProcessor.submit` when
the store is Redis:
1. the processor's verifier runs every local check (size, signature, key, rate, clock,
   and the cursor, which the replica keeps at least as new as the shared one);
2. `CLAIM` (Lua, atomic) compares (epoch, seq[, issue time for snapshots]) with the shared
   cursor exactly as the verifier does, and on success stores the new cursor, the gap
   flag, the accept time and, for load and profile reports, the body (for a snapshot
   that carries the engine's profile, that profile: issue 15). Exactly one
   replica wins a given report; every other replica, and any replay, gets `replayed` or
   `epoch_old` and changes nothing (counted like any rejection);
3. the winner commits through the processor inside `store.report(engine, epoch, seq)`,
   so its residency changes reach Redis as one batch that is idempotent by (engine,
   epoch, seq) even if the claim was skipped (fail open, below). A snapshot is the
   exception: it carries the seq of the engine's last report, which Redis already holds,
   so its purge-and-replace goes as unsequenced batches (only the claim's winner sends
   them). A snapshot over the processor's `snapshot_chunk_keys` is applied in pieces
   that yield to the event loop, as `ReportProcessor.submit_async` does: the per-engine
   lock that orders claim-and-commit is released first, so the engine's deltas accepted
   meanwhile apply at once and are replayed onto the staged copy before the swap.
   A snapshot in parts (`SnapshotBody.parts`) is claimed and applied part by part by
   the replica that applied its part 0 (the one that fetched it); a replica that did
   not start it passes its later parts over (`ReportProcessor.pass_over`: its cursor
   moves, the residency comes from Redis), so the parts are never split between
   replicas.

The pulled and pushed frames of the router's report runtime go through `submit` when
the store is Redis (`ramjet.reports.runtime.ReportsRuntime.build`), and the runtime runs
`run()` beside its pull loops.

The replicas that did not apply a report learn it from Redis: residency through the
store's change log, and the engine's report state (cursor, gap, last report time, load,
profile) through `sync_once`, which reads each engine's shared record and moves the
processor's state forward (never backward) and its view to REPORTED. Trust grades,
staleness and load therefore match across replicas.

Fail open: if Redis does not answer within the link's timeout (or the breaker is open)
the claim is skipped: the local verifier's cursor still refuses anything this replica
has seen, the report is applied locally, and the store dedups its residency batch when
Redis returns. The skip is counted (`ramjet_reports_unclaimed_total`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry

from ramjet.metric_catalogue import counter
from ramjet.reports.bodies import (
    BodyError,
    LoadBody,
    ProfileBody,
    SnapshotBody,
    encode_body,
    parse_body,
    profile_body,
)
from ramjet.reports.processor import ReportProcessor
from ramjet.reports.verify import Accepted, Cursor, Reason, Rejected, cursor_newer
from ramjet.residency.redis_link import LuaScript, RedisLink, RedisUnavailable
from ramjet.residency.redis_ops import Sealer
from ramjet.residency.redis_scripts import EngineKeys
from ramjet.residency.store import SharedStore
from ramjet.residency.tables import ViewMode
from ramjet.types import EngineId

log = logging.getLogger(__name__)

CLAIM = LuaScript(
    "ramjet_reports_claim",
    r"""
-- KEYS: vc.  ARGV: epoch, seq, kind, issued_at_ms, now_ms, retention_ms, body, quiet_ms,
-- mac, body mac, max clock skew ms, force (a stored mac the caller found invalid, or '').
-- Returns {status, epoch, seq, issued, gap, mac, mi, at}: the shared cursor before this
-- claim, with what its MAC covers.
local vc = KEYS[1]
local epoch, seq, kind = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local issued, now, retention = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local cur = redis.call('HMGET', vc, 'epoch', 'seq', 'issued', 'gap', 'mac', 'mi', 'at')
local cepoch, cseq, cissued = tonumber(cur[1]), tonumber(cur[2]), tonumber(cur[3])
local gap = tonumber(cur[4]) or 0
local cmac = cur[5] or ''
if cmac == '' then cmac = '-' end
local stored = {cmac, tonumber(cur[6]) or -1, tonumber(cur[7]) or -1}
-- a cursor no replica wrote does not count: an epoch in the future (epochs are wall-clock
-- start times) or one whose MAC the caller found wrong (compare-and-set on that MAC)
if cepoch ~= nil and (cepoch > now + tonumber(ARGV[11]) or (ARGV[12] ~= '' and cmac == ARGV[12])) then
  cepoch, cseq, cissued, gap = nil, nil, nil, 0
end
if cepoch ~= nil then
  -- epochs as ramjet.reports.verify.epoch_change: a lower one issued after the last
  -- accepted report, the engine silent for quiet_ms, is a restart under a clock stepped
  -- back; a higher one issued before it is a replay of an older process
  local quiet = now - (tonumber(redis.call('HGET', vc, 'at')) or 0) > tonumber(ARGV[8])
  if epoch < cepoch and (issued <= cissued or not quiet) then
    return {'epoch_old', cepoch, cseq, cissued, gap, stored[1], stored[2], stored[3]}
  end
  if epoch > cepoch and issued < cissued then
    return {'replayed', cepoch, cseq, cissued, gap, stored[1], stored[2], stored[3]}
  end
  if epoch == cepoch then
    local stale
    if kind == 'snapshot' then stale = seq < cseq or issued <= cissued else stale = seq <= cseq end
    if stale then return {'replayed', cepoch, cseq, cissued, gap, stored[1], stored[2], stored[3]} end
  end
end
local before = {'ok', cepoch or -1, cseq or -1, cissued or 0, gap, stored[1], stored[2], stored[3]}
if cepoch == nil or epoch ~= cepoch then cseq, cissued, gap = 0, 0, 0 end
if kind == 'snapshot' then gap = 0 elseif seq > cseq + 1 then gap = 1 end
if issued < cissued then issued = cissued end
redis.call('HSET', vc, 'epoch', epoch, 'seq', seq, 'issued', issued, 'gap', gap, 'at', now,
  'mi', ARGV[4], 'mac', ARGV[9])
if kind == 'load' then redis.call('HSET', vc, 'load', ARGV[7], 'load_at', now, 'load_mac', ARGV[10]) end
if (kind == 'profile' or kind == 'snapshot') and ARGV[7] ~= '' then
  redis.call('HSET', vc, 'profile', ARGV[7], 'profile_mac', ARGV[10])
end
redis.call('PEXPIRE', vc, retention)
return before
""",
)


class SharedReports:
    """A `ReportProcessor` whose acceptance is shared with the other replicas."""

    def __init__(
        self,
        processor: ReportProcessor,
        store: SharedStore,
        engines: Iterable[EngineId] = (),
        registry: CollectorRegistry | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.processor = processor
        self.store = store
        self.link: RedisLink = store.link
        self.wall = wall
        self.clock = processor.tables.clock
        self._keys: dict[EngineId, EngineKeys] = {}
        self._profiles: dict[EngineId, str] = {}
        self._locks: dict[EngineId, asyncio.Lock] = {}
        self._stopping = False
        reg = registry if registry is not None else CollectorRegistry()
        self.unclaimed = counter(reg, "ramjet_reports_unclaimed_total")
        self.absorbed = counter(reg, "ramjet_reports_shared_absorbed_total")
        self.refused = counter(reg, "ramjet_reports_shared_rejected_total")
        for reason in ("mac", "epoch"):  # exported from the start (alerts)
            self.refused.labels(reason)
        self.sealer = Sealer(store.settings.secret())
        self.skew_ms = int(store.settings.max_clock_skew_s * 1000)
        for engine in (*engines, *processor.engines()):
            self._track(engine)
        processor.on_purged.append(self._forget_soon)
        self._forgetting: set[asyncio.Task[None]] = set()

    def _forget_soon(self, engines: list[EngineId]) -> None:
        """Engines purged by a key revocation: drop their shared cursors too (best
        effort: a cursor a revoked key moved must not hold back the engine's reports)."""
        if not engines:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        task = loop.create_task(self.forget(engines))
        self._forgetting.add(task)
        task.add_done_callback(self._forgetting.discard)

    async def forget(self, engines: Iterable[EngineId]) -> None:
        for engine in engines:
            vc = self._track(engine).vc

            async def delete(c: Any, vc: str = vc) -> Any:
                return await c.delete(vc)

            try:
                await self.link.call(delete)
            except RedisUnavailable:
                log.warning("could not drop the shared report cursor of %s", engine)

    def _track(self, engine: EngineId) -> EngineKeys:
        keys = self._keys.get(engine)
        if keys is None:
            keys = self._keys[engine] = EngineKeys(self.store.settings.key_prefix, engine)
        return keys

    async def submit(
        self, frame: bytes, expected_engine: EngineId | None = None
    ) -> Accepted | Rejected:
        """Verify locally, claim in Redis, then commit (see the module docstring). A
        snapshot over the processor's `snapshot_chunk_keys` is applied in pieces, as
        `ReportProcessor.submit_async` does. Returns once applied."""
        p = self.processor
        outcome = await p.verifier.check_async(frame, expected_engine)
        if isinstance(outcome, Rejected):
            self._count_rejected(outcome)
            return outcome
        engine = outcome.envelope.engine_id
        seen = p.cursor(engine)
        lock = self._locks.get(engine)
        if lock is None:
            lock = self._locks[engine] = asyncio.Lock()
        async with lock:  # one claim-and-commit per engine at a time: cursors never go back
            if p.cursor(engine) != seen:  # another frame committed meanwhile: judge again
                outcome = await p.verifier.check_async(frame, expected_engine)
                if isinstance(outcome, Rejected):
                    self._count_rejected(outcome)
                    return outcome
            body = outcome.body
            if isinstance(body, SnapshotBody) and body.part > 0 and not p.in_parts(engine):
                # a later part of a snapshot this replica did not start (another replica
                # fetched its part 0; the rest reach every replica through the engine's
                # ring): that replica claims and applies it, this one only moves on
                p.pass_over(outcome)
                return outcome
            claimed = await self._claim(outcome)
            if isinstance(claimed, Rejected):
                return claimed
            env = outcome.envelope
            defer = p.snapshot_chunk_keys > 0
            if env.kind == "snapshot":
                # a snapshot carries the seq of the engine's last report, whose batch Redis
                # holds: as a sequenced batch it would be refused as a duplicate and never
                # reach the other replicas. The claim made it this replica's alone, so its
                # writes go as unsequenced batches (applied in order, idempotent)
                job = p._commit(outcome, defer=defer)
            else:
                with self.store.report(engine, env.epoch, env.seq):
                    job = p._commit(outcome, defer=defer)  # the processor's commit step
        # outside the lock, so this engine's deltas accepted meanwhile apply at once
        # (and are replayed onto the staged copy); the swap reaches Redis as an
        # unsequenced replace, after the snapshot's own (claimed) batch. A large delta or
        # part goes in steps, in the engine's order (`ReportProcessor.run_job`): the
        # steps after the first reach Redis as unsequenced batches
        await p.run_job(engine, job)
        return outcome

    async def _claim(self, outcome: Accepted) -> Accepted | Rejected:
        """The shared claim; Rejected (counted) when another replica, or a replay, got
        there first. Fails open (counted) when Redis does not answer."""
        p = self.processor
        env = outcome.envelope
        engine = env.engine_id
        keys = self._track(engine)
        body = env.body.decode("utf-8") if env.kind in ("load", "profile") else ""
        if isinstance(outcome.body, SnapshotBody) and outcome.body.profile is not None:
            # the snapshot's profile becomes the shared one, as a profile report's would:
            # a replica that learns this engine from Redis (it never pulls the snapshot
            # itself, or its own claim of one loses) must get the measured profile too
            body = encode_body(profile_body(outcome.body.profile)).decode("utf-8")
        now_ms = int(self.wall() * 1000)
        mac = self.sealer.mac("cursor", engine, env.epoch, env.seq, env.issued_at_ms, now_ms)
        if env.kind == "load":
            body_mac = self.sealer.mac("load", engine, body, now_ms)
        else:
            body_mac = self.sealer.mac("profile", engine, body) if body else ""
        force = ""
        while True:
            try:
                res = await self.link.script(
                    CLAIM,
                    [keys.vc],
                    [
                        env.epoch,
                        env.seq,
                        env.kind,
                        env.issued_at_ms,
                        now_ms,
                        self.store.retention_ms,
                        body,
                        int(p.config.stale_after_s * 1000),
                        mac,
                        body_mac,
                        self.skew_ms,
                        force,
                    ],
                )
            except RedisUnavailable:
                self.unclaimed.labels(engine).inc()
                return outcome
            status = _text(res[0])
            stored_ok = self._cursor_ok(
                engine,
                int(res[1]),
                int(res[2]),
                int(res[3]),
                _text(res[5]),
                int(res[6]),
                int(res[7]),
            )
            if status == "ok" or stored_ok or force:
                break
            # the cursor that refused this report is not one a replica wrote (wrong or no
            # MAC): claim again, telling the script to disregard exactly that cursor
            force = _text(res[5])
        if status != "ok":
            rejected = Rejected(
                Reason.EPOCH_OLD if status == "epoch_old" else Reason.REPLAYED,
                f"shared cursor at epoch {int(res[1])} seq {int(res[2])}",
                engine,
            )
            self._count_rejected(rejected)
            with contextlib.suppress(RedisUnavailable):
                await self._absorb_one(engine)
            return rejected
        # another replica may have accepted reports this one has not absorbed yet:
        # start from the shared cursor so the processor judges gaps as Redis did
        shared = Cursor(int(res[1]), int(res[2]), int(res[3]))
        st = p.state(engine)
        if (
            stored_ok
            and shared.epoch >= 0
            and (st.cursor is None or cursor_newer(shared, st.cursor))
        ):
            st.cursor = shared
            st.gap = int(res[4]) == 1
        return outcome

    def _count_rejected(self, outcome: Rejected) -> None:
        p = self.processor
        label = outcome.engine if outcome.engine in p.engines() else "unknown"
        p.metrics.rejected.labels(label, outcome.reason.value).inc()

    # -- learning what the other replicas accepted ------------------------------------

    async def sync_once(self) -> None:
        """Move each engine's local report state forward to the shared record."""
        for engine in list(self._keys):
            await self._absorb_one(engine)

    async def run(self, interval_s: float | None = None) -> None:
        """`sync_once` every `interval_s` (the store's sync interval) until `stop()`."""
        every = interval_s or self.store.settings.sync_interval_ms / 1000
        self._stopping = False
        while not self._stopping:
            try:
                await self.sync_once()
            except RedisUnavailable:  # fail open: the link counts it; the next tick retries
                await asyncio.sleep(every)
                continue
            except Exception:
                log.exception("shared report state sync failed")
            await asyncio.sleep(every)

    def stop(self) -> None:
        """End `run` at its next turn (a cancel alone can be swallowed by a timeout
        inside a Redis call on Python 3.11)."""
        self._stopping = True

    async def _absorb_one(self, engine: EngineId) -> None:
        vc = self._keys[engine].vc
        raw: dict[bytes | str, bytes | str] = await self.link.call(lambda c: c.hgetall(vc))
        if raw:
            self._absorb(engine, {_text(k): _text(v) for k, v in raw.items()})

    def _cursor_ok(
        self, engine: EngineId, epoch: int, seq: int, issued: int, mac: str, mi: int, at: int
    ) -> bool:
        """Whether a shared cursor read from Redis is one a replica wrote: its MAC (over
        epoch, seq, the claimed issue time and the claim time) checks, and neither its
        epoch nor its issue time is in the future. No cursor (epoch < 0) is fine."""
        if epoch < 0:
            return True
        limit = self.wall() * 1000 + self.skew_ms
        if epoch > limit or issued > limit:
            self.refused.labels("epoch").inc()
            return False
        if self.sealer.check(mac, "cursor", engine, epoch, seq, mi, at) and (
            not self.sealer.authenticated or mi <= issued
        ):
            return True
        self.refused.labels("mac").inc()
        return False

    def _absorb(self, engine: EngineId, rec: dict[str, str]) -> None:
        try:
            epoch, seq, issued = int(rec["epoch"]), int(rec["seq"]), int(rec["issued"])
            mi, at_ms = int(rec.get("mi", "-1")), int(rec["at"])
        except (KeyError, ValueError):
            self.refused.labels("mac").inc()  # not a record a replica wrote
            return
        if not self._cursor_ok(engine, epoch, seq, issued, rec.get("mac", ""), mi, at_ms):
            return  # a forged or broken cursor steers nothing; the next claim replaces it
        p = self.processor
        st = p.state(engine)
        now, wall = self.clock(), self.wall()
        moved = False
        if st.cursor is None or cursor_newer(Cursor(epoch, seq, issued), st.cursor):
            # residency (purges included) arrives through the store's log, not here
            st.cursor = Cursor(epoch, seq, issued)
            st.gap = rec.get("gap") == "1"
            st.snapshot_needed = st.gap
            moved = True
        elif (
            (epoch, seq) == (st.cursor.epoch, st.cursor.seq)
            and issued > st.cursor.issued_at_ms
            and rec.get("gap") == "0"
            and (st.gap or st.snapshot_needed)
            and st.applying is None
        ):
            # another replica applied a newer snapshot at this position: the shared
            # residency (which reaches this replica through the store's log) is whole
            st.cursor = Cursor(epoch, seq, issued)
            st.gap = st.snapshot_needed = False
            moved = True
        at = now - max(0.0, wall - int(rec["at"]) / 1000)
        if st.last_report_at is None or at > st.last_report_at + 1e-3:
            st.last_report_at = at
            moved = True
        if "load" in rec and not self.sealer.check(
            rec.get("load_mac", ""), "load", engine, rec["load"], rec.get("load_at", "")
        ):
            self.refused.labels("mac").inc()
        elif "load" in rec:
            load_at = now - max(0.0, wall - int(rec["load_at"]) / 1000)
            if st.load_at is None or load_at > st.load_at + 1e-3:
                with contextlib.suppress(BodyError):
                    body = parse_body("load", rec["load"].encode())
                    if isinstance(body, LoadBody):
                        st.load, st.load_at = body, load_at
        prof = rec.get("profile")
        if prof is not None and not self.sealer.check(
            rec.get("profile_mac", ""), "profile", engine, prof
        ):
            self.refused.labels("mac").inc()
        elif prof is not None and self._profiles.get(engine) != prof:
            with contextlib.suppress(BodyError):
                pbody = parse_body("profile", prof.encode())
                if isinstance(pbody, ProfileBody):
                    st.profile = pbody
                    self._profiles[engine] = prof
        if st.last_report_at is not None and p.tables.mode(engine) is ViewMode.APPROXIMATE:
            p.tables.set_mode(engine, ViewMode.REPORTED)
        if moved:
            self.absorbed.labels(engine).inc()


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
