"""The router with its report runtime: a real router (`RouterServer`) in front of two
fake upstreams, pulling signed reports from a real publisher app for e0 on loopback.

- Views: e0's trust, profile and load come from its signed reports, merged with the
  router's own in-flight counters; residency comes from its exact reports, and the
  router's own routing never overrides it (an SSD block stays SSD after routing there).
- Push: `POST /ramjet/reports` on the push listener (`reports.push.port`) verifies like a
  pull; the client port does not take pushes.
- Staleness (RELIABILITY row 9): a silent engine's "queue full" stops holding traffic
  off within `stale_after_s`, and its residency stops holding traffic on within
  `stale_ttl_s`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fake_upstream import FakeUpstream
from router_rig import Records, router_config

from ramjet.app.server import RouterServer
from ramjet.fleet.signals import REPORTS_KEY
from ramjet.policy.cost import V41_FLASH_TP4_ESTIMATE
from ramjet.reports.bodies import DeltaBody, LoadBody, TierKeys, encode_body
from ramjet.reports.envelope import Envelope, sign
from ramjet.reports.keys import public_key_b64
from ramjet.reports.publisher import ReportPublisher
from ramjet.request.parse import ParseLimits, parse_request
from ramjet.types import EngineId, PrefixKey, TrustGrade

E0 = EngineId("e0")
KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))


def chat(text: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 4}


def block_keys(body: dict[str, Any]) -> tuple[PrefixKey, ...]:
    parsed = parse_request("/v1/chat/completions", json.dumps(body).encode(), {}, ParseLimits())
    return tuple(parsed.keys.blocks)


PROMPT = chat("The shared system prompt of a long agent session. " * 30)
OTHER = chat("Something else entirely, also long enough for blocks. " * 30)


@dataclass
class Publisher:
    pub: ReportPublisher
    runner: web.AppRunner
    url: str

    async def silence(self) -> None:
        await self.pub.stop()
        await self.runner.cleanup()


async def publisher() -> Publisher:
    pub = ReportPublisher(E0, KEY, "e0-a", snapshot=lambda: ([], []), load_interval_s=3600)
    app = web.Application()
    pub.add_routes(app)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    await pub.start()
    return Publisher(pub, runner, f"http://127.0.0.1:{runner.addresses[0][1]}")


@pytest.fixture
async def rig(
    upstreams: list[FakeUpstream],
) -> AsyncIterator[Callable[..., Any]]:
    made: list[tuple[RouterServer, Publisher]] = []

    async def make(incumbent: str, **reports: Any) -> tuple[RouterServer, Publisher, Records]:
        p = await publisher()
        cfg = router_config(
            [u.url for u in upstreams],
            incumbent={"name": incumbent},
            keys={"engines": {"e0": [{"key_id": "e0-a", "public_key": public_key_b64(KEY.public_key())}]}},
            reports={
                "engines": {"e0": p.url},
                "poll": {"wait_s": 0.2, "timeout_s": 2.0, "backoff_min_s": 0.05, "backoff_max_s": 0.1},
                **reports,
            },
        )  # fmt: skip
        records = Records()
        server = RouterServer(cfg, sink=records)
        await server.start()
        made.append((server, p))
        return server, p, records

    try:
        yield make
    finally:
        for server, p in made:
            await server.stop(drain_s=0.5)
            await p.silence()


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def send(server: RouterServer, body: dict[str, Any], n: int = 1) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            async with s.post(server.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                await r.read()


async def metrics_text(server: RouterServer) -> str:
    async with aiohttp.ClientSession() as s, s.get(server.url + "/metrics") as r:
        assert r.status == 200
        return await r.text()


def caught_up(server: RouterServer, p: Publisher) -> Callable[[], bool]:
    proc = server.app[REPORTS_KEY].processor

    def ok() -> bool:
        c = proc.cursor(E0)
        return c is not None and c.seq >= p.pub.seq

    return ok


async def test_views_carry_signed_trust_profile_load_and_exact_residency(
    rig: Callable[..., Any],
) -> None:
    server, p, records = await rig("prefix_affinity", push={"port": 0})
    keys = block_keys(PROMPT)
    assert len(keys) >= 4
    # before e0 reports a profile, /metrics says both engines are priced with the estimate
    src = 'ramjet_engine_profile_source{{engine="{}",source="{}"}} 1.0'
    text = await metrics_text(server)
    assert src.format("e0", "builtin_estimate") in text
    assert src.format("e1", "builtin_estimate") in text
    p.pub.publish_profile(V41_FLASH_TP4_ESTIMATE)
    p.pub.publish_load(
        LoadBody(
            queued_prompt_tokens=5000, running_requests=3, waiting_requests=1, kv_utilization=0.7
        )
    )
    p.pub.publish_delta(DeltaBody(stored=[TierKeys(tier="ssd", keys=keys)]))
    await until(caught_up(server, p))

    text = await metrics_text(server)  # e0's signed profile is its own, whatever its figures
    assert src.format("e0", "reported") in text and src.format("e1", "builtin_estimate") in text
    assert 'ramjet_engine_profile_source{engine="e0",source="builtin_estimate"} 0.0' in text
    await send(server, PROMPT, n=2)
    first, second = records.records
    assert first.engine == second.engine == "e0"  # the reported prefix pulls it there
    views = {v.id: v for v in second.views}
    e0, e1 = views[EngineId("e0")], views[EngineId("e1")]
    assert e0.trust is TrustGrade.EXACT and e1.trust is TrustGrade.APPROXIMATE
    assert e0.profile is not None and e1.profile is None
    assert e0.profile.model_dump() == V41_FLASH_TP4_ESTIMATE.model_dump()
    # the signed load reached the first request's view; by the second, a request had
    # started on e0 since the report came, so its queue no longer counts (fresh load)
    load0 = {v.id: v for v in first.views}[EngineId("e0")].load
    assert (load0.queued_prompt_tokens, load0.running_requests) == (5000, 3)
    assert (e0.load.queued_prompt_tokens, e0.load.running_requests) == (None, 3)
    assert e0.load.kv_utilization == pytest.approx(0.7)
    assert e1.load.queued_prompt_tokens is None and e1.load.running_requests is None
    # routing to e0 did not turn its reported SSD blocks into assumed HBM ones
    tokens = [256] * len(keys)
    match = e0.residency.global_match(keys, tokens)
    assert (match.hbm, match.ssd) == (0, 256 * len(keys))
    # e1 reports nothing: what the router routed there is its (approximate) view
    await send(server, OTHER)
    other_keys = block_keys(OTHER)
    routed = records.records[-1].engine
    now_view = server.router.residency.view(EngineId(routed) if routed else E0)
    if routed == "e1":
        assert now_view.global_match(other_keys, [256] * len(other_keys)).hbm > 0
    else:  # a reporting engine gets no approximate entries
        assert now_view.global_match(other_keys, [256] * len(other_keys)).total == 0

    # push: the same verification on the push listener, never on the client port
    runtime = server.app[REPORTS_KEY]
    cursor = runtime.processor.cursor(E0)
    assert cursor is not None
    env = Envelope(
        E0, "e0-a", cursor.epoch, cursor.seq + 1, int(time.time() * 1000),
        "delta", encode_body(DeltaBody(evicted=(keys[-1],))),
    )  # fmt: skip
    frame = sign(env, KEY)
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + "/ramjet/reports", data=frame) as r:
            assert r.status in (404, 405), r.status
        assert runtime.processor.cursor(E0) == cursor  # the client port changed nothing
        async with s.post(runtime.push_url, data=frame) as r:
            assert r.status == 202
        async with s.post(runtime.push_url, data=frame) as r:
            assert r.status == 400 and (await r.json())["rejected"] == "replayed"
    view = server.router.residency.view(E0)
    assert view.global_match(keys, tokens).ssd == 256 * (len(keys) - 1)


async def test_a_silent_engines_full_queue_stops_holding_traffic_off(
    rig: Callable[..., Any],
) -> None:
    server, p, records = await rig("least_loaded", stale_after_s=0.5, stale_ttl_s=1.0)
    p.pub.publish_load(
        LoadBody(
            queued_prompt_tokens=1_000_000, running_requests=8, waiting_requests=50,
            kv_utilization=0.99,
        )
    )  # fmt: skip
    await until(caught_up(server, p))
    await send(server, OTHER, n=4)
    assert {r.engine for r in records.records} == {"e1"}  # e0 reports a full queue
    await p.silence()  # e0 keeps serving but stops reporting
    t0 = time.monotonic()
    await asyncio.sleep(0.6)
    await send(server, OTHER, n=4)
    assert time.monotonic() - t0 < 3.0
    after = records.records[4:]
    assert "e0" in {r.engine for r in after}  # traffic returned within the TTL
    e0 = next(v for v in after[-1].views if v.id == "e0")
    assert e0.load.queued_prompt_tokens is None and e0.trust is TrustGrade.DEGRADED


async def test_a_silent_engines_residency_stops_holding_traffic_on(
    rig: Callable[..., Any],
) -> None:
    server, p, records = await rig("prefix_affinity", stale_after_s=0.3, stale_ttl_s=0.6)
    keys = block_keys(PROMPT)
    p.pub.publish_delta(DeltaBody(stored=[TierKeys(tier="hbm", keys=keys)]))
    await until(caught_up(server, p))
    await send(server, PROMPT, n=3)
    assert {r.engine for r in records.records} == {"e0"}
    await p.silence()
    # tick every stale_after_s / 4: silent (no steering) by stale_ttl_s + one tick
    await asyncio.sleep(0.6 + 0.2)
    await send(server, PROMPT, n=4)
    after = records.records[3:]
    e0 = next(v for v in after[0].views if v.id == "e0")
    assert e0.residency.global_match(keys, [256] * len(keys)).total == 0
    assert "e1" in {r.engine for r in after}  # no longer pinned by stale residency
