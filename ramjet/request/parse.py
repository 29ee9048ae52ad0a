"""Request body → request features, parsed once.

`parse_request(path, body, headers, limits)` is the router's single pass over a request
body. It decodes the JSON once (msgspec: about 3x faster than the standard library on a
4 MB body, measured by `benchmarks/prefix_keys.py`), validates the fields the router and
the engines rely on, renders the prompt canonically and derives its prefix keys
(`ramjet.keys.prefix`). Everything downstream reads the resulting `ParsedRequest`; nobody
parses the body again, and the original bytes are forwarded byte-exact.

Anything malformed raises `RequestError`, which carries an HTTP status and renders as an
OpenAI error object (`{"error": {"message", "type", "param", "code"}}`); `param` names
the offending field (`messages[2].content[0]`, `max_tokens`, ...). Parsing has no side
effects, so a rejected request changes nothing.

Session identity (used by `session_hash` and the SWA table): the `X-Session-Id` header
when present and non-empty (trimmed, at most `ParseLimits.max_session_chars`), else the
body's `user` field when it is a non-empty string, else None. The header wins because an
operator's gateway sets it deliberately; `user` is the OpenAI field clients already send.

Token estimates: the reference engine tokenizes bytes, so `bytes_per_token` defaults to
1.0 and estimates are exact for it. For another engine the byte offset `b` of the
rendering maps to the token offset `ceil(b / bytes_per_token)`, the same function for
prompt length, block sizes and boundary offsets, so the figures add up.
"""

from __future__ import annotations

import json as _stdjson
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from multidict import CIMultiDict, CIMultiDictProxy

from ramjet.errors import RamjetError
from ramjet.keys.prefix import (
    PrefixKeys,
    PromptError,
    Rendered,
    cache_salt,
    compute_keys,
    key_seed,
    render_chat,
    render_completion,
)
from ramjet.policy.base import RequestView
from ramjet.request.precheck import BodyCounts, CountLimits, body_counts

CHAT_PATH = "/v1/chat/completions"
COMPLETION_PATH = "/v1/completions"

RequestKind = Literal["chat", "completion"]


class RequestError(RamjetError):
    """A request the router refuses, with the HTTP status and OpenAI error fields."""

    def __init__(
        self, status: int, type: str, code: str, message: str, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.code = code
        self.message = message
        self.param = param

    def to_openai_json(self) -> bytes:
        """The OpenAI error object, UTF-8 JSON."""
        err = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return _stdjson.dumps({"error": err}, ensure_ascii=False).encode("utf-8")

    def __repr__(self) -> str:
        return (
            f"RequestError(status={self.status}, type={self.type!r}, code={self.code!r}, "
            f"param={self.param!r}, message={self.message!r})"
        )


def _bad(code: str, message: str, param: str | None) -> RequestError:
    return RequestError(400, "invalid_request_error", code, message, param)


@dataclass(frozen=True, slots=True)
class ParseLimits:
    max_body_bytes: int = 8 * 1024 * 1024
    """Bodies above this are refused with 413 (the proxy refuses earlier, from headers)."""
    max_depth: int = 64
    """Deepest nesting of arrays/objects accepted in a body (JSON nesting bombs)."""
    bytes_per_token: float = 1.0
    """Rendered bytes per prompt token; 1.0 for the byte-level reference engine."""
    max_session_chars: int = 256
    """Longest session id accepted from the header or `user`."""
    max_messages: int = 10_000
    """Most chat messages accepted (`limits.max_messages`); a large body is checked
    before it is decoded into objects."""
    max_content_parts: int = 20_000
    """Most content parts over all of a chat body's `content` arrays
    (`limits.max_content_parts`), checked as `max_messages` is."""
    max_prompt_items: int = 1 << 20
    """Most items in a completion body's `prompt` array and the arrays in it (token ids;
    `limits.max_prompt_items`), checked as `max_messages` is."""
    max_json_values: int = 2_000_000
    """Most JSON values in a large body, any field (`limits.max_json_values`): bounded
    from above before the body is decoded (`ramjet.request.precheck.values_bound`)."""

    def __post_init__(self) -> None:
        if (
            self.max_body_bytes <= 0
            or self.max_depth <= 0
            or self.max_session_chars <= 0
            or self.max_messages <= 0
            or self.max_content_parts <= 0
            or self.max_prompt_items <= 0
            or self.max_json_values <= 0
        ):
            raise ValueError("ParseLimits: limits must be positive")
        if not (self.bytes_per_token > 0 and math.isfinite(self.bytes_per_token)):
            raise ValueError("ParseLimits: bytes_per_token must be a positive number")


@dataclass(init=False, frozen=True, slots=True)
class ParsedRequest:
    kind: RequestKind
    model: str
    stream: bool
    rendered: Rendered
    keys: PrefixKeys
    session: str | None
    prompt_tokens: int
    """Estimated prompt tokens: ceil(rendered bytes / bytes_per_token)."""
    max_tokens: int | None
    """`max_completion_tokens` or `max_tokens` (chat), `max_tokens` (completion)."""
    body: bytes
    """The original body, forwarded byte-exact."""
    json: Mapping[str, Any]
    """The decoded body. Treat as read-only."""
    bytes_per_token: float = 1.0

    def __init__(
        self,
        kind: RequestKind,
        model: str,
        stream: bool,
        rendered: Rendered,
        keys: PrefixKeys,
        session: str | None,
        prompt_tokens: int,
        max_tokens: int | None,
        body: bytes,
        json: Mapping[str, Any],
        bytes_per_token: float = 1.0,
    ) -> None:
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "stream", stream)
        object.__setattr__(self, "rendered", rendered)
        object.__setattr__(self, "keys", keys)
        object.__setattr__(self, "session", session)
        object.__setattr__(self, "prompt_tokens", prompt_tokens)
        object.__setattr__(self, "max_tokens", max_tokens)
        object.__setattr__(self, "body", body)
        object.__setattr__(self, "json", json)
        object.__setattr__(self, "bytes_per_token", bytes_per_token)


# --- field validators -------------------------------------------------------------------

_Check = Callable[[Any], bool]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_str_or_str_list(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))


# (field, check, expected-type phrase, minimum for integers). None is always allowed: the
# OpenAI API treats an explicit null as "not set".
_COMMON_FIELDS: tuple[tuple[str, _Check, str, int | None], ...] = (
    ("stream", lambda v: isinstance(v, bool), "a boolean", None),
    ("max_tokens", _is_int, "an integer", 1),
    ("n", _is_int, "an integer", 1),
    ("temperature", _is_num, "a number", None),
    ("top_p", _is_num, "a number", None),
    ("presence_penalty", _is_num, "a number", None),
    ("frequency_penalty", _is_num, "a number", None),
    ("seed", _is_int, "an integer", None),
    ("stop", _is_str_or_str_list, "a string or an array of strings", None),
    ("user", lambda v: isinstance(v, str), "a string", None),
    ("stream_options", lambda v: isinstance(v, dict), "an object", None),
    ("logit_bias", lambda v: isinstance(v, dict), "an object", None),
)
_CHAT_FIELDS: tuple[tuple[str, _Check, str, int | None], ...] = (
    ("max_completion_tokens", _is_int, "an integer", 1),
    ("tools", lambda v: isinstance(v, list), "an array", None),
    ("logprobs", lambda v: isinstance(v, bool), "a boolean", None),
    ("top_logprobs", _is_int, "an integer", 0),
)
_COMPLETION_FIELDS: tuple[tuple[str, _Check, str, int | None], ...] = (
    ("echo", lambda v: isinstance(v, bool), "a boolean", None),
    ("suffix", lambda v: isinstance(v, str), "a string", None),
    ("best_of", _is_int, "an integer", 1),
    ("logprobs", _is_int, "an integer", 0),
)


_FieldSpec = tuple[str, _Check, str, int | None]
# Each table's specs by name, for a body with fewer keys than the table has fields.
_COMMON_BY_NAME = {f[0]: f for f in _COMMON_FIELDS}
_CHAT_BY_NAME = {f[0]: f for f in _CHAT_FIELDS}
_COMPLETION_BY_NAME = {f[0]: f for f in _COMPLETION_FIELDS}


def _check_fields(
    obj: Mapping[str, Any], fields: Sequence[_FieldSpec], by_name: Mapping[str, _FieldSpec]
) -> None:
    """Raise for the first of `fields` (in table order) that `obj` sets badly; `by_name`:
    the same specs by name."""
    if len(obj) < len(fields):  # visit the body's keys only
        for k, v in obj.items():
            spec = by_name.get(k)
            if spec is not None and v is not None:
                _, check, _, minimum = spec
                if not check(v) or (minimum is not None and v < minimum):
                    break  # a bad field: the loop below names the first in table order
        else:
            return
    for name, check, expected, minimum in fields:
        v = obj.get(name)
        if v is None:
            continue
        if not check(v):
            raise _bad("invalid_type", f"'{name}' must be {expected}, got {_type_name(v)}", name)
        if minimum is not None and v < minimum:
            raise _bad("invalid_value", f"'{name}' must be at least {minimum}, got {v}", name)


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int | float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def _check_depth(root: Any, limit: int) -> None:
    """Refuse nesting deeper than `limit` (iterative: no recursion to exhaust)."""
    stack: list[tuple[Any, int]] = [(root, 1)]
    pop, push = stack.pop, stack.append
    while stack:
        node, depth = pop()
        if depth > limit:
            raise _bad("nesting_too_deep", f"JSON nesting deeper than {limit} levels", None)
        if isinstance(node, dict):
            for v in node.values():
                if isinstance(v, dict | list):
                    push((v, depth + 1))
        else:
            for v in node:
                if isinstance(v, dict | list):
                    push((v, depth + 1))


_decode = msgspec.json.decode
_COUNT_BRACKETS_BELOW = 64 * 1024
_PRECHECK_ABOVE = 256 * 1024
"""Bodies larger than this have their message count checked before the full decode."""


def _too_many_messages(n: int, limit: int) -> RequestError:
    return _bad(
        "too_many_messages",
        f"'messages' has {n} messages; at most {limit} are accepted",
        "messages",
    )


def _too_many_parts(n: int, limit: int) -> RequestError:
    return _bad(
        "too_many_content_parts",
        f"'messages' have {n} content parts in all; at most {limit} are accepted",
        "messages",
    )


def _too_many_prompt_items(n: int, limit: int) -> RequestError:
    return _bad(
        "too_many_prompt_items",
        f"'prompt' has {n} items (token ids, or prompts and theirs); at most {limit} are accepted",
        "prompt",
    )


def count_limits(limits: ParseLimits) -> CountLimits:
    """What `ramjet.request.precheck.body_counts` checks a body against."""
    return CountLimits(
        limits.max_messages,
        limits.max_content_parts,
        limits.max_prompt_items,
        limits.max_json_values,
    )


def check_counts(counts: BodyCounts, limits: ParseLimits) -> None:
    """Raise `RequestError` (400) when a body's counts (`ramjet.request.precheck.
    body_counts`) break a limit, or it is not JSON."""
    if counts.error:
        raise _bad("invalid_json", counts.error, None)
    if counts.messages > limits.max_messages:
        raise _too_many_messages(counts.messages, limits.max_messages)
    if counts.parts > limits.max_content_parts:
        raise _too_many_parts(counts.parts, limits.max_content_parts)
    if counts.prompt_items > limits.max_prompt_items:
        raise _too_many_prompt_items(counts.prompt_items, limits.max_prompt_items)
    if counts.values > limits.max_json_values:
        raise _bad(
            "too_many_values",
            f"request body holds more than {limits.max_json_values} JSON values (about "
            f"{counts.values})",
            None,
        )


def _check_decoded_counts(obj: Mapping[str, Any], kind: RequestKind, limits: ParseLimits) -> None:
    """The count limits on a decoded body (a small one was not counted before)."""
    if kind == "chat":
        messages = obj.get("messages")
        if isinstance(messages, list):
            if len(messages) > limits.max_messages:
                raise _too_many_messages(len(messages), limits.max_messages)
            parts = 0
            for m in messages:
                content = m.get("content") if isinstance(m, dict) else None
                if isinstance(content, list):
                    parts += len(content)
            if parts > limits.max_content_parts:
                raise _too_many_parts(parts, limits.max_content_parts)
    else:
        prompt = obj.get("prompt")
        if isinstance(prompt, list):
            items = len(prompt) + sum(len(p) for p in prompt if isinstance(p, list))
            if items > limits.max_prompt_items:
                raise _too_many_prompt_items(items, limits.max_prompt_items)


def _decode_body(body: bytes, limits: ParseLimits, prechecked: bool = False) -> dict[str, Any]:
    if len(body) > limits.max_body_bytes:
        raise RequestError(
            413,
            "invalid_request_error",
            "body_too_large",
            f"request body of {len(body)} bytes exceeds the limit of {limits.max_body_bytes}",
            None,
        )
    if not body.strip():
        raise _bad("invalid_json", "request body is empty; expected a JSON object", None)
    if len(body) > _PRECHECK_ABOVE and not prechecked:
        # Refuse a large body with too many messages, parts or prompt items before it is
        # decoded into objects (`body_counts`: one small object per item instead of a
        # dict and strings; a body it cannot read is refused as invalid JSON here).
        check_counts(body_counts(body, count_limits(limits)), limits)
    try:
        obj = _decode(body)
    except RecursionError:
        raise _bad("nesting_too_deep", "JSON nesting too deep", None) from None
    except UnicodeDecodeError as e:
        raise _bad("invalid_json", f"request body is not valid UTF-8: {e.reason}", None) from None
    except msgspec.MsgspecError as e:
        raise _bad("invalid_json", f"request body is not valid JSON: {e}", None) from None
    if not isinstance(obj, dict):
        raise _bad(
            "invalid_json", f"request body must be a JSON object, got {_type_name(obj)}", None
        )
    # Each container of the decoded body opened with a `[` or `{` byte, so a small body
    # with no more of them than the limit cannot nest past it: two C scans instead of a
    # walk (a large body keeps the walk, which costs by container, not by byte).
    if len(body) > _COUNT_BRACKETS_BELOW or (
        body.count(b"[") + body.count(b"{") > limits.max_depth
    ):
        _check_depth(obj, limits.max_depth)
    return obj


def _session(headers: Mapping[str, str], obj: Mapping[str, Any], limits: ParseLimits) -> str | None:
    # The servers' headers are a CIMultiDictProxy: its case-insensitive getall, in order,
    # rather than lower-casing every header name.
    found: list[str] = (
        headers.getall("X-Session-Id", [])
        if isinstance(headers, CIMultiDictProxy | CIMultiDict)
        else [v for k, v in headers.items() if k.lower() == "x-session-id"]
    )
    for v in found:
        value = v.strip()
        if value:
            if len(value) > limits.max_session_chars:
                raise _bad(
                    "invalid_value",
                    f"X-Session-Id is longer than {limits.max_session_chars} characters",
                    "X-Session-Id",
                )
            return value
    user = obj.get("user")
    if isinstance(user, str) and user:
        # A long `user` is legal OpenAI input; it is only too long to be a session key.
        return user if len(user) <= limits.max_session_chars else None
    return None


def token_offset(byte_offset: int, bytes_per_token: float) -> int:
    """The estimated token offset of a byte offset of the rendering (see module doc)."""
    if bytes_per_token == 1.0:
        return byte_offset
    return math.ceil(byte_offset / bytes_per_token)


def parse_request(
    path: str,
    body: bytes,
    headers: Mapping[str, str],
    limits: ParseLimits,
    prechecked: bool = False,
) -> ParsedRequest:
    """Parse, validate and key one request; raise `RequestError` on anything malformed.
    `prechecked`: a large body's counts were checked already (`check_counts` on
    `ramjet.request.precheck.body_counts`)."""
    route = path.split("?", 1)[0].rstrip("/")
    kind: RequestKind
    if route == CHAT_PATH:
        kind = "chat"
    elif route == COMPLETION_PATH:
        kind = "completion"
    else:
        raise RequestError(404, "not_found_error", "unknown_url", f"no such endpoint: {path}", None)
    obj = _decode_body(body, limits, prechecked)

    model = obj.get("model")
    if model is None:
        raise _bad("missing_required_parameter", "'model' is required", "model")
    if not isinstance(model, str):
        raise _bad("invalid_type", f"'model' must be a string, got {_type_name(model)}", "model")
    if not model:
        raise _bad("invalid_value", "'model' must not be empty", "model")
    _check_fields(obj, _COMMON_FIELDS, _COMMON_BY_NAME)

    try:
        if kind == "chat":
            _check_fields(obj, _CHAT_FIELDS, _CHAT_BY_NAME)
            messages = obj.get("messages")
            if messages is None:
                raise _bad("missing_required_parameter", "'messages' is required", "messages")
            if not isinstance(messages, list):
                raise _bad(
                    "invalid_type",
                    f"'messages' must be an array, got {_type_name(messages)}",
                    "messages",
                )
            _check_decoded_counts(obj, kind, limits)
            rendered = render_chat(messages, obj.get("tools"))
            max_tokens = obj.get("max_completion_tokens")
            if max_tokens is None:
                max_tokens = obj.get("max_tokens")
        else:
            _check_fields(obj, _COMPLETION_FIELDS, _COMPLETION_BY_NAME)
            if "prompt" not in obj or obj["prompt"] is None:
                raise _bad("missing_required_parameter", "'prompt' is required", "prompt")
            _check_decoded_counts(obj, kind, limits)
            rendered = render_completion(obj["prompt"])
            max_tokens = obj.get("max_tokens")
    except PromptError as e:
        param = getattr(e, "param", None) or ("messages" if kind == "chat" else "prompt")
        raise _bad(getattr(e, "code", None) or "invalid_value", str(e), param) from None
    except RecursionError:
        raise _bad("nesting_too_deep", "JSON nesting too deep", None) from None

    keys = compute_keys(rendered, key_seed(model, salt=cache_salt(obj)))
    bpt = limits.bytes_per_token
    return ParsedRequest(
        kind=kind,
        model=model,
        stream=obj.get("stream") is True,
        rendered=rendered,
        keys=keys,
        session=_session(headers, obj, limits),
        prompt_tokens=token_offset(len(rendered.text), bpt),
        max_tokens=max_tokens,
        body=body,
        json=obj,
        bytes_per_token=bpt,
    )


def to_request_view(parsed: ParsedRequest, request_id: str) -> RequestView:
    """The policy's view of a parsed request: features in tokens, never the body."""
    bpt = parsed.bytes_per_token
    block = parsed.keys.block_bytes
    n = len(parsed.keys.blocks)
    if bpt == 1.0:
        block_tokens: list[int] = [block] * n
        bounds = list(parsed.keys.boundaries)
    else:
        offs = [token_offset(i * block, bpt) for i in range(n + 1)]
        block_tokens = [offs[i + 1] - offs[i] for i in range(n)]
        bounds = [(token_offset(off, bpt), key) for off, key in parsed.keys.boundaries]
    return RequestView(
        request_id=request_id,
        model=parsed.model,
        prompt_tokens=parsed.prompt_tokens,
        block_keys=parsed.keys.blocks,
        block_tokens=block_tokens,
        boundary_keys=bounds,
        session=parsed.session,
        max_output_tokens=parsed.max_tokens,
    )
