"""glibc malloc tuning for multi-megabyte request bodies.

A 4 MB prompt allocates several buffers of its size (the body, the decoded string, its
UTF-8 rendering). With glibc's defaults such buffers are mmap'd fresh or handed back
by heap trimming after each request, so every request faults them in again: about
2,700 minor page faults and a third of the parse time per 4 MB request
(`benchmarks/prefix_keys.py` prints both). Raising the mmap threshold to its maximum
(32 MiB) and the trim threshold keeps such buffers in the heap for reuse: 0 faults.
The price is that up to `trim_threshold_bytes` of freed memory stays with the process.

Call `tune_malloc()` once, first thing at process start (before large allocations
fragment the heap: set later, it measured slower). A no-op returning False where the C
library is not glibc. Setting MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ in the
environment before start has the same effect.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024
"""glibc refuses larger mmap thresholds on 64-bit."""


def tune_malloc(
    mmap_threshold_bytes: int = MMAP_THRESHOLD_MAX, trim_threshold_bytes: int = 256 * 1024 * 1024
) -> bool:
    """Apply the thresholds; True when glibc accepted both."""
    if not (0 < mmap_threshold_bytes <= MMAP_THRESHOLD_MAX) or trim_threshold_bytes <= 0:
        raise ValueError("thresholds must be positive; mmap threshold at most 32 MiB")
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok_trim = mallopt(_M_TRIM_THRESHOLD, trim_threshold_bytes) == 1
    ok_mmap = mallopt(_M_MMAP_THRESHOLD, mmap_threshold_bytes) == 1
    return bool(ok_trim and ok_mmap)
