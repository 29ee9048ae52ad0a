"""The router's predicted cached tokens equal vLLM's own `cached_tokens`, from the
sidecars' signed reports alone.

A multi-turn chat workload (sessions sharing a system prompt) goes through a router in
observe mode; after each answer the stack settles (router, sidecar and the engine's raw
event stream agree). For every request, the candidate's predicted HBM match on the engine
that served it, capped as vLLM caps a hit (it always computes the last prompt token:
at most `(n - 1) // B` blocks), equals `usage.prompt_tokens_details.cached_tokens`, and
the router's prompt length equals vLLM's `prompt_tokens` (same template, same tokens).
Then a second router that never saw the traffic (it learns the engines' caches from the
sidecars' snapshots) routes each session's next turn, and agrees as well.
"""

from __future__ import annotations

import secrets
from typing import Any

import aiohttp
import pytest
from vllm_stack import Stack, chat_body, predicted_cached

from ramjet.app.server import RouterServer

pytestmark = pytest.mark.timeout(240)


def system_prompt(nonce: str) -> str:
    words = " ".join(f"rule {i}: route each request where its prefix lives." for i in range(18))
    return f"[{nonce}] You are an agent in a fleet. {words}"


async def turn(
    http: aiohttp.ClientSession, server: RouterServer, msgs: list[dict[str, Any]]
) -> dict[str, Any]:
    async with http.post(server.url + "/v1/chat/completions", json=chat_body(msgs)) as r:
        assert r.status == 200, await r.text()
        data: dict[str, Any] = await r.json()
    return data


async def test_router_predicts_vllm_cached_tokens_from_reports(
    stack: Stack, routers: list[RouterServer], tmp_path: Any
) -> None:
    server, records = await stack.router(tmp_path)
    routers.append(server)
    await stack.settle([server])
    system = system_prompt(secrets.token_hex(4))
    sessions = [
        [{"role": "system", "content": system}, {"role": "user", "content": f"Task {n}: begin."}]
        for n in range(3)
    ]
    seen: list[tuple[str, int, int, int, int]] = []
    async with aiohttp.ClientSession() as http:
        for t in range(3):
            for n, msgs in enumerate(sessions):
                data = await turn(http, server, msgs)
                rec = records.records[-1]
                usage = data["usage"]
                seen.append(
                    (
                        f"s{n}t{t}@{rec.engine}",
                        predicted_cached(rec),
                        usage["prompt_tokens_details"]["cached_tokens"],
                        rec.prompt_tokens,
                        usage["prompt_tokens"],
                    )
                )
                msgs += [
                    {"role": "assistant", "content": data["choices"][0]["message"]["content"]},
                    {"role": "user", "content": f"Step {t} of task {n} done; continue."},
                ]
                await stack.settle([server])
        assert all(p == c and rn == vn for _, p, c, rn, vn in seen), seen
        assert sum(c for _, _, c, _, _ in seen) > 0, seen  # the workload did hit the cache

        # a router that never saw this traffic learns the caches from snapshots alone
        fresh, fresh_records = await stack.router(tmp_path)
        routers.append(fresh)
        await stack.settle([server, fresh])
        later: list[tuple[str, int, int]] = []
        for n, msgs in enumerate(sessions):
            data = await turn(http, fresh, msgs)
            rec = fresh_records.records[-1]
            cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
            later.append((f"s{n}@{rec.engine}", predicted_cached(rec), cached))
            await stack.settle([server, fresh])
        assert all(p == c for _, p, c in later), later
        assert all(c > 0 for _, _, c in later), later
