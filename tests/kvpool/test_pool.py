"""The shared KV pool (`kvpool.Pool`): atomic publish, LRU under a byte capacity, leases
and readers that eviction never removes from under, and two processes at once."""

from __future__ import annotations

import fcntl
import hashlib
import multiprocessing as mp
import os
import random
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from pool_procs import run_two

from kvpool import Pool, PoolError, chain_stamp

BLOCK = 4096


def key(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def payload(k: str, size: int = BLOCK) -> bytes:
    digest = hashlib.sha256(k.encode()).digest()
    return (digest * (size // len(digest) + 1))[:size]


def test_put_then_read_returns_the_bytes_and_a_block_is_never_replaced(tmp_path: Path) -> None:
    pool = Pool(tmp_path, 10 * BLOCK)
    assert pool.read(key(1)) is None
    assert pool.put(key(1), payload(key(1)))
    assert pool.read(key(1)) == payload(key(1))
    inode = os.stat(pool.blocks / key(1)).st_ino
    assert pool.put(key(1), payload(key(2)))  # same key: touched, not replaced
    assert os.stat(pool.blocks / key(1)).st_ino == inode
    assert pool.read(key(1)) == payload(key(1))
    assert pool.held_keys() == {key(1)}
    assert not list(pool.tmp.iterdir())


def test_metadata_is_published_with_its_block_and_leaves_with_it(tmp_path: Path) -> None:
    pool = Pool(tmp_path, 2 * BLOCK)
    assert pool.put(key(1), payload(key(1)), meta=b'{"tokens": [1, 2]}')
    assert pool.meta(key(1)) == b'{"tokens": [1, 2]}'
    assert pool.put(key(1), payload(key(1)), meta=b"other")  # not replaced either
    assert pool.meta(key(1)) == b'{"tokens": [1, 2]}'
    assert pool.put(key(2), payload(key(2)))  # none given: none kept
    assert pool.meta(key(2)) is None
    with pytest.raises(PoolError, match="meta must be bytes"):
        pool.put(key(3), payload(key(3)), meta="text")  # type: ignore[arg-type]
    assert pool.held_keys() == {key(1), key(2)}
    assert pool.put(key(3), payload(key(3)), meta=b"3")  # evicts key(1), the oldest
    assert pool.held_keys() == {key(2), key(3)}
    assert pool.meta(key(1)) is None and not (pool.metas / key(1)).exists()
    assert {p.name for p in pool.metas.iterdir()} == {key(3)}
    assert not list(pool.tmp.iterdir())


def test_the_used_count_follows_puts_and_evictions_and_heals_when_high(tmp_path: Path) -> None:
    pool = Pool(tmp_path, 4 * BLOCK)

    def counted() -> int:
        return int((tmp_path / "used").read_bytes())

    for i in range(3):
        assert pool.put(key(i), payload(key(i)))
        assert counted() == pool.used_bytes() == (i + 1) * BLOCK
    assert pool.put(key(0), payload(key(0)))  # already there: not counted twice
    assert counted() == 3 * BLOCK
    assert pool.evict_to(BLOCK) == 2 * BLOCK
    assert counted() == pool.used_bytes() == BLOCK
    (kept,) = pool.held_keys()
    # a writer that died after counting its block but before linking it: too high
    (tmp_path / "used").write_bytes(str(4 * BLOCK).encode())
    assert pool.put(key(5), payload(key(5)))  # recounted from the directory, nothing evicted
    assert pool.held_keys() == {kept, key(5)} and counted() == 2 * BLOCK
    (tmp_path / "used").write_bytes(b"garbage")  # torn: recounted too
    assert pool.put(key(6), payload(key(6))) and counted() == 3 * BLOCK
    for i in range(7, 10):  # full: the count stays the directory's through evictions
        assert pool.put(key(i), payload(key(i)))
        assert counted() == pool.used_bytes() <= 4 * BLOCK


@pytest.mark.parametrize("bad", ["", "ABCDEF0123", "../../etc/passwd", "abc", "z" * 16, 7])
def test_a_bad_key_is_refused_and_changes_nothing(tmp_path: Path, bad: object) -> None:
    pool = Pool(tmp_path, 10 * BLOCK)
    with pytest.raises(PoolError, match="hex"):
        pool.put(bad, b"x")  # type: ignore[arg-type]
    with pytest.raises(PoolError):
        pool.read(bad)  # type: ignore[arg-type]
    assert pool.held_keys() == set() and not list(pool.tmp.iterdir())


def test_bad_capacity_is_refused(tmp_path: Path) -> None:
    for cap in (0, -1, 1.5):
        with pytest.raises(PoolError, match="capacity"):
            Pool(tmp_path, cap)  # type: ignore[arg-type]


def test_capacity_evicts_the_least_recently_used(tmp_path: Path) -> None:
    pool = Pool(tmp_path, 3 * BLOCK)
    for i in range(3):
        assert pool.put(key(i), payload(key(i)))
        os.utime(pool.blocks / key(i), (1000 + i, 1000 + i))  # distinct mtimes
    assert pool.read(key(0)) is not None  # a use: key 1 is now the oldest
    assert pool.put(key(3), payload(key(3)))
    assert pool.held_keys() == {key(0), key(2), key(3)}
    assert pool.used_bytes() == 3 * BLOCK
    assert not pool.put(key(9), payload(key(9), 4 * BLOCK))  # larger than the pool


def test_a_chain_used_at_once_is_evicted_tail_first_and_a_bad_stamp_is_refused(
    tmp_path: Path,
) -> None:
    pool = Pool(tmp_path, 4 * BLOCK)
    t = time.time_ns()
    for d in range(3):  # one use of a chain of 3 blocks, its start put first
        assert pool.put(key(d), payload(key(d)), used_ns=chain_stamp(t, d))
    assert pool.put(key(9), payload(key(9)))  # a later use of another block
    assert pool.put(key(10), payload(key(10)))  # full: the chain's deepest block goes
    assert pool.held_keys() == {key(0), key(1), key(9), key(10)}
    assert pool.touch(key(1), used_ns=chain_stamp(t, 1) - 5)  # never moves a use back
    assert pool.put(key(11), payload(key(11)))
    assert pool.held_keys() == {key(0), key(9), key(10), key(11)}
    assert not pool.touch(key(1))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(PoolError, match="used_ns"):
            pool.read(key(0), used_ns=bad)  # type: ignore[arg-type]
    with pytest.raises(PoolError, match="depth"):
        chain_stamp(t, -1)
    assert pool.held_keys() == {key(0), key(9), key(10), key(11)}


def test_a_leased_block_is_never_evicted_and_a_full_pool_refuses(tmp_path: Path) -> None:
    pool = Pool(tmp_path, 2 * BLOCK)
    pool.put(key(0), payload(key(0)))
    pool.put(key(1), payload(key(1)))
    leases = [pool.lease(key(0)), pool.lease(key(1))]
    assert all(leases)
    assert not pool.put(key(2), payload(key(2)))  # everything is leased
    assert pool.evict_to(0) == 0
    assert pool.held_keys() == {key(0), key(1)}
    for lease in leases:
        assert lease is not None
        assert Pool.read_lease(lease) == payload(lease.key)
        Pool.release(lease)
    assert pool.put(key(2), payload(key(2)))
    assert key(2) in pool.held_keys() and len(pool.held_keys()) == 2


def test_a_block_being_read_is_never_evicted(tmp_path: Path) -> None:
    pool = Pool(tmp_path, 2 * BLOCK)
    pool.put(key(0), payload(key(0)))
    fd = os.open(pool.blocks / key(0), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # what a reader holds while it reads
        assert pool.evict_to(0) == 0
        assert pool.contains(key(0))
    finally:
        os.close(fd)
    assert pool.evict_to(0) == BLOCK
    assert not pool.contains(key(0))


def _lease_and_exit(root: str) -> None:
    pool = Pool(root, 2 * BLOCK)
    assert pool.lease(key(0)) is not None


def test_leases_of_a_dead_process_are_swept(tmp_path: Path) -> None:
    pool = Pool(tmp_path, 2 * BLOCK)
    pool.put(key(0), payload(key(0)))
    child = mp.get_context("spawn").Process(target=_lease_and_exit, args=(str(tmp_path),))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert pool.active_leases() == 1
    assert pool.evict_to(0) == BLOCK  # the evictor sweeps the dead process's lease
    assert pool.active_leases() == 0 and pool.held_keys() == set()


def test_old_leases_expire(tmp_path: Path) -> None:
    pool = Pool(tmp_path, 2 * BLOCK, lease_ttl_s=0.05)
    pool.put(key(0), payload(key(0)))
    lease = pool.lease(key(0))
    assert lease is not None
    assert pool.sweep_leases() == 0
    time.sleep(0.1)
    assert pool.sweep_leases() == 1
    assert Pool.read_lease(lease) is None


# -- two processes at once ----------------------------------------------------------------

KEYS = 120
CAPACITY = 24 * BLOCK


def size_of(i: int) -> int:
    return BLOCK // 2 + (i % 5) * BLOCK // 4  # 2-6 KiB: eviction frees unequal sizes


def _worker(root: str, seed: int, seconds: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    pool = Pool(root, CAPACITY)
    rng = random.Random(seed)
    stats = {"put": 0, "hit": 0, "miss": 0, "leased": 0, "errors": []}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        i = rng.randrange(KEYS)
        k, want = key(i), payload(key(i), size_of(i))
        op = rng.random()
        if op < 0.4:
            stats["put"] += pool.put(k, want)
        elif op < 0.8:
            got = pool.read(k)
            if got is None:
                stats["miss"] += 1
            elif got != want:
                stats["errors"].append(f"torn or wrong read of {i}: {len(got)} bytes")
            else:
                stats["hit"] += 1
        else:
            lease = pool.lease(k)
            if lease is None:
                continue
            stats["leased"] += 1
            # make the leased block the eviction's first candidate (oldest use)
            os.utime(pool.blocks / k, (0, 0))
            time.sleep(rng.random() * 0.005)
            if not pool.contains(k):
                stats["errors"].append(f"leased block {i} evicted")
            if Pool.read_lease(lease) != want:
                stats["errors"].append(f"leased block {i} unreadable")
            Pool.release(lease)
    out.put(stats)


def test_two_processes_write_and_read_one_pool_at_once(tmp_path: Path) -> None:
    peak, results = run_two(_worker, tmp_path, CAPACITY)
    pool = Pool(tmp_path, CAPACITY)
    for r in results:
        assert r["errors"] == [], r["errors"][:5]
        assert r["put"] > 100 and r["hit"] > 50 and r["miss"] > 10 and r["leased"] > 20, r
    assert 0 < peak <= CAPACITY
    assert pool.used_bytes() <= CAPACITY
    assert pool.active_leases() == 0
    assert not list(pool.tmp.iterdir())
    for b in pool.listing():  # every block left is whole and right
        i = next(j for j in range(KEYS) if key(j) == b.key)
        assert pool.read(b.key) == payload(b.key, size_of(i))
