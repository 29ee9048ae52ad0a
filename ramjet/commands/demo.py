"""`ramjet demo [--url http://127.0.0.1:8000] [--turns 8] [--sessions 1]`: drive
multi-turn agent conversations through a running router (e.g. `make run`) with the
official `openai` client: `--sessions` closed-loop sessions at once (each its own
`X-Session-Id`; a turn is sent when the session's previous answer has arrived), each
turn streamed, and print per turn: the engine chosen (the router's
`X-Ramjet-Engine` response header), cached prompt tokens by tier and from shared pools, replayed tokens and
TTFT (request sent to first content chunk), from the engine's `usage.prompt_work`.
"""

from __future__ import annotations

import argparse
import sys
import threading
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
    p.add_argument(
        "--sessions", type=int, default=1, help="concurrent closed-loop sessions (threads)"
    )
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
    if args.turns < 1 or args.sessions < 1:
        print("--turns and --sessions must be >= 1", file=sys.stderr)
        return 2
    client = openai.OpenAI(
        base_url=args.url.rstrip("/") + "/v1", api_key="ramjet-demo", max_retries=0
    )
    print(f"{'sess':>4} {'turn':>4} {'engine':>8} {'prompt':>7} {'hbm':>6} {'host':>6} {'ssd':>6} "
          f"{'pool':>6} {'swa':>5} {'replay':>6} {'prefill':>7} {'ttft_ms':>8}")  # fmt: skip
    lock = threading.Lock()
    failed: list[str] = []
    threads = [
        threading.Thread(target=_session, args=(client, args, s, lock, failed), daemon=True)
        for s in range(1, args.sessions + 1)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for f in failed:
        print(f, file=sys.stderr)
    return 1 if failed else 0


def _session(
    client: Any, args: argparse.Namespace, s: int, lock: threading.Lock, failed: list[str]
) -> None:
    """One closed-loop agent session: each turn is sent when the previous answer has
    arrived; its tool output (a few hundred tokens, varying by turn) grows the prompt."""
    import openai

    messages: list[dict[str, Any]] = [{"role": "system", "content": _SYSTEM}]
    for turn in range(1, args.turns + 1):
        messages.append(
            {"role": "user", "content": f"Step {turn}: inspect module_{s}_{turn}.py and report."}
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
                "extra_headers": {"X-Session-Id": f"demo-{s}"},
            }
            raw: Any = client.chat.completions.with_raw_response.create(**request)
            engine = raw.headers.get("x-ramjet-engine") or raw.headers.get("x-engine-id") or "?"
            for chunk in raw.parse():
                if chunk.choices and chunk.choices[0].delta.content:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    usage = _usage_fields(chunk.usage)
        except openai.APIError as exc:
            with lock:
                failed.append(f"session {s} turn {turn}: request failed: {exc}")
            return
        if ttft is None:
            ttft = time.perf_counter() - t0
        work = usage.get("prompt_work") or {}
        with lock:
            print(
                f"{s:>4} {turn:>4} {engine:>8} {usage.get('prompt_tokens', 0):>7} "
                f"{work.get('hbm_tokens', 0):>6} {work.get('host_tokens', 0):>6} "
                f"{work.get('ssd_tokens', 0):>6} {work.get('pool_tokens', 0):>6} "
                f"{work.get('swa_tokens', 0):>5} "
                f"{work.get('replayed_tokens', 0):>6} {work.get('prefilled_tokens', 0):>7} "
                f"{ttft * 1e3:>8.1f}",
                flush=True,
            )
        messages.append({"role": "assistant", "content": "".join(text)})
        lines = 2 + (s * 7 + turn * 3) % 9  # a tool output of 2-10 lines of ~60 bytes
        output = "".join(
            f"module_{s}_{turn}.py:{i * 12}: assert result == expected  # failing\n"
            for i in range(lines)
        )
        messages.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": output})
        if args.pause:
            time.sleep(args.pause)
