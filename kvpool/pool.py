"""A pool of KV blocks in one directory, shared by any number of processes.

Blocks are immutable byte strings keyed by a hex block hash (the engine's block hash
for the same tokens, so every engine that computes the same hashes finds the same
block). Only plain file operations are used (no daemon, no torch), so vLLM engines, the
reference engine and a sidecar that reports residency can all share one pool.

Directory layout under `root`:

    blocks/<key>                 one published block (the file is the block's bytes)
    meta/<key>                   the block's metadata, when its writer gave any (small,
                                 opaque to the pool: e.g. the tokens the block holds)
    tmp/<key>.<pid>.<nonce>      a block being written (never read)
    leases/<key>.<pid>.<ns>      a hard link to blocks/<key> held by a reader
    lock                         the pool lock (flock): taken only to publish and evict
    used                         the bytes under blocks/ as publishers count them (below)

Protocol:

- Publish (`put`). The writer writes the bytes to `tmp/`, fsyncs them when the pool is
  durable, then, holding the pool lock, evicts least recently used blocks until the
  new one fits and hard-links the temp file to `blocks/<key>` (`link` fails if the name
  exists: a block is never replaced, so a reader never sees two versions). The temp
  name is then unlinked; a durable pool also fsyncs `blocks/`. A reader therefore sees
  either no block or the whole block: no torn read. Metadata given with the block is
  written to `meta/<key>` (temp file, then rename) under the same lock just before the
  link, and an evictor unlinks it right after the block, so whenever `blocks/<key>` is
  seen its metadata is there (a reader of both may still see the block evicted
  between its two reads: `meta` then returns None).
- Read (`read`, or `lease` then `read_lease`). The reader opens `blocks/<key>`, takes a
  shared flock on it and checks that the inode is still linked (`st_nlink > 0`). A
  lease is a hard link `leases/<key>.<pid>.<ns>` made under that shared flock; it keeps
  the block's inode alive and, while it exists, marks the block as in use.
- Evict (under the pool lock). The evictor walks blocks oldest `mtime` first (a read or
  a re-publish touches `mtime`: LRU; see "Chains" below), opens each, takes an exclusive flock without
  waiting and unlinks the block only if it got the flock (no reader is reading it) and
  `st_nlink == 1` (no lease). A lease can only be made under the shared flock, so
  none appears between the check and the unlink. Eviction therefore never removes a
  block that another process is reading or holds a lease on.
- Leases end by `release` (unlink of the lease name). Leases of dead processes, and
  leases older than `lease_ttl_s`, are removed by `sweep_leases` (run by every evictor),
  so a crashed reader cannot pin a block forever.

Chains: a prefix's blocks are usable only from its start, so a pool that evicted a
chain's first block and kept its later ones would hold bytes nobody can use. A caller
that uses a chain of blocks at once (reads a prefix, or publishes the blocks it computed
for one) passes one `used_ns` for the whole use and the depth of each block (block 0 is
the chain's start): the block's last use is stamped `used_ns - depth` nanoseconds
(`chain_stamp`). Of one use, the deepest block is therefore the least recent, and the
evictor (oldest `mtime_ns` first) takes a chain's tail before its start; across uses
plain LRU order holds (a depth shifts a stamp by nanoseconds). A stamp never moves a
block's last use back (a late writer does not age a block another use touched since).
Without `used_ns` a use is stamped now, as before.

Capacity: the bytes under `blocks/` never exceed `capacity_bytes` (metadata is not
counted: it is meant to be a few hundred bytes a block). A publisher does not list the
pool to know what it holds: `used` keeps the count, read and rewritten only under the
pool lock, raised before the link (a writer that dies between the two leaves it too
high, never too low) and set from a listing whenever a block would not fit by it and
after every eviction, so it only errs high, and only until the pool next fills. A put
therefore costs the same whatever the pool holds; only eviction walks the directory. A block that cannot
fit (every older block is leased or being read) is not published: `put` returns
False. Temp files are outside the bound while they are written.

Concurrency: any number of processes and threads may call any method at once. The
pool lock serializes publishers and evictors only; readers never take it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_KEY = re.compile(r"^[0-9a-f]{8,128}$")


class PoolError(ValueError):
    """A bad argument to the pool (the pool is unchanged)."""


@dataclass(frozen=True)
class BlockInfo:
    """One published block: its key, size in bytes and last use (`mtime`, seconds)."""

    key: str
    size: int
    last_used: float


@dataclass(frozen=True)
class Lease:
    """A reader's hold on one block: while it exists the block is not evicted."""

    key: str
    path: str


def check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY.match(key):
        raise PoolError(f"pool key must be 8-128 lowercase hex digits, got {key!r}")
    return key


class Pool:
    """A directory of KV blocks; see the module docstring for the protocol."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        durable: bool = False,
        lease_ttl_s: float = 600.0,
    ) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise PoolError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        if lease_ttl_s <= 0:
            raise PoolError(f"lease_ttl_s must be positive, got {lease_ttl_s!r}")
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.durable = durable
        self.lease_ttl_s = lease_ttl_s
        self.blocks = self.root / "blocks"
        self.tmp = self.root / "tmp"
        self.leases = self.root / "leases"
        self.metas = self.root / "meta"
        for d in (self.blocks, self.tmp, self.leases, self.metas):
            d.mkdir(parents=True, exist_ok=True)
        self._lock_path = self.root / "lock"
        self._used_path = self.root / "used"
        self._lock_path.touch(exist_ok=True)

    # -- publish ---------------------------------------------------------------------------

    def put(
        self,
        key: str,
        data: bytes | bytearray | memoryview,
        meta: bytes | None = None,
        *,
        used_ns: int | None = None,
    ) -> bool:
        """Publish `data` as block `key`, with `meta` as its metadata (`meta`). True when
        the pool holds the block afterwards (published now or already there; an existing
        block is touched, not replaced, nor its metadata), False when it cannot fit under
        the capacity. `used_ns`: the block's last use to record (`chain_stamp`; default
        now)."""
        check_key(key)
        if meta is not None and not isinstance(meta, bytes):
            raise PoolError(f"meta must be bytes, got {type(meta).__name__}")
        _check_stamp(used_ns)
        size = len(data)
        if size > self.capacity_bytes:
            return False
        dst = self.blocks / key
        if self._touch(dst, used_ns):
            return True
        tmp = self.tmp / f"{key}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            with os.fdopen(fd, "wb", closefd=False) as out:
                out.write(data)
            if self.durable:
                os.fsync(fd)
            if used_ns is not None:
                os.utime(fd, ns=(used_ns, used_ns))
        finally:
            os.close(fd)
        try:
            with self._pool_lock():
                if self._touch(dst, used_ns):
                    return True
                if not self._make_room(size):
                    return False
                if meta is not None:
                    self._write_meta(key, meta)
                os.link(tmp, dst)
            if self.durable:
                self._fsync_dir(self.blocks)
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    # -- read ------------------------------------------------------------------------------

    def meta(self, key: str) -> bytes | None:
        """The metadata published with block `key`; None if it was published without any,
        or is not (or no longer) in the pool."""
        try:
            return (self.metas / check_key(key)).read_bytes()
        except FileNotFoundError:
            return None

    def contains(self, key: str) -> bool:
        return (self.blocks / check_key(key)).exists()

    def read(self, key: str, *, used_ns: int | None = None) -> bytearray | None:
        """The block's bytes, or None if the pool does not hold it. The block is read
        under a shared flock, so it is not evicted while it is read. A read is a use,
        stamped `used_ns` (`chain_stamp`; default now)."""
        _check_stamp(used_ns)
        fd = self._open_linked(check_key(key))
        if fd is None:
            return None
        try:
            _stamp(fd, used_ns)  # LRU: a read is a use
            buf = bytearray(os.fstat(fd).st_size)
            _read_into(fd, memoryview(buf))
            return buf
        finally:
            os.close(fd)  # releases the flock

    def lease(self, key: str, *, used_ns: int | None = None) -> Lease | None:
        """Hold block `key` until `release`: None if the pool does not hold it. A lease is
        a use, stamped `used_ns` (`chain_stamp`; default now)."""
        _check_stamp(used_ns)
        fd = self._open_linked(check_key(key))
        if fd is None:
            return None
        try:
            _stamp(fd, used_ns)
            path = self.leases / f"{key}.{os.getpid()}.{time.time_ns()}.{secrets.token_hex(2)}"
            os.link(self.blocks / key, path)  # under our shared flock: still this inode
            return Lease(key, str(path))
        finally:
            os.close(fd)

    def touch(self, key: str, *, used_ns: int | None = None) -> bool:
        """Record a use of block `key` without reading it (an engine that used its own
        copy of a pooled chain): False if the pool does not hold it."""
        _check_stamp(used_ns)
        return self._touch(self.blocks / check_key(key), used_ns)

    @staticmethod
    def read_lease(lease: Lease) -> bytearray | None:
        """The leased block's bytes (any process may read a lease by its path); None if
        the lease was swept (it outlived `lease_ttl_s` or its process)."""
        try:
            fd = os.open(lease.path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            buf = bytearray(os.fstat(fd).st_size)
            _read_into(fd, memoryview(buf))
            return buf
        finally:
            os.close(fd)

    @staticmethod
    def read_lease_into(lease: Lease, out: memoryview) -> bool:
        """Read the leased block into `out` (a writable buffer of exactly the block's
        size, e.g. a tensor's memory): False if the lease is gone or the size differs."""
        try:
            fd = os.open(lease.path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            if os.fstat(fd).st_size != out.nbytes:
                return False
            _read_into(fd, out.cast("B"))
            return True
        finally:
            os.close(fd)

    @staticmethod
    def release(lease: Lease) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lease.path)

    # -- what the pool holds ---------------------------------------------------------------

    def listing(self) -> list[BlockInfo]:
        """Every published block, oldest use first (by the nanosecond stamp: a chain's
        tail before its start, module docstring)."""
        out = []
        for entry in self._scan(self.blocks):
            with contextlib.suppress(FileNotFoundError):  # evicted while listing
                st = entry.stat()
                out.append((st.st_mtime_ns, BlockInfo(entry.name, st.st_size, st.st_mtime)))
        out.sort(key=lambda nb: (nb[0], nb[1].key))
        return [b for _, b in out]

    def held_keys(self) -> set[str]:
        return {e.name for e in self._scan(self.blocks)}

    def used_bytes(self) -> int:
        return sum(b.size for b in self.listing())

    def active_leases(self) -> int:
        return sum(1 for _ in self._scan(self.leases))

    # -- eviction --------------------------------------------------------------------------

    def evict_to(self, target_bytes: int) -> int:
        """Evict least recently used blocks (never a leased one or one being read) until
        at most `target_bytes` are held, as far as leases and readers allow; the bytes
        evicted."""
        with self._pool_lock():
            freed = self._evict_until(target_bytes)
            self._write_used(self.used_bytes())
            return freed

    def sweep_leases(self) -> int:
        """Remove leases whose process is gone or that are older than `lease_ttl_s`."""
        now = time.time_ns()
        removed = 0
        for entry in self._scan(self.leases):
            parts = entry.name.split(".")
            try:
                pid, born = int(parts[1]), int(parts[2])
            except (IndexError, ValueError):
                pid, born = -1, 0  # not a lease name of ours: stale by definition
            if _alive(pid) and now - born < self.lease_ttl_s * 1e9:
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed += 1
        return removed

    # -- internals -------------------------------------------------------------------------

    def _make_room(self, size: int) -> bool:
        """Under the pool lock: evict until `size` more bytes fit, and count them in `used`
        (the caller links the block next). False if they cannot fit."""
        limit = self.capacity_bytes - size
        used = self._read_used()
        if used is None or used > limit:  # by the count it does not fit: list, evict
            self._evict_until(limit)
            used = self.used_bytes()
            if used > limit:
                self._write_used(used)
                return False
        self._write_used(used + size)
        return True

    def _read_used(self) -> int | None:
        try:
            return int(self._used_path.read_bytes())
        except (FileNotFoundError, ValueError):  # never written, or a torn write: recount
            return None

    def _write_used(self, used: int) -> None:
        fd = os.open(self._used_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, str(used).encode())
        finally:
            os.close(fd)

    def _evict_until(self, limit: int) -> int:
        """Under the pool lock: evict oldest-used first until at most `limit` bytes are
        held; the bytes evicted."""
        blocks = self.listing()
        used = sum(b.size for b in blocks)
        if used <= limit:
            return 0
        self.sweep_leases()
        freed = 0
        for b in blocks:
            if used - freed <= limit:
                break
            if self._evict_one(b.key):
                freed += b.size
        return freed

    def _evict_one(self, key: str) -> bool:
        path = self.blocks / key
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # a reader holds it
            if os.fstat(fd).st_nlink != 1:
                return False  # leased
            os.unlink(path)
            with contextlib.suppress(FileNotFoundError):  # published without metadata
                os.unlink(self.metas / key)
            return True
        finally:
            os.close(fd)

    def _open_linked(self, key: str) -> int | None:
        """An fd on blocks/<key> holding a shared flock, the block still published."""
        try:
            fd = os.open(self.blocks / key, os.O_RDONLY)
        except FileNotFoundError:
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)
        if os.fstat(fd).st_nlink == 0:  # evicted between open and flock
            os.close(fd)
            return None
        return fd

    def _write_meta(self, key: str, meta: bytes) -> None:
        """Under the pool lock: `meta/<key>` whole or not at all (temp, then rename)."""
        tmp = self.tmp / f"{key}.meta.{os.getpid()}.{secrets.token_hex(4)}"
        tmp.write_bytes(meta)
        os.replace(tmp, self.metas / key)

    def _touch(self, path: Path, used_ns: int | None = None) -> bool:
        try:
            if used_ns is None:
                os.utime(path)
            elif os.stat(path).st_mtime_ns < used_ns:  # never back (module docstring)
                os.utime(path, ns=(used_ns, used_ns))
            return True
        except FileNotFoundError:
            return False

    @contextlib.contextmanager
    def _pool_lock(self) -> Iterator[None]:
        fd = os.open(self._lock_path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    @staticmethod
    def _scan(d: Path) -> Iterator[os.DirEntry[str]]:
        with os.scandir(d) as it:
            yield from it

    @staticmethod
    def _fsync_dir(d: Path) -> None:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def chain_stamp(used_ns: int, depth: int) -> int:
    """The last use to record for the block at `depth` (0: the chain's start) of a chain
    used at `used_ns`: deeper blocks are older, so eviction takes a chain's tail first."""
    if depth < 0:
        raise PoolError(f"depth must be >= 0, got {depth!r}")
    return used_ns - depth


def _check_stamp(used_ns: int | None) -> None:
    if used_ns is not None and (type(used_ns) is not int or used_ns <= 0):
        raise PoolError(f"used_ns must be a positive int (ns since the epoch), got {used_ns!r}")


def _stamp(fd: int, used_ns: int | None) -> None:
    if used_ns is None:
        os.utime(fd)
    elif os.fstat(fd).st_mtime_ns < used_ns:
        os.utime(fd, ns=(used_ns, used_ns))


def _read_into(fd: int, view: memoryview) -> None:
    size, got = view.nbytes, 0
    while got < size:
        n = os.preadv(fd, [view[got:]], got)
        if n == 0:
            raise OSError(errno.EIO, f"short read: {got} of {size} bytes")
        got += n


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
