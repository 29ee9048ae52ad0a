"""The reference engine's priority scheduling (`engine_stub.scheduler`): a short request
sent after a long one gets its first token first under the chunk-preemptive variant; under
vLLM's variant it overtakes only requests still waiting, never a running prefill; FCFS
keeps arrival order. Metrics: queue wait by band, the oldest waiting age, preemptions.
HTTP layer, scheduler and caches are real; the model is the instant stand-in with a
fixed sleep per forward pass, so chunk counts set the timing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient, TestServer
from standin_model import StandinModel

from engine_stub.engine import Engine, EngineSettings
from engine_stub.scheduler import SchedulerConfig, priority_band
from engine_stub.server import build_app

STEP_S = 0.02  # per forward pass: a 4096-token prompt in 256-token chunks is ~0.32 s


async def make(**kw: object) -> tuple[Engine, TestClient]:
    model = StandinModel(window=16, step_s=STEP_S)
    settings = EngineSettings(
        engine_id="p0",
        profile_mode="skip",
        speculate=False,
        prefill_chunk=256,
        **kw,  # type: ignore[arg-type]
    )
    engine = Engine(settings, model=model)
    engine.start()
    client = TestClient(TestServer(build_app(engine)))
    await client.start_server()
    return engine, client


@pytest.fixture
async def engines() -> AsyncIterator[list[tuple[Engine, TestClient]]]:
    made: list[tuple[Engine, TestClient]] = []
    yield made
    for engine, client in made:
        await client.close()
        engine.close()


async def first_token_at(client: TestClient, tokens: int, priority: int | None) -> float:
    """Stream a completion of a `tokens`-byte prompt; the monotonic time of its first
    content event (the body must end in [DONE])."""
    body: dict[str, object] = {"prompt": "x" * tokens, "max_tokens": 2, "stream": True}
    if priority is not None:
        body["priority"] = priority
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200, await resp.text()
    first: float | None = None
    data = b""
    async for chunk in resp.content.iter_any():
        if first is None and b'"text"' in chunk:
            first = time.monotonic()
        data += chunk
    assert data.rstrip().endswith(b"data: [DONE]") and first is not None
    return first


async def run_order(client: TestClient, reqs: list[tuple[int, int | None]]) -> list[float]:
    """Send requests 30 ms apart (in list order); their first-token times."""
    tasks = []
    for tokens, prio in reqs:
        tasks.append(asyncio.create_task(first_token_at(client, tokens, prio)))
        await asyncio.sleep(0.03)
    return list(await asyncio.gather(*tasks))


async def test_chunk_variant_short_after_long_starts_first(engines) -> None:
    engine, client = await make(scheduling_policy="priority")
    engines.append((engine, client))
    long_t, short_t = await run_order(client, [(4096, 1_000_000), (64, 10)])
    assert short_t < long_t
    # and a worse-priority short request still waits behind the long one
    long_t, short_t = await run_order(client, [(4096, 10), (64, 1_000_000)])
    assert long_t < short_t
    text = (await (await client.get("/metrics")).read()).decode()
    assert 'engine_queue_wait_by_band_seconds_count{band="other"} 4.0' in text


async def test_fcfs_keeps_arrival_order_and_ignores_priority(engines) -> None:
    engine, client = await make()
    engines.append((engine, client))
    long_t, short_t = await run_order(client, [(4096, 1_000_000), (64, 10)])
    assert long_t < short_t
    text = (await (await client.get("/metrics")).read()).decode()
    assert 'engine_queue_wait_by_band_seconds_count{band="fcfs"} 2.0' in text


async def test_vllm_variant_orders_waiting_only(engines) -> None:
    # one slot per running prefill is not the limit in vLLM: its token budget is. Here a
    # long prompt is running; a second long one and then a short one wait. The short one
    # overtakes the waiting long one, not the running one.
    engine, client = await make(scheduling_policy="priority", priority_variant="vllm")
    engines.append((engine, client))
    long1, long2, short = await run_order(client, [(4096, 1_000_000), (4096, 1_000_000), (64, 10)])
    assert long1 < short < long2
    # the chunk variant, same arrivals: the short one preempts the running prefill
    engine2, client2 = await make(scheduling_policy="priority", priority_variant="chunk")
    engines.append((engine2, client2))
    long1, long2, short = await run_order(client2, [(4096, 1_000_000), (4096, 1_000_000), (64, 10)])
    assert short < long1 < long2


async def test_slot_preemption_and_oldest_waiting_gauge(engines) -> None:
    # one slot: a better arrival takes the slot of a prefilling worse request
    engine, client = await make(scheduling_policy="priority", max_batch=1)
    engines.append((engine, client))
    task = asyncio.create_task(run_order(client, [(4096, 1_000_000), (64, 10)]))
    await asyncio.sleep(0.15)
    oldest = engine.scheduler.oldest_waiting_s()
    assert 0.1 < oldest < 1.0
    long_t, short_t = await task
    assert short_t < long_t
    text = (await (await client.get("/metrics")).read()).decode()
    assert "engine_priority_preemptions_total 1.0" in text
    assert engine.scheduler.oldest_waiting_s() == 0.0
    assert "engine_oldest_waiting_seconds 0.0" in text


async def test_bad_priority_is_refused(engines) -> None:
    engine, client = await make(scheduling_policy="priority")
    engines.append((engine, client))
    for bad in ("high", 1.5, True, 2**63):
        r = await client.post("/v1/completions", json={"prompt": "x", "priority": bad})
        body = await r.json()
        assert r.status == 400 and body["error"]["param"] == "priority", body
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "priority": -5})
    assert r.status == 200


def test_band_decodes_the_hint_work_and_config_is_checked() -> None:
    t = 1_800_000_000.0
    key = round(1000 * (2.5 + 0.5 * t))
    assert priority_band(key, t, 0.5) == "1_10s"
    assert priority_band(round(1000 * (0.05 + 0.5 * t)), t, 0.5) == "lt_0.1s"
    assert priority_band(round(1000 * (30 + 0.5 * t)), t, 0.5) == "ge_10s"
    assert priority_band(0, t, 0.5) == "other"
    assert priority_band(300, t, 0.0) == "0.1_1s"
    with pytest.raises(ValueError, match="scheduling policy must be fcfs or priority"):
        SchedulerConfig(policy="sjf")
    with pytest.raises(ValueError, match="priority variant must be chunk or vllm"):
        SchedulerConfig(policy="priority", variant="sglang")
