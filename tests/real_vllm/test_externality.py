"""The λ·W externality is live in front of real vLLM (issue 28). vLLM sends no
`prompt_work`, so W is the router's own measure: realized TTFT (a stream's first byte)
minus the calibrated service it predicted. Once traffic has queued, tier_aware's decisions carry a non-zero
mean wait, the note `externality_off` is gone, an engine that would waste work is charged
for it, and the engines' calibrations have learnt from the realized TTFTs."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from vllm_stack import Stack, chat_body

from ramjet.app.server import RouterServer

pytestmark = pytest.mark.timeout(240)


def _sample(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_the_externality_is_live_once_traffic_queues(
    stack: Stack, routers: list[RouterServer], tmp_path: Any
) -> None:
    server, records = await stack.router(
        tmp_path, mode="enforce", candidate_params={"per_job_prefill": False}
    )
    routers.append(server)
    # prompts stay under the session stack's smaller engine's 2,016-token context
    system = "You are an agent of the externality test. " + "tool output line. " * 60

    async def session(i: int, http: aiohttp.ClientSession) -> None:
        msgs: list[dict[str, Any]] = [{"role": "system", "content": system}]
        for t in range(3):  # closed loop: a turn after the previous answer
            msgs.append({"role": "user", "content": f"session {i} turn {t}: " + "x y " * 70})
            body = chat_body(msgs, stream=True)  # a stream: the router sees its first byte
            async with http.post(server.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                text = await r.text()
            assert text.rstrip().endswith("data: [DONE]"), text[-200:]
            msgs.append({"role": "assistant", "content": f"answer {t}"})

    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(session(i, http) for i in range(6)))  # 6 at once: they queue
        async with http.get(server.url + "/metrics") as r:
            metrics = await r.text()
    decided = [r for r in records.records if r.candidate is not None]
    assert len(decided) == 18
    assert _sample(metrics, "ramjet_mean_wait_samples_total", source="router") >= 17
    assert _sample(metrics, "ramjet_mean_wait_samples_total", source="engine") == 0
    assert _sample(metrics, "ramjet_mean_wait_seconds") > 0
    live = [r for r in decided[6:] if "externality_off" not in r.candidate.notes]  # type: ignore[union-attr]
    assert live, [r.candidate.notes for r in decided]  # type: ignore[union-attr]
    charged = [
        c["externality_s"]
        for r in live
        for c in r.candidate.components.values()  # type: ignore[union-attr]
        if c["delta_s"] > 0
    ]
    assert charged and max(charged) > 0, charged
    samples = sum(
        _sample(metrics, "ramjet_ttft_calibration_samples_total", engine=e) for e in ("v0", "v1")
    )
    assert samples >= 17
