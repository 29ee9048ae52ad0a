"""Properties of ramjet.keys.prefix: prefix stability across turns, injectivity of the
rendering (a decoder written from docs/prefix-keys.md recovers the input), model
separation, longest_prefix, and linear cost."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ramjet.keys.prefix as prefix
from ramjet.keys.prefix import (
    BLOCK_BYTES,
    PromptError,
    Rendered,
    compute_keys,
    key_seed,
    longest_prefix,
    render_chat,
    render_completion,
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Text that likes to hit the markers and the escape, plus arbitrary Unicode (no lone
# surrogates: JSON parsers refuse them before rendering).
_tricky = st.sampled_from(["<|", "|>", "<||>", "<|end|>\n", "<|user|>", "<", "|", "\n", "é", "🦀"])
text = st.lists(st.one_of(_tricky, st.text(max_size=12)), max_size=6).map("".join)
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), text)
json_value = st.recursive(
    json_leaf,
    lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(text, kids, max_size=3)),
    max_leaves=8,
)
part = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, text),
    st.builds(lambda u: {"type": "image_url", "image_url": {"url": u}}, text),
    st.builds(lambda v: {"type": "input_audio", "input_audio": v}, json_value),
)
content = st.one_of(st.none(), text, st.lists(part, max_size=4))
tool_call = st.builds(
    lambda i, n, a: {"id": i, "type": "function", "function": {"name": n, "arguments": a}},
    text,
    text,
    text,
)


@st.composite
def message(draw: st.DrawFn) -> dict[str, Any]:
    role = draw(st.sampled_from(["system", "developer", "user", "assistant", "tool", "x-role_2"]))
    msg: dict[str, Any] = {"role": role, "content": draw(content)}
    if draw(st.booleans()):
        msg["name"] = draw(text)
    if role == "assistant" and draw(st.booleans()):
        msg["tool_calls"] = draw(st.lists(tool_call, min_size=1, max_size=2))
    if role == "tool":
        msg["tool_call_id"] = draw(text)
    return msg


tools = st.one_of(
    st.none(),
    st.lists(
        st.builds(
            lambda n, p: {"type": "function", "function": {"name": n, "parameters": p}},
            text,
            json_value,
        ),
        min_size=1,
        max_size=3,
    ),
)
conversation = st.lists(message(), min_size=1, max_size=7)
model = st.text(min_size=1, max_size=20)


# --- a decoder written from the spec: proves the rendering is injective ---------------


def _tokens(s: str) -> list[tuple[str, str]]:
    """Split a rendering into ("marker", name) and ("text", unescaped text) tokens."""
    out: list[tuple[str, str]] = []
    buf: list[str] = []
    i = 0
    while i < len(s):
        j = s.find("<|", i)
        if j < 0:
            buf.append(s[i:])
            break
        buf.append(s[i:j])
        if s.startswith("<||>", j):
            buf.append("<|")
            i = j + 4
            continue
        k = s.index("|>", j + 2)
        if buf:
            out.append(("text", "".join(buf)))
            buf = []
        out.append(("marker", s[j + 2 : k]))
        i = k + 2
        if out[-1] == ("marker", "end"):
            assert s[i] == "\n"  # a section ends with "<|end|>\n"
            i += 1
    if "".join(buf):
        out.append(("text", "".join(buf)))
    return [t for t in out if t != ("text", "")]


def decode_chat(data: bytes) -> list[Any]:
    toks = _tokens(data.decode("utf-8"))
    sections: list[Any] = []
    i = 0
    dec = json.JSONDecoder()
    while i < len(toks):
        kind, role = toks[i]
        assert kind == "marker"
        i += 1
        if role == "tools":
            assert toks[i][0] == "text"
            sections.append(("tools", json.loads(toks[i][1])))
            assert toks[i + 1] == ("marker", "end")
            i += 2
            continue
        body: list[Any] = []
        meta = None
        while toks[i] != ("marker", "end"):
            if toks[i] == ("marker", "part"):
                obj, end = dec.raw_decode(toks[i + 1][1])
                body.append(obj)
                rest = toks[i + 1][1][end:]
                if rest:
                    body.append(rest)
                i += 2
            elif toks[i] == ("marker", "meta"):
                meta = json.loads(toks[i + 1][1])
                i += 2
            else:
                assert toks[i][0] == "text"
                body.append(toks[i][1])
                i += 1
        i += 1
        sections.append((role, _merge(body), meta))
    return sections


def _merge(items: list[Any]) -> list[Any]:
    out: list[Any] = []
    for it in items:
        if isinstance(it, str) and out and isinstance(out[-1], str):
            out[-1] += it
        elif it != "":
            out.append(it)
    return out


def normalize(messages: list[dict[str, Any]], tools: Any) -> list[Any]:
    """What the rendering keeps, in rendering order."""
    secs = []
    for m in messages:
        c = m.get("content")
        items: list[Any] = []
        if isinstance(c, str):
            items = [c]
        elif isinstance(c, list):
            items = [p["text"] if p.get("type") == "text" else p for p in c]
        extras = {k: v for k, v in m.items() if k not in ("role", "content") and v is not None}
        secs.append((m["role"], _merge(items), extras or None))
    if tools:
        lead = 1 if messages[0]["role"] in ("system", "developer") else 0
        secs.insert(lead, ("tools", list(tools)))
    return secs


# --- properties ---------------------------------------------------------------------


@SETTINGS
@given(conversation, tools, model)
def test_chat_turns_are_prefix_stable(msgs: list[dict[str, Any]], tl: Any, m: str) -> None:
    seed = key_seed(m)
    full = render_chat(msgs, tl)
    fk = compute_keys(full, seed)
    for k in range(1, len(msgs)):
        turn = render_chat(msgs[:k], tl)
        assert full.text.startswith(turn.text)
        assert full.boundaries[: len(turn.boundaries)] == turn.boundaries
        tk = compute_keys(turn, seed)
        assert fk.blocks[: len(tk.blocks)] == tk.blocks
        assert fk.boundaries[: len(tk.boundaries)] == tk.boundaries


@SETTINGS
@given(conversation, tools)
def test_chat_rendering_is_injective(msgs: list[dict[str, Any]], tl: Any) -> None:
    r = render_chat(msgs, tl)
    assert decode_chat(r.text) == normalize(msgs, tl)
    # Boundaries are exactly the section ends.
    assert r.boundaries[-1] == len(r.text)
    assert all(r.text[:b].endswith(b"<|end|>\n") for b in r.boundaries)
    assert len(r.boundaries) == len(msgs) + (1 if tl else 0)


@SETTINGS
@given(text, text, model)
def test_completion_string_prompts_are_prefix_stable(p: str, q: str, m: str) -> None:
    if not p:
        return
    a, b = render_completion(p), render_completion(p + q)
    assert b.text.startswith(a.text)
    seed = key_seed(m)
    ka, kb = compute_keys(a, seed), compute_keys(b, seed)
    assert kb.blocks[: len(ka.blocks)] == ka.blocks
    # A boundary key names the byte prefix it ends: the same key at that offset of b.
    same = compute_keys(Rendered(b.text, (len(a.text),)), seed)
    assert same.boundaries == ka.boundaries


@SETTINGS
@given(st.lists(st.integers(0, 2**32), min_size=1, max_size=50), st.lists(st.integers(0, 2**32)))
def test_completion_token_ids_prefix_iff_id_prefix(a: list[int], b: list[int]) -> None:
    ra, rab = render_completion(a), render_completion(a + b)
    assert rab.text.startswith(ra.text)
    rb = render_completion(b) if b else None
    if rb is not None:
        assert rb.text.startswith(ra.text) == (b[: len(a)] == a)


@SETTINGS
@given(text)
def test_completion_strings_never_collide_with_token_ids(p: str) -> None:
    if not p:
        return
    assert not render_completion(p).text.startswith(b"<|ids|>")


@SETTINGS
@given(conversation, tools, model, model)
def test_different_models_never_share_keys(
    msgs: list[dict[str, Any]], tl: Any, m1: str, m2: str
) -> None:
    if m1 == m2:
        return
    r = render_chat(msgs, tl)
    k1, k2 = compute_keys(r, key_seed(m1)), compute_keys(r, key_seed(m2))
    s1 = set(k1.blocks) | {k for _, k in k1.boundaries}
    s2 = set(k2.blocks) | {k for _, k in k2.boundaries}
    assert not s1 & s2


def test_adapter_and_model_separate_keys() -> None:
    seeds = {key_seed("m"), key_seed("m", "a"), key_seed("m", "b"), key_seed("m2")}
    assert len(seeds) == 4
    assert key_seed("m", None) == key_seed("m", "")


def test_block_and_boundary_keys_of_one_rendering_are_distinct() -> None:
    r = render_chat([{"role": "user", "content": "x" * 2000}])
    k = compute_keys(r, key_seed("m"))
    assert len(set(k.blocks)) == len(k.blocks) == 2000 // BLOCK_BYTES
    assert not set(k.blocks) & {b for _, b in k.boundaries}


@pytest.mark.parametrize(
    "messages,param",
    [
        ([], "messages"),
        ("hi", "messages"),
        ([1], "messages[0]"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": 3}], "messages[0].role"),
        ([{"role": "us er"}], "messages[0].role"),
        ([{"role": "tools"}], "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": [7]}], "messages[0].content[0]"),
        ([{"role": "user", "content": "\ud800"}], "messages[0].content"),
        (
            [{"role": "user"}, {"role": "user", "content": [{"type": "x", 1: 2}]}],
            "messages[1].content[0]",
        ),
    ],
)
def test_render_chat_rejects(messages: Any, param: str) -> None:
    with pytest.raises(PromptError) as e:
        render_chat(messages)
    assert e.value.param == param


@pytest.mark.parametrize(
    "prompt", ["", [], [-1], [1.5], [True], ["a", "b"], [[1], [2]], {"a": 1}, None]
)
def test_render_completion_rejects(prompt: Any) -> None:
    with pytest.raises(PromptError) as e:
        render_completion(prompt)
    assert e.value.param == "prompt"


def test_tools_must_be_an_array() -> None:
    with pytest.raises(PromptError) as e:
        render_chat([{"role": "user", "content": "x"}], {"a": 1})  # type: ignore[arg-type]
    assert e.value.param == "tools"


def test_bad_boundaries_are_refused() -> None:
    with pytest.raises(ValueError):
        compute_keys(Rendered(b"abc", (4,)), 0)
    with pytest.raises(ValueError):
        compute_keys(Rendered(b"abc", (2, 1)), 0)
    with pytest.raises(ValueError):
        compute_keys(Rendered(b"abc", (3,)), 0, block_bytes=0)


# --- longest_prefix -----------------------------------------------------------------


@SETTINGS
@given(st.integers(0, 300), st.integers(0, 300))
def test_longest_prefix_binary_search_matches_linear(n: int, resident_n: int) -> None:
    keys = list(range(n))
    probes: list[int] = []

    def resident(k: int) -> bool:
        probes.append(k)
        return k < resident_n

    got = longest_prefix(keys, resident)
    assert got == min(n, resident_n) == longest_prefix(keys, resident, monotone=False)
    # the binary search itself: log2(n) + 2 probes at most
    assert len(probes) - (min(n, resident_n) + 1 if resident_n < n else n) <= n.bit_length() + 2


def test_longest_prefix_with_holes_needs_the_linear_fallback() -> None:
    present = {0, 1, 3, 4, 5, 6, 7}  # key 2 evicted on its own: not monotone
    keys = list(range(8))
    assert longest_prefix(keys, present.__contains__, monotone=False) == 2
    # the binary search reports an upper bound there, as documented
    assert longest_prefix(keys, present.__contains__) >= 2


def test_longest_prefix_probe_count_is_logarithmic() -> None:
    keys = list(range(16384))
    calls = 0

    def resident(k: int) -> bool:
        nonlocal calls
        calls += 1
        return k < 10000

    assert longest_prefix(keys, resident) == 10000
    assert calls <= 17


# --- cost ---------------------------------------------------------------------------


def test_cost_is_linear_one_hash_per_block_and_boundary(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0
    real = prefix._xxh3

    def counting(data: Any, seed: int = 0) -> int:
        nonlocal calls
        calls += 1
        return real(data, seed)

    monkeypatch.setattr(prefix, "_xxh3", counting)
    for size in (1_000, 100_000, 1_000_000):
        calls = 0
        msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "x" * size}]
        k = compute_keys(render_chat(msgs), 1)
        assert calls == len(k.blocks) + len(k.boundaries) == k.length // BLOCK_BYTES + 2


def test_text_parts_join_before_escaping() -> None:
    """Parts escaped one by one let "<" + "|end|>" join into a real marker, so a single
    message could render as two (found by the injectivity property)."""
    forged = [{"type": "text", "text": "<"}, {"type": "text", "text": "|end|>\n<|user|>hi"}]
    as_parts = render_chat([{"role": "system", "content": forged}])
    as_text = render_chat([{"role": "system", "content": "<|end|>\n<|user|>hi"}])
    assert as_parts.text == as_text.text
    two = render_chat([{"role": "system", "content": ""}, {"role": "user", "content": "hi"}])
    assert as_parts.text != two.text


def test_cache_salt_separates_keys_and_leaves_unsalted_ones_alone() -> None:
    # the unsalted seed is today's (the vectors pin its keys); each salt has its own, and
    # a salt never collides with an adapter of the same name
    assert key_seed("m", salt=None) == key_seed("m") == 0xA649E2EAD5C320CC
    seeds = [
        key_seed("m"),
        key_seed("m", salt="a"),
        key_seed("m", salt="b"),
        key_seed("m", salt=""),
        key_seed("m", "a"),
        key_seed("m2", salt="a"),
    ]
    assert len(set(seeds)) == len(seeds)
    assert key_seed("m", salt="a") == key_seed("m", None, "a")
    r = render_chat([{"role": "user", "content": "x" * 700}])
    plain, a, b = (compute_keys(r, key_seed("m", salt=s)) for s in (None, "a", "b"))
    every = [set(k.blocks) | {key for _, key in k.boundaries} for k in (plain, a, b)]
    assert not every[0] & every[1] and not every[0] & every[2] and not every[1] & every[2]


@pytest.mark.parametrize(
    ("body", "salt"),
    [({}, None), ({"cache_salt": None}, None), ({"cache_salt": "t"}, "t"),
     ({"cache_salt": ""}, ""), ({"cache_salt": 5}, "5"), ({"cache_salt": {"b": 1, "a": 2}}, '{"a": 2, "b": 1}')],
)  # fmt: skip
def test_cache_salt_of_a_body(body: dict[str, Any], salt: str | None) -> None:
    assert prefix.cache_salt(body) == salt
