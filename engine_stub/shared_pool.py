"""Pools that the reference engines of one machine share (ARCHITECTURE 5b): a pool of
global-KV blocks (a host-memory or SSD tier) and a pool of SWA states, each a `kvpool.Pool`
directory (`--pool-dir`, `--swa-pool-dir`), so a session moved to another engine
resumes from what the first one computed instead of recomputing it.

Names. A pool key is the router key written as 16 hex digits (the global block key, or
the SWA boundary key), so the pool's own reporter (`ramjet pool-reporter`,
`ramjet.sidecar.pool_watch.hex_router_key`) names the blocks as the router does. Each
pool file starts with a header (magic, the engine's model fingerprint, the key, the
tokens it covers); a file of another model or config, or of another key, reads as a
miss, never as state.

Writes. Every block the engine computes, and every SWA state it pools, is written
through at once (`publish`), by one background thread per pool from a bounded queue: a
full queue drops the write (counted in `dropped`), it never blocks the scheduler.

Chains. A prefix is usable only from its start, so every use of a prompt's chain (the
blocks it read from the pool, and at `publish` the whole chain: blocks computed now,
and the earlier ones the engine served from its own tiers) is stamped as one use, the
deepest block least recent (`kvpool.chain_stamp`): the pool's LRU then evicts a chain's
tail before its start, not the start of a prefix whose later blocks it keeps (short of
a reader holding the tail, or a dropped write).

Chains. A prefix is usable only from its start, so every use of a prompt's chain (the
blocks it read from the pool, and at `publish` the whole chain: blocks computed now,
and the earlier ones the engine served from its own tiers) is stamped as one use, the
deepest block least recent (`kvpool.chain_stamp`): the pool's LRU then evicts a chain's
tail before its start, never the start of a prefix whose later blocks it keeps (that a
reader holds, or a late stamp, aside).
`kvpool.Pool.put` publishes atomically (a reader sees no block or the whole block), fsyncs
when the pool is durable (an SSD pool), and evicts least-recently-used blocks under the
pool's byte capacity, never one another engine is reading.

Reads (`read_prefix`, `SharedSWA.get`) take the pool's shared lock per file, and are timed:
the time and bytes land in the request's `prompt_work` (`pool_tokens`, `pool_io_ms`,
`pools`). SWA states expire `ttl_s` after their last use (the file's mtime, which every
read and re-publish touches), as in the engine's own SWA pool.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool import Pool, chain_stamp
from ramjet.types import PrefixKey

log = logging.getLogger("engine_stub.pool")

_MAGIC_KV = b"RJPK"
_MAGIC_SWA = b"RJPS"
_HEAD = struct.Struct("<4s8sQI")  # magic, model fingerprint (8 bytes), key, n_tokens


def pool_key(key: PrefixKey) -> str:
    """The pool file name of a router key: 16 lowercase hex digits."""
    return f"{int(key):016x}"


@dataclass(frozen=True, slots=True)
class Pulled:
    """What one read from a pool returned."""

    blobs: list[bytes]
    nbytes: int
    seconds: float


_Item = tuple[str, bytes | None, int | None]
"""(pool key, payload to publish or None to only stamp a use, the use's stamp or None)."""


class _Writer:
    """One background thread publishing blocks (and stamping uses of blocks already
    there) from a bounded queue."""

    def __init__(self, pool: Pool, name: str, queue_items: int) -> None:
        self.pool = pool
        self._q: queue.Queue[_Item | None] = queue.Queue(maxsize=queue_items)
        self.written = 0
        """Writes that left the pool holding the item (published, or already there)."""
        self.refused = 0
        """Writes the pool could not fit (every older block leased or being read)."""
        self.dropped = 0
        """Writes dropped because the queue was full."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, key: str, payload: bytes | None, used_ns: int | None = None) -> None:
        try:
            self._q.put_nowait((key, payload, used_ns))
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                key, payload, used_ns = item
                try:
                    if payload is None:
                        self.pool.touch(key, used_ns=used_ns)  # gone: nothing to keep
                        continue
                    ok = self.pool.put(key, payload, used_ns=used_ns)
                except OSError:
                    log.exception("pool write failed")
                    ok = False
                if ok:
                    self.written += 1
                else:
                    self.refused += 1
            finally:
                self._q.task_done()

    def flush(self) -> None:
        """Wait until every write submitted so far has been done."""
        self._q.join()

    def close(self) -> None:
        self.flush()
        self._q.put(None)
        self._thread.join(timeout=10)


def _fingerprint_bytes(fingerprint: str) -> bytes:
    return bytes.fromhex(fingerprint)[:8].ljust(8, b"\0")


class SharedKV:
    """The engine's side of a shared global-KV pool (module docstring)."""

    def __init__(
        self,
        pool: Pool,
        pool_id: str,
        fingerprint: str,
        block_tokens: int,
        queue_items: int = 1024,
    ) -> None:
        self.pool = pool
        self.pool_id = pool_id
        self._fp = _fingerprint_bytes(fingerprint)
        self.block_tokens = block_tokens
        self.writer = _Writer(pool, f"pool-write-{pool_id}", queue_items)
        self.read_errors = 0
        """Reads that failed with an I/O error (taken as a miss, and logged)."""

    def publish(
        self, items: Sequence[tuple[PrefixKey, bytes]], chain: Sequence[PrefixKey] | None = None
    ) -> None:
        """Write blocks through to the pool in the background, and stamp the use of
        `chain` (the prompt's block keys from its start; `items` are its blocks computed
        now, the rest are stamped where the pool holds them): module docstring. Without
        `chain`, `items` are taken as the chain."""
        now = time.time_ns()
        blobs = dict(items)
        for depth, key in enumerate([k for k, _ in items] if chain is None else chain):
            stamp = chain_stamp(now, depth)
            blob = blobs.get(key)
            if blob is None:
                self.writer.submit(pool_key(key), None, stamp)
                continue
            head = _HEAD.pack(_MAGIC_KV, self._fp, int(key), self.block_tokens)
            self.writer.submit(pool_key(key), head + blob, stamp)

    def read_prefix(self, keys: Sequence[PrefixKey], first_depth: int = 0) -> Pulled:
        """The blocks of the longest prefix of `keys` the pool holds (stops at the first
        miss, or at a block of another model or key). `keys[0]` is block `first_depth` of
        its chain (the engine holds the blocks before it): the read is stamped as one use
        of the chain (module docstring)."""
        t0 = time.perf_counter()
        now = time.time_ns()
        blobs: list[bytes] = []
        nbytes = 0
        for depth, key in enumerate(keys, first_depth):
            try:
                data = self.pool.read(pool_key(key), used_ns=chain_stamp(now, depth))
            except OSError:
                log.exception("pool read failed")
                self.read_errors += 1
                data = None
            blob = self._payload(key, data)
            if blob is None:
                break
            blobs.append(blob)
            nbytes += len(blob)
        return Pulled(blobs, nbytes, time.perf_counter() - t0)

    def _payload(self, key: PrefixKey, data: bytearray | None) -> bytes | None:
        if data is None or len(data) <= _HEAD.size:
            return None
        magic, fp, k, n = _HEAD.unpack_from(data)
        if magic != _MAGIC_KV or fp != self._fp or k != int(key) or n != self.block_tokens:
            return None
        return bytes(memoryview(data)[_HEAD.size :])

    def close(self) -> None:
        self.writer.close()


class SharedSWA:
    """The engine's side of a shared SWA pool (module docstring)."""

    def __init__(
        self, pool: Pool, pool_id: str, fingerprint: str, ttl_s: float, queue_items: int = 256
    ) -> None:
        if ttl_s <= 0:
            raise ValueError("SWA TTL must be positive seconds")
        self.pool = pool
        self.pool_id = pool_id
        self._fp = _fingerprint_bytes(fingerprint)
        self.ttl_s = ttl_s
        self.writer = _Writer(pool, f"pool-write-{pool_id}", queue_items)

    def publish(self, key: PrefixKey, n_tokens: int, tail: bytes) -> None:
        head = _HEAD.pack(_MAGIC_SWA, self._fp, int(key), n_tokens)
        self.writer.submit(pool_key(key), head + tail)

    def get(self, key: PrefixKey, n_tokens: int) -> tuple[bytes, float] | None:
        """(the SWA tail, seconds the read took) of the live state at boundary `key` that
        ends at `n_tokens`, or None."""
        name = pool_key(key)
        t0 = time.perf_counter()
        try:
            age = time.time() - os.stat(self.pool.blocks / name).st_mtime
        except FileNotFoundError:
            return None
        if age >= self.ttl_s:
            return None
        data = None
        with contextlib.suppress(OSError):
            data = self.pool.read(name)
        if data is None or len(data) <= _HEAD.size:
            return None
        magic, fp, k, n = _HEAD.unpack_from(data)
        if magic != _MAGIC_SWA or fp != self._fp or k != int(key) or n != n_tokens:
            return None
        return bytes(memoryview(data)[_HEAD.size :]), time.perf_counter() - t0

    def close(self) -> None:
        self.writer.close()
