"""A loop-turn tracer for the residency benchmarks: where a long event-loop iteration's
CPU went. Diagnostic only (a benchmark turns it on with `RAMJET_TRACE_TURNS_MS`).

Per loop iteration (`BaseEventLoop._run_once`): the loop thread's CPU, the CPU of each
callback it ran (`asyncio.Handle._run`), the cyclic GC's time by generation
(`gc.callbacks`), its minor page faults (first touches of fresh memory:
`getrusage(RUSAGE_THREAD)`), and stacks sampled every ~2 ms by a thread while the loop has been
out of `select()` for over 4 ms (`sys._current_frames`; compiled modules show no frames of their own,
so a sample names the innermost Python frame that called into them). `report()` prints
the `keep` longest iterations by CPU, those over the threshold counted, each with its start on
CLOCK_MONOTONIC (`time.perf_counter`), so samples of `perf record -k CLOCK_MONOTONIC`
taken meanwhile can be cut to that iteration.
"""

from __future__ import annotations

import asyncio
import gc
import heapq
import resource
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from types import FrameType
from typing import Any

_THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
"""The loop thread's own minor page faults (Linux), else the process's."""


def _where(frame: FrameType | None, depth: int = 6) -> str:
    out: list[str] = []
    while frame is not None and len(out) < depth:
        code = frame.f_code
        name = code.co_filename.rsplit("/", 2)
        out.append(f"{'/'.join(name[-2:])}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return " < ".join(out)


def _name(h: asyncio.Handle) -> str:
    """The callback's name, or the coroutine a task step or wakeup runs (never a repr of
    the arguments: a future's result can be a whole report)."""
    cb = h._callback  # type: ignore[attr-defined]
    owner = getattr(cb, "__self__", None)
    if isinstance(owner, asyncio.Task):
        return f"{getattr(cb, '__name__', 'step')} {owner.get_coro().__qualname__}"  # type: ignore[union-attr]
    return getattr(cb, "__qualname__", type(cb).__name__)


class LoopTracer:
    def __init__(self, threshold_s: float, paused: Callable[[], bool], keep: int = 10) -> None:
        self.threshold_s = threshold_s
        self.paused = paused
        self.keep = keep
        self.over = 0
        self.turns = 0
        self._top: list[tuple[float, int, dict[str, Any]]] = []
        self._cbs: list[tuple[float, str]] = []
        self._gc: list[tuple[int, float]] = []
        self._samples: list[str] = []
        self._gc_t0 = 0.0
        self._busy_since = 0.0
        self._stop = False
        self._undo: list[Callable[[], None]] = []

    def start(self) -> LoopTracer:
        loop = asyncio.get_running_loop()
        orig_once = loop._run_once  # type: ignore[attr-defined]
        handle_cls = asyncio.events.Handle
        orig_run = handle_cls._run

        def run_once() -> None:
            self._cbs, self._gc, self._samples = [], [], []
            f0 = resource.getrusage(_THREAD).ru_minflt
            c0, w0 = time.thread_time(), time.perf_counter()
            try:
                orig_once()
            finally:
                cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
                self._end(cpu, wall, w0, resource.getrusage(_THREAD).ru_minflt - f0)

        def handle_run(h: asyncio.Handle) -> None:
            c0 = time.thread_time()
            try:
                orig_run(h)
            finally:
                self._cbs.append((time.thread_time() - c0, _name(h)))

        selector = loop._selector  # type: ignore[attr-defined]
        orig_select = selector.select

        def select(timeout: float | None = None) -> Any:
            self._busy_since = 0.0
            try:
                return orig_select(timeout)
            finally:
                self._busy_since = time.perf_counter()

        selector.select = select
        loop._run_once = run_once  # type: ignore[attr-defined]
        handle_cls._run = handle_run  # type: ignore[method-assign,assignment]
        gc.callbacks.append(self._on_gc)
        main = threading.get_ident()
        sampler = threading.Thread(target=self._sample, args=(main,), daemon=True)
        sampler.start()

        def undo() -> None:
            self._stop = True
            loop._run_once = orig_once  # type: ignore[attr-defined]
            selector.select = orig_select
            handle_cls._run = orig_run  # type: ignore[method-assign]
            gc.callbacks.remove(self._on_gc)
            sampler.join()

        self._undo.append(undo)
        return self

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self._gc.append((info["generation"], time.perf_counter() - self._gc_t0))

    def _sample(self, main: int) -> None:
        while not self._stop:
            time.sleep(0.002)
            start = self._busy_since  # the loop thread out of select() since then
            if start and time.perf_counter() - start > 0.004:
                samples = self._samples
                samples.append(_where(sys._current_frames().get(main)))

    def _end(self, cpu: float, wall: float, start: float, faults: int) -> None:
        self.turns += 1
        if self.paused() or cpu < self.threshold_s / 4:
            return
        if cpu >= self.threshold_s:
            self.over += 1
        rec = {
            "cpu_ms": cpu * 1e3,
            "wall_ms": wall * 1e3,
            "faults": faults,
            "start": start,
            "gc_ms": [(g, round(t * 1e3, 2)) for g, t in self._gc],
            "callbacks": sorted(self._cbs, reverse=True)[:3],
            "samples": Counter(self._samples).most_common(4),
        }
        item = (cpu, self.turns, rec)
        if len(self._top) < self.keep:
            heapq.heappush(self._top, item)
        elif cpu > self._top[0][0]:
            heapq.heapreplace(self._top, item)

    def stop(self) -> None:
        for undo in self._undo:
            undo()
        self._undo.clear()

    def report(self, label: str) -> None:
        print(
            f"  [trace {label}] {self.turns:,} loop iterations, {self.over} over "
            f"{self.threshold_s * 1e3:.0f} ms CPU; the longest:",
            file=sys.stderr,
        )
        for cpu, turn, rec in sorted(self._top, reverse=True):
            print(
                f"    #{turn}: {cpu * 1e3:.1f} ms CPU (wall {rec['wall_ms']:.1f}), "
                f"{rec['faults']:,} page faults, gc {rec['gc_ms']}, at {rec['start']:.6f} s (CLOCK_MONOTONIC: "
                f"`perf record -k CLOCK_MONOTONIC` samples line up)",
                file=sys.stderr,
            )
            for c, r in rec["callbacks"]:
                print(f"      cb {c * 1e3:.1f} ms {r}", file=sys.stderr)
            for s, k in rec["samples"]:
                print(f"      x{k} {s}", file=sys.stderr)
        sys.stderr.flush()
