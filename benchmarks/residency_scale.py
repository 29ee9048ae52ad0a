"""Residency at production scale, in process: the compact store (`MemoryStore`, a
`BlockIndex` per engine) against today's dict store (`DictStore`), same run.

    .venv/bin/python benchmarks/residency_scale.py                      # quick: 1M blocks
    .venv/bin/python benchmarks/residency_scale.py --blocks 20000000    # the full figure
    .venv/bin/python benchmarks/residency_scale.py --quick              # make bench

Each store runs in its own subprocess (so its RSS is its own). N blocks are loaded into
one router's `ResidencyTables` through the real report path: signed frames
(`ramjet.reports.envelope.sign`, Ed25519), verified and applied by `ReportProcessor`:
first a snapshot of half the blocks (at least a body's worth) sent in parts of
`reports.max_keys` (524,288) keys (`SnapshotBody.part/parts`), then deltas of that size,
the first ones with a 1-hour TTL; all with `submit_async` (applied in steps). Printed per
store:

- router RSS per block: (RSS after loading - RSS before) / N (target <= 40 bytes);
- `global_match` p99 over 1,000 fresh views, for a 50k-token prompt (`--block-tokens`
  64: 782 blocks, the first 3/4 resident over three tiers), at 1M blocks and at N
  (target <= 1 ms); every answer checked against the blocks known resident;
- snapshot apply rate: keys / the router's CPU seconds in `submit_async` of the
  snapshot's parts (verify, parse, additive apply, the drop of unnamed blocks at the
  last part; target >= 1M blocks/s), and the delta apply rate; the longest loop stall
  while each runs. The router's CPU (`RouterCpu`) is the loop thread's CPU in every
  event-loop callback but the benchmark's own tasks' (the stall monitor, which spins
  on `asyncio.sleep(0)` and so burns a core whenever the loop would otherwise wait:
  all the time the worker thread parses a frame), plus every other thread's CPU (that
  worker). Each rate is also printed over the process's CPU, the monitor included
  (how it was measured before 2026-12-07): 5-7 % lower at 20M blocks;
- the longest event-loop stall (a coroutine yielding in a loop measures the gaps, in CPU
  time of the loop's thread and in wall time) while the expiry sweep drops the 1-hour
  half (`ResidencyTables.expire_step` in steps for the compact store; today's store
  expires in one call), then while a snapshot is applied over the N loaded blocks (its
  swap frees them) as the sweep runs over all of them (the clock moved past their TTL).
  The snapshot goes through `submit_async`, which verifies and parses a large frame in
  a worker thread (`ReportVerifier.check_async`); the one-step verify + parse CPU of a
  max-size frame is printed on its own. The worker runs `tune_gc()` as the router does.

`RAMJET_TRACE_TURNS_MS=8` prints, per phase, the longest loop iterations, the callbacks
in them with their thread CPU, GC passes and sampled stacks (`benchmarks/loop_trace.py`);
its sampling thread's CPU then counts in the rates: judge the rates on a run without it.

`--dict-blocks` (default: N up to 5M) loads today's store with fewer blocks where N would
not fit beside other work (about 130-150 bytes a block); its per-block figures are still
comparable, its stall grows with its size. Then a `self-check:` line. `--quick` (1M
blocks, as the default) prints the figures without judging the targets: the rates and
stalls of one short run on a shared host are within its noise of them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import heapq
import json
import os
import random
import subprocess
import sys
import time
import weakref
from array import array
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client import CollectorRegistry

from ramjet.native import install_ramjet

# the hot modules as `ramjet serve` runs them (ramjet/native.py), in each worker too:
# before any other ramjet module is imported
NATIVE = install_ramjet().line()

from ramjet.reports.bodies import (  # noqa: E402
    MAX_KEYS_PER_BODY,
    DeltaBody,
    SnapshotBody,
    TierKeys,
    encode_body,
)
from ramjet.reports.config import ReportsConfig  # noqa: E402
from ramjet.reports.envelope import Envelope, ReportKind, sign  # noqa: E402
from ramjet.reports.keys import KeyRing  # noqa: E402
from ramjet.reports.processor import ReportProcessor  # noqa: E402
from ramjet.reports.verify import Accepted  # noqa: E402
from ramjet.residency.config import ResidencyConfig  # noqa: E402
from ramjet.residency.store import DictStore, MemoryStore, Table  # noqa: E402
from ramjet.residency.tables import ResidencyTables, ViewMode  # noqa: E402
from ramjet.runtime.gc import tune_gc  # noqa: E402
from ramjet.types import EngineId, PrefixKey, Tier  # noqa: E402

E0 = EngineId("e0")
KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
PROMPT_TOKENS = 50_000
CHUNK = MAX_KEYS_PER_BODY  # keys per report: the most a body may carry
TIERS = ("hbm", "host", "ssd")
T = TypeVar("T")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Clock:
    """The tables' monotonic clock, which the benchmark moves forward for the expiry."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


BENCH_TASKS: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()
"""The benchmark's own tasks on the loop (`StallMonitor`'s spinning coroutine, the
sweeper of `snapshot_during_sweep`): `RouterCpu` leaves their CPU out."""


class RouterCpu:
    """The router's CPU over a window, without the benchmark's: the loop thread's CPU in
    every event-loop callback but those of `BENCH_TASKS` (`asyncio.Handle._run` timed
    with the thread's CPU clock), plus the CPU of every other thread of the process
    (the worker thread that verifies and parses a large frame: process CPU - the loop
    thread's CPU). Not counted: the loop's own work between callbacks (`select`, a few
    microseconds an iteration, which the spinning monitor multiplies by thousands).
    `process_s` is the process CPU of the window, the monitor's spinning included (the
    figure the rates used to be taken from). With `RAMJET_TRACE_TURNS_MS` set, the
    tracer's sampling thread is in `threads_s` too."""

    def __init__(self) -> None:
        self.loop_s = 0.0
        """CPU of the loop thread's callbacks, the benchmark's tasks left out."""
        self.threads_s = 0.0
        """CPU of the process's other threads (verify and parse off the loop)."""
        self.process_s = 0.0

    @property
    def cpu_s(self) -> float:
        return self.loop_s + self.threads_s

    @contextmanager
    def window(self) -> Iterator[RouterCpu]:
        handle_cls = asyncio.events.Handle
        orig = handle_cls._run
        bench = BENCH_TASKS

        def run(h: asyncio.Handle) -> None:
            owner = getattr(h._callback, "__self__", None)  # type: ignore[attr-defined]
            if owner is not None and isinstance(owner, asyncio.Task) and owner in bench:
                orig(h)
                return
            c0 = time.thread_time()
            try:
                orig(h)
            finally:
                self.loop_s += time.thread_time() - c0

        p0, t0 = time.process_time(), time.thread_time()
        handle_cls._run = run  # type: ignore[method-assign,assignment]
        try:
            yield self
        finally:
            handle_cls._run = orig  # type: ignore[method-assign]
            p, t = time.process_time() - p0, time.thread_time() - t0
            self.process_s += p
            self.threads_s += max(0.0, p - t)


def _tracer(paused: Callable[[], bool]) -> Any:
    """A `benchmarks/loop_trace.py` tracer started on the running loop when
    `RAMJET_TRACE_TURNS_MS` is set (its threshold), else None."""
    trace_ms = float(os.environ.get("RAMJET_TRACE_TURNS_MS", "0"))
    if not trace_ms:
        return None
    try:
        from benchmarks.loop_trace import LoopTracer
    except ImportError:  # run as a script without the repository on the path
        from loop_trace import LoopTracer  # type: ignore[no-redef,import-not-found]
    return LoopTracer(trace_ms / 1e3, paused).start()


def _trace_report(tracer: Any, label: str) -> None:
    if tracer is not None:
        tracer.stop()
        tracer.report(label)


TOP = 16
"""Gaps a `StallMonitor` keeps, longest first, for `--perf` to check for vCPU pauses."""
STALLS: dict[str, list[tuple[float, float, float]]] = {}
"""Per phase (`StallMonitor.note`), its monitor's `top` gaps, longest first."""


class StallMonitor:
    """The longest gap between two turns of a coroutine that only yields."""

    def __init__(self) -> None:
        self.longest = 0.0
        """Wall seconds (on a loaded machine, preemption is in it)."""
        self.longest_cpu = 0.0
        """CPU seconds the loop's thread spent between two turns: the work that stalled it."""
        self.longest_cpu_at = 0.0
        """When that gap ended, on CLOCK_MONOTONIC (`time.perf_counter`): samples of
        `perf record -a -k CLOCK_MONOTONIC` taken meanwhile can be cut to it (uvloop,
        which the loop tracer cannot hook)."""
        self.gaps_cpu: array[float] = array("d")
        """Every counted gap's CPU seconds; an array, which the cyclic GC never walks (a
        list of a float per loop turn would lengthen the collections it measures)."""
        self.top: list[tuple[float, float, float]] = []
        """The `TOP` longest gaps by CPU, (cpu s, start, end on CLOCK_MONOTONIC): a heap."""
        self.paused = False
        """While True, gaps are not counted (the benchmark's own measuring)."""
        self._stop = False
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        last, last_cpu = time.perf_counter(), time.thread_time()
        while not self._stop:
            await asyncio.sleep(0)
            now, cpu = time.perf_counter(), time.thread_time()
            if not self.paused:
                self.longest = max(self.longest, now - last)
                if cpu - last_cpu > self.longest_cpu:
                    self.longest_cpu, self.longest_cpu_at = cpu - last_cpu, now
                if len(self.top) < TOP or cpu - last_cpu > self.top[0][0]:
                    push = heapq.heappush if len(self.top) < TOP else heapq.heapreplace
                    push(self.top, (cpu - last_cpu, last, now))
                self.gaps_cpu.append(cpu - last_cpu)
                # the next gap starts after this bookkeeping: growing a gap array of tens
                # of millions (a 20M load) took 12.6 ms of one turn, not the router's
                now, cpu = time.perf_counter(), time.thread_time()
            last, last_cpu = now, cpu

    def note(self, phase: str) -> None:
        """The phase's longest CPU stall and when it ended, on stderr (for perf); its
        `top` gaps kept in `STALLS[phase]`."""
        STALLS[phase] = sorted(self.top, reverse=True)
        print(
            f"  [stall] {phase}: {self.longest_cpu * 1e3:.1f} ms CPU, ended at "
            f"{self.longest_cpu_at:.4f} s (CLOCK_MONOTONIC)",
            file=sys.stderr,
            flush=True,
        )

    def reset(self) -> None:
        """Start a new phase's longest."""
        self.longest = self.longest_cpu = self.longest_cpu_at = 0.0
        self.top = []

    async def __aenter__(self) -> StallMonitor:
        self._task = asyncio.create_task(self._run())
        BENCH_TASKS.add(self._task)
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop = True
        assert self._task is not None
        await self._task


async def sweep_phase(expire_step: Callable[[], bool]) -> dict[str, float]:
    """The expiry sweep alone, in the tables' bounded steps with a turn for the loop
    between, until nothing expired is left; its wall time and the loop's longest stall
    (`sweep_s`, `sweep_stall_s`, `sweep_stall_cpu_s`). Shared with the Redis half
    (`residency_scale_redis.py`)."""
    tracer = _tracer(lambda: False)
    async with StallMonitor() as mon:
        t0 = time.perf_counter()
        while expire_step():
            await asyncio.sleep(0)
        took = time.perf_counter() - t0
    mon.note("expiry sweep")
    _trace_report(tracer, "expiry sweep")
    return {"sweep_s": took, "sweep_stall_s": mon.longest, "sweep_stall_cpu_s": mon.longest_cpu}


async def snapshot_during_sweep(
    apply: Callable[[], Awaitable[T]], expire_step: Callable[[], bool]
) -> tuple[T, dict[str, float]]:
    """`apply()` (a snapshot's apply) while the expiry sweep takes a bounded step every
    loop turn (the ingest's tick, every turn instead of every second); its result, and
    its wall time, the process CPU meanwhile (the sweep's and the stall monitor's
    included), the router's CPU in the apply (`RouterCpu`: the sweep's and the monitor's
    tasks left out) and the loop's longest stall meanwhile (`snapshot2_s`,
    `snapshot2_cpu_s`, `snapshot2_router_cpu_s`, `snapshot_stall_s`,
    `snapshot_stall_cpu_s`). Shared with the Redis half, whose `apply` also waits for
    the write queue to reach Redis."""
    done = False
    out: dict[str, float] = {}

    async def sweeper() -> None:
        while not done:
            expire_step()
            await asyncio.sleep(0)

    tracer = _tracer(lambda: False)
    meter = RouterCpu()
    async with StallMonitor() as mon:
        sweep = asyncio.create_task(sweeper())
        BENCH_TASKS.add(sweep)
        t0 = time.perf_counter()
        try:
            with meter.window():
                res = await apply()
            out["snapshot2_s"] = time.perf_counter() - t0
            out["snapshot2_cpu_s"] = meter.process_s
            out["snapshot2_router_cpu_s"] = meter.cpu_s
        finally:
            done = True
            await sweep
    mon.note("snapshot + sweep")
    _trace_report(tracer, "snapshot + sweep")
    out["snapshot_stall_s"] = mon.longest
    out["snapshot_stall_cpu_s"] = mon.longest_cpu
    return res, out


class Loader:
    def __init__(self, kind: str, n: int) -> None:
        self.clock = Clock()
        cfg = ResidencyConfig(max_global_entries=max(1_000_000, n + n // 10))
        caps = {Table.GLOBAL: cfg.max_global_entries, Table.SWA: cfg.max_swa_entries}
        store = DictStore(caps) if kind == "dict" else None
        self.tables = ResidencyTables(cfg, store, clock=self.clock)
        assert isinstance(self.tables.store, DictStore if kind == "dict" else MemoryStore)
        ring = KeyRing({"k": (E0, KEY.public_key())})
        rcfg = ReportsConfig(
            rate_per_s=1e9, burst=10**9, max_report_bytes=16 << 20, max_keys=MAX_KEYS_PER_BODY
        )
        self.proc = ReportProcessor(ring, self.tables, rcfg, CollectorRegistry())
        self.seq = 0
        self.rng = random.Random(7)
        self.early: dict[str, list[PrefixKey]] = {t: [] for t in TIERS}
        """Keys known resident by tier, from the first reports (1-hour TTL)."""
        self.late: dict[str, list[PrefixKey]] = {t: [] for t in TIERS}
        """... from the last report (no TTL: they outlive the expiry sweep)."""

    def keys(self, n: int) -> tuple[PrefixKey, ...]:
        b = self.rng.randbytes(8 * n)
        return tuple(PrefixKey(k) for k in memoryview(b).cast("Q"))

    def frame(self, kind: ReportKind, body: Any) -> bytes:
        self.seq += 1
        issued = int(time.time() * 1000)
        env = Envelope(E0, "k", 1, self.seq, issued, kind, encode_body(body))
        return sign(env, KEY)

    def snapshot(self, keys: tuple[PrefixKey, ...], ttl_ms: int | None) -> bytes:
        group = TierKeys(tier="hbm", keys=keys, ttl_ms=ttl_ms)
        return self.frame("snapshot", SnapshotBody(seq=self.seq + 1, residency=[group]))

    def delta(self, keys: tuple[PrefixKey, ...], ttl_ms: int | None) -> bytes:
        """Half the keys stored in host memory, half on SSD."""
        h = len(keys) // 2
        groups = [
            TierKeys(tier="host", keys=keys[:h], ttl_ms=ttl_ms),
            TierKeys(tier="ssd", keys=keys[h:], ttl_ms=ttl_ms),
        ]
        return self.frame("delta", DeltaBody(stored=groups))

    def prompt(
        self, block_tokens: int, sample: dict[str, list[PrefixKey]]
    ) -> tuple[list[PrefixKey], list[int], int]:
        """A 50k-token prompt: its first 3/4 blocks resident (HBM, host, SSD, in that
        order, as a prefix would be demoted; from `sample`), then blocks nobody holds."""
        n = -(-PROMPT_TOKENS // block_tokens)
        hit = n * 3 // 4
        keys: list[PrefixKey] = []
        for i, t in enumerate(TIERS):
            want = hit // 3 if i < 2 else hit - 2 * (hit // 3)
            keys += sample[t][:want]
        assert len(keys) == hit, "not enough resident keys sampled"
        keys += list(self.keys(n - hit))
        tokens = [block_tokens] * n
        tokens[-1] = PROMPT_TOKENS - block_tokens * (n - 1)
        return keys, tokens, hit

    def match_p99(
        self, block_tokens: int, sample: dict[str, list[PrefixKey]], rounds: int = 1000
    ) -> tuple[float, bool]:
        """p99 of the CPU time of a fresh view's `global_match` (CPU, not wall: on a
        loaded machine a wall p99 is the scheduler's time slice), every answer checked."""
        keys, tokens, hit = self.prompt(block_tokens, sample)
        want = sum(tokens[:hit])
        ok = True
        times = []
        for _ in range(rounds):
            t0 = time.thread_time()
            m = self.tables.view(E0).global_match(keys, tokens)
            times.append(time.thread_time() - t0)
            ok = ok and m.total == want and m.host > 0 and m.ssd > 0
        times.sort()
        return times[int(len(times) * 0.99) - 1], ok


async def worker(kind: str, n: int, block_tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": kind, "blocks": n, "native": NATIVE}
    ld = Loader(kind, n)
    ld.tables.set_mode(E0, ViewMode.REPORTED)
    tune_gc()  # as `ramjet serve` does after start-up (`ramjet.runtime.gc`)
    base = rss_bytes()
    checks: list[bool] = []

    # 1. the snapshot (1-hour TTL): half the blocks (at least a body's worth), signed in
    # parts of `reports.max_keys` keys (`SnapshotBody.part/parts`, as
    # `split_snapshot` cuts them), each part made when it is sent, applied with
    # `submit_async` (additive, in steps; the replace at the last part), loop in view
    hour = 3_600_000
    first = min(n, max(CHUNK, n // 2))
    parts = -(-first // CHUNK)
    seq0 = ld.seq
    snap_wall = stall = stall_cpu = 0.0
    meter = RouterCpu()
    outside = [True]  # the benchmark's own work between reports: not traced
    tracer = _tracer(lambda: outside[0])
    # each frame is made outside the stall monitor (the engine makes it, not the router)
    for part in range(parts):
        size = min(CHUNK, first - part * CHUNK)
        keys = ld.keys(size)
        if part == 0:
            ld.early["hbm"] = list(keys[:2000])
        group = TierKeys(tier="hbm", keys=keys, ttl_ms=hour)
        body = SnapshotBody(
            seq=seq0 + part, residency=[group], part=part, parts=parts
        )  # part 0 at the last report's seq, as a whole snapshot
        ld.seq = seq0 + part - 1
        frame = ld.frame("snapshot", body)
        del keys, group, body
        gc.collect()  # the frame's making leaves young garbage: not the router's
        async with StallMonitor() as mon:
            outside[0] = False
            t0 = time.perf_counter()
            with meter.window():
                res = await ld.proc.submit_async(frame)
            snap_wall += time.perf_counter() - t0
        outside[0] = True
        stall, stall_cpu = max(stall, mon.longest), max(stall_cpu, mon.longest_cpu)
        checks.append(isinstance(res, Accepted))
        del frame, res
    _trace_report(tracer, f"{kind} snapshot in parts")
    out["snapshot_s"] = snap_wall
    out["snapshot_cpu_s"] = meter.cpu_s
    out["snapshot_loop_cpu_s"] = meter.loop_s
    out["snapshot_process_cpu_s"] = meter.process_s
    out["snapshot_keys"] = first
    out["snapshot_parts"] = parts
    out["parts_stall_s"] = stall
    out["parts_stall_cpu_s"] = stall_cpu
    checks.append(ld.tables.size(Table.GLOBAL) == first)
    checks.append(not ld.proc.in_parts(E0) and not ld.proc.snapshot_needed(E0))
    print(f"  [{kind}] {first:,} blocks loaded by a snapshot in {parts} parts", file=sys.stderr)

    # 2. deltas (half host, half SSD) up to n - 6000: up to half of n with a 1-hour TTL,
    # then none; then one of 2000 blocks a tier, no TTL (the prompt's blocks at the end).
    # Each as large as a body may be, applied with `submit_async` (in steps), loop in view
    loaded = first
    bulk = max(first, n - 6000)
    stall = stall_cpu = 0.0
    meter = RouterCpu()
    tracer = _tracer(lambda: outside[0])
    while loaded < bulk:
        size = min(CHUNK, bulk - loaded)
        keys = ld.keys(size)
        if not ld.early["host"]:
            ld.early["host"], ld.early["ssd"] = list(keys[:2000]), list(keys[-2000:])
        frame = ld.delta(keys, hour if loaded < n // 2 else None)
        del keys
        gc.collect()
        async with StallMonitor() as mon:
            outside[0] = False
            with meter.window():
                res = await ld.proc.submit_async(frame)
        outside[0] = True
        stall, stall_cpu = max(stall, mon.longest), max(stall_cpu, mon.longest_cpu)
        checks.append(isinstance(res, Accepted))
        del frame, res
        loaded += size
        if loaded // 2_000_000 != (loaded - size) // 2_000_000:
            print(f"  [{kind}] {loaded:,} blocks loaded", file=sys.stderr, flush=True)
        if "p99_1m_s" not in out and loaded >= min(bulk, 1_000_000) and ld.early["ssd"]:
            out["p99_1m_s"], ok = ld.match_p99(block_tokens, ld.early)
            out["p99_1m_at"] = loaded
            checks.append(ok)
    _trace_report(tracer, f"{kind} deltas")
    delta_cpu = meter.cpu_s
    out["delta_rate"] = (loaded - first) / delta_cpu if delta_cpu else 0.0
    out["delta_rate_process"] = (loaded - first) / meter.process_s if meter.process_s else 0.0
    out["delta_stall_s"] = stall
    out["delta_stall_cpu_s"] = stall_cpu
    if loaded < n:
        for t in TIERS:
            ld.late[t] = list(ld.keys((n - loaded) // 3))
        stored = [TierKeys(tier=t, keys=tuple(ld.late[t])) for t in TIERS]
        checks.append(
            isinstance(ld.proc.submit(ld.frame("delta", DeltaBody(stored=stored))), Accepted)
        )
        loaded += 3 * ((n - loaded) // 3)
    out["blocks"] = loaded
    checks.append(ld.tables.size(Table.GLOBAL) == loaded)
    gc.collect()
    out["rss_per_block"] = (rss_bytes() - base) / loaded
    out["p99_n_s"], ok = ld.match_p99(block_tokens, ld.late)
    checks.append(ok)

    # 3. the expiry sweep: the 1-hour blocks (the snapshot's and the first deltas') go
    ld.clock.offset = 2 * 3600.0
    before = ld.tables.size(Table.GLOBAL)
    out.update(await sweep_phase(ld.tables.expire_step))
    out["swept"] = before - ld.tables.size(Table.GLOBAL)
    checks.append(0 < out["swept"] <= loaded - 6000)
    keys_, tokens, hit = ld.prompt(block_tokens, ld.late)
    m = ld.tables.view(E0).global_match(keys_, tokens)
    checks.append(m.total == sum(tokens[:hit]))  # the blocks without a TTL stay

    # 4. a whole snapshot over the loaded blocks (its swap frees them) while the expiry
    # sweep runs (every block left expires: the clock moves past the 72-hour TTL), the
    # loop in view. The benchmark's own key tuples are dropped first: a young tuple of
    # 524k ints costs the collector ~20 ms the first time it walks it (the router parses
    # long key lists into `PackedKeys`, which it never walks)
    first = min(n, CHUNK)
    keys = ld.keys(first)
    frame = ld.snapshot(keys, None)
    probe = list(keys[:1000])
    del keys
    t0, c0 = time.perf_counter(), time.process_time()
    outcome = ld.proc.verifier.check(frame)  # the one-step verify + parse, on its own
    out["verify_parse_s"] = time.perf_counter() - t0
    out["verify_parse_cpu_s"] = time.process_time() - c0
    checks.append(isinstance(outcome, Accepted))
    del outcome
    ld.clock.offset += 73 * 3600.0
    gc.collect()
    res, figures = await snapshot_during_sweep(
        lambda: ld.proc.submit_async(frame), ld.tables.expire_step
    )
    out.update(figures)
    out["snapshot2_keys"] = first
    checks.append(isinstance(res, Accepted) and ld.tables.size(Table.GLOBAL) == first)
    got = ld.tables.store.get_many(Table.GLOBAL, E0, probe, ld.clock(), False)
    checks.append(all(e is not None and e.tier is Tier.HBM for e in got))
    out["checks"] = all(checks)
    return out


def run_worker(kind: str, n: int, block_tokens: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", kind, "--blocks", str(n)]
    cmd += ["--block-tokens", str(block_tokens)]
    # stdout: the result; stderr (progress, errors) goes straight to ours
    r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"worker {kind} failed (exit {r.returncode}): see above")
    result: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--dict-blocks", type=int, default=None)
    ap.add_argument("--block-tokens", type=int, default=64)
    ap.add_argument(
        "--redis-blocks",
        type=int,
        default=0,
        help="also load N blocks into a real redis-server, packed encoding "
        "(`residency_scale_redis.measure_redis`; minutes: ~6k blocks/s written); 0: not run",
    )
    ap.add_argument(
        "--redis-keys-blocks",
        type=int,
        default=1_000_000,
        help="blocks for today's per-key Redis encoding beside it (at most N; ~320 B a block)",
    )
    ap.add_argument("--worker", choices=("compact", "dict"), default=None)
    ap.add_argument(
        "--quick", action="store_true", help="1M blocks, targets not judged (make bench)"
    )
    a = ap.parse_args()
    if a.quick:
        a.blocks = 1_000_000
    if a.worker is not None:
        print(json.dumps(asyncio.run(worker(a.worker, a.blocks, a.block_tokens))))
        return
    dict_n = a.dict_blocks if a.dict_blocks is not None else min(a.blocks, 5_000_000)
    print(NATIVE)
    print(
        f"loading {a.blocks:,} blocks (compact) and {dict_n:,} (dict) through signed "
        f"reports; prompt {PROMPT_TOKENS:,} tokens in {a.block_tokens}-token blocks"
    )
    new = run_worker("compact", a.blocks, a.block_tokens)
    old = run_worker("dict", dict_n, a.block_tokens)
    print(f"  workers: {new['native']}")
    for r in (new, old):
        # that snapshot's own keys (524,288): until 2026-12-07 the parts' 10M were
        # divided by its CPU, a rate ~19x too high
        r["snapshot2_rate"] = r["snapshot2_keys"] / r["snapshot2_router_cpu_s"]
        r["snapshot2_rate_process"] = r["snapshot2_keys"] / r["snapshot2_cpu_s"]
        r["snapshot_rate_process"] = r["snapshot_keys"] / r["snapshot_process_cpu_s"]
        r["snapshot_loop_share"] = r["snapshot_loop_cpu_s"] / r["snapshot_cpu_s"]

    def row(name: str, key: str, fmt: str, scale: float = 1.0, better: str = "lower") -> None:
        n, o = new[key] * scale, old[key] * scale
        ratio = n / o if o else float("inf")
        print(f"  {name:<44} {format(n, fmt):>12} {format(o, fmt):>12}   {ratio:6.2f}x")

    print(f"  {'':<44} {'compact':>12} {'dict (today)':>12}   ratio")
    print(f"  {'blocks loaded':<44} {new['blocks']:>12,} {old['blocks']:>12,}")
    row("router RSS per block (bytes)", "rss_per_block", ".1f")
    row(f"global_match p99 at {new['p99_1m_at']:,} blocks (CPU ms)", "p99_1m_s", ".3f", 1e3)
    row("global_match p99 at all loaded (CPU ms)", "p99_n_s", ".3f", 1e3)
    snap_new = new["snapshot_keys"] / new["snapshot_cpu_s"]
    snap_old = old["snapshot_keys"] / old["snapshot_cpu_s"]
    print(
        f"  {'snapshot apply rate (blocks/CPU-s)':<44} {snap_new:>12,.0f} {snap_old:>12,.0f}"
        f"   {snap_new / snap_old:6.2f}x"
    )
    row("  the same, process CPU (monitor's spin in it)", "snapshot_rate_process", ",.0f")
    row("  share of the router's CPU on the loop", "snapshot_loop_share", ".2f")
    print(
        f"  {'snapshot parts (of <= max_keys keys)':<44} {new['snapshot_parts']:>12} {old['snapshot_parts']:>12}"
    )
    row("longest loop stall, snapshot in parts (CPU ms)", "parts_stall_cpu_s", ".1f", 1e3)
    row("  the same, wall (ms)", "parts_stall_s", ".1f", 1e3)
    row("delta apply rate (blocks/CPU-s)", "delta_rate", ",.0f")
    row("  the same, process CPU (monitor's spin in it)", "delta_rate_process", ",.0f")
    row("longest loop stall, max-size deltas (CPU ms)", "delta_stall_cpu_s", ".1f", 1e3)
    row("  the same, wall (ms)", "delta_stall_s", ".1f", 1e3)
    row("longest loop stall, expiry sweep (CPU ms)", "sweep_stall_cpu_s", ".1f", 1e3)
    row("  the same, wall (ms)", "sweep_stall_s", ".1f", 1e3)
    row("expiry sweep wall time (s)", "sweep_s", ".2f")
    row("longest loop stall, snapshot + sweep (CPU ms)", "snapshot_stall_cpu_s", ".1f", 1e3)
    row("  the same, wall (ms)", "snapshot_stall_s", ".1f", 1e3)
    row("  that snapshot's apply (blocks/CPU-s)", "snapshot2_rate", ",.0f")
    row("  the same, process CPU (sweep, monitor in it)", "snapshot2_rate_process", ",.0f")
    row("verify + parse of one max-size frame (CPU ms)", "verify_parse_cpu_s", ".1f", 1e3)
    print(f"  blocks swept: compact {new['swept']:,}, dict {old['swept']:,}")
    targets = [
        ("RSS <= 40 B/block", new["rss_per_block"] <= 40),
        ("p99 <= 1 ms at 1M", new["p99_1m_s"] <= 1e-3),
        ("p99 <= 1 ms at N", new["p99_n_s"] <= 1e-3),
        ("snapshot >= 1M blocks/s", snap_new >= 1e6),
        (
            "stall <= 10 ms (CPU)",
            max(
                new["snapshot_stall_cpu_s"],
                new["sweep_stall_cpu_s"],
                new["parts_stall_cpu_s"],
                new["delta_stall_cpu_s"],
            )
            <= 0.01,
        ),
    ]
    redis_ok = True
    if a.redis_blocks > 0:
        from residency_scale_redis import measure_redis

        keys_n = min(a.redis_blocks, a.redis_keys_blocks)
        print(
            f"  Redis (loopback redis-server): packed {a.redis_blocks:,}, per-key {keys_n:,} blocks"
        )
        rp = measure_redis(a.redis_blocks, "packed")
        rk = measure_redis(keys_n, "keys")
        for label, key, fmt in (
            ("Redis memory per block (bytes, steady)", "bytes_per_block", ".1f"),
            ("  with the snapshot's log not yet aged out", "bytes_per_block_with_log", ".1f"),
            ("snapshot write to Redis (blocks/s)", "snapshot_write_blocks_per_s", ",.0f"),
            ("fresh replica pull (blocks/s)", "snapshot_pull_blocks_per_s", ",.0f"),
            ("global_match p99 on the replica (ms)", "global_match_p99_ms", ".3f"),
        ):
            pv, kv = rp[key], rk[key]
            print(f"  {label:<44} {format(pv, fmt):>12} {format(kv, fmt):>12}   {pv / kv:6.2f}x")
        targets.append(("Redis <= 48 B/block", rp["bytes_per_block"] <= 48))
        redis_ok = bool(rp["ok"] and rk["ok"])
    else:
        print("  Redis: not run (--redis-blocks N; or benchmarks/residency_scale_redis.py)")
    if a.quick:
        print("  targets: not judged in --quick (the full run, --blocks 20000000, judges them)")
    else:
        print("  targets: " + ", ".join(f"{t}: {'met' if ok else 'NOT met'}" for t, ok in targets))
    for label, n, o, unit in (
        ("router RSS per block", new["rss_per_block"], old["rss_per_block"], "B"),
        ("snapshot apply rate", snap_new / 1e3, snap_old / 1e3, "kblocks/CPU-s"),
        ("global_match p99 at all loaded", new["p99_n_s"] * 1e6, old["p99_n_s"] * 1e6, "us"),
    ):
        print(f"figure: residency scale, {label} / compact = {n:.1f} {unit}")
        print(f"figure: residency scale, {label} / dict (today) = {o:.1f} {unit}")
    ok = bool(new["checks"] and old["checks"] and redis_ok)
    print(
        f"self-check: {'ok' if ok else 'FAILED'} (every report accepted, table sizes, every "
        "global_match answer equal to the blocks known resident, sweep and final snapshot "
        "content; Redis: pulled replicas hold every loaded block and match the writer)"
    )
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
