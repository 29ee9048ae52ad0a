"""The engine's HTTP layer, scheduler and prompt cache in one process, with a stand-in
model at the model seam (the real model runs in tests/integration)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient, TestServer
from standin_model import StandinModel

from engine_stub.engine import Engine, EngineSettings
from engine_stub.server import build_app
from ramjet.request.parse import ParseLimits, parse_request

SYSTEM = "You are a careful agent. " * 24  # ~600 bytes: two full key blocks


def chat(*turns: str) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": SYSTEM}]
    for i, t in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return msgs


async def make(**kw: object) -> tuple[Engine, TestClient, StandinModel]:
    model = StandinModel(window=16, step_s=float(kw.pop("step_s", 0.0)))  # type: ignore[arg-type]
    settings = EngineSettings(engine_id="t0", profile_mode="skip", speculate=False, **kw)  # type: ignore[arg-type]
    engine = Engine(settings, model=model)
    engine.start()
    client = TestClient(TestServer(build_app(engine)))
    await client.start_server()
    return engine, client, model


@pytest.fixture
async def served() -> AsyncIterator[tuple[Engine, TestClient, StandinModel]]:
    engine, client, model = await make(swa_ttl_s=0.5)
    try:
        yield engine, client, model
    finally:
        await client.close()
        engine.close()


async def test_turn_two_resumes_from_swa_then_replays_after_ttl(served) -> None:
    engine, client, model = served
    r1 = await client.post("/v1/chat/completions", json={"messages": chat("hi"), "max_tokens": 4})
    b1 = await r1.json()
    assert r1.status == 200, b1
    u1 = b1["usage"]
    assert u1["prompt_tokens_details"]["cached_tokens"] == 0
    assert u1["prompt_work"]["prefilled_tokens"] == u1["prompt_tokens"]
    assert u1["completion_tokens"] == 4 and b1["choices"][0]["finish_reason"] == "length"
    assert r1.headers["X-Engine-Epoch"] == str(engine.epoch) == str(u1["prompt_work"]["epoch"])
    msgs2 = chat("hi", b1["choices"][0]["message"]["content"], "next")
    b2 = await (
        await client.post("/v1/chat/completions", json={"messages": msgs2, "max_tokens": 4})
    ).json()
    w2 = b2["usage"]["prompt_work"]
    assert w2["hbm_tokens"] == 512 and w2["replayed_tokens"] == 0
    assert b2["usage"]["prompt_tokens_details"]["cached_tokens"] == u1["prompt_tokens"]
    assert "import_tail" in model.calls
    await asyncio.sleep(0.7)  # SWA TTL passes; global KV stays
    msgs3 = [*msgs2, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    b3 = await (
        await client.post("/v1/chat/completions", json={"messages": msgs3, "max_tokens": 2})
    ).json()
    w3 = b3["usage"]["prompt_work"]
    assert w3["replayed_tokens"] == 16 and w3["hbm_tokens"] == 512
    assert model.calls[-3:-1] == ["from_global:512", "replay:16"] or "replay:16" in model.calls


async def test_stream_ends_with_usage_then_done(served) -> None:
    _, client, _ = served
    resp = await client.post(
        "/v1/completions", json={"prompt": "abc", "max_tokens": 3, "stream": True}
    )
    assert resp.status == 200
    raw = (await resp.read()).decode()
    events = [line[6:] for line in raw.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) != ""
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert all("usage" not in c for c in chunks[:-1])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("reasoning_effort", 0),
        ("reasoning_effort", 101),
        ("reasoning_effort", "high"),
        ("reasoning_effort", True),
        ("max_tokens", 0),
        ("temperature", -1),
        ("stop", [1]),
        ("seed", 1.5),
    ],
)
async def test_bad_fields_are_400_naming_the_field(served, field: str, value: object) -> None:
    _, client, _ = served
    resp = await client.post("/v1/chat/completions", json={"messages": chat("x"), field: value})
    body = await resp.json()
    assert (
        resp.status == 400 and body["error"]["param"] == field and field in body["error"]["message"]
    )


async def test_reasoning_effort_sets_budget_and_stop_cuts(served) -> None:
    _, client, _ = served
    b = await (
        await client.post("/v1/completions", json={"prompt": "q", "reasoning_effort": 2})
    ).json()
    assert b["usage"]["completion_tokens"] == 6  # ceil(2% of 256)
    full = b["choices"][0]["text"]
    stop = full[2:4]
    b2 = await (
        await client.post(
            "/v1/completions", json={"prompt": "q", "reasoning_effort": 2, "stop": stop}
        )
    ).json()
    assert (
        b2["choices"][0]["finish_reason"] == "stop"
        and b2["choices"][0]["text"] == full[: full.find(stop)]
    )


async def test_models_health_metrics_and_errors(served) -> None:
    engine, client, _ = served
    assert (await (await client.get("/v1/models")).json())["data"][0]["id"] == "mini-v4"
    h = await (await client.get("/health")).json()
    assert h["epoch"] == engine.epoch and h["status"] == "ok"
    await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    text = await (await client.get("/metrics")).text()
    assert 'engine_prompt_tokens_total{source="prefilled"}' in text
    assert "engine_generated_tokens_total 2.0" in text
    bad = await client.post("/v1/completions", data=b"{nope")
    assert bad.status == 400 and "JSON" in (await bad.json())["error"]["message"]
    wrong = await client.post("/v1/completions", json={"prompt": "x", "model": "other"})
    assert wrong.status == 404 and (await wrong.json())["error"]["code"] == "model_not_found"
    assert (await client.get("/profile")).status == 503  # started with --profile skip


async def test_full_queue_is_503_with_retry_after() -> None:
    engine, client, _ = await make(max_batch=1, max_queue=1, step_s=0.02)
    try:
        body = {"prompt": "slow", "max_tokens": 50}
        first = asyncio.create_task(client.post("/v1/completions", json=body))
        await asyncio.sleep(0.2)
        second = asyncio.create_task(client.post("/v1/completions", json=body))
        await asyncio.sleep(0.1)
        third = await client.post("/v1/completions", json=body)
        assert third.status == 503 and int(third.headers["Retry-After"]) >= 1
        assert (await third.json())["error"]["code"] == "queue_full"
        assert (await first).status == 200 and (await second).status == 200
    finally:
        await client.close()
        engine.close()


async def test_cache_salt_keeps_caches_apart_in_the_routers_keys(served) -> None:
    """As vLLM: a salted request shares no cached block with unsalted requests or other
    salts, and hits its own salt's; the blocks it stores are the router's keys for it."""
    engine, client, _ = served
    msgs = chat("salted turn")

    async def cached(**extra: object) -> int:
        r = await client.post(
            "/v1/chat/completions", json={"messages": msgs, "max_tokens": 1, **extra}
        )
        b = await r.json()
        assert r.status == 200, b
        return int(b["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert await cached() == 0
    assert await cached(cache_salt="a") == 0  # unsalted blocks serve no salted request
    assert await cached(cache_salt="b") == 0  # nor another salt's
    assert await cached(cache_salt="a") == 512  # the same salt hits
    assert await cached() == 512 and await cached(cache_salt=None) == 512
    for salt in ("a", "b", None):
        body = {"model": engine.settings.model_name, "messages": msgs, "cache_salt": salt}
        parsed = parse_request("/v1/chat/completions", json.dumps(body).encode(), {}, ParseLimits())
        assert len(parsed.keys.blocks) == 2
        assert all(engine.kv.tier_of(k) is not None for k in parsed.keys.blocks), salt
    for bad in ("", 5):
        r = await client.post("/v1/chat/completions", json={"messages": msgs, "cache_salt": bad})
        assert r.status == 400 and (await r.json())["error"]["param"] == "cache_salt"


async def test_ignore_eos_generates_the_whole_budget() -> None:
    """vLLM's `ignore_eos`: a batch user's long generation runs to `max_tokens` past the
    model's end-of-sequence token (hostile_clients' case 3 needs it); without it the EOS
    ends the answer ("stop"). A non-boolean value is a 400 naming the field."""
    prompt = "q"
    model = StandinModel(window=16, eos_after=1 + 3)  # EOS after 3 generated tokens
    engine = Engine(EngineSettings(engine_id="t0", profile_mode="skip", speculate=False), model)
    engine.start()
    client = TestClient(TestServer(build_app(engine)))
    await client.start_server()
    try:
        body = {"prompt": prompt, "max_tokens": 20}
        stopped = await (await client.post("/v1/completions", json=body)).json()
        assert stopped["choices"][0]["finish_reason"] == "stop"
        assert stopped["usage"]["completion_tokens"] < 20
        full = await (
            await client.post("/v1/completions", json={**body, "ignore_eos": True})
        ).json()
        assert full["choices"][0]["finish_reason"] == "length"
        assert full["usage"]["completion_tokens"] == 20
        bad = await client.post("/v1/completions", json={**body, "ignore_eos": "yes"})
        assert bad.status == 400 and (await bad.json())["error"]["param"] == "ignore_eos"
    finally:
        await client.close()
        engine.close()
