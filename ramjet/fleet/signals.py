"""Signed engine reports in the router: what they add to each engine's view, and how the
report runtime rides on the router's app.

Views. `ramjet.fleet.views.engine_views` builds one `EngineView` per engine from the
router's own state (health, in-flight counters), the residency tables, and an
`EngineSignals`:

- `trust(engine)`: the report processor's grade (APPROXIMATE before any report,
  DEGRADED after a gap, while a snapshot is pending or applying, or after
  `reports.stale_after_s` of silence, else EXACT);
- `profile(engine)`: the engine's last signed profile, None before one;
- `load(engine_state)`: `EngineLoad` with the router's own in-flight requests and
  their predicted uncached prompt tokens (the router's counters), plus the engine's last signed load report (queued prompt tokens,
  running requests, HBM KV utilization). The report is older than the router's
  bookkeeping, so the policies correct one by the other
  (`ramjet.policy.candidates.outstanding_prompt_tokens`: the larger of the reported
  queue and the router's in-flight prompt tokens). Fresh load: a report received before
  the latest first byte the router saw from the engine (`EngineState.started_at`) may
  still count work that has since started, so its queue (tokens and waiting requests)
  is left out until the next report; its running requests and KV use still count.

Staleness (RELIABILITY row 9): a load report older than `reports.stale_after_s` is
dropped (the view carries only the router's own counters, as for an engine that never
reported), and after `reports.stale_ttl_s` without any report the engine's residency
stops steering (`ViewMode.SILENT`, applied by the processor's tick, which the runtime
runs every `min(1 s, stale_after_s / 4)`). Traffic held off by a stale "queue full" or
held on by stale residency returns within those TTLs.

Residency precedence: the router's own `record_routed` entries are approximate; for an
engine that reports they are neither written nor read (`ViewMode.REPORTED`), and an
exact entry is never overridden by an approximate one (`ramjet.residency.store`). For
every engine, reporting or not, the blocks of requests the router has sent and no report
has confirmed yet read as pending HBM residency (`ramjet.residency.pending`), beneath
the exact entries.

Profile groups: engines of one kind (`EngineConfig.profile_group`) are priced with one
profile, the mean of the group's signed profiles (`GroupedProfiles`,
`ramjet.policy.profile.mean_profile`), so the noise of each engine's own probe cannot
make one of two identical engines look cheaper and take every request.

Wiring: `ramjet.app.wiring` builds the report runtime and hands the router its
`ReportSignals` (wrapped in `GroupedProfiles` where the policy groups engines).
"""

from __future__ import annotations

import math
from typing import Protocol

from aiohttp import web

from ramjet.fleet.engines import EngineState
from ramjet.policy.base import EngineLoad
from ramjet.policy.profile import EngineProfile, mean_profile
from ramjet.reports.keys import KeyRing
from ramjet.reports.processor import ReportProcessor
from ramjet.reports.runtime import ReportsRuntime
from ramjet.types import EngineId, TrustGrade

REPORTS_KEY = web.AppKey("reports", ReportsRuntime)


class EngineSignals(Protocol):
    """What the router's views take from sources other than its own bookkeeping."""

    def trust(self, engine: EngineId) -> TrustGrade: ...

    def profile(self, engine: EngineId) -> EngineProfile | None: ...

    def load(self, engine: EngineState, now: float | None = None) -> EngineLoad:
        """`now`: the fleet's clock, for `EngineLoad.busy_s` (None: 0)."""
        ...

    def replace_keys(self, ring: KeyRing) -> dict[str, list[str]] | None:
        """Swap in a reloaded key ring, purging what revoked keys signed (None: no
        reports, nothing to swap)."""
        ...


class NoSignals:
    """No reports: approximate trust, no profile, the router's own counters only."""

    def trust(self, engine: EngineId) -> TrustGrade:
        return TrustGrade.APPROXIMATE

    def profile(self, engine: EngineId) -> EngineProfile | None:
        return None

    def replace_keys(self, ring: KeyRing) -> dict[str, list[str]] | None:
        return None

    def load(self, engine: EngineState, now: float | None = None) -> EngineLoad:
        return EngineLoad(
            inflight_requests=engine.inflight_requests,
            inflight_prompt_tokens=engine.inflight_prompt_tokens,
            busy_s=busy_seconds(engine, now),
            inflight_jobs=engine.jobs(),
        )


class ReportSignals:
    """`EngineSignals` from a `ReportProcessor` (see the module docstring)."""

    def __init__(self, processor: ReportProcessor) -> None:
        self.processor = processor

    def trust(self, engine: EngineId) -> TrustGrade:
        return self.processor.trust(engine)

    def profile(self, engine: EngineId) -> EngineProfile | None:
        return self.processor.profile(engine)

    def replace_keys(self, ring: KeyRing) -> dict[str, list[str]] | None:
        return self.processor.replace_keyring(ring)

    def load(self, engine: EngineState, now: float | None = None) -> EngineLoad:
        reported = self.processor.load(engine.id)  # None once older than stale_after_s
        if reported is None:
            return EngineLoad(
                inflight_requests=engine.inflight_requests,
                inflight_prompt_tokens=engine.inflight_prompt_tokens,
                busy_s=busy_seconds(engine, now),
                inflight_jobs=engine.jobs(),
            )
        received = self.processor.load_received_at(engine.id)
        if received is not None and received < engine.started_at:
            # a request started after the report: its queue may count finished work
            return EngineLoad(
                inflight_requests=engine.inflight_requests,
                inflight_prompt_tokens=engine.inflight_prompt_tokens,
                running_requests=reported.running_requests,
                kv_utilization=reported.kv_utilization,
                busy_s=busy_seconds(engine, now),
                inflight_jobs=engine.jobs(),
            )
        queued = reported.queued_prompt_tokens
        # the reported queue is what was left when the report came: progress since then
        since = received if queued and queued > engine.inflight_prompt_tokens else None
        return EngineLoad(
            inflight_requests=engine.inflight_requests,
            inflight_prompt_tokens=engine.inflight_prompt_tokens,
            queued_prompt_tokens=queued,
            running_requests=reported.running_requests,
            kv_utilization=reported.kv_utilization,
            waiting_requests=reported.waiting_requests,
            busy_s=busy_seconds(engine, now, since),
            inflight_jobs=engine.jobs(),
        )


def busy_seconds(engine: EngineState, now: float | None, since: float | None = None) -> float:
    """How far the engine is into the outstanding prompt work the view counts
    (`EngineLoad.busy_s`): since the router's oldest unanswered request there started
    (`EngineState.busy_since`), or since `since` (a reported queue's arrival) when that is
    the work counted; 0 when nothing is outstanding or the time is unknown."""
    if now is None:
        return 0.0
    if since is None:
        if engine.inflight_prompt_tokens <= 0:
            return 0.0
        since = engine.busy_since
    elif engine.inflight_prompt_tokens > 0:
        since = max(since, engine.busy_since)
    return max(now - since, 0.0) if math.isfinite(since) else 0.0


class GroupedProfiles:
    """`EngineSignals` whose profile of an engine in a profile group is the mean of the
    group members' profiles (those that have one); everything else is `inner`'s. The mean
    is made again only when a member's profile changes."""

    def __init__(self, inner: EngineSignals, groups: dict[EngineId, tuple[EngineId, ...]]):
        self.inner = inner
        self._groups = groups
        """Each grouped engine's group, itself included."""
        self._made: dict[tuple[EngineId, ...], tuple[tuple[EngineProfile, ...], EngineProfile]]
        self._made = {}

    def trust(self, engine: EngineId) -> TrustGrade:
        return self.inner.trust(engine)

    def load(self, engine: EngineState, now: float | None = None) -> EngineLoad:
        return self.inner.load(engine, now)

    def replace_keys(self, ring: KeyRing) -> dict[str, list[str]] | None:
        return self.inner.replace_keys(ring)

    def profile(self, engine: EngineId) -> EngineProfile | None:
        members = self._groups.get(engine)
        if members is None:
            return self.inner.profile(engine)
        got = tuple(p for m in members if (p := self.inner.profile(m)) is not None)
        if not got:
            return None
        made = self._made.get(members)
        if (
            made is None
            or len(made[0]) != len(got)
            or any(a is not b for a, b in zip(made[0], got, strict=True))
        ):
            made = self._made[members] = (got, mean_profile(got))
        return made[1]
