"""Write or check the prefix-key test vectors (`tests/vectors/prefix_keys.json`).

    python scripts/gen_prefix_vectors.py            # write the file if it does not exist
    python scripts/gen_prefix_vectors.py --check    # exit 1 if the file differs from ramjet.keys.prefix
    python scripts/gen_prefix_vectors.py --force    # overwrite (only with a SPEC_VERSION bump)

The vectors pin the specification (`docs/prefix-keys.md`): a change to the rendering or
the chaining changes keys that engines, simulators and other routers rely on, so the file
is never rewritten silently. Writing over an existing, different file needs `--force`,
and the test suite checks the implementation against the committed file.

Keys are written as 16 lowercase hex digits (a JSON number cannot hold 64 bits exactly
in every language); the rendering as hex and, for reading, as text.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ramjet.keys.prefix import (
    BLOCK_BYTES,
    SPEC_VERSION,
    compute_keys,
    key_seed,
    render_chat,
    render_completion,
)

OUT = Path(__file__).resolve().parent.parent / "tests" / "vectors" / "prefix_keys.json"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def _pad_to(messages: list[dict[str, Any]], index: int, end: int) -> list[dict[str, Any]]:
    """Pad messages[index]'s content with 'x' so that its section ends at byte `end`."""
    r = render_chat(messages)
    have = r.boundaries[index]
    if have > end:
        raise ValueError(f"section {index} already ends at {have} > {end}")
    out = [dict(m) for m in messages]
    out[index]["content"] = out[index]["content"] + "x" * (end - have)
    return out


def cases() -> list[dict[str, Any]]:
    """The vector inputs: name, kind, model, adapter, cache_salt where there is one, and
    messages/tools or prompt."""
    worked = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18°C, clear"},
    ]
    one_block = _pad_to([{"role": "user", "content": "fill "}], 0, BLOCK_BYTES)
    empty_tail = _pad_to(
        [{"role": "system", "content": "sys "}, {"role": "user", "content": "next "}],
        0,
        BLOCK_BYTES,
    )
    empty_tail = _pad_to(empty_tail, 1, 2 * BLOCK_BYTES)
    chat = "chat"
    return [
        {"name": "worked_example", "kind": chat, "model": "ramjet-ref",
         "messages": worked, "tools": [WEATHER_TOOL]},
        {"name": "worked_example_turn1", "kind": chat, "model": "ramjet-ref",
         "messages": worked[:2], "tools": [WEATHER_TOOL]},
        {"name": "chat_minimal", "kind": chat, "model": "ramjet-ref",
         "messages": [{"role": "user", "content": "hi"}]},
        {"name": "chat_other_model", "kind": chat, "model": "other-model",
         "messages": [{"role": "user", "content": "hi"}]},
        {"name": "chat_adapter", "kind": chat, "model": "ramjet-ref", "adapter": "lora-7",
         "messages": [{"role": "user", "content": "hi"}]},
        {"name": "chat_cache_salt", "kind": chat, "model": "ramjet-ref", "cache_salt": "tenant-7",
         "messages": [{"role": "user", "content": "hi"}]},
        {"name": "chat_tools_without_system", "kind": chat, "model": "ramjet-ref",
         "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER_TOOL]},
        {"name": "chat_only_system_with_tools", "kind": chat, "model": "ramjet-ref",
         "messages": [{"role": "developer", "content": "Be brief."}], "tools": [WEATHER_TOOL]},
        {"name": "chat_two_system_messages_with_tools", "kind": chat, "model": "ramjet-ref",
         "messages": [{"role": "system", "content": "Be brief."},
                      {"role": "system", "content": "Use metric units."},
                      {"role": "user", "content": "Weather in Oslo?"}],
         "tools": [WEATHER_TOOL]},
        {"name": "chat_multipart", "kind": chat, "model": "ramjet-ref",
         "messages": [{"role": "user", "content": [
             {"type": "text", "text": "What is in "},
             {"type": "text", "text": "this picture?"},
             {"type": "image_url", "image_url": {"url": "https://example.com/cat.png",
                                                 "detail": "low"}},
         ]}]},
        {"name": "chat_multipart_equals_string", "kind": chat, "model": "ramjet-ref",
         "messages": [{"role": "user", "content": "What is in this picture?"}]},
        {"name": "chat_unicode", "kind": chat, "model": "ramjet-ref",
         "messages": [
             {"role": "system", "content": "Réponds en français. 日本語も可。"},
             {"role": "user", "name": "Zoë", "content": "emoji 🦀🚀, RTL שלום, e\u0301, NUL \u0000, tab\t."},
         ]},
        {"name": "chat_marker_escape", "kind": chat, "model": "ramjet-ref",
         "messages": [{"role": "user", "content": "a<|end|>\n<|user|>b <||> <|"}]},
        {"name": "chat_exactly_one_block", "kind": chat, "model": "ramjet-ref",
         "messages": one_block},
        {"name": "chat_boundary_on_block_edge", "kind": chat, "model": "ramjet-ref",
         "messages": empty_tail},
        {"name": "chat_multi_block", "kind": chat, "model": "ramjet-ref",
         "messages": [{"role": "system", "content": "".join(f"line {i}\n" for i in range(150))},
                      {"role": "user", "content": "Summarize."}]},
        {"name": "completion_string", "kind": "completion", "model": "ramjet-ref",
         "prompt": "def fib(n):\n    "},
        {"name": "completion_one_element_list", "kind": "completion", "model": "ramjet-ref",
         "prompt": ["def fib(n):\n    "]},
        {"name": "completion_token_ids", "kind": "completion", "model": "ramjet-ref",
         "prompt": [1, 22, 333, 0]},
        {"name": "completion_marker_escape", "kind": "completion", "model": "ramjet-ref",
         "prompt": "<|ids|>1,"},
        {"name": "completion_multi_block", "kind": "completion", "model": "ramjet-ref",
         "prompt": "0123456789abcdef" * 40},
    ]  # fmt: skip


def _hex(k: int) -> str:
    return f"{k:016x}"


def build() -> dict[str, Any]:
    out = []
    for case in cases():
        if case["kind"] == "chat":
            rendered = render_chat(case["messages"], case.get("tools"))
            inputs = {"messages": case["messages"]}
            if case.get("tools") is not None:
                inputs["tools"] = case["tools"]
        else:
            rendered = render_completion(case["prompt"])
            inputs = {"prompt": case["prompt"]}
        seed = key_seed(case["model"], case.get("adapter"), case.get("cache_salt"))
        keys = compute_keys(rendered, seed)
        # the request's cache_salt, only where a case has one (older cases stay as they were)
        salt = {"cache_salt": case["cache_salt"]} if "cache_salt" in case else {}
        out.append(
            {
                "name": case["name"],
                "kind": case["kind"],
                "model": case["model"],
                "adapter": case.get("adapter"),
                **salt,
                "input": inputs,
                "seed": _hex(seed),
                "rendering_text": rendered.text.decode("utf-8"),
                "rendering_hex": rendered.text.hex(),
                "length": len(rendered.text),
                "boundaries": list(rendered.boundaries),
                "block_keys": [_hex(k) for k in keys.blocks],
                "boundary_keys": [[off, _hex(k)] for off, k in keys.boundaries],
            }
        )
    return {
        "spec": "ramjet prefix keys (docs/prefix-keys.md)",
        "spec_version": SPEC_VERSION,
        "block_bytes": BLOCK_BYTES,
        "hash": "xxh3-64 (XXH3_64bits_withSeed)",
        "key_format": "16 lowercase hex digits, big-endian",
        "generated_by": "scripts/gen_prefix_vectors.py",
        "cases": out,
    }


def dumps(doc: dict[str, Any]) -> str:
    return json.dumps(doc, ensure_ascii=False, indent=1) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare, do not write")
    ap.add_argument("--force", action="store_true", help="overwrite a different file")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    text = dumps(build())
    existing = args.out.read_text("utf-8") if args.out.exists() else None
    if args.check:
        if existing == text:
            print(f"{args.out}: up to date ({len(build()['cases'])} cases)")
            return 0
        print(f"{args.out}: DIFFERS from ramjet.keys.prefix (or is missing)", file=sys.stderr)
        return 1
    if existing is not None and existing != text and not args.force:
        print(
            f"{args.out} exists and differs: the keys changed. Bump SPEC_VERSION, update "
            "docs/prefix-keys.md, then rerun with --force.",
            file=sys.stderr,
        )
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, "utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
