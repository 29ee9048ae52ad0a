"""Continuous batching: a bounded waiting queue, chunked prefill, batched decode with
DSpark verification, in one worker thread.

Each loop iteration (the worker thread; torch releases the GIL, so the server's event
loop stays responsive):

1. admit: move waiting requests into free slots (at most `max_batch` running);
2. abort: drop requests whose client went away (`Request.cancelled`), freeing the slot;
3. prefill: the oldest request still prefilling restores its prompt from the caches
   (`PromptCache.restore`, first chunk only) and prefills one chunk of at most
   `prefill_chunk` tokens; after its last chunk it stores its blocks and SWA state and
   samples its first token;
4. decode: every request past prefill advances: greedy ones whose draft is worth
   verifying run a DSpark step (`Speculator`), the rest share one `decode_batch`.

Prefill chunks and decode steps alternate, so a long prompt delays running decodes by
at most one chunk per token (the chunked-prefill trade-off).

Admission control: `submit` raises `QueueFull` once `max_queue` requests wait; the
server answers 503 with a Retry-After estimated from recent service times.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from engine_stub.metrics import EngineMetrics
from engine_stub.prompt_cache import PromptCache
from engine_stub.request import Request, sample
from engine_stub.speculation import Speculator

log = logging.getLogger("engine_stub.scheduler")


class ServingModel(Protocol):
    """The part of `engine_stub.model.MiniV4` the scheduler drives."""

    def prefill(self, state: Any, ids: list[int]) -> torch.Tensor: ...
    def decode_batch(self, states: list[Any], tokens: list[int]) -> torch.Tensor: ...


class QueueFull(Exception):
    def __init__(self, retry_after_s: float) -> None:
        super().__init__("engine queue is full")
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_batch: int = 8
    max_queue: int = 64
    prefill_chunk: int = 512
    speculate: bool = True


@dataclass(eq=False, slots=True)
class _Seq:
    req: Request
    state: Any = None
    pos: int = 0
    """Prompt tokens already in `state`."""
    restored: bool = False
    pending: int = -1
    """Last sampled token, not yet fed to the model."""
    gen: torch.Generator | None = None
    admitted: float = 0.0
    prefill_s: float = 0.0


@dataclass(slots=True)
class LoadStats:
    waiting: int = 0
    running: int = 0
    recent_service_s: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=32)
    )


class Scheduler:
    def __init__(
        self,
        model: ServingModel,
        cache: PromptCache,
        *,
        detokenize: Any,
        eos_ids: frozenset[int],
        config: SchedulerConfig,
        metrics: EngineMetrics,
        speculator: Speculator | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.detokenize = detokenize
        self.eos_ids = eos_ids
        self.cfg = config
        self.metrics = metrics
        self.spec = speculator
        self.epoch = 0
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._running: list[_Seq] = []
        self._stop = False
        self._thread: threading.Thread | None = None
        self.load = LoadStats()
        self.steps = 0
        self.decode_tokens_per_s = 0.0
        """EMA of tokens produced per second by decode steps (whole batch)."""

    # -- loop side ------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        """Queue a request; raises QueueFull (and queues nothing) when the queue is full."""
        with self._cond:
            if len(self._waiting) >= self.cfg.max_queue:
                raise QueueFull(self._retry_after())
            req.work.epoch = self.epoch
            self._waiting.append(_Seq(req, gen=req.params.generator()))
            self._gauges()
            self._cond.notify()

    def wake(self) -> None:
        """Nudge the worker (a request was cancelled)."""
        with self._cond:
            self._cond.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens waiting or not yet prefilled."""
        with self._cond:
            seqs = [*self._waiting, *(s for s in self._running if s.pending < 0)]
            return sum(len(s.req.prompt_ids) - s.pos for s in seqs)

    def counts(self) -> tuple[int, int]:
        with self._cond:
            return len(self._waiting), len(self._running)

    def _retry_after(self) -> float:
        recent = self.load.recent_service_s
        mean = sum(recent) / len(recent) if recent else 1.0
        return max(1.0, mean * len(self._waiting) / max(1, self.cfg.max_batch))

    def _gauges(self) -> None:
        self.load.waiting, self.load.running = len(self._waiting), len(self._running)
        self.metrics.waiting.set(self.load.waiting)
        self.metrics.running.set(self.load.running)

    # -- worker side ----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._waiting and not self._running:
                    self._cond.wait(timeout=1.0)
                if self._stop:
                    break
                self._admit()
                self._abort_cancelled()
                self._gauges()
                running = list(self._running)
            try:
                self.step(running)
            except Exception:  # a model bug must not kill the engine; fail the batch
                log.exception("scheduler step failed")
                for seq in running:
                    seq.req.fail("internal engine error")
                    self._release(seq, "error")
        with self._cond:
            for seq in [*self._waiting, *self._running]:
                seq.req.fail("engine shutting down")
            self._waiting.clear()
            self._running.clear()

    def _admit(self) -> None:
        now = time.perf_counter()
        while self._waiting and len(self._running) < self.cfg.max_batch:
            seq = self._waiting.popleft()
            if seq.req.cancelled:
                self.metrics.requests.labels("cancelled").inc()
                continue
            seq.admitted = now
            seq.req.work.queue_ms = (now - seq.req.arrived) * 1e3
            self.metrics.queue_time.observe(now - seq.req.arrived)
            self._running.append(seq)

    def _abort_cancelled(self) -> None:
        for seq in [s for s in self._running if s.req.cancelled]:
            self._running.remove(seq)
            self.metrics.requests.labels("cancelled").inc()
            seq.state = None

    def _release(self, seq: _Seq, outcome: str) -> None:
        with self._cond:
            if seq in self._running:
                self._running.remove(seq)
                self.load.recent_service_s.append(time.perf_counter() - seq.admitted)
                self.metrics.requests.labels(outcome).inc()
                self._gauges()
        seq.state = None

    def step(self, running: list[_Seq]) -> None:
        """One iteration: a prefill chunk for the oldest prefilling request, then one
        decode step for every request past prefill."""
        self.steps += 1
        prefilling = [s for s in running if s.pending < 0]
        if prefilling:
            self._prefill_chunk(prefilling[0])
        decoding = [s for s in running if s.pending >= 0 and s.req.finish_reason is None]
        if decoding:
            self._decode(decoding)

    # prefill
    def _prefill_chunk(self, seq: _Seq) -> None:
        req = seq.req
        ids = req.prompt_ids
        if not seq.restored:
            seq.state, seq.pos = self.cache.restore(ids, req.keys, req.work)
            seq.restored = True
            self.metrics.restore_time.observe(req.work.restore_ms / 1e3)
        end = min(len(ids), seq.pos + self.cfg.prefill_chunk)
        t0 = time.perf_counter()
        logits = self.model.prefill(seq.state, ids[seq.pos : end])
        seq.prefill_s += time.perf_counter() - t0
        req.work.prefilled_tokens += end - seq.pos
        seq.pos = end
        if seq.pos < len(ids):
            return
        req.work.prefill_ms = seq.prefill_s * 1e3
        self.metrics.prefill_time.observe(seq.prefill_s)
        self.cache.store(seq.state, ids, req.keys)
        self._count_prompt(req)
        req.push("first", None)
        last = logits[-1] if logits.dim() == 2 else logits
        self._emit(seq, sample(last, req.params, seq.gen))
        self.metrics.ttft.observe(time.perf_counter() - req.arrived)

    def _count_prompt(self, req: Request) -> None:
        w = req.work
        for source, n in (
            ("hbm", w.hbm_tokens),
            ("host", w.host_tokens),
            ("ssd", w.ssd_tokens),
            ("swa", w.swa_tokens),
            ("replayed", w.replayed_tokens),
            ("prefilled", w.prefilled_tokens),
        ):
            if n:
                self.metrics.prompt_tokens.labels(source).inc(n)

    # decode
    def _decode(self, seqs: list[_Seq]) -> None:
        t0 = time.perf_counter()
        before = sum(len(s.req.tokens) for s in seqs)
        plain = seqs
        if self.spec is not None and self.cfg.speculate:
            plain = []
            for seq in seqs:
                if seq.req.params.temperature > 0:
                    plain.append(seq)
                    continue
                left = seq.req.params.max_new_tokens - len(seq.req.tokens)
                tokens = self.spec.step(seq.state, seq.pending, len(seqs), left)
                if tokens is None:
                    plain.append(seq)
                    continue
                for tok in tokens:
                    if not self._emit(seq, tok):
                        break
        if plain:
            logits = self.model.decode_batch([s.state for s in plain], [s.pending for s in plain])
            for seq, row in zip(plain, logits, strict=True):
                self._emit(seq, sample(row, seq.req.params, seq.gen))
            if self.spec is not None:
                self.spec.observe_plain(len(plain), time.perf_counter() - t0)
        dt = time.perf_counter() - t0
        produced = sum(len(s.req.tokens) for s in seqs) - before
        rate = produced / dt if dt > 0 else 0.0
        self.decode_tokens_per_s = 0.8 * self.decode_tokens_per_s + 0.2 * rate
        self.metrics.decode_step.observe(dt)
        self.metrics.decode_batch.set(len(seqs))
        if self.spec is not None:
            self.metrics.spec_acceptance.set(self.spec.acceptance)
            self.metrics.tokens_per_step.set(self.spec.tokens_per_step)

    def _emit(self, seq: _Seq, token: int) -> bool:
        """Deliver one token; releases the slot when the request finishes."""
        req = seq.req
        if req.cancelled:
            return False
        if token in self.eos_ids:
            req.finish("stop")
            self._release(seq, "ok")
            return False
        self.metrics.generated_tokens.inc()
        if not req.emit_token(token, self.detokenize([token])):
            self._release(seq, "ok")
            return False
        seq.pending = token
        return True
