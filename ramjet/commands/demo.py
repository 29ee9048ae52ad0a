"""`ramjet demo [--url http://127.0.0.1:8000] [--turns 8]`: drive a multi-turn agent
conversation through a running router (e.g. `make run`) with the official `openai`
client, streaming each turn, and print per turn: the engine chosen (the router's
`X-Ramjet-Engine` response header), cached prompt tokens by tier, replayed tokens and
TTFT (request sent to first content chunk), from the engine's `usage.prompt_work`.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

_SYSTEM = (
    "You are a coding agent working in a repository. Use the tools to inspect files, "
    "run tests and propose patches. Think step by step and keep answers short. "
) * 6
_TOOLS = [
    {
        "type": "function",
        "function": {"name": n, "description": d, "parameters": {"type": "object"}},
    }
    for n, d in (
        ("read_file", "Read a file from the repository"),
        ("run_tests", "Run the test suite and return the failures"),
        ("apply_patch", "Apply a unified diff"),
    )
]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("demo", help="drive a multi-turn agent session through the router")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="router base URL")
    p.add_argument("--model", default="mini-v4")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--pause", type=float, default=0.0, help="seconds between turns")
    p.set_defaults(handler=_run)


def _usage_fields(usage: Any) -> dict[str, Any]:
    if usage is None:
        return {}
    data: dict[str, Any] = usage.model_dump() if hasattr(usage, "model_dump") else dict(usage)
    return data


def _run(args: argparse.Namespace) -> int:
    try:
        import openai
    except ImportError:
        print(
            "ramjet demo needs the openai client: pip install 'ramjet[dev]' (or pip install openai)",
            file=sys.stderr,
        )
        return 2
    if args.turns < 1:
        print("--turns must be >= 1", file=sys.stderr)
        return 2
    client = openai.OpenAI(
        base_url=args.url.rstrip("/") + "/v1", api_key="ramjet-demo", max_retries=0
    )
    messages: list[dict[str, Any]] = [{"role": "system", "content": _SYSTEM}]
    print(f"{'turn':>4} {'engine':>8} {'prompt':>7} {'hbm':>6} {'host':>6} {'ssd':>6} {'swa':>5} "
          f"{'replay':>6} {'prefill':>7} {'ttft_ms':>8}")  # fmt: skip
    for turn in range(1, args.turns + 1):
        messages.append(
            {"role": "user", "content": f"Step {turn}: inspect module_{turn}.py and report."}
        )
        t0 = time.perf_counter()
        ttft: float | None = None
        text: list[str] = []
        usage: dict[str, Any] = {}
        try:
            request: dict[str, Any] = {
                "model": args.model,
                "messages": messages,
                "tools": _TOOLS,
                "max_tokens": args.max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            raw: Any = client.chat.completions.with_raw_response.create(**request)
        except openai.APIError as exc:
            print(f"turn {turn}: request failed: {exc}", file=sys.stderr)
            return 1
        engine = raw.headers.get("x-ramjet-engine") or raw.headers.get("x-engine-id") or "?"
        for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = _usage_fields(chunk.usage)
        if ttft is None:
            ttft = time.perf_counter() - t0
        work = usage.get("prompt_work") or {}
        print(
            f"{turn:>4} {engine:>8} {usage.get('prompt_tokens', 0):>7} {work.get('hbm_tokens', 0):>6} "
            f"{work.get('host_tokens', 0):>6} {work.get('ssd_tokens', 0):>6} {work.get('swa_tokens', 0):>5} "
            f"{work.get('replayed_tokens', 0):>6} {work.get('prefilled_tokens', 0):>7} {ttft * 1e3:>8.1f}"
        )
        messages.append({"role": "assistant", "content": "".join(text)})
        messages.append(
            {
                "role": "tool",
                "tool_call_id": f"call_{turn}",
                "content": f"module_{turn}.py: 120 lines, 2 failing tests",
            }
        )
        if args.pause:
            time.sleep(args.pause)
    return 0
