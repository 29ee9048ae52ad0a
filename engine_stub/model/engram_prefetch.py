"""Engram prefetch: every Engram layer's rows are a function of token ids only, so a forward
pass starts fetching them from host memory before layer 0 runs, and a layer blocks only if
its rows are not there yet when it needs them.

    pf = EngramPrefetcher(weights, compressed_ids, device, overlap=True)
    fetch = pf.start(pf.segment_ids(segs))  # before layer 0: one job per Engram layer, in order
    emb = fetch.get(layer)                  # [N, 24*Dh] fp32 on the model's device
    fetch.finish()                          # in a finally: settles unfinished jobs, adds stats
    pf.close()                              # joins the worker; later forwards fetch inline

Where the bytes live and who moves them:

* CPU: the tables are host memory. One worker thread per model (a one-thread
  ``ThreadPoolExecutor``, created on first use) hashes the rows and gathers and dequantizes
  them; torch releases the GIL inside its ops, so this runs while the forward computes the
  earlier layers (layer 1's rows beside layer 0, layer 14's beside layers 0-13).
* CUDA: the tables are pinned host memory (``Weights`` keeps them there). The worker hashes
  rows on the host, gathers the FP8 bytes and exponents into pinned buffers, copies them to
  the device on a side stream (``non_blocking``) and dequantizes there, recording an event;
  the consuming stream waits on that event (a device-side wait, the host does not block on
  the copy). The rows tensor is handed to the consuming stream with ``record_stream``.
* ``overlap=False``, a closed prefetcher, or an interpreted Triton backend: the same fetch
  runs inline when the layer needs it (the synchronous baseline; all of it is exposed). The
  Triton interpreter patches ``triton.language`` globally while a kernel runs, so two
  threads must never interpret kernels at once.

Results are bitwise equal with and without overlap: the same ops on the same inputs, and the
backend a caller forces with ``kernels.dispatch.use_backend`` is carried into the worker.

Batches and threads: one ``start`` covers all segments of a pass (rows in segment order, as
the projections expect); the token context is read on the calling thread before the job is
queued, so the worker never touches sequence state. Several threads may run forwards at once:
each holds its own handle, the single worker serialises the jobs, and the totals are updated
under a lock.

Accounting, per forward and accumulated in ``EngramStats``: ``bytes`` = rows x (Dh + Dh/32)
read from the tables (on CUDA exactly the bytes copied to the device); ``seconds`` = wall time
of the fetch jobs; ``wait_seconds`` = time the forward blocked for rows (exposed);
``forwards`` = passes.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from kernels import dispatch as ops

from .tokenizer import PAD

if TYPE_CHECKING:
    from .forward import Segment
    from .weights import Weights

CONTEXT = 3  # tokens before a segment's first row that its 4-grams read


@dataclass
class EngramStats:
    bytes: int = 0
    seconds: float = 0.0  # fetch job wall time (in the worker when overlapped)
    rows: int = 0
    wait_seconds: float = 0.0  # time forwards blocked waiting for rows (exposed)
    forwards: int = 0


@dataclass(frozen=True)
class HashIds:
    ids: torch.Tensor  # [sum(3 + T_i)] int64 host: each segment's context, then its tokens
    keep: torch.Tensor | None  # [sum T_i] rows of one engram_rows call that are real rows


@dataclass
class _Fetched:
    emb: torch.Tensor  # [N, 24*Dh] fp32 on the model's device
    event: Any  # torch.cuda.Event the consumer waits on (CUDA), else None
    rows: int
    nbytes: int
    seconds: float


class EngramPrefetcher:
    def __init__(
        self, weights: Weights, compressed: torch.Tensor, device: torch.device, overlap: bool
    ) -> None:
        self.w = weights
        self.device = device
        self.overlap = overlap
        self._cuda = device.type == "cuda"
        self._compressed = compressed.cpu()
        # Hash parameters on the host: rows are computed there, from token ids.
        self._hash = {
            layer: (ew.mult.cpu(), ew.primes.cpu(), ew.offsets.cpu())
            for layer, ew in weights.engram.items()
        }
        self._stream = (
            torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]  # torch's stub
            if self._cuda
            else None
        )
        self._lock = threading.Lock()
        self._stats = EngramStats()
        self._pool: ThreadPoolExecutor | None = None
        self._finalizer: weakref.finalize[Any, EngramPrefetcher] | None = None
        self._closed = False

    # -- inputs ---------------------------------------------------------------------

    def segment_ids(self, segs: list[Segment]) -> HashIds:
        """The host ids the rows hash, read on the calling thread (jobs never touch sequence
        state): per segment the 3 tokens before p0 (pad before the sequence start or where
        the state no longer knows them), then its new tokens; segments concatenated, so one
        `engram_rows` call serves a whole batch."""
        parts, keep, base = [], [], 0
        for sg in segs:
            known = sg.st.tokens
            first_known = sg.st.n_tokens - len(known)
            ctx = []
            for p in range(sg.p0 - CONTEXT, sg.p0):
                off = p - first_known
                ctx.append(known[off] if p >= 0 and 0 <= off < len(known) else PAD)
            new = sg.ids.cpu()
            parts.append(torch.cat((torch.tensor(ctx, dtype=torch.int64), new)))
            n = int(new.shape[0])
            keep.append(torch.arange(base, base + n))
            base += CONTEXT + n
        if len(parts) == 1:
            return HashIds(parts[0], None)
        return HashIds(torch.cat(parts), torch.cat(keep))

    def rows(self, layer: int, ids: HashIds) -> torch.Tensor:
        """Host rows [N, 24] int64 of one Engram layer for all segments' new tokens."""
        mult, primes, offsets = self._hash[layer]
        # Row k hashes ids[k : k + 4]; rows straddling two segments are dropped.
        rows = ops.engram_rows(self._compressed[ids.ids], mult, primes, offsets)
        return rows if ids.keep is None else rows[ids.keep]

    # -- the pass -------------------------------------------------------------------

    def start(self, ids: HashIds) -> EngramFetch:
        backend = ops.forced_backend()
        pool = self._worker(backend)
        fetch = EngramFetch(self, ids, backend)
        if pool is not None:
            for layer in self.w.engram:  # dict order = layer order: layer 1's job first
                fetch.futures[layer] = pool.submit(self._job, layer, ids, backend)
        return fetch

    def _worker(self, backend: str) -> ThreadPoolExecutor | None:
        if not self.overlap or self._closed:
            return None
        probe = torch.zeros(1, dtype=torch.int64)
        if not self._cuda and ops.active_backend(probe) == "triton":
            return None  # interpreted kernels: never on two threads at once
        with self._lock:
            if self._closed:
                return None
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-prefetch")
                self._finalizer = weakref.finalize(self, self._pool.shutdown, wait=False)
            return self._pool

    def _job(self, layer: int, ids: HashIds, backend: str) -> _Fetched:
        t0 = time.perf_counter()
        ew = self.w.engram[layer]
        with ops.use_backend(backend), torch.no_grad():
            rows = self.rows(layer, ids)
            nbytes = rows.numel() * (ew.table.shape[1] + ew.exp.shape[1])
            event = None
            if self._cuda:
                emb, event = self._to_device(ew.table, ew.exp, rows)
            else:
                emb = ops.engram_gather(ew.table, ew.exp, rows)
        return _Fetched(emb, event, rows.numel(), nbytes, time.perf_counter() - t0)

    def _to_device(
        self, table: torch.Tensor, exp: torch.Tensor, rows: torch.Tensor
    ) -> tuple[torch.Tensor, Any]:
        """Gather the FP8 rows on the host into pinned buffers, copy them on the side stream,
        dequantize there; returns the rows and the event that marks them ready."""
        flat = rows.flatten()
        n = flat.numel()
        tb = torch.empty((n, table.shape[1]), dtype=table.dtype, pin_memory=True)
        eb = torch.empty((n, exp.shape[1]), dtype=exp.dtype, pin_memory=True)
        torch.index_select(table, 0, flat, out=tb)
        torch.index_select(exp, 0, flat, out=eb)
        assert self._stream is not None
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            dt = tb.to(self.device, non_blocking=True)
            de = eb.to(self.device, non_blocking=True)
            local = torch.arange(n, device=self.device).view(rows.shape)
            emb = ops.engram_gather(dt, de, local)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch's stub
            event.record(self._stream)
        return emb, event

    def _account(self, done: list[_Fetched], waited: float) -> None:
        with self._lock:
            s = self._stats
            for f in done:
                s.bytes += f.nbytes
                s.rows += f.rows
                s.seconds += f.seconds
            s.wait_seconds += waited
            s.forwards += 1

    @property
    def stats(self) -> EngramStats:
        """A snapshot of the running totals."""
        with self._lock:
            return replace(self._stats)

    def close(self) -> None:
        """Join the worker (idempotent). Later forwards fetch inline."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
            if self._finalizer is not None:
                self._finalizer.detach()
                self._finalizer = None
        if pool is not None:
            pool.shutdown(wait=True)


class EngramFetch:
    """One forward pass's Engram rows: `get(layer)` once per Engram layer, then `finish()`."""

    def __init__(self, pf: EngramPrefetcher, ids: HashIds, backend: str) -> None:
        self.pf = pf
        self.ids = ids
        self.backend = backend
        self.futures: dict[int, Future[_Fetched]] = {}
        self._done: list[_Fetched] = []
        self._waited = 0.0
        self._finished = False

    def get(self, layer: int) -> torch.Tensor:
        t0 = time.perf_counter()
        fut = self.futures.pop(layer, None)
        got = self.pf._job(layer, self.ids, self.backend) if fut is None else fut.result()
        if got.event is not None:
            stream = torch.cuda.current_stream(self.pf.device)
            stream.wait_event(got.event)
            got.emb.record_stream(stream)
        self._waited += time.perf_counter() - t0
        self._done.append(got)
        return got.emb

    def finish(self) -> None:
        """Settle jobs never asked for (a pass that raised): cancel those not started, wait
        for the running one, so no job outlives its pass. Then add this pass to the totals."""
        if self._finished:
            return
        self._finished = True
        for fut in self.futures.values():
            if not fut.cancel():
                # the pass is already failing; its error is the one to see, not the fetch's
                with contextlib.suppress(Exception):
                    self._done.append(fut.result())
        self.futures.clear()
        self.pf._account(self._done, self._waited)


__all__ = ["CONTEXT", "EngramFetch", "EngramPrefetcher", "EngramStats", "HashIds"]
