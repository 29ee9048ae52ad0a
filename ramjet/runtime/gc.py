"""Cyclic garbage collector settings for the serving process.

CPython's collector runs a young-generation pass whenever container allocations
outnumber deallocations by `gen0` (700 by default). A router with a few dozen requests
in flight crosses that every few dozen requests, though almost everything a request
allocates is freed by reference counting when it ends; and every pass that reaches the
oldest generation walks every object the process holds (config, policies, metrics,
aiohttp's modules). Measured under `benchmarks/proxy_overhead.py`'s JSON load: ~16 us
of CPU per request spent collecting (5%); with the threshold at 10,000, no collection
ran in ~3,900 requests, and at 2,500 (below) the request path's CPU measured the same as
at 10,000 (`proxy_overhead.py --base`, one run).

`tune_gc()`, called once after start-up: collects, then freezes everything alive then
(start-up state is never garbage, so later passes skip it), and raises the young
threshold to `gen0` so a pass runs only when garbage actually accumulates. Reference
cycles are still collected, later; the cost is at most ~`gen0` extra objects alive.

Not higher than 2,500: a young pass costs its loop turn ~0.2 us per object it meets,
and it meets more than `gen0`. The count is allocations less deallocations, so a
residency store that replaces long-lived objects (an index shard's arrays at each
rehash, a run's key list) leaves the new ones in the young list without moving the
count: at 10,000 the passes met 13-25k objects and took up to 7.6 ms, in turns of
7-9 ms, while 5M blocks loaded over Redis (`benchmarks/residency_scale_redis.py`,
traced); at 2,500 the longest was 3.2 ms, and the middle generation's 6.4 ms.
"""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 2_500


def tune_gc(gen0: int = GEN0_THRESHOLD) -> None:
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0, gen1, gen2)
