"""Pending residency through a real router: a continuation sent while its parent is still
in flight (queued on its engine, no first byte yet, no report yet) goes to the parent's
engine under `prefix_affinity` and `tier_aware`, and the in-flight load counts predicted
uncached prompt tokens, not whole prompts."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fake_upstream import Behavior, FakeUpstream
from proxy_client import post
from router_rig import Records, router_config

from ramjet.app.server import RouterServer
from ramjet.residency.config import ResidencyConfig
from ramjet.residency.tables import ResidencyTables, ViewMode
from ramjet.types import EngineId

SYSTEM = "You are a careful assistant. " * 700  # ~20 KB: a long shared prefix
HOLD_S = 0.8
"""How long each fake engine holds a request before its first byte: the parent is still
in flight while the continuation is routed."""


def chat(*contents: str) -> dict[str, Any]:
    roles = ["system", "user", "assistant", "user"]
    return {
        "model": "m",
        "messages": [{"role": r, "content": c} for r, c in zip(roles, contents, strict=False)],
    }


async def wait_received(up: FakeUpstream, n: int) -> None:
    async with asyncio.timeout(5):
        while len(up.generation_requests()) < n:
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("policy", ["prefix_affinity", "tier_aware"])
async def test_continuation_follows_its_in_flight_parent(
    upstreams: list[FakeUpstream], policy: str
) -> None:
    for up in upstreams:
        up.behavior = Behavior(headers_delay_s=HOLD_S, chunks=1)
    cfg = router_config(
        [u.url for u in upstreams],
        incumbent={"name": policy},
        timeouts={"first_byte_s": 5.0, "idle_s": 5.0},
    )
    # exact (report-fed) mode, as for engines that report: only exact and pending entries
    # steer, so nothing the router recorded after a finished request can explain the pick
    tables = ResidencyTables(ResidencyConfig())
    for e in ("e0", "e1"):
        tables.set_mode(EngineId(e), ViewMode.REPORTED)
    records = Records()
    server = RouterServer(cfg, residency=tables, sink=records)
    await server.start()
    try:
        parent = chat(SYSTEM, "Summarize the plan in three steps.")
        p_task = asyncio.create_task(post(server.url, body=parent))
        async with asyncio.timeout(5):
            while not any(u.generation_requests() for u in upstreams):
                await asyncio.sleep(0.01)
        p_engine = next(u for u in upstreams if u.generation_requests())
        other = next(u for u in upstreams if u is not p_engine)
        # an unrelated, slightly shorter prompt keeps the other engine a little less busy:
        # without pending residency both policies would send the continuation there
        unrelated = chat("Unrelated context. " * 850, "Another question.")
        u_task = asyncio.create_task(post(server.url, body=unrelated))
        await wait_received(other, 1)
        child = chat(
            SYSTEM, "Summarize the plan in three steps.", "1. a 2. b 3. c", "Expand step 2."
        )
        c_task = asyncio.create_task(post(server.url, body=child))
        async with asyncio.timeout(5):
            while sum(len(u.generation_requests()) for u in upstreams) < 3:
                await asyncio.sleep(0.01)
        # all three wait on their engines (no first byte yet)
        inflight = server.router.fleet.get(p_engine.name).inflight_prompt_tokens
        p_reply, u_reply, c_reply = await asyncio.gather(p_task, u_task, c_task)
    finally:
        await server.stop(drain_s=0.2)
    assert p_reply.status == u_reply.status == c_reply.status == 200
    assert u_reply.engine == other.name
    assert c_reply.engine == p_reply.engine == p_engine.name
    by_size = sorted(records.records, key=lambda r: r.prompt_tokens)
    c_rec = by_size[-1]
    p_rec = next(r for r in records.records if r.engine == p_engine.name and r is not c_rec)
    comps = c_rec.live.components
    # the decision shows the parent's blocks pending on its engine, and none elsewhere
    pending = comps[EngineId(p_engine.name)]["pending_tokens"]
    assert pending > 0.8 * p_rec.prompt_tokens
    assert comps[EngineId(other.name)]["pending_tokens"] == 0
    # in flight on the parent's engine: the parent's whole prompt (nothing was cached when
    # it was routed) plus only the continuation's predicted uncached tokens
    expected = p_rec.prompt_tokens + c_rec.prompt_tokens - int(pending)
    assert inflight == expected < p_rec.prompt_tokens + c_rec.prompt_tokens
