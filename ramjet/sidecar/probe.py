"""The engine's profile from timed probe requests (`ramjet.policy.profile.EngineProfile`).

vLLM and SGLang publish no cost profile, so the sidecar measures one through the engine's
own API (`/v1/completions`, `max_tokens` 1, temperature 0), before it serves traffic or
whenever an operator asks (`--profile probe`):

1. **Overhead**: a tiny prompt, cold: `prefill_overhead_s` = its latency.
2. **Prefill curve**: for each size n_k (ascending, `sizes`), a prompt of about n_k
   *tokens* (the engine's own: a calibration request reads `usage.prompt_tokens` for a
   known filler, and the filler is scaled to each size) that no cache holds (a random
   nonce leads it), cold. Sizes are clamped to the engine's maximum model length
   (`max_model_len` of `/v1/models`, as vLLM serves it) and the default sizes end at
   that limit, so the curve covers every length the engine can be sent and the cost
   model never extrapolates within it (`EngineProfile` extrapolates no faster than the
   measured trend past the last point). With T_k its latency minus the overhead and
   n_k the engine's own `usage.prompt_tokens`, the curve is the fit of
   T(n) = b·n + k·n² over all sizes (`fit_curve`): rate b + 2k·x at context x.
3. **Replay floor**: the same prompt again, warm. The engine says how much it found in
   cache (`usage.prompt_tokens_details.cached_tokens`: vLLM with
   `--enable-prompt-tokens-details`, SGLang with `--enable-cache-report`). Whatever the
   warm hit costs beyond the overhead and the prefill of its uncached tail is the cost
   of resuming from cache: the replay of the SWA window, `replay_floor_s` (the median
   over sizes, floored at 0). An engine that reports no cached tokens gives no floor (0).
4. **Decode step**: a tiny prompt with `max_tokens` 16: (latency - overhead) / generated.

Each timing is the best of `repeats` (each repeat with a fresh nonce, so cold stays
cold). Sizes in bytes of the KV (`global_kv_bytes_per_token`) and tier bandwidths are
the model's and the machine's, given by the operator.

The requests go through the router's engine-facing client
(`ramjet.sidecar.engine_client`), each within `timeout_s`.
"""

from __future__ import annotations

import json
import secrets
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ramjet.errors import RamjetError
from ramjet.policy.profile import CurvePoint, EngineProfile, TierCost
from ramjet.sidecar.engine_client import EngineClient, engine_client

DEFAULT_SIZES = (256, 1024, 4096, 16384, 65536, 131072)
"""Probe sizes in tokens when none are given: clamped to the engine's limit, which is
probed last."""
LIMIT_MARGIN = 16
"""Tokens kept free below the engine's limit (the generated token, rounding)."""


class PromptTooLong(RamjetError, RuntimeError):
    """The engine refused a probe prompt as longer than its context (HTTP 400 naming the
    context length, as vLLM and SGLang word it)."""


@dataclass(frozen=True, slots=True)
class ProbeResult:
    seconds: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def filler(words: int, nonce: str) -> str:
    """A prompt of `words` filler words that no cache holds (it starts with the nonce)."""
    return nonce + " " + " ".join(f"w{(i * 7919) % 1000}" for i in range(max(1, words)))


async def max_model_len(engine: EngineClient, model: str) -> int | None:
    """The engine's maximum model length from `/v1/models` (vLLM: `max_model_len`), or
    None when it does not say (or cannot be reached: the probes will say why)."""
    try:
        status, body = await engine.request("GET", "/v1/models")
        if status != 200:
            return None
        data: Any = json.loads(body)
    except (OSError, ValueError):
        return None
    cards = data.get("data") if isinstance(data, dict) else None
    if not isinstance(cards, list):
        return None
    for card in sorted(cards, key=lambda c: isinstance(c, dict) and c.get("id") != model):
        if isinstance(card, dict) and isinstance(card.get("max_model_len"), int):
            return int(card["max_model_len"])
    return None


def plan_sizes(sizes: Sequence[int] | None, limit: int | None) -> list[int]:
    """The probe sizes in tokens: `sizes` (or `DEFAULT_SIZES`, then ending at the limit)
    clamped below the engine's limit."""
    cap = None if limit is None else max(1, limit - LIMIT_MARGIN)
    want = list(DEFAULT_SIZES if sizes is None else sizes)
    if cap is None:
        return want if sizes is not None else want[:3]
    out = [n for n in want if n < cap]
    if (sizes is None or any(n >= cap for n in want)) and (not out or out[-1] < cap):
        out.append(cap)
    return out


def fit_curve(samples: Sequence[tuple[int, float]]) -> list[CurvePoint]:
    """The prefill curve from cold probes (n tokens, seconds beyond the overhead): the
    least-squares fit of T(n) = b·n + k·n² (b, k >= 0: a per-token cost and one that grows
    with the context, attention's), in relative error (each probe weighted by 1/T²), as
    the curve's rate b + 2k·x at context x: two points, (0, b) and (n_max, b + 2k·n_max)
    (n_max the longest probe: a prediction past it is flagged as beyond the probes).

    Differencing successive probes (the rate on [n_{i-1}, n_i) from two timings) gave
    curves that fell and rose by 3x between neighbours on real vLLM: one noisy timing
    set a segment. The fit spreads each probe's noise over the whole curve, and its
    shape is the one prefill has."""
    pts = [(float(n), t) for n, t in samples if n > 0 and t > 0]
    if not pts:
        return [CurvePoint(context_tokens=0, seconds_per_token=0.0)]
    # normal equations of sum(((t - b n - k n^2) / t)^2): in u = n/t, v = n^2/t, target 1
    suu = sum((n / t) ** 2 for n, t in pts)
    suv = sum((n / t) * (n * n / t) for n, t in pts)
    svv = sum((n * n / t) ** 2 for n, t in pts)
    su = sum(n / t for n, t in pts)
    sv = sum(n * n / t for n, t in pts)
    det = suu * svv - suv * suv
    b = k = -1.0
    if len({n for n, _ in pts}) > 1 and det > 1e-12 * suu * svv:
        b, k = (su * svv - sv * suv) / det, (sv * suu - su * suv) / det
    if b < 0 or k < 0:  # the constrained optimum lies on an edge: the better of the two
        b_only, k_only = su / suu, sv / svv
        loss_b = sum((1 - b_only * n / t) ** 2 for n, t in pts)
        loss_k = sum((1 - k_only * n * n / t) ** 2 for n, t in pts)
        b, k = (b_only, 0.0) if loss_b <= loss_k else (0.0, k_only)
    top = max(n for n, _ in pts)  # the last point also says how far the probes reached
    return [
        CurvePoint(context_tokens=0, seconds_per_token=b),
        CurvePoint(context_tokens=int(top), seconds_per_token=b + 2 * k * int(top)),
    ]


async def probe_once(
    engine: EngineClient, model: str, prompt: str, max_tokens: int = 1
) -> ProbeResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    t0 = time.perf_counter()
    status, answer = await engine.request("POST", "/v1/completions", body)
    dt = time.perf_counter() - t0
    if status != 200:
        text = answer.decode("utf-8", "replace")
        # vLLM says "context length" past its limit; at exactly the limit it clamps
        # max_tokens to the room left (0) and names max_tokens instead
        if status == 400 and ("context length" in text or "max_tokens must be at least 1" in text):
            raise PromptTooLong(f"probe prompt too long: {text[:200]}")
        raise RuntimeError(f"probe request failed: HTTP {status}: {text[:200]}")
    data: Any = json.loads(answer)
    if not isinstance(data, dict):
        raise ValueError(f"probe answer is not a JSON object: {answer[:200]!r}")
    usage = data.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return ProbeResult(
        dt,
        int(usage.get("prompt_tokens") or 0),
        int(details.get("cached_tokens") or 0),
        int(usage.get("completion_tokens") or 0),
    )


async def probe_profile(
    url: str,
    model: str,
    *,
    sizes: Sequence[int] | None = None,
    repeats: int = 2,
    global_kv_bytes_per_token: float,
    tiers: dict[str, TierCost] | None = None,
    replay_window_tokens: int = 128,
    timeout_s: float = 120.0,
) -> EngineProfile:
    if sizes is not None and (not sizes or sorted(set(sizes)) != list(sizes) or sizes[0] <= 0):
        raise ValueError("probe sizes must be positive and strictly increasing")
    async with engine_client(url, timeout_s) as s:
        plan = plan_sizes(sizes, await max_model_len(s, model))
        # tokens per filler word, in the engine's own tokenizer
        calib_words = 64
        calib = await probe_once(s, model, filler(calib_words, secrets.token_hex(8)))
        fixed = (await probe_once(s, model, filler(1, secrets.token_hex(8)))).prompt_tokens
        per_word = max(1e-3, (calib.prompt_tokens - fixed) / (calib_words - 1))

        def words_for(tokens: int) -> int:
            return max(1, int((tokens - fixed) / per_word) + 1)

        async def best(words: int, max_tokens: int = 1) -> tuple[ProbeResult, ProbeResult]:
            cold: ProbeResult | None = None
            warm: ProbeResult | None = None
            for _ in range(repeats):
                for shrink in range(4):
                    # the words-to-tokens estimate is linear and each nonce tokenizes its
                    # own way: a prompt sized at the limit can come out a few tokens over
                    prompt = filler(words, secrets.token_hex(8))
                    try:
                        c = await probe_once(s, model, prompt, max_tokens)
                        break
                    except PromptTooLong:
                        if shrink == 3:
                            raise
                        words = max(1, int(words * 0.98) - LIMIT_MARGIN)
                w = await probe_once(s, model, prompt, max_tokens)
                cold = c if cold is None or c.seconds < cold.seconds else cold
                warm = w if warm is None or w.seconds < warm.seconds else warm
            assert cold is not None and warm is not None
            return cold, warm

        # one request first, unmeasured: connection setup must not count as overhead
        await probe_once(s, model, filler(4, secrets.token_hex(8)))
        tiny, _ = await best(4)
        overhead = tiny.seconds
        measured: list[tuple[ProbeResult, ProbeResult]] = [await best(words_for(n)) for n in plan]
        gen, _ = await best(4, max_tokens=16)

    points = fit_curve(
        [(cold.prompt_tokens, max(0.0, cold.seconds - overhead)) for cold, _ in measured]
    )
    shape = EngineProfile(prefill_curve=points, replay_floor_s=0.0, global_kv_bytes_per_token=1.0)
    floors = []
    for _cold, warm in measured:
        if warm.cached_tokens > 0:
            tail = shape.prefill_seconds(
                warm.prompt_tokens - warm.cached_tokens, warm.cached_tokens
            )
            floors.append(max(0.0, warm.seconds - overhead - tail))
    decode = (
        max(0.0, (gen.seconds - overhead) / gen.completion_tokens) if gen.completion_tokens else 0.0
    )
    return EngineProfile(
        prefill_curve=points,
        prefill_overhead_s=overhead,
        replay_floor_s=statistics.median(floors) if floors else 0.0,
        replay_window_tokens=replay_window_tokens,
        global_kv_bytes_per_token=global_kv_bytes_per_token,
        tiers=dict(tiers or {}),
        decode_step_s=decode,
    )
