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

Scheduling policy (`SchedulerConfig.policy`, `--scheduling-policy`):

- `fcfs` (default): admission and prefill in arrival order, as above.
- `priority`: each request's integer `priority` (the router's hint, `ramjet.app.priority`:
  predicted work + aging x arrival in ms; lowest first, ties by arrival; a request
  without one has 0, as in vLLM). Two variants (`--priority-variant`):
  - `chunk` (the simulator's chunk-preemptive model): admission by priority, and at
    every chunk boundary the best prefilling request runs the next chunk, so a short
    arrival preempts a long prompt's prefill after at most one chunk. With every slot
    taken, a waiting request better than the worst running request still prefilling
    takes that one's slot (its prefilled state is kept and resumes later).
  - `vllm` (vLLM V1's `--scheduling-policy priority`): running requests are served
    first, in the order they were admitted, each taking what it needs of the step's
    token budget (`prefill_chunk`); a waiting request is admitted (best priority
    first) only when a step has budget left over, and prefills with that leftover. A
    running prefill is never preempted by a better arrival: priority only orders the
    waiting queue. (vLLM also preempts its lowest-priority running request when KV
    blocks run short; this engine's HBM is not reserved per running request, so that
    path does not arise here.)
- Metrics: `engine_queue_wait_by_band_seconds{band}` (arrival to first prefill chunk,
  by the hint's work band, decoded as priority - aging x arrival_ms with the engine's
  `priority_aging`), `engine_oldest_waiting_seconds` (the oldest request without its
  first token), `engine_priority_preemptions_total`.

Admission control: `submit` raises `QueueFull` once `max_queue` requests wait; the
server answers 503 with a Retry-After estimated from recent service times.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from engine_stub.metrics import EngineMetrics
from engine_stub.prompt_cache import PromptCache
from engine_stub.request import Request, sample
from engine_stub.speculation import Speculator
from ramjet.config import DEFAULT_AGING

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
    policy: str = "fcfs"
    """"fcfs" or "priority" (see the module docstring)."""
    variant: str = "chunk"
    """Under priority: "chunk" (preempt at chunk boundaries) or "vllm" (vLLM V1's)."""
    priority_aging: float = DEFAULT_AGING
    """The router's aging, used only to decode a hint's work band for the metrics (a
    hint over the router's cap, aging x horizon, decodes as the cap)."""

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be fcfs or priority, not {self.policy!r}")
        if self.variant not in ("chunk", "vllm"):
            raise ValueError(f"priority variant must be chunk or vllm, not {self.variant!r}")


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
    order: int = 0
    """Arrival order: ties of equal priority go to the earlier."""
    started: bool = False
    """Whether a prefill chunk has run (the queue wait ends there)."""

    def rank(self) -> tuple[int, int]:
        return (self.req.priority, self.order)


BANDS = ((0.1, "lt_0.1s"), (1.0, "0.1_1s"), (10.0, "1_10s"), (float("inf"), "ge_10s"))


def priority_band(priority: int, arrived_unix: float, aging: float) -> str:
    """The hint's work band: priority - aging x arrival (ms) is the predicted work; a
    value that is no hint (negative, or implausibly far from now) is "other"."""
    work_s = (priority - round(1000.0 * aging * arrived_unix)) / 1000.0
    if not 0.0 <= work_s < 86400.0:
        return "other"
    return next(name for bound, name in BANDS if work_s < bound)


class WaitQueue:
    """The waiting requests: arrival order (fcfs) or a heap on (priority, arrival)."""

    def __init__(self, by_priority: bool) -> None:
        self.by_priority = by_priority
        self._fifo: collections.deque[_Seq] = collections.deque()
        self._heap: list[tuple[tuple[int, int], _Seq]] = []

    def __len__(self) -> int:
        return len(self._heap) if self.by_priority else len(self._fifo)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self) -> Iterator[_Seq]:
        if self.by_priority:
            return iter([s for _, s in self._heap])
        return iter(list(self._fifo))

    def push(self, seq: _Seq) -> None:
        if self.by_priority:
            heapq.heappush(self._heap, (seq.rank(), seq))
        else:
            self._fifo.append(seq)

    def peek(self) -> _Seq:
        return self._heap[0][1] if self.by_priority else self._fifo[0]

    def pop(self) -> _Seq:
        return heapq.heappop(self._heap)[1] if self.by_priority else self._fifo.popleft()

    def clear(self) -> None:
        self._fifo.clear()
        self._heap.clear()


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
        self._priority = config.policy == "priority"
        self._vllm = self._priority and config.variant == "vllm"
        self._waiting = WaitQueue(self._priority)
        self._order = itertools.count()
        self._running: list[_Seq] = []
        self._stop = False
        self._thread: threading.Thread | None = None
        self.load = LoadStats()
        self.steps = 0
        self.decode_tokens_per_s = 0.0
        """EMA of tokens produced per second by decode steps (whole batch)."""
        metrics.oldest_waiting.set_function(self.oldest_waiting_s)

    # -- loop side ------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        """Queue a request; raises QueueFull (and queues nothing) when the queue is full."""
        with self._cond:
            if len(self._waiting) >= self.cfg.max_queue:
                raise QueueFull(self._retry_after())
            req.work.epoch = self.epoch
            if not self._priority:
                req.priority = 0
            seq = _Seq(req, gen=req.params.generator(), order=next(self._order))
            self._waiting.push(seq)
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
        """Prompt tokens waiting or not yet prefilled: what the engine will compute, as
        the router counts its in-flight work. A request not started yet counts its prompt
        less the resident global-KV prefix it will restore (looked up now, outside the
        scheduler's lock); one started, what it has left."""
        with self._cond:
            seqs = [*self._waiting, *(s for s in self._running if s.pending < 0)]
            left = [(s.req, len(s.req.prompt_ids) - s.pos, s.restored or s.pos > 0) for s in seqs]
        total = 0
        block = self.cache.block
        for req, n, started in left:
            if not started and req.keys.blocks:
                usable = max(0, (len(req.prompt_ids) - 1) // block)
                n -= len(self.cache.kv.lookup(req.keys.blocks[:usable])) * block
            total += max(n, 0)
        return total

    def oldest_waiting_s(self) -> float:
        """Age of the oldest request without its first token (waiting or prefilling)."""
        now = time.perf_counter()
        with self._cond:
            seqs = [*self._waiting, *(s for s in self._running if s.pending < 0)]
            return max((now - s.req.arrived for s in seqs), default=0.0)

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
        if self._vllm:
            # vLLM: a waiting request is admitted only with token budget left in the step
            # after the running prefills took theirs (decodes' single tokens not counted)
            left = self.cfg.prefill_chunk - sum(
                len(s.req.prompt_ids) - s.pos for s in self._running if s.pending < 0
            )
        else:
            left = 1
        while self._waiting and len(self._running) < self.cfg.max_batch and left > 0:
            seq = self._waiting.pop()
            if seq.req.cancelled:
                self.metrics.requests.labels("cancelled").inc()
                continue
            self._start(seq, now)
            if self._vllm:
                left -= len(seq.req.prompt_ids) - seq.pos
        if self._priority and not self._vllm:
            self._preempt_slots(now)

    def _start(self, seq: _Seq, now: float) -> None:
        if not seq.admitted:
            seq.admitted = now
            seq.req.work.queue_ms = (now - seq.req.arrived) * 1e3
            self.metrics.queue_time.observe(now - seq.req.arrived)
        self._running.append(seq)

    def _preempt_slots(self, now: float) -> None:
        """Chunk variant, every slot taken: a waiting request better than the worst
        running one still prefilling takes its slot (the other keeps its state)."""
        while self._waiting and len(self._running) >= self.cfg.max_batch:
            cands = [s for s in self._running if s.pending < 0]
            if not cands:
                return
            worst = max(cands, key=_Seq.rank)
            best = self._waiting.peek()
            if best.rank() >= worst.rank():
                return
            self._running.remove(worst)
            self._waiting.push(worst)
            self.metrics.preemptions.inc()
            seq = self._waiting.pop()
            if seq.req.cancelled:
                self.metrics.requests.labels("cancelled").inc()
                continue
            self._start(seq, now)

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
        if prefilling and self._vllm:
            # running requests in admission order share the step's token budget
            budget = self.cfg.prefill_chunk
            for seq in prefilling:
                if budget <= 0:
                    break
                budget -= self._prefill_chunk(seq, budget)
        elif prefilling:
            pick = min(prefilling, key=_Seq.rank) if self._priority else prefilling[0]
            self._prefill_chunk(pick, self.cfg.prefill_chunk)
        decoding = [s for s in running if s.pending >= 0 and s.req.finish_reason is None]
        if decoding:
            self._decode(decoding)

    # prefill
    def _prefill_chunk(self, seq: _Seq, budget: int) -> int:
        """One chunk of at most `budget` tokens; returns the tokens prefilled."""
        req = seq.req
        ids = req.prompt_ids
        if not seq.started:
            seq.started = True
            wait = time.perf_counter() - req.arrived
            band = priority_band(req.priority, req.arrived_unix, self.cfg.priority_aging)
            self.metrics.queue_wait_band.labels(band if self._priority else "fcfs").observe(wait)
        if not seq.restored:
            seq.state, seq.pos = self.cache.restore(ids, req.keys, req.work)
            seq.restored = True
            self.metrics.restore_time.observe(req.work.restore_ms / 1e3)
        start = seq.pos
        end = min(len(ids), seq.pos + budget)
        t0 = time.perf_counter()
        logits = self.model.prefill(seq.state, ids[seq.pos : end])
        seq.prefill_s += time.perf_counter() - t0
        req.work.prefilled_tokens += end - seq.pos
        seq.pos = end
        if seq.pos < len(ids):
            return end - start
        req.work.prefill_ms = seq.prefill_s * 1e3
        self.metrics.prefill_time.observe(seq.prefill_s)
        self.cache.store(seq.state, ids, req.keys)
        self._count_prompt(req)
        req.push("first", None)
        last = logits[-1] if logits.dim() == 2 else logits
        self._emit(seq, sample(last, req.params, seq.gen))
        self.metrics.ttft.observe(time.perf_counter() - req.arrived)
        return end - start

    def _count_prompt(self, req: Request) -> None:
        w = req.work
        for source, n in (
            ("hbm", w.hbm_tokens),
            ("host", w.host_tokens),
            ("ssd", w.ssd_tokens),
            ("pool", w.pool_tokens),
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
        if token in self.eos_ids and not req.params.ignore_eos:
            req.finish("stop")
            self._release(seq, "ok")
            return False
        self.metrics.generated_tokens.inc()
        if not req.emit_token(token, self.detokenize([token])):
            self._release(seq, "ok")
            return False
        seq.pending = token
        return True
