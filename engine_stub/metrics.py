"""The reference engine's Prometheus metrics: prefix `engine_`, units in names, created
against a registry passed in (several engines can live in one test process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LAT = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry, engine_id: str) -> None:
        r = registry
        self.requests = Counter(
            "engine_requests_total", "Requests by outcome", ["outcome"], registry=r
        )
        self.rejected = Counter(
            "engine_rejected_total", "Requests refused before scheduling", ["reason"], registry=r
        )
        self.waiting = Gauge("engine_queue_waiting_requests", "Requests waiting", registry=r)
        self.running = Gauge("engine_running_requests", "Requests holding a slot", registry=r)
        self.prompt_tokens = Counter(
            "engine_prompt_tokens_total",
            "Prompt tokens by source (hbm, host, ssd, pool, swa, replayed, prefilled)",
            ["source"],
            registry=r,
        )
        self.generated_tokens = Counter(
            "engine_generated_tokens_total", "Completion tokens", registry=r
        )
        self.ttft = Histogram(
            "engine_ttft_seconds", "Arrival to first token", buckets=_LAT, registry=r
        )
        self.queue_time = Histogram(
            "engine_queue_seconds", "Arrival to admission", buckets=_LAT, registry=r
        )
        self.queue_wait_band = Histogram(
            "engine_queue_wait_by_band_seconds",
            "Arrival to first prefill chunk, by the priority hint's work band (lt_0.1s, "
            "0.1_1s, 1_10s, ge_10s, other; fcfs when the engine does not schedule by priority)",
            ["band"],
            buckets=_LAT,
            registry=r,
        )
        self.oldest_waiting = Gauge(
            "engine_oldest_waiting_seconds",
            "Age of the oldest request without its first token (waiting or prefilling)",
            registry=r,
        )
        self.preemptions = Counter(
            "engine_priority_preemptions_total",
            "Prefilling requests that gave their slot to a better waiting one (chunk variant)",
            registry=r,
        )
        self.prefill_time = Histogram(
            "engine_prefill_seconds", "Prefill compute per request", buckets=_LAT, registry=r
        )
        self.restore_time = Histogram(
            "engine_restore_seconds",
            "Cache restore (incl. replay) per request",
            buckets=_LAT,
            registry=r,
        )
        self.decode_step = Histogram(
            "engine_decode_step_seconds", "One batched decode step", buckets=_LAT, registry=r
        )
        self.decode_batch = Gauge(
            "engine_decode_batch_size", "Sequences in the last decode step", registry=r
        )
        self.spec_proposed = Counter(
            "engine_spec_proposed_tokens_total", "DSpark draft positions verified", registry=r
        )
        self.spec_accepted = Counter(
            "engine_spec_accepted_tokens_total", "DSpark draft positions accepted", registry=r
        )
        self.spec_acceptance = Gauge(
            "engine_spec_acceptance_ratio", "Accepted / verified draft positions (EMA)", registry=r
        )
        self.tokens_per_step = Gauge(
            "engine_spec_tokens_per_step",
            "Effective tokens per sequence per step (EMA)",
            registry=r,
        )
        self.kv_resident_tokens = Gauge(
            "engine_kv_resident_tokens", "Global-KV tokens resident by tier", ["tier"], registry=r
        )
        self.kv_resident_bytes = Gauge(
            "engine_kv_resident_bytes", "Global-KV bytes resident by tier", ["tier"], registry=r
        )
        self.kv_moved_bytes = Gauge(
            "engine_kv_io_bytes", "Bytes read/written per tier since start", ["op"], registry=r
        )
        self.kv_moved_seconds = Gauge(
            "engine_kv_io_seconds", "Seconds spent reading/writing per tier", ["op"], registry=r
        )
        self.cache_events = Counter(
            "engine_cache_events_total", "Cache events by kind", ["kind"], registry=r
        )
        self.swa_entries = Gauge("engine_swa_pool_entries", "Pooled SWA states", registry=r)
        self.swa_bytes = Gauge("engine_swa_pool_bytes", "Bytes of pooled SWA state", registry=r)
        self.engram_bytes = Counter(
            "engine_engram_prefetch_bytes_total",
            "Engram rows fetched ahead from host memory",
            registry=r,
        )
        self.engram_seconds = Counter(
            "engine_engram_prefetch_seconds_total",
            "Time spent fetching Engram rows (in the background when overlapped)",
            registry=r,
        )
        self.engram_wait = Counter(
            "engine_engram_wait_seconds_total",
            "Time forward passes waited for Engram rows (the exposed part of the fetch)",
            registry=r,
        )
        self.engram_forwards = Counter(
            "engine_engram_prefetch_forwards_total",
            "Forward passes that fetched Engram rows (per-forward figures: divide by this)",
            registry=r,
        )
        self.info = Gauge("engine_info", "Engine identity", ["engine_id", "epoch"], registry=r)
        self.engine_id = engine_id
        self._engram_seen = [0.0, 0.0, 0.0, 0.0]  # totals already counted

    def set_engram_totals(
        self, nbytes: float, seconds: float, wait_seconds: float = 0.0, forwards: float = 0.0
    ) -> None:
        """Advance the Engram counters to the model's running totals (a counter has no
        set(); totals that went down, a model reset, add nothing)."""
        now = (nbytes, seconds, wait_seconds, forwards)
        counters = (self.engram_bytes, self.engram_seconds, self.engram_wait, self.engram_forwards)
        for i, (counter, total) in enumerate(zip(counters, now, strict=True)):
            counter.inc(max(total - self._engram_seen[i], 0.0))
            self._engram_seen[i] = max(total, self._engram_seen[i])
