"""The router's token blocks are the blocks vLLM stores (issue 15, problem 2).

For chat with a system prompt, with tools (the template's `tojson` and `strftime_now`),
with content-part arrays, and for `/v1/completions` (vLLM adds special tokens there by
default), the router's key pool (configured as a user would: the model directory's
`tokenizer.json` and the `chat_template.jinja` transformers 5 writes, with
`bos_token` from `tokenizer_config.json`) tokenizes exactly as the engine:

- its prompt length equals vLLM's `usage.prompt_tokens` and its tokens equal what
  vLLM's `/tokenize` returns for the same request;
- its block keys equal the keys of the `token_ids` the engine's `BlockStored` events
  carry for that request (read from the raw event stream).

Then a template that raises on a request (an unknown role here) leaves that request
with text keys and counts it: the router still forwards it (never a 400 of its own).
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry
from vllm_engines import BLOCK, MODEL, post_json
from vllm_stack import Stack

from ramjet.keys.pools import KeyPoolConfig, KeyPools
from ramjet.keys.tokens import chain_keys, token_key_seed
from ramjet.request.parse import ParseLimits, parse_request
from ramjet.types import EngineId

pytestmark = pytest.mark.timeout(120)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Wetter <für> & eine Stadt, 'quoted'",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def pools(stack: Stack, registry: CollectorRegistry | None = None) -> KeyPools:
    return KeyPools(
        [
            KeyPoolConfig(
                name="vllm",
                engines=("v0", "v1"),
                keys_mode="tokens",
                tokenizer_file=str(stack.env.tokenizer_file),
                chat_template_file=str(stack.env.chat_template_file),
                block_tokens=BLOCK,
            )
        ],
        registry=registry,
    )


def cases(nonce: str) -> dict[str, tuple[str, dict[str, Any]]]:
    long = " ".join(f"clause {i} of the brief" for i in range(20))
    return {
        "system": (
            "chat",
            {"messages": [{"role": "system", "content": f"{nonce} Be brief. {long}"},
                          {"role": "user", "content": "Hello there"}]},
        ),
        "tools": (
            "chat",
            {"messages": [{"role": "user", "content": f"{nonce} Weather in Köln? {long}"}],
             "tools": TOOLS, "tool_choice": "none"},  # "auto" needs a tool parser
        ),
        "parts": (
            "chat",
            {"messages": [{"role": "system", "content": f"{nonce} {long}"},
                          {"role": "user", "content": [{"type": "text", "text": "part one"},
                                                       {"type": "text", "text": "part two"}]}]},
        ),
        "completion": ("completion", {"prompt": f"{nonce} Once upon a time. {long}"}),
    }  # fmt: skip


def test_router_token_blocks_equal_vllm_stored_blocks(stack: Stack) -> None:
    kp = pools(stack)
    eng, raw = stack.engines["v0"], stack.raw["v0"]
    seed = token_key_seed(MODEL)
    got: dict[str, tuple[int, int, int]] = {}
    for name, (kind, extra) in cases(secrets.token_hex(4)).items():
        body = {"model": MODEL, "max_tokens": 1, "temperature": 0, **extra}
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        parsed = parse_request(path, json.dumps(body).encode(), {}, ParseLimits())
        mine = kp.rekey(parsed, [EngineId("v0")])
        tok_body = {k: v for k, v in body.items() if k in ("model", "messages", "tools", "prompt")}
        if kind == "chat":
            tok_body["add_generation_prompt"] = True
        status, tokenized = post_json(eng.url + "/tokenize", tok_body)
        assert status == 200, tokenized
        vllm_ids = tokenized["tokens"]

        before, _ = raw.snapshot()
        status, data = post_json(eng.url + path, body)
        assert status == 200, data
        deadline = time.monotonic() + 10
        stored: list[int] = []
        while not stored and time.monotonic() < deadline:
            time.sleep(0.05)
            with raw.lock:
                frames = list(raw.frames)
            for f in frames:
                seq = int.from_bytes(f[1], "big")
                if before is not None and seq <= before:
                    continue
                for ev in msgspec.msgpack.decode(f[2])[1]:
                    if ev["type"] == "BlockStored" and ev["parent_block_hash"] is None:
                        stored = list(ev["token_ids"])
        assert stored, f"{name}: the engine stored no block"
        got[name] = (mine.prompt_tokens, data["usage"]["prompt_tokens"], len(vllm_ids))
        assert mine.prompt_tokens == data["usage"]["prompt_tokens"] == len(vllm_ids), (name, got)
        want = chain_keys(stored, seed, BLOCK)
        assert list(mine.keys.blocks[: len(want)]) == want, (name, got)


def test_a_template_the_router_cannot_render_falls_back_to_text_keys(stack: Stack) -> None:
    registry = CollectorRegistry()
    kp = pools(stack, registry)
    body = {"model": MODEL, "messages": [{"role": "narrator", "content": "once"}]}
    parsed = parse_request("/v1/chat/completions", json.dumps(body).encode(), {}, ParseLimits())
    out = kp.rekey(parsed, [EngineId("v0")])
    assert out.keys == parsed.keys  # text keys kept, no RequestError
    assert kp.fallbacks["vllm"] == 1
    assert registry.get_sample_value("ramjet_token_keys_fallback_total", {"pool": "vllm"}) == 1
    # and the engine itself decides: vLLM's template raises too, so vLLM answers 400
    status, data = post_json(stack.engines["v0"].url + "/v1/chat/completions", body)
    assert status == 400, data
