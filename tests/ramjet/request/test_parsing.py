"""ramjet.request.parse: one parse per request, OpenAI-style errors for every bad input."""

from __future__ import annotations

import json
from typing import Any

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from ramjet.keys.prefix import compute_keys, key_seed, render_chat, render_completion
from ramjet.request.parse import (
    ParseLimits,
    RequestError,
    parse_request,
    to_request_view,
    token_offset,
)

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
LIMITS = ParseLimits()
MSGS = [{"role": "user", "content": "hi"}]


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def chat(**extra: Any) -> bytes:
    return body(model="m", messages=MSGS, **extra)


def comp(**extra: Any) -> bytes:
    return body(model="m", prompt="abc", **extra)


# (id, path, body, status, code, param)
BAD: list[tuple[str, str, bytes, int, str, str | None]] = [
    ("empty body", CHAT, b"", 400, "invalid_json", None),
    ("whitespace body", CHAT, b"  \n", 400, "invalid_json", None),
    ("malformed json", CHAT, b'{"model": "m",', 400, "invalid_json", None),
    ("trailing garbage", CHAT, chat() + b"x", 400, "invalid_json", None),
    (
        "NaN literal",
        CHAT,
        b'{"model":"m","messages":[],"temperature":NaN}',
        400,
        "invalid_json",
        None,
    ),
    ("invalid utf-8", CHAT, b'{"model":"m\xff"}', 400, "invalid_json", None),
    (
        "lone surrogate",
        CHAT,
        b'{"model":"m","messages":[{"role":"user","content":"\\ud800"}]}',
        400,
        "invalid_json",
        None,
    ),
    ("number out of range", CHAT, b'{"model":"m","temperature":1e400}', 400, "invalid_json", None),
    ("array body", CHAT, b"[1,2]", 400, "invalid_json", None),
    ("string body", CHAT, b'"hi"', 400, "invalid_json", None),
    ("nesting bomb", CHAT, b"[" * 100_000 + b"]" * 100_000, 400, "nesting_too_deep", None),
    (
        "nesting over limit",
        CHAT,
        body(model="m", messages=MSGS, x=json.loads("[" * 70 + "]" * 70)),
        400,
        "nesting_too_deep",
        None,
    ),
    ("missing model", CHAT, body(messages=MSGS), 400, "missing_required_parameter", "model"),
    (
        "null model",
        CHAT,
        body(model=None, messages=MSGS),
        400,
        "missing_required_parameter",
        "model",
    ),
    ("model not a string", CHAT, body(model=3, messages=MSGS), 400, "invalid_type", "model"),
    ("empty model", CHAT, body(model="", messages=MSGS), 400, "invalid_value", "model"),
    ("missing messages", CHAT, body(model="m"), 400, "missing_required_parameter", "messages"),
    ("messages not array", CHAT, body(model="m", messages="hi"), 400, "invalid_type", "messages"),
    ("messages empty", CHAT, body(model="m", messages=[]), 400, "invalid_value", "messages"),
    (
        "message not object",
        CHAT,
        body(model="m", messages=["hi"]),
        400,
        "invalid_type",
        "messages[0]",
    ),
    (
        "role missing",
        CHAT,
        body(model="m", messages=[{"content": "x"}]),
        400,
        "missing_required_parameter",
        "messages[0].role",
    ),
    (
        "role wrong type",
        CHAT,
        body(model="m", messages=[{"role": 1}]),
        400,
        "invalid_type",
        "messages[0].role",
    ),
    (
        "role reserved",
        CHAT,
        body(model="m", messages=[{"role": "end"}]),
        400,
        "invalid_value",
        "messages[0].role",
    ),
    (
        "content wrong type",
        CHAT,
        body(model="m", messages=[{"role": "user", "content": 1}]),
        400,
        "invalid_type",
        "messages[0].content",
    ),
    (
        "content part wrong type",
        CHAT,
        body(model="m", messages=[MSGS[0], {"role": "user", "content": [1]}]),
        400,
        "invalid_type",
        "messages[1].content[0]",
    ),
    ("tools not array", CHAT, chat(tools={"a": 1}), 400, "invalid_type", "tools"),
    ("stream not bool", CHAT, chat(stream="yes"), 400, "invalid_type", "stream"),
    ("stream number", CHAT, chat(stream=1), 400, "invalid_type", "stream"),
    ("max_tokens string", CHAT, chat(max_tokens="10"), 400, "invalid_type", "max_tokens"),
    ("max_tokens float", CHAT, chat(max_tokens=1.5), 400, "invalid_type", "max_tokens"),
    ("max_tokens bool", CHAT, chat(max_tokens=True), 400, "invalid_type", "max_tokens"),
    ("max_tokens zero", CHAT, chat(max_tokens=0), 400, "invalid_value", "max_tokens"),
    (
        "max_completion_tokens neg",
        CHAT,
        chat(max_completion_tokens=-1),
        400,
        "invalid_value",
        "max_completion_tokens",
    ),
    ("n string", CHAT, chat(n="2"), 400, "invalid_type", "n"),
    ("n zero", CHAT, chat(n=0), 400, "invalid_value", "n"),
    ("temperature string", CHAT, chat(temperature="hot"), 400, "invalid_type", "temperature"),
    ("stop number", CHAT, chat(stop=5), 400, "invalid_type", "stop"),
    ("stop list of numbers", CHAT, chat(stop=[1]), 400, "invalid_type", "stop"),
    ("user number", CHAT, chat(user=5), 400, "invalid_type", "user"),
    ("stream_options list", CHAT, chat(stream_options=[]), 400, "invalid_type", "stream_options"),
    ("logprobs int on chat", CHAT, chat(logprobs=1), 400, "invalid_type", "logprobs"),
    ("missing prompt", COMP, body(model="m"), 400, "missing_required_parameter", "prompt"),
    ("prompt number", COMP, body(model="m", prompt=5), 400, "invalid_type", "prompt"),
    ("prompt empty", COMP, body(model="m", prompt=""), 400, "invalid_value", "prompt"),
    ("prompt batch", COMP, body(model="m", prompt=["a", "b"]), 400, "invalid_value", "prompt"),
    ("prompt negative id", COMP, body(model="m", prompt=[1, -2]), 400, "invalid_type", "prompt"),
    ("echo not bool", COMP, comp(echo="no"), 400, "invalid_type", "echo"),
    ("best_of zero", COMP, comp(best_of=0), 400, "invalid_value", "best_of"),
    ("suffix number", COMP, comp(suffix=1), 400, "invalid_type", "suffix"),
    ("unknown path", "/v1/embeddings", chat(), 404, "unknown_url", None),
]


@pytest.mark.parametrize(
    "path,data,status,code,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD]
)
def test_bad_input(path: str, data: bytes, status: int, code: str, param: str | None) -> None:
    with pytest.raises(RequestError) as info:
        parse_request(path, data, {}, LIMITS)
    e = info.value
    assert (e.status, e.code, e.param) == (status, code, param), e
    err = json.loads(e.to_openai_json())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["code"] == code and err["message"]
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_body_over_limit_is_413() -> None:
    with pytest.raises(RequestError) as info:
        parse_request(CHAT, chat(), {}, ParseLimits(max_body_bytes=10))
    assert info.value.status == 413 and info.value.code == "body_too_large"


def test_long_session_header_is_refused() -> None:
    with pytest.raises(RequestError) as info:
        parse_request(CHAT, chat(), {"X-Session-Id": "s" * 300}, LIMITS)
    assert info.value.param == "X-Session-Id"


def test_chat_features() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    raw = body(model="m", messages=MSGS, tools=tools, stream=True, max_tokens=7, user="alice")
    p = parse_request(CHAT, raw, {}, LIMITS)
    assert (p.kind, p.model, p.stream, p.max_tokens, p.session) == ("chat", "m", True, 7, "alice")
    assert p.body is raw
    assert p.json["tools"] == tools
    assert p.rendered == render_chat(MSGS, tools)
    assert p.keys == compute_keys(p.rendered, key_seed("m"))
    assert p.prompt_tokens == len(p.rendered.text)


def test_a_salted_request_keys_its_text_by_its_salt() -> None:
    """Text-keyed pools: a `cache_salt` request shares no key with unsalted requests or
    other salts (engines share no KV across salts); same salt, same keys; an unsalted or
    null-salted request keeps the keys it always had."""
    long = [{"role": "user", "content": "a long shared prompt " * 40}]

    def keys(path: str, **extra: Any) -> Any:
        fields = {"messages": long} if path == CHAT else {"prompt": "p" * 900}
        return parse_request(path, body(model="m", **fields, **extra), {}, LIMITS).keys

    for path in (CHAT, COMP):
        plain, a, a2, b = (
            keys(path),
            keys(path, cache_salt="a"),
            keys(path, cache_salt="a"),
            (keys(path, cache_salt="b")),
        )
        assert keys(path, cache_salt=None) == plain
        rendered = render_chat(long) if path == CHAT else render_completion("p" * 900)
        assert plain == compute_keys(rendered, key_seed("m"))
        assert a == a2 and len(a.blocks) == len(plain.blocks) >= 3
        for x, y in ((plain, a), (plain, b), (a, b)):
            assert not set(x.blocks) & set(y.blocks)
            assert not {k for _, k in x.boundaries} & {k for _, k in y.boundaries}


def test_completion_features_and_nulls_mean_unset() -> None:
    raw = body(model="m", prompt=[1, 2, 3], stream=None, max_tokens=None, n=None, stop=None)
    p = parse_request(COMP + "?x=1", raw, {}, LIMITS)
    assert (p.kind, p.stream, p.max_tokens, p.session) == ("completion", False, None, None)
    assert p.rendered == render_completion([1, 2, 3])


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    p = parse_request(CHAT, chat(max_tokens=9, max_completion_tokens=4), {}, LIMITS)
    assert p.max_tokens == 4


def test_session_rule_header_then_user_then_none() -> None:
    assert parse_request(CHAT, chat(user="u"), {"x-session-id": " s1 "}, LIMITS).session == "s1"
    assert parse_request(CHAT, chat(user="u"), {"X-Session-Id": ""}, LIMITS).session == "u"
    assert parse_request(CHAT, chat(user=""), {}, LIMITS).session is None
    assert parse_request(CHAT, chat(), {}, LIMITS).session is None
    assert parse_request(CHAT, chat(user="u" * 300), {}, LIMITS).session is None


def test_session_from_a_server_s_multidict_headers() -> None:
    """The servers pass a CIMultiDictProxy: any case, the first non-empty of repeats."""
    raw = CIMultiDict([("X-SESSION-ID", "  "), ("Host", "h"), ("x-session-id", " s2 ")])
    heads = CIMultiDictProxy(raw)
    assert parse_request(CHAT, chat(user="u"), heads, LIMITS).session == "s2"
    empty = CIMultiDictProxy(CIMultiDict([("x-Session-Id", "")]))
    assert parse_request(CHAT, chat(user="u"), empty, LIMITS).session == "u"
    long = CIMultiDictProxy(CIMultiDict([("X-Session-Id", "s" * 300)]))
    with pytest.raises(RequestError) as e:
        parse_request(CHAT, chat(), long, LIMITS)
    assert e.value.param == "X-Session-Id"


def test_nesting_is_checked_whatever_the_brackets_in_strings() -> None:
    """Brackets inside strings count toward the small-body shortcut but never nest: a
    body with 200 of them in a string passes; 70 real levels fail, small or large."""
    text = "[{" * 100
    msgs = [{"role": "user", "content": text}]
    assert parse_request(CHAT, body(model="m", messages=msgs), {}, LIMITS)
    deep = json.loads("[" * 70 + "]" * 70)
    for pad in ("", "p" * 70_000):  # under and over the shortcut's body size
        bad = body(model="m", messages=[{"role": "user", "content": pad or "x"}], x=deep)
        with pytest.raises(RequestError) as e:
            parse_request(CHAT, bad, {}, LIMITS)
        assert e.value.code == "nesting_too_deep"
    ok = json.loads("[" * 62 + "]" * 62)  # root object + x + 62 arrays = 64 levels
    assert parse_request(CHAT, body(model="m", messages=MSGS, x=ok), {}, LIMITS)


def test_bytes_per_token_estimates() -> None:
    big = body(model="m", messages=[{"role": "user", "content": "z" * 3000}])
    p1 = parse_request(CHAT, big, {}, LIMITS)
    p4 = parse_request(CHAT, big, {}, ParseLimits(bytes_per_token=4.0))
    n = len(p1.rendered.text)
    assert p1.prompt_tokens == n and p4.prompt_tokens == -(-n // 4)
    v1, v4 = to_request_view(p1, "r1"), to_request_view(p4, "r4")
    assert list(v1.block_tokens) == [256] * (n // 256)
    assert list(v4.block_tokens) == [64] * (n // 256)
    assert v4.boundary_keys[-1] == (p4.prompt_tokens, p4.keys.boundaries[-1][1])
    assert list(v1.boundary_keys) == list(p1.keys.boundaries)
    assert v1.block_keys == p1.keys.blocks and v1.request_id == "r1" and v1.model == "m"
    odd = ParseLimits(bytes_per_token=3.3)
    v = to_request_view(parse_request(CHAT, big, {}, odd), "r")
    assert sum(v.block_tokens) == token_offset(256 * (n // 256), 3.3) <= v.prompt_tokens


def test_request_view_carries_session_and_max_tokens() -> None:
    v = to_request_view(parse_request(CHAT, chat(user="u", max_tokens=5), {}, LIMITS), "id")
    assert (v.session, v.max_output_tokens) == ("u", 5)


def test_parse_limits_validate() -> None:
    for bad in (
        {"max_body_bytes": 0},
        {"max_depth": 0},
        {"bytes_per_token": 0.0},
        {"bytes_per_token": float("nan")},
    ):
        with pytest.raises(ValueError):
            ParseLimits(**bad)


def test_unicode_prompt_round_trips() -> None:
    raw = body(model="m", messages=[{"role": "user", "content": "日本語 🦀 <|end|>"}])
    p = parse_request(CHAT, raw, {}, LIMITS)
    assert "日本語 🦀 <||>end|>".encode() in p.rendered.text


def test_error_json_is_utf8_and_escapes() -> None:
    e = RequestError(400, "invalid_request_error", "c", 'bad "é"', "p")
    assert json.loads(e.to_openai_json().decode("utf-8"))["error"]["message"] == 'bad "é"'


def test_several_bad_fields_name_the_first_in_the_field_table() -> None:
    """A body with several bad fields is refused for the first in the table's order
    (common fields, then the route's), whatever the body's key order: the check that
    visits only a small body's keys hands the error to the table-order check."""
    for data in (
        body(n=0, top_logprobs=-1, max_tokens="x", model="m", messages=MSGS),
        body(top_logprobs=-1, model="m", messages=MSGS, n=0),
    ):
        with pytest.raises(RequestError) as e:
            parse_request(CHAT, data, {}, LIMITS)
        assert e.value.param == ("max_tokens" if b"max_tokens" in data else "n")
    with pytest.raises(RequestError) as e:
        parse_request(CHAT, body(top_logprobs=-1, model="m", messages=MSGS), {}, LIMITS)
    assert (e.value.param, e.value.code) == ("top_logprobs", "invalid_value")
