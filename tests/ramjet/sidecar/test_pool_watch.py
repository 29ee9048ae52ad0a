"""The pool's reporter (`ramjet.sidecar.pool_watch`): what a kvpool directory holds
reaches a router signed by the pool's own key, and the router's pool residency equals
the directory's content through stores, evictions and a snapshot."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from reports_fixtures import KEYS, Clocks

from kvpool import Pool
from ramjet.keys.tokens import chain_keys, token_key_seed
from ramjet.reports.config import ReportsConfig
from ramjet.reports.keys import KeyRing
from ramjet.reports.processor import ReportProcessor
from ramjet.reports.publisher import ReportPublisher
from ramjet.reports.verify import Accepted
from ramjet.residency.tables import ResidencyTables
from ramjet.sidecar.engine_hashes import (
    VLLM_DEFAULT_NONE_HASH_SEED,
    vllm_block_hashes,
    vllm_none_hash,
)
from ramjet.sidecar.pool_watch import PoolWatcher, VllmPoolKeys, hex_router_key
from ramjet.types import EngineId, PrefixKey, Tier

POOL = EngineId("host0")


def _router(clocks: Clocks) -> tuple[ReportProcessor, ResidencyTables]:
    tables = ResidencyTables(clock=clocks.clock)
    ring = KeyRing({"stranger": (POOL, KEYS["stranger"].public_key())})
    proc = ReportProcessor(
        ring, tables, ReportsConfig(), CollectorRegistry(), clocks.wall_clock, clocks.clock
    )
    return proc, tables


def _held(tables: ResidencyTables, keys: list[PrefixKey]) -> set[PrefixKey]:
    view = tables.view(POOL)
    return {k for k in keys if view.global_match([k], [256]).total}


def test_the_routers_pool_residency_is_the_directorys_content(tmp_path: Path) -> None:
    clocks = Clocks()
    pool = Pool(tmp_path / "pool", capacity_bytes=64 * 1024)
    watchers: list[PoolWatcher] = []  # the publisher's snapshot source is the watcher
    pub = ReportPublisher(
        POOL,
        KEYS["stranger"],
        "stranger",
        snapshot=lambda: watchers[0].snapshot(),
        wall_clock=clocks.wall_clock,
    )
    watcher = PoolWatcher(pool, pub, Tier.HOST)
    watchers.append(watcher)
    proc, tables = _router(clocks)
    keys = [PrefixKey(0x1000 + i) for i in range(40)]
    for k in keys[:30]:
        assert pool.put(f"{k:016x}", b"x" * 1024)
    assert pool.put("ab" * 10, b"y")  # a key no router key maps to: skipped, counted

    def pull() -> None:
        for frame in pub.frames_after(proc_seq[0]):
            assert isinstance(proc.submit(frame), Accepted)
        proc_seq[0] = pub.seq

    proc_seq = [0]
    assert watcher.scan() == 30 and watcher.unmapped == 1
    pull()
    assert _held(tables, keys) == set(keys[:30])
    pool.evict_to(10 * 1024 + 1)  # the pool's LRU owner evicts: 20 blocks go
    for k in keys[30:]:
        assert pool.put(f"{k:016x}", b"x" * 1024)
    watcher.scan()
    pull()
    on_disk = {hex_router_key(k) for k in pool.held_keys()} - {None}
    assert _held(tables, keys) == on_disk and len(on_disk) < 30
    # a router that starts now converges from one snapshot
    late, late_tables = _router(clocks)
    assert isinstance(late.submit(pub.snapshot_frame()), Accepted)
    assert _held(late_tables, keys) == on_disk


def test_bad_parameters_are_refused(tmp_path: Path) -> None:
    pool = Pool(tmp_path / "p", capacity_bytes=1024)
    pub = ReportPublisher(POOL, KEYS["stranger"], "stranger")
    with pytest.raises(ValueError, match="host or ssd"):
        PoolWatcher(pool, pub, Tier.HBM)
    with pytest.raises(ValueError, match="interval_s"):
        PoolWatcher(pool, pub, Tier.HOST, interval_s=0)
    assert hex_router_key("zz" * 8) is None and hex_router_key("ab") is None


def test_an_swa_pools_states_reach_the_router_live_and_expire_when_idle(tmp_path: Path) -> None:
    import os

    clocks = Clocks()
    pool = Pool(tmp_path / "swa", capacity_bytes=64 * 1024)
    watchers: list[PoolWatcher] = []
    pub = ReportPublisher(
        POOL,
        KEYS["stranger"],
        "stranger",
        snapshot=lambda: watchers[0].snapshot(),
        wall_clock=clocks.wall_clock,
    )
    watcher = PoolWatcher(
        pool, pub, "swa", swa_ttl_s=60.0, heartbeat_s=5.0, wall_clock=clocks.wall_clock
    )
    watchers.append(watcher)
    proc, tables = _router(clocks)
    seq = [0]

    def pull() -> None:
        for frame in pub.frames_after(seq[0]):
            assert isinstance(proc.submit(frame), Accepted)
        seq[0] = pub.seq

    def used(k: PrefixKey, age_s: float) -> None:  # the state's last use, age_s ago
        t = clocks.wall - age_s
        os.utime(pool.blocks / f"{k:016x}", (t, t))

    a, b = PrefixKey(0xA0), PrefixKey(0xB0)
    for k in (a, b):
        assert pool.put(f"{k:016x}", b"s" * 512)
    used(a, 0)
    used(b, 50)  # 10 s left
    assert watcher.scan() == 2
    pull()
    view = tables.view(POOL)
    assert view.swa_match([(300, a)]) == 300 and view.swa_match([(700, b)]) == 700
    assert view.global_match([a, b], [256, 256]).total == 0  # SWA states, not blocks
    # b idles past its TTL: reported expired; a is used again: its TTL restarts
    clocks.advance(20)
    used(a, 0)
    assert watcher.scan() == 2
    pull()
    view = tables.view(POOL)
    assert view.swa_match([(700, b)]) == 0 and view.swa_match([(300, a)]) == 300
    assert watcher.held() == {a}
    _, swa = watcher.snapshot()
    assert [s.keys for s in swa] == [(a,)] and swa[0].ttl_ms == 60_000
    # quiet: nothing to report, but an empty delta once heartbeat_s has passed
    before = pub.seq
    watcher._last_publish -= 10  # the last report was 10 s ago
    assert watcher.scan() == 0 and pub.seq == before + 1
    assert watcher.scan() == 0 and pub.seq == before + 1  # not again at once
    pull()


# -- a pool written by vLLM engines through our connector (VllmPoolKeys) ------------------

B = 4
MODEL = "tiny"
NONE = vllm_none_hash("sha256_cbor", VLLM_DEFAULT_NONE_HASH_SEED)


def _vllm_publish(pool: Pool, tokens: list[int], extra_first: bool = False) -> list[str]:
    """Publish every full block of `tokens` as the connector does (`block_meta`): keyed
    by vLLM's block hash, its metadata beside it. Returns the pool keys in order."""
    hashes = vllm_block_hashes(
        tokens,
        B,
        "sha256_cbor",
        NONE,
        extra_keys=[("cache_salt", "s")] + [None] * 8 if extra_first else None,
    )
    out = []
    for i, h in enumerate(hashes):
        meta = {"v": 1, "parent": hashes[i - 1].hex() if i else None,
                "tokens": tokens[i * B : (i + 1) * B], "extra": extra_first and i == 0}  # fmt: skip
        assert pool.put(h.hex(), b"kv" * 8, json.dumps(meta).encode())
        out.append(h.hex())
    return out


def test_a_vllm_pools_signed_residency_is_the_router_keys_of_its_blocks(tmp_path: Path) -> None:
    clocks = Clocks()
    pool = Pool(tmp_path / "pool", capacity_bytes=64 * 16)
    keymap = VllmPoolKeys(pool, MODEL, B)
    watchers: list[PoolWatcher] = []
    pub = ReportPublisher(POOL, KEYS["stranger"], "stranger",
                          snapshot=lambda: watchers[0].snapshot(), wall_clock=clocks.wall_clock)  # fmt: skip
    watcher = PoolWatcher(pool, pub, Tier.HOST, router_key_of=keymap)
    watchers.append(watcher)
    proc, tables = _router(clocks)
    seed = token_key_seed(MODEL)
    a = list(range(100, 120))  # 5 blocks
    b = a[:8] + list(range(500, 508))  # shares 2 blocks with a, then 2 of its own
    # the router's keys of each prompt: what a request's prefix keys are
    want_a, want_b = chain_keys(a, seed, B), chain_keys(b, seed, B)
    _vllm_publish(pool, a)
    _vllm_publish(pool, b)
    salted = _vllm_publish(pool, list(range(900, 908)), extra_first=True)
    bad = json.dumps({"v": 1, "parent": None, "tokens": [1, 2, 3, 4], "extra": False})
    assert pool.put("ab" * 32, b"x", bad.encode())  # metadata that does not hash to the key
    assert pool.put("cd" * 32, b"x")  # no metadata

    seq = [0]

    def pull() -> None:
        for frame in pub.frames_after(seq[0]):
            assert isinstance(proc.submit(frame), Accepted)
        seq[0] = pub.seq

    watcher.scan()
    pull()
    assert watcher.held() == set(want_a) | set(want_b)
    assert _held(tables, want_a + want_b) == set(want_a) | set(want_b)
    assert tables.view(POOL).global_match(want_b, [B] * 4).total == 4 * B
    assert keymap.stats == {"extra_keys": 1, "unknown_parent": 1, "hash_mismatch": 1,
                            "no_meta": 1}  # fmt: skip
    assert watcher.unmapped == 4 and salted[0] in pool.held_keys()

    # the first blocks leave the pool: their children keep the keys mapped before
    assert pool.evict_to(pool.used_bytes() - 3 * 16) >= 3 * 16
    gone = set(watcher.held())
    watcher.scan()
    pull()
    gone -= watcher.held()
    assert gone and _held(tables, want_a + want_b) == watcher.held()
    on_disk = {keymap(k) for k in pool.held_keys()} - {None}
    assert watcher.held() == on_disk
    late, late_tables = _router(clocks)
    assert isinstance(late.submit(pub.snapshot_frame()), Accepted)
    assert _held(late_tables, want_a + want_b) == on_disk


def test_a_vllm_key_map_refuses_a_hash_it_cannot_check(tmp_path: Path) -> None:
    pool = Pool(tmp_path / "p", capacity_bytes=1024)
    with pytest.raises(ValueError, match="cryptographic"):
        VllmPoolKeys(pool, MODEL, B, algo="xxhash")
    with pytest.raises(ValueError, match="block_tokens"):
        VllmPoolKeys(pool, MODEL, 0)


def test_the_pool_reporter_serves_a_vllm_pools_residency_signed(tmp_path: Path) -> None:
    """`ramjet pool-reporter --key-map vllm`, a process on a free port: its snapshot, fetched
    over HTTP, verifies with the pool's public key and holds the router keys of the
    blocks the directory holds; a bad argument exits 2 with the reason."""
    import os
    import socket
    import subprocess
    import sys
    import time

    from ramjet.reports.keys import write_keypair

    repo = Path(__file__).resolve().parents[3]

    pool = Pool(tmp_path / "pool", capacity_bytes=1 << 20)
    tokens = list(range(300, 316))
    _vllm_publish(pool, tokens)
    public = write_keypair(tmp_path, "vpool-a")[2].public_key()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = [sys.executable, "-m", "ramjet", "pool-reporter", "--pool-dir", str(pool.root),
            "--id", "vpool", "--tier", "host", "--key", str(tmp_path / "vpool-a.key"),
            "--key-id", "vpool-a", "--port", str(port), "--key-map", "vllm"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(repo)}
    bad = subprocess.run([*base, "--model", MODEL], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "needs --model and --block-tokens" in bad.stderr
    with (tmp_path / "reporter.log").open("wb") as log:
        proc = subprocess.Popen(
            [*base, "--model", MODEL, "--block-tokens", str(B), "--interval", "0.1"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        want = set(chain_keys(tokens, token_key_seed(MODEL), B))
        ring = KeyRing({"vpool-a": (EngineId("vpool"), public)})
        while True:
            assert proc.poll() is None, (tmp_path / "reporter.log").read_text()
            if _snapshot_holds(port, ring, want) == want:
                break
            assert time.monotonic() < deadline, (tmp_path / "reporter.log").read_text()
            time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(10)
    assert proc.returncode == 0


def _snapshot_holds(port: int, ring: KeyRing, want: set[PrefixKey]) -> set[PrefixKey] | None:
    """Which of `want` the pool reporter's signed snapshot on `port` holds, verified as a
    router would; None while it is not listening yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ramjet/snapshot", timeout=2) as r:
            frame = r.read()
    except OSError:
        return None
    tables = ResidencyTables()
    assert isinstance(ReportProcessor(ring, tables).submit(frame), Accepted)
    view = tables.view(EngineId("vpool"))
    return {k for k in want if view.global_match([k], [B]).total}
