"""The engine's load from its Prometheus metrics, as a signed `load` report body.

Neither vLLM nor SGLang reports Ramjet's load figures directly; the sidecar reads them
from the engine's `/metrics` every `load_interval_s`:

| figure | vLLM | SGLang | reference engine |
|---|---|---|---|
| running | `vllm:num_requests_running` | `sglang:num_running_reqs` | `engine_running_requests` |
| waiting | `vllm:num_requests_waiting` | `sglang:num_queue_reqs` | `engine_queue_waiting_requests` |
| KV use (0..1) | `vllm:kv_cache_usage_perc` (`vllm:gpu_cache_usage_perc` before) | `sglang:token_usage` | — |
| generated tokens (counter) | `vllm:generation_tokens_total` | `sglang:generation_tokens_total` | `engine_generated_tokens_total` |
| prompt tokens (counter) | `vllm:prompt_tokens_total` | `sglang:prompt_tokens_total` | `engine_prompt_tokens_total` |
| finished requests (counter) | `vllm:request_success_total` | `sglang:num_requests_total` | `engine_requests_total` |

`queued_prompt_tokens` is estimated as waiting x the mean prompt length so far (prompt
tokens / finished requests), and `decode_tokens_per_s` as the generated-token counter's
rate between two scrapes. Series are summed over their labels (vLLM labels each engine
core `engine="i"`, SGLang each DP rank: counts add up), except KV use, a fraction per
core, which is their mean. A name that is absent leaves its figure at 0 (or None).

Names checked against the engines' source: vLLM `vllm/v1/metrics/loggers.py`
(`PrometheusStatLogger`: counters are declared without `_total`, which the client adds on
exposition; `vllm:gpu_cache_usage_perc` is the deprecated name of
`vllm:kv_cache_usage_perc`), SGLang `python/sglang/srt/metrics/collector.py`
(`SchedulerMetricsCollector`, `TokenizerMetricsCollector`; exposed only with
`--enable-metrics`).
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

from ramjet.reports.bodies import LoadBody

METRIC_NAMES: Mapping[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs", "engine_running_requests"),
    "waiting": (
        "vllm:num_requests_waiting",
        "sglang:num_queue_reqs",
        "engine_queue_waiting_requests",
    ),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"),
    "generated": (
        "vllm:generation_tokens",
        "sglang:generation_tokens",
        "engine_generated_tokens",
    ),
    "prompt": ("vllm:prompt_tokens", "sglang:prompt_tokens", "engine_prompt_tokens"),
    "requests": ("vllm:request_success", "sglang:num_requests", "engine_requests"),
}


def parse_metrics(text: str, counts: dict[str, int] | None = None) -> dict[str, float]:
    """Sum of each series' samples over their labels, by sample name (counters under
    their name without `_total`); histogram and summary parts are left out. `counts`, if
    given, receives the number of series summed under each name."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith(("_created", "_bucket", "_count", "_sum")):
                continue
            name = s.name.removesuffix("_total")
            out[name] = out.get(name, 0.0) + float(s.value)
            if counts is not None:
                counts[name] = counts.get(name, 0) + 1
    return out


def _first(
    values: Mapping[str, float], figure: str, counts: Mapping[str, int] | None = None
) -> float | None:
    """The figure's first present name: its sum, or its mean over series with `counts`."""
    for name in METRIC_NAMES[figure]:
        if name in values:
            return values[name] / counts[name] if counts else values[name]
    return None


class LoadScraper:
    """Turns successive scrapes into `LoadBody`s (keeps the previous for rates)."""

    def __init__(self) -> None:
        self._prev: tuple[float, float] | None = None  # (time, generated tokens)

    def load(self, text: str, now: float) -> LoadBody:
        n: dict[str, int] = {}
        v = parse_metrics(text, n)
        running = int(_first(v, "running") or 0)
        waiting = int(_first(v, "waiting") or 0)
        usage = _first(v, "kv_usage", n)  # a fraction per engine core: mean, not sum
        prompt, reqs = _first(v, "prompt"), _first(v, "requests")
        mean_prompt = prompt / reqs if prompt and reqs else 0.0
        gen = _first(v, "generated")
        rate: float | None = None
        if gen is not None:
            if self._prev is not None and now > self._prev[0] and gen >= self._prev[1]:
                rate = (gen - self._prev[1]) / (now - self._prev[0])
            self._prev = (now, gen)
        return LoadBody(
            queued_prompt_tokens=max(0, round(waiting * mean_prompt)),
            running_requests=max(0, running),
            waiting_requests=max(0, waiting),
            kv_utilization=min(1.0, max(0.0, usage or 0.0)),
            decode_tokens_per_s=rate,
        )
