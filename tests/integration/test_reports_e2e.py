"""Issue 5 end to end: two real reference-engine processes signing their cache reports,
and the real router (in this process) holding only their public keys (key files named
by a policy file, relative to it).

Workload: multi-turn chat sessions through the router, with tiers small enough that
blocks are demoted HBM -> host -> SSD, a 2 s SWA TTL, one report of e0 lost in transit
(the puller's test seam drops it each time it is pulled), and a restart of e1 (new epoch) between turns. Then:

- the router saw the gap and healed it with a snapshot, and saw e1's new epoch;
- after SWA expiry on both sides, and again with fresh SWA state after one more turn,
  the router's tables (exact entries, per engine) equal the engine's own cache state as
  a fresh signed snapshot states it (signature checked with the engine's public key),
  and that snapshot equals the engine's unsigned `/cache` dump;
- the state compared has demoted blocks (host and SSD tiers) in it.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from engines import EngineProcess, free_port, signed_policy_text

from ramjet.app.server import RouterServer
from ramjet.config import load_policy
from ramjet.fleet.signals import REPORTS_KEY
from ramjet.reports.bodies import SnapshotBody, parse_body
from ramjet.reports.envelope import decode, verify_signature
from ramjet.reports.keys import load_private_key, write_keypair
from ramjet.reports.runtime import ReportsRuntime
from ramjet.residency.store import MemoryStore, Table
from ramjet.residency.tables import ResidencyTables
from ramjet.types import EngineId

pytestmark = pytest.mark.timeout(120)

MODEL = "mini-v4"
SWA_TTL_S = 2.0
ENGINE_FLAGS: dict[str, Any] = {
    "window": 16,
    "profile": "skip",
    "log_level": "WARNING",
    "hbm_tokens": 512,  # 2 blocks: every session's prefix is demoted soon
    "host_tokens": 1024,
    "ssd_tokens": 16384,
    "swa_ttl": SWA_TTL_S,
    "max_gen": 8,
}


def policy_text(urls: dict[str, str]) -> str:
    return signed_policy_text(
        urls,
        """\
incumbent: {name: prefix_affinity}
health: {probe_interval_s: 0.2, consecutive_failures: 2, ejection_base_s: 0.5}
timeouts: {first_byte_s: 30, connect_s: 1}
""",
    )


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return bytes(resp.read())


class Rig:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.engines: dict[str, EngineProcess] = {}
        self.public: dict[str, Any] = {}
        self.server: RouterServer | None = None

    @property
    def runtime(self) -> ReportsRuntime:
        assert self.server is not None
        return self.server.app[REPORTS_KEY]

    @property
    def tables(self) -> ResidencyTables:
        assert self.server is not None
        tables = self.server.router.residency
        assert isinstance(tables, ResidencyTables)
        return tables

    def metric(self, name: str, engine: str) -> float:
        assert self.server is not None
        v = self.server.router.metrics.registry.get_sample_value(name, {"engine": engine})
        return v or 0.0


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    r = Rig(tmp_path)
    try:
        for eid in ("e0", "e1"):
            priv, _pub, _ = write_keypair(tmp_path / "keys", f"{eid}-a")
            r.public[eid] = load_private_key(priv).public_key()
            (tmp_path / eid).mkdir()
            flags = {**ENGINE_FLAGS, "key": priv, "key_id": f"{eid}-a"}
            r.engines[eid] = EngineProcess(eid, free_port(), tmp_path / eid, flags)
        await asyncio.gather(*(asyncio.to_thread(e.start) for e in r.engines.values()))
        policy = tmp_path / "policy.yaml"
        policy.write_text(policy_text({e: p.url for e, p in r.engines.items()}))
        r.server = RouterServer(load_policy(policy), policy_path=str(policy))
        await r.server.start()
        yield r
    finally:
        if r.server is not None:
            await r.server.stop(drain_s=1.0)
        for e in r.engines.values():
            e.stop()


def router_state(tables: ResidencyTables, engine: str) -> tuple[dict[int, str], set[int]]:
    store = tables.store
    assert isinstance(store, MemoryStore)
    now = tables.clock()
    blocks = {
        int(k): e.tier.label
        for k, e in store.entries(Table.GLOBAL, EngineId(engine), exact=True)
        if e.expires_at > now
    }
    swa = {
        int(k)
        for k, e in store.entries(Table.SWA, EngineId(engine), exact=True)
        if e.expires_at > now
    }
    return blocks, swa


def engine_state(rig: Rig, engine: str) -> tuple[int, int, dict[int, str], set[int]]:
    """(epoch, seq, blocks, swa) from a fresh snapshot, its signature checked."""
    signed = decode(_get(rig.engines[engine].url + "/ramjet/snapshot"), 64 << 20)
    assert signed.envelope.engine_id == engine and signed.envelope.kind == "snapshot"
    assert verify_signature(signed, rig.public[engine])
    body = parse_body("snapshot", signed.envelope.body)
    assert isinstance(body, SnapshotBody)
    blocks = {int(k): g.tier for g in body.residency for k in g.keys}
    swa = {int(k) for g in body.swa for k in g.keys}
    return signed.envelope.epoch, signed.envelope.seq, blocks, swa


async def assert_router_matches(rig: Rig, engine: str, timeout: float = 8.0) -> dict[int, str]:
    """Wait for the router to catch up with a fresh snapshot, then compare; retried
    while the engine's state is still moving (a delta in flight)."""
    proc = rig.runtime.processor
    deadline = time.monotonic() + timeout
    while True:
        epoch, seq, blocks, swa = await asyncio.to_thread(engine_state, rig, engine)
        cursor = proc.cursor(EngineId(engine))
        caught_up = (
            cursor is not None
            and (cursor.epoch, cursor.seq) >= (epoch, seq)
            and not proc.snapshot_needed(EngineId(engine))
            and proc.state(EngineId(engine)).applying is None
        )
        mine = router_state(rig.tables, engine)
        if caught_up and mine == (blocks, swa):
            break
        if time.monotonic() > deadline:
            only_router = set(mine[0].items()) - set(blocks.items())
            only_engine = set(blocks.items()) - set(mine[0].items())
            raise AssertionError(
                f"{engine}: router != engine snapshot (cursor {cursor}, snapshot {epoch}/{seq}):"
                f" blocks only in router {sorted(only_router)[:8]}, only in engine "
                f"{sorted(only_engine)[:8]}; swa router {sorted(mine[1])} engine {sorted(swa)}"
            )
        await asyncio.sleep(0.1)
    # the signed snapshot is the engine's real state
    cache = json.loads(await asyncio.to_thread(_get, rig.engines[engine].url + "/cache"))
    assert {b["key"]: b["tier"] for b in cache["blocks"]} == blocks
    return blocks


class Session:
    def __init__(self, n: int) -> None:
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": f"Session {n}: you are agent {n}. " * 22},
            {"role": "user", "content": f"Start task {n}."},
        ]

    async def turn(self, http: aiohttp.ClientSession, url: str, i: int) -> None:
        body = {"model": MODEL, "messages": self.messages, "max_tokens": 2}
        async with http.post(url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            data = await r.json()
        self.messages += [
            {"role": "assistant", "content": data["choices"][0]["message"]["content"]},
            {"role": "user", "content": f"Continue with step {i}."},
        ]


async def test_router_tables_match_engines_after_demotions_expiry_loss_and_restart(
    rig: Rig,
) -> None:
    assert rig.server is not None
    url = rig.server.url
    sessions = [Session(n) for n in range(4)]
    ingest = rig.runtime.ingest
    lost: list[tuple[int, int]] = []

    def drop_one_delta(engine: EngineId, frame: bytes) -> bool:
        """Lose one e0 delta that stores blocks, for good: every time it is pulled again
        (the cursor has not passed it) it is lost again, until a later report arrives
        and the router sees the gap."""
        if engine != "e0":
            return False
        env = decode(frame, 64 << 20).envelope
        if lost:
            return (env.epoch, env.seq) == lost[0]
        if env.kind == "delta" and b'"stored"' in env.body:
            lost.append((env.epoch, env.seq))
            return True
        return False

    async with aiohttp.ClientSession() as http:
        for s in sessions:
            await s.turn(http, url, 1)
        saw_swa = any(router_state(rig.tables, e)[1] for e in ("e0", "e1"))
        gaps_before = rig.metric("ramjet_reports_gaps_total", "e0")
        fetched_before = rig.metric("ramjet_reports_snapshots_fetched_total", "e0")
        ingest.drop = drop_one_delta
        for s in sessions:
            await s.turn(http, url, 2)
        old_epoch = rig.engines["e1"].health()["epoch"]
        await asyncio.to_thread(rig.engines["e1"].restart)
        assert rig.engines["e1"].health()["epoch"] > old_epoch
        for s in sessions:
            await s.turn(http, url, 3)

        # the lost report was noticed and healed by a snapshot
        assert lost, "no e0 delta was dropped"
        deadline = time.monotonic() + 5
        while rig.metric("ramjet_reports_gaps_total", "e0") <= gaps_before:
            assert time.monotonic() < deadline, "the gap was never seen"
            await asyncio.sleep(0.1)
        while rig.metric("ramjet_reports_snapshots_fetched_total", "e0") <= fetched_before:
            assert time.monotonic() < deadline, "no snapshot healed the gap"
            await asyncio.sleep(0.1)
        assert rig.metric("ramjet_reports_epoch_changes_total", "e1") >= 1

        # SWA expired on both sides (engine sweep, router's own clock): tables match
        assert saw_swa, "the workload left no SWA state to expire"
        await asyncio.sleep(SWA_TTL_S + 0.6)
        tiers: set[str] = set()
        for e in ("e0", "e1"):
            blocks = await assert_router_matches(rig, e)
            assert router_state(rig.tables, e)[1] == set()
            tiers |= set(blocks.values())
        assert {"host", "ssd"} & tiers, f"no demotion happened: tiers {tiers}"

        # one more turn: fresh SWA state and new blocks match too
        await sessions[0].turn(http, url, 4)
        for e in ("e0", "e1"):
            await assert_router_matches(rig, e)
        assert any(router_state(rig.tables, e)[1] for e in ("e0", "e1"))
    # every frame the engines signed verified (a replay of an already applied seq aside)
    assert rig.server.router.metrics.registry is not None
    refused = {
        (s.labels["engine"], s.labels["reason"]): s.value
        for fam in rig.server.router.metrics.registry.collect()
        if fam.name == "ramjet_reports_rejected"
        for s in fam.samples
        if s.name.endswith("_total") and s.value and s.labels["reason"] != "replayed"
    }
    assert refused == {}
