"""Report metrics, on a registry passed in (several routers can share a process).

- ramjet_reports_rejected_total{engine,reason}: every rejection; `engine` is the claimed
  engine only when it is a configured one, else "unknown" (no attacker-chosen labels).
- ramjet_reports_accepted_total{engine,kind}
- ramjet_reports_gaps_total{engine}: sequence gaps seen (each asks for a snapshot)
- ramjet_reports_snapshots_fetched_total{engine}: snapshots pulled by the router
- ramjet_reports_epoch_changes_total{engine}
- ramjet_reports_revoked_purges_total{engine}: views purged because a key that signed
  them was revoked by a reload
- read at scrape time from the processor: ramjet_reports_epoch{engine},
  ramjet_reports_trust_grade{engine} (0 exact, 1 degraded, 2 approximate),
  ramjet_reports_staleness_seconds{engine} (since the last accepted report).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ramjet.metric_catalogue import counter, family
from ramjet.reports.verify import Reason

ABANDON_REASONS = ("gap", "out_of_order", "restarted", "interrupted")
"""Why a snapshot sent in parts was abandoned (`ramjet_reports_snapshots_abandoned_total`):
a seq gap, a part out of order (or of another cut), a new part 0 (or whole snapshot), a
report of another kind between parts."""


@dataclass(frozen=True, slots=True)
class EngineFigures:
    engine: str
    epoch: int | None
    trust: int
    staleness_s: float | None


class ReportMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.rejected = counter(registry, "ramjet_reports_rejected_total")
        self.accepted = counter(registry, "ramjet_reports_accepted_total")
        self.gaps = counter(registry, "ramjet_reports_gaps_total")
        self.snapshots_fetched = counter(registry, "ramjet_reports_snapshots_fetched_total")
        self.epoch_changes = counter(registry, "ramjet_reports_epoch_changes_total")
        self.revoked_purges = counter(registry, "ramjet_reports_revoked_purges_total")
        self.snapshots_abandoned = counter(registry, "ramjet_reports_snapshots_abandoned_total")
        self._registry = registry

    def init_engines(self, engines: Iterable[str]) -> None:
        """Create the per-engine counters at 0 (every rejection reason, plus "unknown"),
        so a healthy router exports them and alerts on their increase see a series."""
        for engine in (*engines, "unknown"):
            for reason in Reason:
                self.rejected.labels(engine, reason.value)
            if engine != "unknown":
                self.gaps.labels(engine)
                self.snapshots_fetched.labels(engine)
                self.epoch_changes.labels(engine)
                self.revoked_purges.labels(engine)
                for why in ABANDON_REASONS:
                    self.snapshots_abandoned.labels(engine, why)

    def watch(self, figures: Callable[[], Iterable[EngineFigures]]) -> None:
        self._registry.register(_EngineCollector(figures))


class _EngineCollector(Collector):
    def __init__(self, figures: Callable[[], Iterable[EngineFigures]]) -> None:
        self._figures = figures

    def collect(self) -> Iterator[GaugeMetricFamily]:
        epoch = family("ramjet_reports_epoch")
        trust = family("ramjet_reports_trust_grade")
        stale = family("ramjet_reports_staleness_seconds")
        for f in self._figures():
            trust.add_metric([f.engine], float(f.trust))
            if f.epoch is not None:
                epoch.add_metric([f.engine], float(f.epoch))
            if f.staleness_s is not None:
                stale.add_metric([f.engine], f.staleness_s)
        yield epoch
        yield trust
        yield stale
