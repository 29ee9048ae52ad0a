"""Prefix keys: one specification shared by the router, the reference engine and the
simulator. `docs/prefix-keys.md` is the written spec; `tests/vectors/prefix_keys.json`
holds test vectors any other implementation can check itself against.

Algorithm
---------
1. Render the request's prompt to a canonical UTF-8 byte string that is prefix-stable
   across turns: when turn k+1 appends messages to turn k, the rendering of turn k is a
   byte prefix of turn k+1's. Each message renders on its own (no closing brackets that
   move), so appending a message appends bytes. Leading system/developer messages come
   first, then the tool definitions, then the remaining messages in order.
2. The seed is xxh3-64 of the model name and adapter, so different models never share
   keys.
3. Block keys: the rendering is cut into fixed blocks of `BLOCK_BYTES`; block i's key is
   xxh3-64(block i, seed=key of block i-1), chained from the seed. Only full blocks are
   keyed. A key therefore names a whole prefix, and a resident block implies all its
   predecessors are resident (the monotonicity lookups rely on).
4. Boundary keys: at the byte offset where each message ends, key = xxh3-64(bytes since
   the last full block, seed=key of that block). They name a prefix ending exactly at a
   message boundary, which is where SWA state is kept.

The reference engine tokenizes bytes (one token per byte), so its token blocks are these
blocks exactly and it reports residency in these keys.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from ramjet.types import PrefixKey

SPEC_VERSION = 1
BLOCK_BYTES = 256
"""Bytes per block key. 4 MB of prompt is 16,384 xxh3 calls (a few ms in CPython)."""

_xxh3 = xxhash.xxh3_64_intdigest
_END = b"<|end|>\n"


class PromptError(ValueError):
    """The request body has no prompt we can render (wrong types, missing fields)."""


def key_seed(model: str, adapter: str | None = None) -> int:
    """The chain's seed: different models or adapters never share keys."""
    tag = f"ramjet-prefix-v{SPEC_VERSION}\x00{model}\x00{adapter or ''}"
    return _xxh3(tag.encode("utf-8"))


def _canon_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _render_content(content: Any, path: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out: list[str] = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, Mapping):
                if part.get("type") == "text" and isinstance(part.get("text"), str):
                    out.append(part["text"])
                else:  # images, audio, files: their canonical JSON stands for them
                    out.append("<|part|>" + _canon_json(part))
            else:
                raise PromptError(f"{path}[{i}]: content part must be a string or an object")
        return "".join(out)
    raise PromptError(f"{path}: content must be a string, a list of parts or null")


def _render_message(msg: Any, i: int) -> str:
    path = f"messages[{i}]"
    if not isinstance(msg, Mapping):
        raise PromptError(f"{path}: must be an object")
    role = msg.get("role")
    if not isinstance(role, str) or not role:
        raise PromptError(f"{path}.role: must be a non-empty string")
    head = role
    name = msg.get("name")
    if isinstance(name, str) and name:
        head += ":" + name
    call_id = msg.get("tool_call_id")
    if isinstance(call_id, str) and call_id:
        head += "#" + call_id
    body = _render_content(msg.get("content"), path + ".content")
    calls = msg.get("tool_calls")
    if calls:
        body += "<|tool_calls|>" + _canon_json(calls)
    return f"<|{head}|>{body}"


@dataclass(frozen=True, slots=True)
class Rendered:
    """A prompt rendered to canonical bytes, and where each message ends."""

    text: bytes
    boundaries: tuple[int, ...]
    """Byte offsets just past each message (ascending; the last equals len(text))."""


def render_chat(messages: Sequence[Any], tools: Sequence[Any] | None = None) -> Rendered:
    """Render chat messages (OpenAI format) canonically; see the module docstring."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes) or not messages:
        raise PromptError("messages: must be a non-empty array")
    lead = 0
    while lead < len(messages) and isinstance(messages[lead], Mapping) and messages[lead].get("role") in ("system", "developer"):
        lead += 1
    parts: list[bytes] = []
    bounds: list[int] = []
    pos = 0

    def emit(s: str) -> None:
        nonlocal pos
        b = s.encode("utf-8") + _END
        parts.append(b)
        pos += len(b)
        bounds.append(pos)

    for i in range(lead):
        emit(_render_message(messages[i], i))
    if tools:
        emit("<|tools|>" + _canon_json(list(tools)))
    for i in range(lead, len(messages)):
        emit(_render_message(messages[i], i))
    return Rendered(b"".join(parts), tuple(bounds))


def render_completion(prompt: Any) -> Rendered:
    """Render a /v1/completions prompt: a string, or an array of token ids."""
    if isinstance(prompt, str):
        text = prompt.encode("utf-8")
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        text = b"<|ids|>" + ",".join(map(str, prompt)).encode("ascii")
    elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        text = prompt[0].encode("utf-8")
    else:
        raise PromptError("prompt: must be a string, a one-element array of strings, or an array of token ids")
    if not text:
        raise PromptError("prompt: must not be empty")
    return Rendered(text, (len(text),))


@dataclass(frozen=True, slots=True)
class PrefixKeys:
    """The keys of one rendered prompt."""

    seed: int
    block_bytes: int
    blocks: tuple[PrefixKey, ...]
    """Chained key per full block, in order."""
    boundaries: tuple[tuple[int, PrefixKey], ...]
    """(byte offset, key) at each message boundary, ascending."""
    length: int
    """Length of the rendering in bytes."""


def compute_keys(rendered: Rendered, seed: int, block_bytes: int = BLOCK_BYTES) -> PrefixKeys:
    """Chain block keys and boundary keys over a rendering. Linear in its length."""
    if block_bytes <= 0:
        raise ValueError("block_bytes must be positive")
    text = memoryview(rendered.text)
    n_full = len(text) // block_bytes
    blocks: list[PrefixKey] = []
    append = blocks.append
    h = seed
    for start in range(0, n_full * block_bytes, block_bytes):
        h = _xxh3(text[start : start + block_bytes], h)
        append(PrefixKey(h))
    bkeys: list[tuple[int, PrefixKey]] = []
    for off in rendered.boundaries:
        j = off // block_bytes
        prev = seed if j == 0 else blocks[j - 1]
        bkeys.append((off, PrefixKey(_xxh3(text[j * block_bytes : off], prev))))
    return PrefixKeys(seed, block_bytes, tuple(blocks), tuple(bkeys), len(text))
