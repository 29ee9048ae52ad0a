"""The reference engine's side of a shared pool (`engine_stub.shared_pool`): two processes
write blocks through and read prefixes of one small pool at once; every read is whole
and right, nothing another process reads is deleted, and the capacity holds. Also: a
block of another model reads as a miss, SWA states expire, a full write queue drops."""

from __future__ import annotations

import hashlib
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from engine_stub.shared_pool import SharedKV, SharedSWA, pool_key

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from pool_procs import run_two

from kvpool import Pool
from ramjet.types import PrefixKey

FP = "0123456789abcdef"
BLOCK_TOKENS = 256
BLOB = 4096
CAPACITY = 24 * (BLOB + 24)  # 24 blocks and their headers: far fewer than the keys used
CHAINS, DEPTH = 12, 6


def chain(c: int) -> list[PrefixKey]:
    """A prompt's block keys: chain c, blocks 0..DEPTH-1."""
    return [PrefixKey(0x1000_0000 + c * 64 + i) for i in range(DEPTH)]


def blob(key: PrefixKey) -> bytes:
    return hashlib.sha256(int(key).to_bytes(8, "little")).digest() * (BLOB // 32)


def _engine(root: str, seed: int, seconds: float, out: Any) -> None:
    pool = Pool(root, CAPACITY)
    kv = SharedKV(pool, "host0", FP, BLOCK_TOKENS, queue_items=64)
    rng = random.Random(seed)
    stats: dict[str, Any] = {"published": 0, "pulled": 0, "reads": 0, "errors": []}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        keys = chain(rng.randrange(CHAINS))
        if rng.random() < 0.5:  # a prompt computed here: its blocks written through
            kv.publish([(k, blob(k)) for k in keys])
            stats["published"] += len(keys)
        else:  # a prompt that missed locally: its longest prefix pulled from the pool
            got = kv.read_prefix(keys)
            stats["reads"] += 1
            stats["pulled"] += len(got.blobs)
            for k, b in zip(keys, got.blobs, strict=False):
                if b != blob(k):
                    stats["errors"].append(f"block {k:#x}: {len(b)} bytes, not its own")
            if got.nbytes != sum(len(b) for b in got.blobs):
                stats["errors"].append("nbytes disagrees with the blocks")
        time.sleep(0.0005)
    kv.close()
    stats["written"], stats["refused"] = kv.writer.written, kv.writer.refused
    if kv.read_errors:
        stats["errors"].append(f"{kv.read_errors} reads failed")
    out.put(stats)


def test_two_engine_processes_write_and_read_one_pool_at_once(tmp_path: Path) -> None:
    peak, results = run_two(_engine, tmp_path, CAPACITY)
    pool = Pool(tmp_path, CAPACITY)
    for r in results:
        assert r["errors"] == [], r["errors"][:5]
        # both wrote through and both pulled blocks (their own and the other's)
        assert r["written"] > 50 and r["reads"] > 50 and r["pulled"] > 50, r
    assert 0 < peak <= CAPACITY
    assert pool.used_bytes() <= CAPACITY
    assert not list(pool.tmp.iterdir()) and pool.active_leases() == 0
    kv = SharedKV(pool, "host0", FP, BLOCK_TOKENS)
    try:
        for c in range(CHAINS):  # every block left is whole and right
            for k, b in zip(chain(c), kv.read_prefix(chain(c)).blobs, strict=False):
                assert b == blob(k)
    finally:
        kv.close()


def test_the_pool_evicts_a_chain_from_its_tail_not_its_start(tmp_path: Path) -> None:
    """A prefix is usable only from its start: a full pool must give up a chain's deepest
    blocks, whether the chain was written in one go or grew over two turns while its start
    was used from the engine's own tiers."""
    pool = Pool(tmp_path, 8 * (BLOB + 24))  # 8 blocks and their headers
    a = SharedKV(pool, "host0", FP, BLOCK_TOKENS)
    b = SharedKV(pool, "host0", FP, BLOCK_TOKENS)
    x, y, z = chain(0), chain(1), chain(2)
    a.publish([(k, blob(k)) for k in x[:4]])  # turn 1 of session x, computed on a
    a.writer.flush()
    assert len(b.read_prefix(x).blobs) == 4  # b resumed x from the pool
    time.sleep(0.002)
    # turn 2 on a: blocks 0-3 from a's own tiers, 4-5 computed and written through
    a.publish([(k, blob(k)) for k in x[4:]], chain=x)
    a.writer.flush()
    b.publish([(k, blob(k)) for k in y[:4]])  # 10 blocks: two must go
    b.writer.flush()
    assert len(b.read_prefix(x).blobs) == 4, sorted(pool.held_keys())
    assert len(a.read_prefix(y).blobs) == 4
    a.publish([(k, blob(k)) for k in z])  # 6 more: x's four go, tail first, then y's tail
    a.writer.flush()
    held = {int(k, 16) for k in pool.held_keys()}
    for c in (x, y, z):  # what each chain keeps is a prefix of it
        kept = [k in held for k in c]
        assert kept == sorted(kept, reverse=True), (c, kept)
    assert len(b.read_prefix(z).blobs) == 6
    a.close()
    b.close()


def test_a_block_of_another_model_or_key_reads_as_a_miss(tmp_path: Path) -> None:
    pool = Pool(tmp_path, 1 << 20)
    ours = SharedKV(pool, "host0", FP, BLOCK_TOKENS)
    theirs = SharedKV(pool, "host0", "fedcba9876543210", BLOCK_TOKENS)
    keys = chain(0)
    theirs.publish([(keys[0], blob(keys[0]))])
    theirs.writer.flush()
    assert ours.read_prefix(keys).blobs == []  # same key, another model: not our state
    assert [len(b) for b in theirs.read_prefix(keys).blobs] == [BLOB]
    # a file under our next key holding another key's block stops the prefix there
    ours.publish([(keys[1], blob(keys[1]))])
    ours.writer.flush()
    os.rename(pool.blocks / pool_key(keys[1]), pool.blocks / pool_key(keys[2]))
    assert theirs.read_prefix(keys).blobs == [blob(keys[0])]
    ours.close()
    theirs.close()


def test_a_pooled_swa_state_is_read_by_its_boundary_and_expires(tmp_path: Path) -> None:
    pool = Pool(tmp_path, 1 << 20)
    a = SharedSWA(pool, "swa0", FP, ttl_s=1.0)
    b = SharedSWA(pool, "swa0", FP, ttl_s=1.0)
    a.publish(PrefixKey(77), 622, b"tail" * 100)
    a.writer.flush()
    got = b.get(PrefixKey(77), 622)
    assert got is not None and got[0] == b"tail" * 100 and got[1] >= 0
    assert b.get(PrefixKey(77), 600) is None  # a state that ends elsewhere is not this one
    assert b.get(PrefixKey(78), 622) is None
    past = time.time() - 2
    os.utime(pool.blocks / pool_key(PrefixKey(77)), (past, past))
    assert b.get(PrefixKey(77), 622) is None  # idle past the TTL
    a.close()
    b.close()


def test_a_full_write_queue_drops_the_write_and_does_not_block(tmp_path: Path) -> None:
    pool = Pool(tmp_path, 1 << 20)
    kv = SharedKV(pool, "host0", FP, BLOCK_TOKENS, queue_items=1)
    with open(pool.root / "lock", "rb") as lock:  # hold the pool lock: the writer waits
        import fcntl

        fcntl.flock(lock, fcntl.LOCK_EX)
        t0 = time.monotonic()
        kv.publish([(k, blob(k)) for c in range(4) for k in chain(c)])
        assert time.monotonic() - t0 < 1.0
        fcntl.flock(lock, fcntl.LOCK_UN)
    kv.close()
    assert kv.writer.dropped > 0
    assert kv.writer.written + kv.writer.dropped == 4 * DEPTH
    assert len(pool.held_keys()) == kv.writer.written
