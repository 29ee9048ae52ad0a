"""Two processes that share one `kvpool` directory at once (the pool tests of kvpool and
of the reference engine's shared pools): start them, watch the pool's bytes in use while
they run, and gather what each reports. Imported by module name (tests/helpers on
sys.path)."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvpool import Pool


def run_two(
    target: Callable[..., None], pool_dir: Path, capacity: int, seconds: float = 3.0
) -> tuple[int, list[dict[str, Any]]]:
    """Run `target(pool_dir, seed, seconds, out)` in two spawned processes (seeds 1 and
    2); each puts one dict of figures on `out`. Returns the peak bytes the pool held while
    they ran, and their dicts. Both must exit 0."""
    ctx = mp.get_context("spawn")
    out: Any = ctx.Queue()
    procs = [ctx.Process(target=target, args=(str(pool_dir), s, seconds, out)) for s in (1, 2)]
    for p in procs:
        p.start()
    pool = Pool(pool_dir, capacity)
    peak, results = 0, []
    deadline = time.monotonic() + 30 * seconds
    while len(results) < 2 and time.monotonic() < deadline:
        peak = max(peak, pool.used_bytes())
        while not out.empty():
            results.append(out.get())
        time.sleep(0.005)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert len(results) == 2
    return peak, results
