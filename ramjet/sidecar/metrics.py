"""The sidecar's Prometheus metrics (served on its `/metrics`), on a registry passed in so
several sidecars can live in one process:

- ramjet_sidecar_unknown_fields_total{event,field}: fields of known events (or of the
  batch, event="EventBatch") that the decoder does not know and ignored; a new engine
  release shows up here before anything goes wrong;
- ramjet_sidecar_unknown_events_total{event}: events of unknown type, skipped;
- ramjet_sidecar_malformed_events_total{event}: known events dropped because a field
  had the wrong type or was missing (the reason is logged);
- ramjet_sidecar_resyncs_total: batches whose dropped event may have removed blocks, so
  the sidecar forgot its state and started a new epoch;
- ramjet_sidecar_events_decoded_total{event}: events decoded and applied, by type
  (BlockStored, BlockRemoved, AllBlocksCleared);
- ramjet_sidecar_event_to_report_seconds: from the engine's timestamp of the oldest
  batch in a delta to that delta being signed (what routers wait beyond transport);
- ramjet_sidecar_events_silent: 1 while no event has arrived within
  `--events-warn-after` seconds of start (a misconfigured endpoint: see the log);
- ramjet_sidecar_events_down: 1 while the event path is down (its thread died: the
  sidecar purged its residency with a new epoch and pauses load reports, so routers'
  trust in the engine degrades, until the restarted path catches up);
- ramjet_sidecar_event_path_restarts_total: restarts of the event path after it died.

`event` and `field` come from the engine's bytes, so label values are cut to
`MAX_LABEL_CHARS` and at most `MAX_SERIES` distinct label sets are made per metric;
further ones are counted under `_other` (a misbehaving engine cannot grow the registry
without bound).
"""

from __future__ import annotations

import logging
from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter

from ramjet.metric_catalogue import counter, gauge, histogram
from ramjet.sidecar.wire import EventBatch

log = logging.getLogger(__name__)

MAX_SERIES = 64
MAX_LABEL_CHARS = 64
OTHER = "_other"


class _Bounded:
    """Label sets of one counter, capped at `MAX_SERIES` (overflow folds into `_other`)."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self.seen: set[tuple[str, ...]] = set()

    def inc(self, *labels: str) -> None:
        key = tuple(v[:MAX_LABEL_CHARS] for v in labels)
        if key not in self.seen:
            if len(self.seen) >= MAX_SERIES:
                key = tuple(OTHER for _ in labels)
            self.seen.add(key)
        self.counter.labels(*key).inc()


class SidecarMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.unknown_fields = counter(registry, "ramjet_sidecar_unknown_fields_total")
        self.unknown_events = counter(registry, "ramjet_sidecar_unknown_events_total")
        self.malformed_events = counter(registry, "ramjet_sidecar_malformed_events_total")
        self.resyncs = counter(registry, "ramjet_sidecar_resyncs_total")
        self.events_decoded = counter(registry, "ramjet_sidecar_events_decoded_total")
        for name in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
            self.events_decoded.labels(name)
        self.event_to_report = histogram(registry, "ramjet_sidecar_event_to_report_seconds")
        self.events_silent = gauge(registry, "ramjet_sidecar_events_silent")
        self.events_down = gauge(registry, "ramjet_sidecar_events_down")
        self.event_path_restarts = counter(registry, "ramjet_sidecar_event_path_restarts_total")
        self._fields = _Bounded(self.unknown_fields)
        self._events = _Bounded(self.unknown_events)
        self._malformed = _Bounded(self.malformed_events)
        self.stats: Tally[str] = Tally()
        """The same counts, unlabelled, for the sidecar's /health."""

    def observe(self, batch: EventBatch) -> None:
        """Count what the decoder took, ignored or dropped in one batch (and log drops)."""
        for ev in batch.events:
            self.events_decoded.labels(type(ev).__name__).inc()
        for event, field in batch.unknown_fields:
            self._fields.inc(event, field)
        self.stats["unknown_fields"] += len(batch.unknown_fields)
        for s in batch.skipped:
            if s.known:
                self._malformed.inc(s.event or "?")
                self.stats["malformed_events"] += 1
                log.warning("dropped a malformed event: %s", s.reason)
            else:
                self._events.inc(s.event)
                self.stats["unknown_events"] += 1
        if batch.resync_from is not None:
            self.resyncs.inc()
            self.stats["resyncs"] += 1
