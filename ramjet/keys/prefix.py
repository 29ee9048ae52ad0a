"""Prefix keys: one specification shared by the router, the reference engine and the
simulator. `docs/prefix-keys.md` is the written spec (grammar, byte-level examples,
versioning); `tests/vectors/prefix_keys.json` holds test vectors any other
implementation can check itself against (`scripts/gen_prefix_vectors.py` writes them).

Algorithm
---------
1. Render the prompt to a canonical UTF-8 byte string that is prefix-stable across
   turns: when turn k+1 appends messages to turn k, turn k's rendering is a byte prefix
   of turn k+1's. Each message renders on its own as one section
   `<|role|>body[<|meta|>json]<|end|>\\n`, so appending a message appends bytes. A first
   message with role system or developer comes first, then the tool definitions as one
   section `<|tools|>json<|end|>\\n`, then the remaining messages in order.
   The rendering is injective on what it keeps: every piece of client text (content,
   canonical JSON) is escaped by replacing `<|` with `<||>`, so client text can never
   forge a marker; roles are restricted to `[A-Za-z0-9_-]{1,64}` minus the marker names.
   Text content parts concatenate (a list of text parts renders like the string they
   join to); other parts render as `<|part|>` + canonical JSON. Message fields other
   than role and content (name, tool_calls, tool_call_id, ...; nulls dropped) render as
   canonical JSON after `<|meta|>`.
2. The seed is xxh3-64 of `ramjet-prefix-v{SPEC_VERSION}\\0{model}\\0{adapter}`, so
   different models, adapters or spec versions never share keys; a request's
   `cache_salt` appends `\\0salt\\0{salt}`, so salts never share keys either.
3. Block keys: the rendering is cut into blocks of `BLOCK_BYTES` (256); block i's key is
   xxh3-64(block i, seed=key of block i-1), chained from the seed. Only full blocks are
   keyed. A key names a whole byte prefix, so a resident block implies its predecessors
   are resident wherever tables insert and expire whole prefixes (`longest_prefix`).
4. Boundary keys: at each section end `off`, key = xxh3-64(bytes [j*B, off), seed=key of
   block j-1) with j = off // B (the chain seed when j = 0). Shorter than a block, so it
   never equals a block key; it names the exact prefix [0, off), where SWA state is kept.

Cost is linear: one C-level pass to escape and encode the text, one join, and one xxh3
call per 256-byte block in a list comprehension (about 2.3 ms for 4 MB here).

The reference engine tokenizes bytes (one token per byte), so its token blocks are these
blocks exactly and it reports residency in these keys.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import xxhash

from ramjet.errors import RamjetError
from ramjet.types import PrefixKey

SPEC_VERSION = 1
BLOCK_BYTES = 256
"""Bytes per block key. 4 MB of prompt is 16,384 xxh3 calls (about 2.3 ms in CPython)."""

_xxh3 = xxhash.xxh3_64_intdigest
_END = b"<|end|>\n"
_META = b"<|meta|>"
_PART = "<|part|>"
_TOOLS = b"<|tools|>"
_IDS = b"<|ids|>"
_ROLE_RE = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")
RESERVED_ROLES = frozenset({"tools", "meta", "part", "end", "ids"})
"""Marker names a message role may not take (they would forge a section)."""


class PromptError(RamjetError, ValueError):
    """The request has no prompt we can render (wrong types, missing fields).

    `param` names the offending field in OpenAI style (`messages[2].content`); `code` is
    the OpenAI-style error code the router reports.
    """

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def cache_salt(body: Mapping[str, Any]) -> str | None:
    """The request's `cache_salt` (vLLM and SGLang), as the text its keys are seeded with;
    None when absent or null. A non-string salt is seeded by its JSON text: the engine
    decides whether it is valid, and it still matches no unsalted block."""
    v = body.get("cache_salt")
    if v is None:
        return None
    return v if isinstance(v, str) else json.dumps(v, sort_keys=True)


def key_seed(model: str, adapter: str | None = None, salt: str | None = None) -> int:
    """The chain's seed: different models or adapters never share keys. `salt`: the
    request's `cache_salt` (`cache_salt(body)`): engines share no cached block between
    salts, so a salted request's chain starts from its own seed and matches no unsalted
    block and no other salt's. Without a salt the seed is what it always was."""
    tag = f"ramjet-prefix-v{SPEC_VERSION}\x00{model}\x00{adapter or ''}"
    if salt is not None:
        tag += f"\x00salt\x00{salt}"
    return _xxh3(tag.encode("utf-8", "surrogatepass"))


def _esc(text: str) -> str:
    """Replace every `<|` with `<||>`.

    Searching a two-character needle runs at about 1 GB/s in CPython (3.4 ms per 4 MB,
    14 ms for a string with one emoji), while a one-character find is a memchr (0.2 ms).
    Most prompts hold few `|`: look at each, and fall back to `replace` as soon as a
    `<|` shows up or the pipes are too many to visit one by one.
    """
    find = text.find
    i = find("|", 1)
    for _ in range(64):
        if i < 0:
            return text  # no `<|`: no copy
        if text[i - 1] == "<":
            break
        i = find("|", i + 1)
    return text.replace("<|", "<||>")


def _canon_json(value: Any, param: str) -> str:
    """Canonical JSON: sorted keys, no whitespace, UTF-8 (not \\u-escaped), escaped."""
    try:
        return _esc(json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False))
    except (TypeError, ValueError) as e:  # non-string keys, NaN from a lenient parser
        raise PromptError(f"{param}: cannot be rendered as JSON ({e})", param) from None


def _utf8(text: str, param: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise PromptError(
            f"{param}: text is not valid Unicode (lone surrogate)", param, "invalid_encoding"
        ) from None


def _render_content(content: Any, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return _esc(content)
    if isinstance(content, list):
        # Adjacent text parts join before escaping: escaped one by one, "<" + "|end|>"
        # would join to an unescaped marker and forge a section.
        out: list[str] = []
        run: list[str] = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                run.append(part)
            elif isinstance(part, Mapping):
                text = part.get("text")
                if part.get("type") == "text" and isinstance(text, str):
                    run.append(text)
                else:  # images, audio, files: their canonical JSON stands for them
                    if run:
                        out.append(_esc("".join(run)))
                        run = []
                    out.append(_PART + _canon_json(part, f"{param}[{i}]"))
            else:
                raise PromptError(
                    f"{param}[{i}]: content part must be a string or an object",
                    f"{param}[{i}]",
                    "invalid_type",
                )
        if run:
            out.append(_esc("".join(run)))
        return "".join(out)
    raise PromptError(
        f"{param}: content must be a string, an array of parts or null", param, "invalid_type"
    )


def _render_message(msg: Any, i: int, out: list[bytes]) -> None:
    path = f"messages[{i}]"
    if not isinstance(msg, Mapping):
        raise PromptError(f"{path}: must be an object", path, "invalid_type")
    role = msg.get("role")
    if role is None:
        raise PromptError(f"{path}.role: is required", f"{path}.role", "missing_required_parameter")
    if not isinstance(role, str):
        raise PromptError(f"{path}.role: must be a string", f"{path}.role", "invalid_type")
    if not _ROLE_RE.match(role) or role in RESERVED_ROLES:
        raise PromptError(
            f"{path}.role: {role[:70]!r} is not a valid role (1-64 of A-Z a-z 0-9 _ -, "
            f"not one of {', '.join(sorted(RESERVED_ROLES))})",
            f"{path}.role",
        )
    out.append(b"<|" + role.encode("ascii") + b"|>")
    out.append(_utf8(_render_content(msg.get("content"), path + ".content"), path + ".content"))
    extras = {k: v for k, v in msg.items() if k != "role" and k != "content" and v is not None}
    if extras:
        out.append(_META + _utf8(_canon_json(extras, path), path))
    out.append(_END)


@dataclass(init=False, frozen=True, slots=True)
class Rendered:
    """A prompt rendered to canonical bytes, and where each section ends."""

    text: bytes
    boundaries: tuple[int, ...]
    """Byte offsets just past each section (ascending; the last equals len(text))."""

    def __init__(
        self,
        text: bytes,
        boundaries: tuple[int, ...],
    ) -> None:
        object.__setattr__(self, "text", text)
        object.__setattr__(self, "boundaries", boundaries)


def render_chat(messages: Sequence[Any], tools: Sequence[Any] | None = None) -> Rendered:
    """Render chat messages (OpenAI format) canonically; see the module docstring."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise PromptError("messages: must be an array", "messages", "invalid_type")
    if not messages:
        raise PromptError("messages: must not be empty", "messages")
    if tools is not None and (not isinstance(tools, Sequence) or isinstance(tools, str | bytes)):
        raise PromptError("tools: must be an array", "tools", "invalid_type")
    # Tools go after the first message when it is a system/developer prompt, else first.
    # Only ever after the first message: were they placed after a run of leading system
    # messages, a turn of only system messages followed by one more would move them.
    first = messages[0]
    lead = 1 if isinstance(first, Mapping) and first.get("role") in ("system", "developer") else 0
    parts: list[bytes] = []
    bounds: list[int] = []
    pos = 0
    for i in range(len(messages) + (1 if tools else 0)):
        start = len(parts)
        if tools and i == lead:
            parts.append(_TOOLS + _utf8(_canon_json(list(tools), "tools"), "tools") + _END)
        else:
            j = i - 1 if tools and i > lead else i
            _render_message(messages[j], j, parts)
        for k in range(start, len(parts)):
            pos += len(parts[k])
        bounds.append(pos)
    return Rendered(b"".join(parts), tuple(bounds))


def render_completion(prompt: Any) -> Rendered:
    """Render a /v1/completions prompt: a string or an array of token ids, or a
    one-element array of either. Batches of several prompts are refused."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise PromptError("prompt: must not be empty", "prompt")
        return _one_section(_utf8(_esc(prompt), "prompt"))
    if not isinstance(prompt, list):
        raise PromptError(
            "prompt: must be a string or an array of token ids", "prompt", "invalid_type"
        )
    if not prompt:
        raise PromptError("prompt: must not be empty", "prompt")
    if all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        # Each id is terminated by a comma, so rendering a is a prefix of rendering b
        # exactly when the id sequence a is a prefix of b.
        return _one_section(_IDS + ",".join(map(str, prompt)).encode("ascii") + b",")
    if all(isinstance(p, str | list) for p in prompt):
        raise PromptError(
            f"prompt: batches of {len(prompt)} prompts are not supported; send one prompt "
            "per request",
            "prompt",
        )
    raise PromptError("prompt: token ids must be non-negative integers", "prompt", "invalid_type")


def _one_section(text: bytes) -> Rendered:
    return Rendered(text, (len(text),))


@dataclass(init=False, frozen=True, slots=True)
class PrefixKeys:
    """The keys of one rendered prompt."""

    seed: int
    block_bytes: int
    blocks: tuple[PrefixKey, ...]
    """Chained key per full block, in order."""
    boundaries: tuple[tuple[int, PrefixKey], ...]
    """(byte offset, key) at each section boundary, ascending."""
    length: int
    """Length of the rendering in bytes."""

    def __init__(
        self,
        seed: int,
        block_bytes: int,
        blocks: tuple[PrefixKey, ...],
        boundaries: tuple[tuple[int, PrefixKey], ...],
        length: int,
    ) -> None:
        object.__setattr__(self, "seed", seed)
        object.__setattr__(self, "block_bytes", block_bytes)
        object.__setattr__(self, "blocks", blocks)
        object.__setattr__(self, "boundaries", boundaries)
        object.__setattr__(self, "length", length)


def compute_keys(rendered: Rendered, seed: int, block_bytes: int = BLOCK_BYTES) -> PrefixKeys:
    """Chain block keys and boundary keys over a rendering. Linear in its length."""
    if block_bytes <= 0:
        raise ValueError("block_bytes must be positive")
    text = rendered.text
    size = len(text)
    h = seed
    x = _xxh3
    # One Python-level call per block is the floor for a chained hash; the comprehension
    # with an assignment expression is the cheapest loop CPython offers (bytes slices of
    # 256 bytes are cheaper than memoryview slices here).
    blocks = [
        h := x(text[s : s + block_bytes], h) for s in range(0, size - block_bytes + 1, block_bytes)
    ]
    bkeys: list[tuple[int, int]] = []
    prev_off = -1
    for off in rendered.boundaries:
        if not (0 <= off <= size) or off < prev_off:
            raise ValueError(f"boundary {off} is out of order or outside 0..{size}")
        prev_off = off
        j = off // block_bytes
        bkeys.append((off, x(text[j * block_bytes : off], seed if j == 0 else blocks[j - 1])))
    return PrefixKeys(
        seed,
        block_bytes,
        cast(tuple[PrefixKey, ...], tuple(blocks)),
        cast(tuple[tuple[int, PrefixKey], ...], tuple(bkeys)),
        size,
    )


K = TypeVar("K")


def longest_prefix(
    keys: Sequence[K], resident: Callable[[K], bool], *, monotone: bool = True
) -> int:
    """How many leading `keys` are resident: the n with keys[:n] resident, keys[n] not.

    With `monotone=True` (the default) this is a binary search, O(log n) probes. It is
    exact when the table is monotone over chains: whenever a key is resident, every
    earlier key of its chain is too. Chained keys make that natural: a table that inserts
    and refreshes a prompt's keys together and expires or evicts a key no earlier than
    its successors keeps it (a TTL table that refreshes whole prefixes does). Where the
    table may hold holes (independent per-key eviction), the binary search may report a
    prefix that crosses a hole; pass `monotone=False` for the linear scan that stops at
    the first missing key, O(n) probes.
    """
    n = len(keys)
    if not monotone:
        for i in range(n):
            if not resident(keys[i]):
                return i
        return n
    # Invariant: keys[:lo] resident (by monotonicity), keys[hi:] not resident.
    if n == 0 or not resident(keys[0]):
        return 0
    if resident(keys[n - 1]):
        return n
    lo, hi = 1, n - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if resident(keys[mid]):
            lo = mid + 1
        else:
            hi = mid
    return lo
