"""The engine: one model, its caches, the scheduler, metrics and profile, assembled from
`EngineSettings`. The HTTP layer (`engine_stub.server`) only talks to this object.

Epoch. Every start takes a fresh time-based epoch: wall-clock milliseconds at start (so
a restart's epoch is higher, which the router's report processor requires). Volatile
tiers (HBM, host, the SWA pool) start empty; the SSD tier under `cache_dir` is re-indexed
(see `engine_stub.kvstore`), so blocks on disk survive a restart and are announced again
under the new epoch. Without `--cache-dir` the SSD tier lives in a temporary directory
that is deleted at shutdown, so nothing survives.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from engine_stub.events import CacheEvent, CacheEvents
from engine_stub.kvstore import DEFAULT_TTL_S, GlobalKVStore
from engine_stub.metrics import EngineMetrics
from engine_stub.prompt_cache import PromptCache
from engine_stub.scheduler import Scheduler, SchedulerConfig
from engine_stub.shared_pool import SharedKV, SharedSWA
from engine_stub.speculation import Speculator
from engine_stub.swa_pool import DEFAULT_TTL_S as SWA_TTL_S
from engine_stub.swa_pool import SWAPool
from kvpool import Pool
from ramjet.config import DEFAULT_AGING
from ramjet.keys.prefix import key_seed
from ramjet.policy.profile import EngineProfile
from ramjet.types import Tier

log = logging.getLogger("engine_stub")


@dataclass(frozen=True)
class EngineSettings:
    engine_id: str = "e0"
    model_name: str = "mini-v4"
    seed: int = 0
    window: int = 128
    device: str = "cpu"
    cache_dir: Path | None = None
    hbm_tokens: int = 65536
    host_tokens: int = 262144
    ssd_tokens: int = 1048576
    global_ttl_s: float = DEFAULT_TTL_S
    swa_ttl_s: float = SWA_TTL_S
    swa_bytes: int | None = None
    max_queue: int = 64
    max_batch: int = 8
    prefill_chunk: int = 512
    scheduling_policy: str = "fcfs"
    """fcfs or priority (`engine_stub.scheduler`: the body's `priority`, lowest first)."""
    priority_variant: str = "chunk"
    """Under priority: chunk (preempt at chunk boundaries) or vllm (vLLM V1's)."""
    priority_aging: float = DEFAULT_AGING
    """The router's aging: only to band the queue-wait metric by the hint's work."""
    max_gen_tokens: int = 256
    """The generation budget at reasoning_effort=100 (and the default max_tokens)."""
    max_prompt_tokens: int = 65536
    speculate: bool = True
    engram_prefetch: bool = True
    """Fetch Engram rows in the background while earlier layers run (False: inline)."""
    profile_mode: str = "fast"
    probe_lock: str | None = None
    """A lock file engines on this host share while probing (`profiler.probe_quietly`);
    None: no lock."""
    threads: int = 1
    pool_dir: Path | None = None
    """A global-KV pool shared with other engines (`engine_stub.shared_pool`); None: none."""
    pool_id: str = "pool0"
    """The pool's id in the router's policy (`fabric.pools`): names it in prompt_work."""
    pool_bytes: int = 1 << 30
    pool_durable: bool = False
    """fsync every block published (an SSD pool); a host-memory pool need not."""
    swa_pool_dir: Path | None = None
    """An SWA-state pool shared with other engines; None: SWA state stays in the process."""
    swa_pool_id: str = "swa0"
    swa_pool_bytes: int = 256 << 20
    extra: dict[str, Any] = field(default_factory=dict)


class Engine:
    def __init__(self, settings: EngineSettings, model: Any | None = None) -> None:
        from engine_stub.model.tokenizer import ByteTokenizer

        self.settings = s = settings
        torch.set_num_threads(max(1, s.threads))
        self.epoch = int(time.time() * 1000)
        self.started_at = time.time()
        self.registry = CollectorRegistry()
        self.metrics = EngineMetrics(self.registry, s.engine_id)
        self.metrics.info.labels(s.engine_id, str(self.epoch)).set(1)
        if model is None:
            from engine_stub.model import MiniV4, ModelConfig

            cfg = ModelConfig.tiny(window=s.window)
            model = MiniV4(cfg, seed=s.seed, device=s.device, engram_prefetch=s.engram_prefetch)
            self._owns_model = True
        else:
            self._owns_model = False
        self.model = model
        self.cfg = model.cfg
        self.tokenizer = ByteTokenizer()
        self.key_seed = key_seed(s.model_name)
        """The seed of an unsalted prompt's keys (`prompt_seed(None)`)."""
        self.events = CacheEvents()
        self.events.subscribe(self._count_event)
        self._tmpdir: str | None = None
        cache_dir = s.cache_dir
        if cache_dir is None:
            self._tmpdir = tempfile.mkdtemp(prefix=f"engine-{s.engine_id}-")
            cache_dir = Path(self._tmpdir)
        self.fingerprint = self._fingerprint()
        self.kv = GlobalKVStore(
            block_tokens=self.cfg.block_tokens,
            capacity_tokens=(s.hbm_tokens, s.host_tokens, s.ssd_tokens),
            cache_dir=cache_dir,
            fingerprint=self.fingerprint,
            device=s.device,
            ttl_s=s.global_ttl_s,
            events=self.events,
        )
        self.swa = SWAPool(cap_bytes=s.swa_bytes, ttl_s=s.swa_ttl_s, events=self.events)
        self.shared_kv: SharedKV | None = None
        self.shared_swa: SharedSWA | None = None
        if s.pool_dir is not None:
            pool = Pool(s.pool_dir, s.pool_bytes, durable=s.pool_durable)
            self.shared_kv = SharedKV(pool, s.pool_id, self.fingerprint, self.cfg.block_tokens)
        if s.swa_pool_dir is not None:
            swa_pool = Pool(s.swa_pool_dir, s.swa_pool_bytes)
            self.shared_swa = SharedSWA(swa_pool, s.swa_pool_id, self.fingerprint, s.swa_ttl_s)
        self.cache = PromptCache(
            self.model,
            self.kv,
            self.swa,
            window=self.cfg.window,
            shared_kv=self.shared_kv,
            shared_swa=self.shared_swa,
        )
        self.speculator = Speculator(self.model) if s.speculate else None
        self.scheduler = Scheduler(
            self.model,
            self.cache,
            detokenize=self.detokenize,
            eos_ids=frozenset(self.eos_ids()),
            config=SchedulerConfig(
                max_batch=s.max_batch,
                max_queue=s.max_queue,
                prefill_chunk=s.prefill_chunk,
                speculate=s.speculate,
                policy=s.scheduling_policy,
                variant=s.priority_variant,
                priority_aging=s.priority_aging,
            ),
            metrics=self.metrics,
            speculator=self.speculator,
        )
        self.scheduler.epoch = self.epoch
        self.profile: EngineProfile | None = None
        self.profile_extra: dict[str, Any] = {}

    # -- identity -------------------------------------------------------------------

    def _fingerprint(self) -> str:
        s = self.settings
        desc = f"{s.model_name}|{self.cfg!r}|seed={s.seed}"
        return hashlib.sha256(desc.encode()).hexdigest()[:16]

    def eos_ids(self) -> list[int]:
        tok = self.tokenizer
        ids = [
            getattr(tok, name)
            for name in ("eos_id", "eos")
            if isinstance(getattr(tok, name, None), int)
        ]
        return ids

    def prompt_seed(self, salt: str | None) -> int:
        """The seed of a prompt's keys (`ramjet.keys.prefix.key_seed`, the router's): a
        request's `cache_salt` gives its blocks and SWA states keys of their own, so they
        serve only requests with the same salt, as in vLLM and SGLang, and the engine's
        reports name them as the router keys the salted request."""
        return self.key_seed if salt is None else key_seed(self.settings.model_name, salt=salt)

    def encode(self, text: bytes) -> list[int]:
        return list(text)  # byte-level: one token per byte, the router's key blocks exactly

    def detokenize(self, ids: list[int]) -> bytes:
        return bytes(t for t in ids if 0 <= t < 256)

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        if self.settings.profile_mode != "skip":
            from engine_stub.profiler import Profiler, probe_quietly

            t0 = time.perf_counter()
            s = self.settings
            profiler = Profiler(self.model, mode=s.profile_mode, device=s.device)
            if s.device == "cpu":
                result = probe_quietly(profiler.run, threads=s.threads, lock_path=s.probe_lock)
            else:  # process CPU time says nothing of a GPU's
                result = profiler.run()
            self.profile, self.profile_extra = result.profile, result.extra
            log.info(
                "profiled in %.1fs (cpu share %s)",
                time.perf_counter() - t0,
                result.extra.get("cpu_share", "n/a"),
            )
        self.scheduler.start()

    def close(self) -> None:
        self.scheduler.stop()
        for shared in (self.shared_kv, self.shared_swa):
            if shared is not None:
                shared.close()  # the writes already queued reach the pool
        if self._owns_model:  # a model passed in may serve other engines
            self.model.close()
        self.kv.clear_volatile()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def sweep(self) -> None:
        self.kv.sweep()
        self.swa.sweep()

    # -- views ----------------------------------------------------------------------

    def _count_event(self, event: CacheEvent) -> None:
        self.metrics.cache_events.labels(event.kind).inc()

    def refresh_gauges(self) -> None:
        m = self.metrics
        for tier, n, b in zip(
            Tier, self.kv.resident_tokens(), self.kv.resident_bytes(), strict=True
        ):
            m.kv_resident_tokens.labels(tier.label).set(n)
            m.kv_resident_bytes.labels(tier.label).set(b)
        for op, n in self.kv.stats.bytes_moved.items():
            m.kv_moved_bytes.labels(op).set(n)
        for op, sec in self.kv.stats.seconds_moved.items():
            m.kv_moved_seconds.labels(op).set(sec)
        engram = getattr(self.model, "engram_stats", None)
        if engram is not None:
            m.set_engram_totals(
                engram.bytes,
                engram.seconds,
                getattr(engram, "wait_seconds", 0.0),
                getattr(engram, "forwards", 0),
            )
        m.swa_entries.set(len(self.swa))
        m.swa_bytes.set(self.swa.bytes_used)

    def load(self) -> dict[str, Any]:
        waiting, running = self.scheduler.counts()
        spec = self.speculator
        return {
            "engine_id": self.settings.engine_id,
            "epoch": self.epoch,
            "waiting": waiting,
            "running": running,
            "max_batch": self.settings.max_batch,
            "max_queue": self.settings.max_queue,
            "spec_acceptance": spec.acceptance if spec else 0.0,
            "spec_tokens_per_step": spec.tokens_per_step if spec else 1.0,
            "kv_resident_tokens": dict(
                zip(("hbm", "host", "ssd"), self.kv.resident_tokens(), strict=True)
            ),
            "swa_entries": len(self.swa),
            "swa_bytes": self.swa.bytes_used,
            "pools": {
                p.pool_id: {
                    "written": p.writer.written,
                    "refused": p.writer.refused,
                    "dropped": p.writer.dropped,
                }
                for p in (self.shared_kv, self.shared_swa)
                if p is not None
            },
        }

    def cache_snapshot(self) -> dict[str, Any]:
        return {
            "engine_id": self.settings.engine_id,
            "epoch": self.epoch,
            "blocks": [
                {"key": int(k), "tier": t.label, "expires_at": e} for k, t, e in self.kv.snapshot()
            ],
            "swa": [
                {"key": int(k), "n_tokens": n, "expires_at": e} for k, n, e in self.swa.snapshot()
            ],
        }
