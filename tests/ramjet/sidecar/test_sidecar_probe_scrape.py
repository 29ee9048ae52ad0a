"""The sidecar's profile probes against an HTTP engine whose costs are known (a fake at
the probe's seam: latency = overhead + per-token prefill of the uncached tail + a replay
floor on warm hits), and load from Prometheus text of each engine kind."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from ramjet.policy.profile import CurvePoint, EngineProfile
from ramjet.sidecar.probe import fit_curve, probe_profile
from ramjet.sidecar.scrape import LoadScraper, parse_metrics

OVERHEAD, PER_TOKEN, REPLAY, DECODE = 0.05, 2e-4, 0.05, 0.004


async def _fake_engine(
    max_len: int | None = None, long_extra: int = 0
) -> tuple[web.AppRunner, str]:
    """`max_len`: the engine's context (served by /v1/models; longer prompts get vLLM's
    400); `long_extra`: tokens a prompt of over 100 words has beyond one per word (a
    tokenizer the probe's linear words-to-tokens estimate gets wrong at length)."""
    seen: set[str] = set()

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "max_model_len": max_len}]})

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        prompt, max_tokens = body["prompt"], body["max_tokens"]
        n = len(prompt.split())
        n += long_extra if n > 100 else 0
        if max_len is not None and n > max_len:
            msg = f"This model's maximum context length is {max_len} tokens. However, your prompt contains at least {n} input tokens"
            return web.json_response({"error": {"message": msg}}, status=400)
        if max_len is not None and n + max_tokens > max_len:
            # vLLM 0.32 clamps max_tokens to the room left and then refuses it
            msg = f"max_tokens must be at least 1, got {max_len - n}."
            return web.json_response({"error": {"message": msg}}, status=400)
        cached = (n // 16) * 16 if prompt in seen else 0
        seen.add(prompt)
        delay = OVERHEAD + PER_TOKEN * (n - cached) + (REPLAY if cached else 0.0)
        delay += DECODE * (max_tokens - 1)
        await asyncio.sleep(delay)
        usage = {"prompt_tokens": n, "completion_tokens": max_tokens,
                 "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
        return web.json_response({"choices": [{"text": "x"}], "usage": usage})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    if max_len is not None:
        app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


@pytest.mark.timeout(30)
async def test_probe_recovers_the_engines_costs() -> None:
    runner, url = await _fake_engine()
    try:
        prof = await probe_profile(
            url, "m", sizes=(200, 400, 800), repeats=3, global_kv_bytes_per_token=1000.0
        )
    finally:
        await runner.cleanup()
    assert prof.prefill_overhead_s == pytest.approx(OVERHEAD, abs=0.03)  # + HTTP time
    rates = [p.seconds_per_token for p in prof.prefill_curve]
    assert prof.prefill_curve[0].context_tokens == 0
    # a loaded test machine adds a few ms of noise per request: the whole curve is
    # checked tightly, each segment loosely
    assert prof.prefill_seconds(801) - prof.prefill_overhead_s == pytest.approx(
        801 * PER_TOKEN, rel=0.2
    )
    for r in rates:
        assert r == pytest.approx(PER_TOKEN, rel=0.6)
    assert prof.replay_floor_s == pytest.approx(REPLAY, rel=0.35)
    assert prof.decode_step_s == pytest.approx(DECODE * 15 / 16, abs=0.002)
    assert prof.global_kv_bytes_per_token == 1000.0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("extra", [30, 16])
async def test_a_probe_prompt_at_or_over_the_limit_is_retried_shorter(extra: int) -> None:
    # sized at the limit from a short calibration, the longest prompt comes out `extra`
    # tokens long: 30 puts it over (vLLM refuses the prompt), 16 exactly at 300 (vLLM
    # leaves no room for the one token asked and refuses max_tokens); the probe shortens
    # it and measures it
    runner, url = await _fake_engine(max_len=300, long_extra=extra)
    try:
        prof = await probe_profile(url, "m", repeats=1, global_kv_bytes_per_token=1.0)
    finally:
        await runner.cleanup()
    assert 0 < prof.prefill_curve[-1].context_tokens < 300


async def test_probe_refuses_bad_sizes() -> None:
    with pytest.raises(ValueError, match="increasing"):
        await probe_profile(
            "http://127.0.0.1:9", "m", sizes=(400, 200), global_kv_bytes_per_token=1
        )


VLLM = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3
vllm:num_requests_running{engine="1",model_name="m"} 1
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 2
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.5
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{model_name="m"} 10000
# TYPE vllm:request_success counter
vllm:request_success_total{finished_reason="stop",model_name="m"} 8
vllm:request_success_total{finished_reason="length",model_name="m"} 2
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{model_name="m"} GEN
"""

SGLANG = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 5
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 1
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.25
"""


def test_load_from_vllm_and_sglang_metrics() -> None:
    s = LoadScraper()
    first = s.load(VLLM.replace("GEN", "1000"), 10.0)
    assert (first.running_requests, first.waiting_requests) == (4, 2)
    assert first.kv_utilization == 0.5 and first.queued_prompt_tokens == 2000
    assert first.decode_tokens_per_s is None
    second = s.load(VLLM.replace("GEN", "1500"), 12.0)
    assert second.decode_tokens_per_s == pytest.approx(250.0)
    sg = LoadScraper().load(SGLANG, 1.0)
    assert (sg.running_requests, sg.waiting_requests, sg.kv_utilization) == (5, 1, 0.25)
    assert parse_metrics("") == {}
    # two engine cores (DP): counts add up, KV use is their mean, not their sum
    dp = VLLM.replace("GEN", "1").replace('{model_name="m"}', '{engine="0",model_name="m"}')
    dp += dp.replace('engine="0"', 'engine="1"').replace("0.5", "0.7")
    two = LoadScraper().load(dp, 1.0)
    assert two.running_requests == 8 and two.kv_utilization == pytest.approx(0.6)
    empty = LoadScraper().load("# nothing\n", 1.0)
    assert empty.running_requests == 0 and empty.kv_utilization == 0.0


def test_the_curve_is_fitted_over_all_probes_so_one_noisy_probe_cannot_bend_it() -> None:
    b, k = 1e-4, 1.2e-8  # a per-token cost and attention's, as vLLM's tiny Llama shows
    sizes = (252, 1014, 2030, 8176)
    exact = [(n, b * n + k * n * n) for n in sizes]
    noisy = [(n, t * (1.4 if n == 1014 else 1.0)) for n, t in exact]  # one slow probe
    prof = EngineProfile(
        prefill_curve=fit_curve(noisy), replay_floor_s=0.0, global_kv_bytes_per_token=1.0
    )
    rates = [prof.prefill_seconds(1, x) for x in range(0, 8176, 512)]
    assert rates == sorted(rates)  # differencing gave 0.21, 0.08, 0.23 ms/token here
    for n, t in exact:
        assert prof.prefill_seconds(n) == pytest.approx(t, rel=0.2)
    line = fit_curve([(200, 0.04), (400, 0.08), (800, 0.16)])
    assert [(p.context_tokens, p.seconds_per_token) for p in line] == [
        (0, pytest.approx(2e-4)),
        (800, pytest.approx(2e-4)),
    ]
    assert fit_curve([]) == [CurvePoint(context_tokens=0, seconds_per_token=0.0)]
