"""Priority hints: the key, the engine conventions, the body splice and the policy
file's `priority:` section (`ramjet.app.priority`, `ramjet.config.PriorityConfig`)."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry

from ramjet.app.modes import canary_share_of
from ramjet.app.priority import (
    CLASS_STRIDE,
    PriorityHint,
    PriorityHints,
    hint_key_ms,
    priority_value,
    with_priority,
)
from ramjet.config import PolicyFileError, parse_policy
from ramjet.policy.base import EngineLoad, EngineView, KeyedQueue
from ramjet.policy.priority_key import hint_key_s
from ramjet.types import EngineId


def test_key_is_integer_ms_of_work_plus_aged_arrival() -> None:
    assert hint_key_ms(1.2346, 0.5, 1_800_000_000.0) == 900_000_001_235
    assert hint_key_ms(0.25, 0.0, 1_800_000_000.0) == 250
    # negative work (never predicted, but defensive) is clipped to zero
    assert hint_key_ms(-1.0, 0.0, 5.0) == 0
    # two replicas with the same arrival time compute the same key
    assert hint_key_ms(0.1, 0.5, 1e9 + 0.1234) == hint_key_ms(0.1, 0.5, 1e9 + 0.1234)


def test_least_work_first_with_aging_order() -> None:
    # a long prompt (10 s) that arrived 30 s before a 0.5 s one goes first at aging 0.5:
    # it was forgiven 15 s of work
    t = 1_800_000_000.0
    long_old = hint_key_ms(10.0, 0.5, t)
    short_new = hint_key_ms(0.5, 0.5, t + 30)
    assert long_old < short_new
    # ... but not if it arrived only 10 s before (forgiven 5 s < 9.5 s difference)
    assert hint_key_ms(10.0, 0.5, t) > hint_key_ms(0.5, 0.5, t + 10)


def test_a_horizon_caps_how_long_later_arrivals_overtake() -> None:
    t = 1_800_000_000.0
    # without a horizon a 10 s prompt at aging 0.1 is overtaken by a 0.5 s one that
    # arrives up to 95 s later; with a 20 s horizon (work capped at 2 s) only up to 15 s
    assert hint_key_ms(10.0, 0.1, t) > hint_key_ms(0.5, 0.1, t + 60)
    assert hint_key_ms(10.0, 0.1, t, 20.0) < hint_key_ms(0.5, 0.1, t + 16, 20.0)
    assert hint_key_ms(10.0, 0.1, t, 20.0) > hint_key_ms(0.5, 0.1, t + 14, 20.0)
    # work under the cap is unchanged: same key as without a horizon
    assert hint_key_ms(1.5, 0.1, t, 20.0) == hint_key_ms(1.5, 0.1, t)
    # work over the cap keeps arrival order among such requests
    assert hint_key_ms(9.0, 0.1, t, 20.0) < hint_key_ms(3.0, 0.1, t + 0.01, 20.0)


def test_conventions_and_client_classes() -> None:
    assert priority_value(1234, "vllm", None) == 1234
    assert priority_value(1234, "reference", None) == 1234
    assert priority_value(1234, "sglang", None) == -1234
    # combine: a better client class (lower for vLLM, higher for SGLang) beats any key
    assert priority_value(10**14, "vllm", 0) < priority_value(1, "vllm", 1)
    assert priority_value(10**14, "sglang", 1) > priority_value(1, "sglang", 0)
    assert priority_value(5, "vllm", -2) == -2 * CLASS_STRIDE + 5
    # within a class the key decides
    assert priority_value(5, "vllm", 3) < priority_value(6, "vllm", 3)
    assert priority_value(5, "sglang", 3) > priority_value(6, "sglang", 3)


@pytest.mark.parametrize(
    "body",
    [
        b'{"model":"m","messages":[]}',
        b'  {\n "model" : "m",\t"x":[1, 2.50], "s":"caf\\u00e9 \xe2\x9c\x93"}  ',
        b"{}",
        b"{ }",
    ],
)
def test_insert_keeps_every_other_byte(body: bytes) -> None:
    out = with_priority(body, 42, replace=False)
    obj = json.loads(out)
    assert obj["priority"] == 42
    assert {k: v for k, v in obj.items() if k != "priority"} == json.loads(body)
    i = body.index(b"{") + 1
    inserted = b'"priority":42' + (b"" if body[i:].strip() == b"}" else b",")
    assert out == body[:i] + inserted + body[i:]


def test_replace_touches_only_the_top_level_value() -> None:
    body = (
        b'{"model":"m","messages":[{"role":"user","content":"\\"priority\\": 1",'
        b'"priority":7}], "priority" :  -3 , "tail":"\xe2\x9c\x93"}'
    )
    out = with_priority(body, 99, replace=True)
    assert out == body.replace(b":  -3 ,", b":  99 ,")
    assert json.loads(out)["messages"][0]["priority"] == 7
    # duplicate keys: the last one (the value a JSON reader keeps) is replaced
    dup = b'{"priority":1,"model":"m","priority":2}'
    assert with_priority(dup, 5, replace=True) == b'{"priority":1,"model":"m","priority":5}'


def _policy(priority: object) -> dict[str, object]:
    return {
        "engines": [
            {"id": "e0", "url": "http://127.0.0.1:1"},
            {"id": "e1", "url": "http://127.0.0.1:2"},
        ],
        "incumbent": {"name": "round_robin"},
        "priority": priority,
    }


def test_priority_section_defaults_and_values() -> None:
    cfg = parse_policy(_policy([{"name": "v", "engines": ["e0", "e1"]}]))
    [p] = cfg.priority
    assert (p.mode, p.convention, p.aging, p.horizon_s, p.client, p.share) == (
        "observe",
        "vllm",
        0.05,
        20.0,
        "keep",
        1.0,
    )
    # aging 0 (pure least-work-first) is accepted with the default horizon, which then
    # does not apply; `horizon_s: null` drops the cap
    [p] = parse_policy(_policy([{"name": "v", "engines": ["e0"], "aging": 0}])).priority
    assert hint_key_ms(9.0, p.aging, 1e9, p.horizon_s) == 9000
    [p] = parse_policy(_policy([{"name": "v", "engines": ["e0"], "horizon_s": None}])).priority
    assert p.horizon_s is None
    cfg = parse_policy(
        _policy(
            [
                {"name": "v", "engines": ["e0"], "mode": "on", "convention": "sglang"},
                {"name": "r", "engines": ["e1"], "mode": "off", "client": "combine"},
            ]
        )
    )
    assert [p.name for p in cfg.priority] == ["v", "r"]
    assert parse_policy(_policy([])).priority == ()


@pytest.mark.parametrize(
    ("priority", "where", "says"),
    [
        (
            [{"name": "v", "engines": ["e0"], "mode": "enforce"}],
            "priority[0].mode",
            "'off', 'observe' or 'on'",
        ),
        ([{"name": "v", "engines": ["e0"], "convention": "trt"}], "priority[0].convention", "vllm"),
        (
            [{"name": "v", "engines": ["e0"], "aging": -1}],
            "priority[0].aging",
            "greater than or equal",
        ),
        (
            [{"name": "v", "engines": ["e0"], "horizon_s": 0}],
            "priority[0].horizon_s",
            "greater than 0",
        ),
        (
            [{"name": "v", "engines": ["e0"], "aging": 0, "horizon_s": 10}],
            "priority[0]",
            "set aging > 0 or drop horizon_s",
        ),
        ([{"name": "v", "engines": ["e0"], "client": "drop"}], "priority[0].client", "keep"),
        (
            [{"name": "v", "engines": ["e0"], "share": 1.5}],
            "priority[0].share",
            "less than or equal",
        ),
        ([{"name": "v", "engines": []}], "priority[0].engines", "at least 1"),
        ([{"name": "v", "engines": ["e0"], "agin": 1}], "priority[0].agin", "Extra inputs"),
        ([{"name": "v", "engines": ["e9"]}], "", "engine 'e9' is not in engines"),
        (
            [{"name": "v", "engines": ["e0"]}, {"name": "w", "engines": ["e0"]}],
            "",
            "engine 'e0' is in priority pools 'v' and 'w'",
        ),
        (
            [{"name": "v", "engines": ["e0"]}, {"name": "v", "engines": ["e1"]}],
            "",
            "priority pool name 'v' is repeated",
        ),
    ],
)
def test_bad_priority_sections_name_the_field(priority: object, where: str, says: str) -> None:
    with pytest.raises(PolicyFileError) as info:
        parse_policy(_policy(priority), "p.yaml")
    [(path, msg)] = info.value.problems
    assert path == where and says in msg, (path, msg)


def test_routing_is_told_which_engines_serve_by_key() -> None:
    # e0 in a pool in mode on (vLLM: a started prefill is not preempted), e1 observed:
    # only e0's hinted requests, with their keys, reach the policy's `FleetStats.keyed`
    cfg = parse_policy(
        _policy(
            [
                {"name": "v", "engines": ["e0"], "mode": "on"},
                {"name": "o", "engines": ["e1"], "mode": "observe"},
            ]
        )
    )
    hints = PriorityHints(cfg.priority, CollectorRegistry())

    class _NoResidency:
        def global_match(self, keys: object, tokens: object) -> object:
            raise AssertionError("not read")

        def swa_match(self, keys: object) -> int:
            return 0

    def view(name: str, inflight_tokens: int) -> EngineView:
        load = EngineLoad(inflight_requests=1, inflight_prompt_tokens=inflight_tokens)
        return EngineView(EngineId(name), True, load, _NoResidency())  # type: ignore[arg-type]

    def hint(engine: str, outcome: str) -> PriorityHint:
        return PriorityHint("v", "on", outcome, engine, 0.3, 0, 0)

    hints.track(hint("e0", "sent"), "r1", 10.0, 700)
    hints.track(hint("e0", "canary_out"), "r2", 10.0, 900)  # not sent: not keyed
    hints.track(hint("e1", "sent"), "r3", 10.0, 500)  # not a pool in mode on
    keyed = hints.keyed([view("e0", 700), view("e1", 500)], "s1")
    key = hint_key_s(0.3, 0.05, 10.0, 20.0)
    assert keyed == {EngineId("e0"): KeyedQueue(0.05, 20.0, False, ((key, 700, False),))}
    hints.untrack(hint("e0", "sent"), "r1")
    assert hints.keyed([view("e0", 0)], "s1") == {EngineId("e0"): KeyedQueue(0.05, 20.0, False)}
    # keyed_wait false: the pool sends hints, but routing prices FCFS waits
    off = parse_policy(
        _policy([{"name": "v", "engines": ["e0"], "mode": "on", "keyed_wait": False}])
    )
    hints = PriorityHints(off.priority, CollectorRegistry())
    hints.track(hint("e0", "sent"), "r1", 10.0, 700)
    assert not hints.queues
    assert hints.keyed([view("e0", 700)], "s1") == {}
    # a session outside the pool's canary share gets no hint: FCFS waits for it
    canary = parse_policy(_policy([{"name": "v", "engines": ["e0"], "mode": "on", "share": 0.0}]))
    assert PriorityHints(canary.priority, CollectorRegistry()).keyed([view("e0", 0)], "s1") == {}


def test_keyed_engines_follow_each_pools_canary_share() -> None:
    # two pools in mode on, shares 0.3 and 0.8: a session whose canary hash lies between
    # them is keyed on the second pool's engine only; one below both on both; above, none
    cfg = parse_policy(
        _policy(
            [
                {"name": "a", "engines": ["e0"], "mode": "on", "share": 0.3},
                {"name": "b", "engines": ["e1"], "mode": "on", "share": 0.8},
            ]
        )
    )
    hints = PriorityHints(cfg.priority, CollectorRegistry())

    def view(name: str) -> EngineView:
        return EngineView(EngineId(name), True, EngineLoad(), None)  # type: ignore[arg-type]

    def session(lo: float, hi: float) -> str:
        return next(f"s{i}" for i in range(10_000) if lo <= canary_share_of(f"s{i}") < hi)

    views = [view("e0"), view("e1")]
    assert set(hints.keyed(views, session(0.0, 0.3))) == {EngineId("e0"), EngineId("e1")}
    assert set(hints.keyed(views, session(0.3, 0.8))) == {EngineId("e1")}
    assert hints.keyed(views, session(0.8, 1.0)) == {}
