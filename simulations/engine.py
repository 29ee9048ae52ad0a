"""One simulated engine: a prefill queue served in chunks, batched decode, and its caches.

Prefill. One job prefills at a time, in chunks of `chunk_tokens` (a forward pass each).
When a job starts, the engine resolves its resume point from its caches *at that moment*
with the same rule the cost model predicts with (`ramjet.policy.cost.prompt_work`: live
SWA at q, or the global prefix g with restore + bounded replay, or cold). The first
chunk carries the restore and replay time; chunk i costs the prefill curve's integral
over its token range (plus the profile's fixed overhead once per job). While any request
is decoding, each chunk also carries one decode step (chunked prefill interleaves the
running batch's decode with prefill: the interference the cost model charges).
Restores are serial with prefill here (a real engine may overlap them: pessimistic).

Scheduling. FCFS: the queue in arrival order, a job runs to its first token. Priority:
a heap on `min(hint, aging · horizon) + aging · arrival` where the hint is the router's
predicted prompt work (seconds; `ramjet.policy.priority_key`, the router's key); since
every waiting job ages at the same rate, that static key orders jobs as "least predicted
work first, forgiving `aging` seconds of work per second waited", and with a `horizon`
no job is overtaken by one that arrived more than `horizon` seconds after it. The
running job is re-queued at each chunk boundary with its remaining work (preemption at
chunk granularity: `priority`, the chunk-preemptive engine; the reference engine's
`--priority-variant chunk`).

vLLM's variant (`vllm-priority`, vLLM V1 with `--scheduling-policy priority`): the same
heap orders the *waiting* jobs, but a job that has started is never preempted by a better
arrival. vLLM schedules its running requests first each step, each taking what it needs
of the step's token budget (`max_num_batched_tokens`, here `chunk_tokens`); waiting
requests, best (priority, arrival) first, get only the budget left over. So a running
long prefill keeps the whole budget until its last chunk, and the leftover of that last
chunk goes to the best waiting job in the same forward pass (no second decode step).
vLLM's other preemption, of its lowest-priority running request when KV blocks run
short, is not modelled: running requests reserve no HBM here (see Decode). `vllm-fcfs`
is the same step packing in arrival order (vLLM's default policy), to separate the
packing's effect from the priority order's.

Decode. A request decodes `ceil(output / spec_tokens_per_step)` steps of `decode_step_s`
after its first token (batch size does not stretch a step: an approximation), then
finishes: its SWA state is stored at its last full block and it leaves the in-flight set.
Global KV blocks of the prompt become resident (HBM, promoted if restored) at the first
token; cache capacity is not reserved for running requests (an approximation; at 890
bytes per token the running set is a rounding error of HBM).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable

from ramjet.policy.base import GlobalMatch, KeyedQueue
from ramjet.policy.cost import prompt_work
from ramjet.policy.priority_key import hint_key_s
from ramjet.types import EngineId, PrefixKey
from simulations.cache import SwaPool, TieredCache
from simulations.fabric import FabricCache, Pools
from simulations.preset import PACKING_SCHEDULERS, EngineSpec
from simulations.workload import Request


class Job:
    __slots__ = (
        "arrival",
        "ctx",
        "end",
        "engine",
        "first_token_s",
        "hint_s",
        "hit",
        "key",
        "pending_s",
        "predicted_new",
        "replay",
        "req",
        "restore_s",
        "resume",
        "start_s",
        "started",
    )

    def __init__(self, req: Request, engine: int, predicted_new: int, hint_s: float) -> None:
        self.req = req
        self.arrival = req.arrival_s
        self.engine = engine
        self.predicted_new = predicted_new
        self.hint_s = hint_s
        self.key = 0.0
        self.started = False
        self.start_s = 0.0
        self.ctx = 0
        self.end = req.prompt_tokens
        self.pending_s = 0.0
        self.resume = "cold"
        self.hit = (0, 0, 0)
        self.replay = False
        self.restore_s = 0.0
        self.first_token_s = 0.0


class Engine:
    """See the module docstring. `schedule(t, fn)` is the simulator's event hook."""

    def __init__(
        self,
        index: int,
        spec: EngineSpec,
        cache: TieredCache | FabricCache,
        swa: SwaPool,
        schedule: Callable[[float, Callable[[float], None]], None],
        on_start: Callable[[Job, float], None],
        on_first_token: Callable[[Job, float], None],
        on_finish: Callable[[Job, float], None] | None = None,
        pools: Pools | None = None,
    ) -> None:
        self.index = index
        self.id = EngineId(f"e{index}")
        self.spec = spec
        self.profile = spec.profile
        self.cache = cache
        self.swa = swa
        self._schedule = schedule
        self._on_start = on_start
        self._on_first_token = on_first_token
        self._on_finish = on_finish
        self.pools = pools
        """The shared fabric's pools (`simulations.fabric`): restores are pulls over their
        links, computed blocks are written through. None: islands."""
        self.priority = spec.scheduler in ("priority", "vllm-priority")
        """A heap on the key orders the waiting jobs."""
        self.preempt = spec.scheduler == "priority"
        """The running job is re-queued at each chunk boundary."""
        self.pack = spec.scheduler in PACKING_SCHEDULERS
        """vLLM: a job's last chunk leaves the step's budget to the next job."""
        self._carry = 0
        self._left = 0
        self.fifo: deque[Job] = deque()
        self.heap: list[tuple[float, int, Job]] = []
        self._seq = 0
        self.current: Job | None = None
        self.queued_tokens = 0
        self.pending: dict[PrefixKey, int] = {}
        """Blocks of requests queued here, not yet prefilled: resident by the time a
        request routed now starts (the engine knows its queue; exact views include it)."""
        self.inflight = 0
        self.decoding = 0
        self.decode_tokens = 0
        self.busy_s = 0.0
        self.window: tuple[float, float] | None = None
        """Measurement window (closed-loop steady state): busy time inside it is summed
        in `busy_window_s` as well."""
        self.busy_window_s = 0.0
        self.prefilled_tokens = 0
        self.overhead = self.profile.prefill_overhead_s
        self.step_s = self.profile.decode_step_s
        self.tokens_per_step = self.profile.spec_tokens_per_step

    # -- queue -----------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return len(self.heap) if self.priority else len(self.fifo)

    def keyed_queue(self, charge_jumps: bool = True) -> KeyedQueue:
        """A priority engine's queue as the cost model's priority-aware wait reads it
        (`FleetStats.keyed`): each job's key and predicted tokens left; the job in
        prefill is the started one. `charge_jumps`: `KeyedQueue.charge_jumps`."""
        entries = [(j.key, j.predicted_new, False) for _, _, j in self.heap]
        cur = self.current
        if cur is not None:
            entries.append((cur.key, cur.predicted_new, True))
        return KeyedQueue(
            self.spec.aging, self.spec.horizon_s, self.preempt, tuple(entries), charge_jumps
        )

    def submit(self, job: Job, now: float) -> None:
        pending = self.pending
        for k in job.req.block_keys:
            pending[k] = pending.get(k, 0) + 1
        self.inflight += 1
        self.queued_tokens += job.predicted_new
        if self.priority:
            job.key = hint_key_s(job.hint_s, self.spec.aging, job.arrival, self.spec.horizon_s)
            self._seq += 1
            heapq.heappush(self.heap, (job.key, self._seq, job))
        else:
            self.fifo.append(job)
        if self.current is None:
            self._next(now)

    def _next(self, now: float) -> None:
        if self.priority:
            if not self.heap:
                self.current = None
                self._carry = 0
                return
            job = heapq.heappop(self.heap)[2]
        else:
            if not self.fifo:
                self.current = None
                self._carry = 0
                return
            job = self.fifo.popleft()
        self.current = job
        if not job.started:
            self._begin(job, now)
        self._chunk(now)

    # -- prefill ---------------------------------------------------------------------

    def _begin(self, job: Job, now: float) -> None:
        req = job.req
        hbm, host, ssd = self.cache.match(req.block_keys, req.block_tokens)
        # the furthest live SWA state within the global prefix held (on the shared SWA
        # pool a session's latest state may lie past what this engine can reach)
        q = self.swa.match_upto(req.boundaries, now, hbm + host + ssd) if req.boundaries else 0
        work = prompt_work(self.profile, req.prompt_tokens, GlobalMatch(hbm, host, ssd), q)
        job.started = True
        job.start_s = now
        job.resume = work.resume
        job.ctx = work.resume_tokens
        job.restore_s = work.restore_s
        job.replay = work.replay_s > 0
        if work.resume == "cold":
            job.hit = (0, 0, 0)
        elif work.resume == "swa":
            share = q / (hbm + host + ssd)
            job.hit = (round(hbm * share), round(host * share), round(ssd * share))
        else:
            job.hit = (min(hbm, req.prompt_tokens), host, ssd)
        pools = self.pools
        if pools is not None and work.resume != "cold":
            # the pull from the pool, queued behind the link's other transfers
            swa = work.resume == "swa" and pools.swa_remote(_key_at(req.boundaries, q), self.index)
            job.restore_s = pools.pull(now, job.hit[1], job.hit[2], swa)
        job.pending_s = job.restore_s + work.replay_s + self.overhead
        new = max(job.end - job.ctx, 0)
        self.queued_tokens += new - job.predicted_new
        job.predicted_new = new
        self._on_start(job, now)

    def _chunk(self, now: float) -> None:
        job = self.current
        assert job is not None
        carried = self._carry > 0  # vLLM: the rest of the step a job's last chunk left
        budget = self._carry if carried else self.spec.chunk_tokens
        self._carry = 0
        k = min(budget, job.end - job.ctx)
        self._left = budget - k
        dur = job.pending_s
        job.pending_s = 0.0
        if k > 0:
            dur += self.profile.prefill_seconds(k, job.ctx) - self.overhead
        if self.decoding > 0 and not carried:
            dur += self.step_s
        self.busy_s += dur
        w = self.window
        if w is not None:
            lo, hi = max(now, w[0]), min(now + dur, w[1])
            if hi > lo:
                self.busy_window_s += hi - lo
        self._schedule(now + dur, lambda t: self._chunk_done(job, k, t))

    def _chunk_done(self, job: Job, k: int, now: float) -> None:
        job.ctx += k
        job.predicted_new -= k
        self.queued_tokens -= k
        self.prefilled_tokens += k
        if job.ctx >= job.end:
            self._first_token(job, now)
            if self.pack:
                self._carry = self._left
            self._next(now)
        elif self.preempt:
            # re-queue with the remaining work; the best job runs next chunk
            remaining = self.profile.prefill_seconds(job.end - job.ctx, job.ctx)
            job.key = hint_key_s(remaining, self.spec.aging, job.arrival, self.spec.horizon_s)
            self._seq += 1
            heapq.heappush(self.heap, (job.key, self._seq, job))
            self._next(now)
        else:
            self._chunk(now)

    # -- first token and decode ------------------------------------------------------

    def _first_token(self, job: Job, now: float) -> None:
        job.first_token_s = now
        req = job.req
        self.cache.touch(req.block_keys)
        if self.pools is not None:
            self.pools.write_through(req.block_keys, req.block_tokens, now)
        pending = self.pending
        for k in req.block_keys:
            c = pending[k] - 1
            if c:
                pending[k] = c
            else:
                del pending[k]
        ctx = req.prompt_tokens + req.output_tokens
        self._on_first_token(job, now)
        steps = math.ceil(req.output_tokens / self.tokens_per_step)
        if steps == 0:  # nothing to decode: the request ends with its first token
            self.inflight -= 1
            if req.swa_key is not None:
                self._store_swa(req.swa_key, now)
            if self._on_finish is not None:
                self._on_finish(job, now)
            return
        self.decoding += 1
        self.decode_tokens += ctx
        self._schedule(now + steps * self.step_s, lambda t: self._finish(job, ctx, t))

    def _finish(self, job: Job, ctx: int, now: float) -> None:
        self.decoding -= 1
        self.decode_tokens -= ctx
        self.inflight -= 1
        if job.req.swa_key is not None:
            self._store_swa(job.req.swa_key, now)
        if self._on_finish is not None:
            self._on_finish(job, now)

    def _store_swa(self, key: PrefixKey, now: float) -> None:
        self.swa.store(key, now)
        if self.pools is not None:
            self.pools.swa_written(now, key, self.index)


def _key_at(boundaries: tuple[tuple[int, PrefixKey], ...], offset: int) -> PrefixKey | None:
    """The key of the boundary at `offset` (the SWA state a resume there reads)."""
    for off, k in reversed(boundaries):
        if off == offset:
            return k
    return None
