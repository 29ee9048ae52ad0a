"""`cache_salt` end to end on text keys: two real reference-engine processes signing
their cache reports, the real router (in this process) in front of them on loopback.

The engine keeps salts apart as vLLM and SGLang do (a salted request shares no cached
block with unsalted requests or other salts) and names a salted request's blocks by the
router's keys for it (`ramjet.keys.prefix.key_seed(model, salt=...)`, the one
implementation). So, with one prompt sent unsalted, then with salt a, then salt b, then
salt a again (one session, one engine):

- the router's exact entries, built from the engines' signed reports only, hold the
  router's own keys for each salted request it sent;
- salt a and salt b are predicted no hit on any engine (nor served one), though the
  unsalted prompt's (and salt a's) blocks are resident there;
- salt a again is predicted a hit on its engine, which serves one.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from engines import EngineProcess, free_port, signed_policy_text
from router_rig import Records

from ramjet.app.server import RouterServer
from ramjet.config import load_policy
from ramjet.keys.prefix import key_seed
from ramjet.request.parse import ParseLimits, parse_request
from ramjet.residency.store import MemoryStore, Table
from ramjet.residency.tables import ResidencyTables
from ramjet.types import EngineId

pytestmark = pytest.mark.timeout(120)

MODEL = "mini-v4"
FLAGS: dict[str, Any] = {"window": 16, "profile": "skip", "log_level": "WARNING", "max_gen": 2}
PROMPT = [{"role": "user", "content": "One tenant's long shared prompt, line by line. " * 24}]


def policy_text(urls: dict[str, str]) -> str:
    return signed_policy_text(
        urls,
        """\
incumbent: {name: session_hash}
candidate: {name: tier_aware}
mode: {kind: observe, candidate_budget_s: 1.0}
timeouts: {first_byte_s: 30, connect_s: 1}
""",
    )


@pytest.fixture
async def router(tmp_path: Path) -> AsyncIterator[tuple[RouterServer, Records]]:
    from ramjet.reports.keys import write_keypair

    procs: list[EngineProcess] = []
    server: RouterServer | None = None
    try:
        for eid in ("e0", "e1"):
            priv, _pub, _ = write_keypair(tmp_path / "keys", f"{eid}-a")
            (tmp_path / eid).mkdir()
            flags = {**FLAGS, "key": priv, "key_id": f"{eid}-a"}
            procs.append(EngineProcess(eid, free_port(), tmp_path / eid, flags))
        await asyncio.gather(*(asyncio.to_thread(p.start) for p in procs))
        policy = tmp_path / "policy.yaml"
        policy.write_text(policy_text({p.engine_id: p.url for p in procs}))
        records = Records()
        server = RouterServer(load_policy(policy), policy_path=str(policy), sink=records)
        await server.start()
        yield server, records
    finally:
        if server is not None:
            await server.stop(drain_s=1.0)
        for p in procs:
            p.stop()


def body(salt: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"model": MODEL, "messages": PROMPT, "max_tokens": 2}
    if salt is not None:
        out["cache_salt"] = salt
    return out


def router_keys(salt: str | None) -> list[int]:
    parsed = parse_request(
        "/v1/chat/completions", json.dumps(body(salt)).encode(), {}, ParseLimits()
    )
    return [int(k) for k in parsed.keys.blocks]


def reported(server: RouterServer, engine: str) -> set[int]:
    """The blocks the router holds for `engine` from its signed reports (exact entries)."""
    tables = server.router.residency
    assert isinstance(tables, ResidencyTables) and isinstance(tables.store, MemoryStore)
    now = tables.clock()
    entries = tables.store.entries(Table.GLOBAL, EngineId(engine), exact=True)
    return {int(k) for k, e in entries if e.expires_at > now}


async def until_reported(server: RouterServer, engine: str, keys: list[int]) -> None:
    deadline = time.monotonic() + 10
    while not set(keys) <= reported(server, engine):
        assert time.monotonic() < deadline, (engine, keys, sorted(reported(server, engine)))
        await asyncio.sleep(0.05)


async def test_a_salted_request_hits_only_its_own_salts_blocks(
    router: tuple[RouterServer, Records],
) -> None:
    server, records = router
    keys = {s: router_keys(s) for s in (None, "a", "b")}
    assert len(keys[None]) >= 4
    assert key_seed(MODEL, salt="a") != key_seed(MODEL)
    seen: list[tuple[str | None, dict[str, int], int]] = []
    async with aiohttp.ClientSession() as http:
        for salt in (None, "a", "b", "a"):
            url = server.url + "/v1/chat/completions"
            headers = {"X-Session-Id": "tenant-session"}  # session_hash: one engine
            async with http.post(url, json=body(salt), headers=headers) as r:
                assert r.status == 200, await r.text()
                data = await r.json()
            rec = records.records[-1]
            assert rec.engine is not None and rec.candidate is not None
            hbm = {e: int(c["hbm_tokens"]) for e, c in rec.candidate.components.items()}
            cached = int(data["usage"]["prompt_tokens_details"]["cached_tokens"])
            seen.append((salt, hbm, cached))
            # the engine's signed reports name the request's blocks by the router's keys
            await until_reported(server, rec.engine, keys[salt])
    print("\n(salt, predicted hbm tokens per engine, engine's cached tokens):", *seen, sep="\n  ")
    (_, _, c0), (_, p_a, c_a), (_, p_b, c_b), (_, p_a2, c_a2) = seen
    engine = rec.engine
    assert set(p_a) == {"e0", "e1"}
    assert c0 == 0 and c_a == 0 and c_b == 0  # the engine shares nothing across salts
    assert all(v == 0 for v in (*p_a.values(), *p_b.values())), seen  # nor does the router
    assert c_a2 > 0 and p_a2[engine] >= c_a2, seen  # the same salt hits
    assert all(v == 0 for e, v in p_a2.items() if e != engine), seen
