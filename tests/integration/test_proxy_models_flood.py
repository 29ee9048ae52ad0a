"""A flood of `GET /v1/models` must not take the health probes' connections: probes keep
passing and `/readyz` stays 200 (it used to fail on every replica, and Kubernetes
removed them all)."""

from __future__ import annotations

import asyncio

import aiohttp
from fake_upstream import FakeUpstream
from router_rig import RouterFactory


async def test_models_flood_leaves_probes_and_readyz_alone(
    upstreams: list[FakeUpstream], make_router: RouterFactory
) -> None:
    for u in upstreams:
        u.behavior.models_delay_s = 0.2  # a slow model list
    router = await make_router(timeouts={"probe_s": 0.5}, health={"probe_interval_s": 0.05})
    async with aiohttp.ClientSession() as s:

        async def models() -> tuple[int, set[str]]:
            async with s.get(router.url + "/v1/models") as r:
                data = await r.json()
                return r.status, {m["id"] for m in data["data"]}

        async def readyz() -> list[int]:
            seen = []
            for _ in range(20):
                await asyncio.sleep(0.1)
                async with s.get(router.url + "/readyz") as r:
                    seen.append(r.status)
            return seen

        flood = [asyncio.create_task(models()) for _ in range(300)]
        ready = await readyz()
        replies = await asyncio.wait_for(asyncio.gather(*flood), 60)
    assert ready == [200] * 20, ready
    assert replies == [(200, {"m"})] * 300
    assert all(e.probe_ok and not e.ejected for e in router.router.fleet.engines)
    # shared fetches: far fewer engine calls than client calls
    assert all(u.models_requests < 100 for u in upstreams), [u.models_requests for u in upstreams]
