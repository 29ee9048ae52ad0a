"""Profiles against the real engine (issue 15, problems 4 and 8).

- The probe sizes prompts in the engine's tokens (not words) and stops at the engine's
  maximum model length: on v1 (limit 2016) the default sizes end just below it and
  nothing is refused; the fitted curve spans them.
- A router started after the sidecars had published their profiles gets them from the
  snapshots it takes: its decisions price neither engine with the default profile.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from vllm_engines import MODEL
from vllm_stack import Stack, chat_body

from ramjet.app.server import RouterServer
from ramjet.sidecar.probe import probe_profile

pytestmark = pytest.mark.timeout(180)


async def test_probe_sizes_are_engine_tokens_up_to_its_limit(stack: Stack) -> None:
    prof = await probe_profile(
        stack.engines["v1"].url, MODEL, repeats=1, global_kv_bytes_per_token=1.0
    )
    starts = [p.context_tokens for p in prof.prefill_curve]
    # the fitted curve (`fit_curve`) runs from 0 to the longest probe, which the default
    # sizes put just under the 2016-token limit in the engine's own tokens (a size in
    # words would land far off, or be refused)
    assert len(starts) == 2 and starts[0] == 0, starts
    assert 0.9 * 2016 <= starts[1] < 2016, starts
    rates = [p.seconds_per_token for p in prof.prefill_curve]
    assert 0 < rates[0] <= rates[1], prof


async def test_a_router_started_after_the_sidecars_gets_their_profiles(
    stack: Stack, routers: list[RouterServer], tmp_path: Any
) -> None:
    deadline = time.monotonic() + 90
    for eid, sc in stack.sidecars.items():
        while (await asyncio.to_thread(sc.health))["profile"] is None:
            assert time.monotonic() < deadline, f"sidecar {eid} published no profile"
            await asyncio.sleep(0.5)
    await asyncio.sleep(1.0)  # well after the profile reports: a late router
    server, records = await stack.router(tmp_path)
    routers.append(server)
    await stack.settle([server])
    async with aiohttp.ClientSession() as http:
        body = chat_body([{"role": "user", "content": "profiles, please"}])
        async with http.post(server.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
    rec = records.records[-1]
    assert rec.candidate is not None
    notes = rec.candidate.notes
    assert not [n for n in notes if n.startswith(("default_profile", "estimate_profile"))], notes
