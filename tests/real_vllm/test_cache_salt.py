"""A request's `cache_salt` on real vLLM: the engine shares no cached block between
salts (the salt is in the first block's hash, `extra_keys`), so the router must predict
no hit for a salted request from unsalted blocks, and the sidecar must report no salted
block as a hit for unsalted requests.

An unsalted prompt warms an engine; the same prompt with a salt then gets 0 cached tokens
from vLLM, and the router predicts no hit for it on any engine; the same salted prompt
again hits in vLLM (same salt), and the router claims no more than vLLM's hit (only what
it sent there itself, never a block from the sidecar). The sidecar reports every block
of the raw stream but the salted ones.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

import aiohttp
import pytest
from vllm_engines import BLOCK
from vllm_stack import Stack, chat_body, predicted_cached, reset

from ramjet.app.server import RouterServer

pytestmark = pytest.mark.timeout(240)


async def wait_applied(stack: Stack, eid: str, timeout_s: float = 20) -> dict[str, Any]:
    """Until the sidecar has applied the raw stream's last batch; its health."""
    deadline = time.monotonic() + timeout_s
    while True:
        seq, _ = stack.raw[eid].snapshot()
        h: dict[str, Any] = await asyncio.to_thread(stack.sidecars[eid].health)
        if h["last_event_seq"] == seq:
            return h
        if time.monotonic() > deadline:
            raise AssertionError(f"{eid}: sidecar at {h['last_event_seq']}, stream at {seq}")
        await asyncio.sleep(0.1)


async def test_a_salted_request_is_predicted_no_hit_from_other_salts(
    stack: Stack, routers: list[RouterServer], tmp_path: Any
) -> None:
    # session_hash with one session id keeps all three requests on one engine
    server, records = await stack.router(tmp_path, incumbent="session_hash")
    routers.append(server)
    await stack.settle([server])
    text = " ".join(f"salted line {i}: one cache per tenant." for i in range(30))
    msgs = [{"role": "user", "content": f"[{secrets.token_hex(4)}] {text}"}]
    got: list[tuple[str, int, int]] = []
    try:
        async with aiohttp.ClientSession() as http:
            for label, extra in (
                ("plain", {}),
                ("salt-a", {"cache_salt": "tenant-a"}),
                ("salt-a again", {"cache_salt": "tenant-a"}),
            ):
                url = server.url + "/v1/chat/completions"
                headers = {"X-Session-Id": "salt-test"}
                async with http.post(url, json=chat_body(msgs, **extra), headers=headers) as r:
                    assert r.status == 200, await r.text()
                    data = await r.json()
                rec = records.records[-1]
                assert rec.engine is not None
                cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
                got.append((label, predicted_cached(rec), cached))
                if label == "plain":
                    await stack.settle([server])
                    eid = rec.engine
                else:
                    assert rec.engine == eid
                    # no hit predicted elsewhere: other salts' blocks serve no salted request
                    # (on `eid`, the second one may match what the router itself sent
                    # there: its pending entries for the first salted request's keys)
                    assert rec.candidate is not None
                    hbm = {e: c["hbm_tokens"] for e, c in rec.candidate.components.items()}
                    others = [v for e, v in hbm.items() if e != eid or label == "salt-a"]
                    assert all(v == 0 for v in others), (label, hbm)
                    h = await wait_applied(stack, eid)
        (_, p0, c0), (_, p1, c1), (_, p2, c2) = got
        assert c0 == 0 and p0 == 0, got  # a new prompt
        assert c1 == 0 and p1 == 0, got  # vLLM shares nothing across salts; nor may we
        assert c2 > 0 and p2 <= c2, got  # a same-salt hit: never claimed beyond vLLM's
        # the raw stream holds the salted blocks (all of them hit just now); the sidecar
        # keys none of them, and holds every other block the stream holds
        raw = len(stack.raw[eid].snapshot()[1])
        assert raw - h["resident_blocks"] == c2 // BLOCK, (raw, h, got)
    finally:
        for eid in stack.engines:
            await reset(stack, eid)
        await stack.settle([server])
