"""Priority hints end to end through a real router to real upstreams on loopback that
record every byte they receive (`tests/helpers/fake_upstream.py`): observe mode changes
no byte of any request, on mode inserts exactly `"priority":N,` and nothing else, the
client's own priority is kept / overridden / combined, canary by session, SGLang's
convention, and the hint in the decision log and `ramjet explain`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import aiohttp
from fake_upstream import FakeUpstream
from router_rig import Records, RouterFactory

from ramjet.app.modes import canary_share_of
from ramjet.app.priority import CLASS_STRIDE, hint_key_ms
from ramjet.commands.explain import explain
from ramjet.decisions.log import read_log

POOL = {"name": "fleet", "engines": ["e0", "e1"]}
TRUSTED = {"priority_trusted_networks": ["127.0.0.1/32"]}
"""These tests' client (loopback) is trusted with its own `priority`; untrusted clients'
is removed (`test_untrusted_client_priority_is_removed_by_default`)."""

BODIES: list[bytes] = [
    b'{"model":"m","messages":[{"role":"user","content":"hi"}]}',
    b'{ "messages":[{"role":"user","content":"caf\\u00e9 \xe2\x9c\x93"}],\n "model" : "m",'
    b' "x_extra": [1, 2.50]}',
    b'{"model":"m","stream":true,"messages":[{"role":"user","content":"' + b"y" * 3000 + b'"}]}',
    b'{"priority": 3, "model":"m","messages":[{"role":"user","content":"with own priority"}]}',
    b'\n  {"model":"m","messages":[{"role":"system","content":"s"},'
    b'{"role":"user","content":"\\"priority\\": 5"}], "user": "u-1"}\n',
]


async def _post(url: str, body: bytes, session: str | None = None) -> int:
    headers = {"Content-Type": "application/json"}
    if session is not None:
        headers["X-Session-Id"] = session
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/chat/completions", data=body, headers=headers) as r,
    ):
        await r.read()
        return r.status


def _received(upstreams: list[FakeUpstream]) -> list[bytes]:
    return [r.body for u in upstreams for r in u.generation_requests()]


def _without_insert(sent: bytes, got: bytes, value: int) -> bytes:
    """`got` with the one inserted `"priority":value,` taken out (asserts it is there)."""
    ins = b'"priority":' + str(value).encode()
    i = got.index(ins)
    rest = got[i + len(ins) :]
    return got[:i] + (rest[1:] if rest.startswith(b",") else rest)


async def test_observe_mode_changes_no_byte_and_logs_the_would_be_hint(
    upstreams: list[FakeUpstream], make_router: RouterFactory, tmp_path: Path
) -> None:
    log_path = tmp_path / "decisions.jsonl"
    sink = Records()
    router = await make_router(
        limits=TRUSTED,
        sink=sink,
        priority=[{**POOL, "mode": "observe", "client": "override"}],
        logging={"decisions_path": str(log_path)},
    )
    for body in BODIES:
        assert await _post(router.url, body) == 200
    got = _received(upstreams)
    assert sorted(got) == sorted(BODIES)  # byte for byte, every one
    assert all(b"priority" not in g or g in (BODIES[3], BODIES[4]) for g in got)
    hints = [r.priority for r in sink.records]
    assert all(h is not None and h["outcome"] == "observe" and not h["sent"] for h in hints)
    assert all(h is not None and isinstance(h["value"], int) and h["work_s"] > 0 for h in hints)
    m = (await _metrics(router.url)).get(
        'ramjet_priority_hints_total{outcome="observe",pool="fleet"}'
    )
    assert m == len(BODIES)
    assert router.router.accounting.log is not None
    assert router.router.accounting.log.flush()
    lines = read_log(log_path)
    assert [ln["priority"]["outcome"] for ln in lines] == ["observe"] * len(BODIES)
    text = explain(lines[0])
    assert "priority (fleet, observe): not sent (observe): value" in text
    assert f"key {lines[0]['priority']['key_ms']} ms" in text


async def test_on_mode_inserts_the_key_and_nothing_else(
    upstreams: list[FakeUpstream], make_router: RouterFactory
) -> None:
    sink = Records()
    router = await make_router(
        limits=TRUSTED, sink=sink, priority=[{**POOL, "mode": "on", "aging": 0.5}]
    )
    short = BODIES[0]
    long = b'{"model":"m","messages":[{"role":"user","content":"' + b"z" * 40000 + b'"}]}'
    t_before = time.time()
    for body in (short, long):
        assert await _post(router.url, body) == 200
    t_after = time.time()
    got = _received(upstreams)
    by_len = sorted(got, key=len)
    recs = sorted(sink.records, key=lambda r: r.prompt_tokens)
    for sent, seen, rec in zip((short, long), by_len, recs, strict=True):
        hint = rec.priority
        assert hint is not None and hint["outcome"] == "sent"
        assert json.loads(seen)["priority"] == hint["value"] == hint["key_ms"]
        assert seen.startswith(b'{"priority":%d,' % hint["value"])
        assert _without_insert(sent, seen, hint["value"]) == sent
        lo = hint_key_ms(hint["work_s"], 0.5, t_before) - 1
        hi = hint_key_ms(hint["work_s"], 0.5, t_after) + 1
        assert lo <= hint["key_ms"] <= hi
    assert recs[1].priority is not None and recs[0].priority is not None
    assert recs[1].priority["work_s"] > 10 * recs[0].priority["work_s"]  # 40k vs ~50 tokens


async def test_client_priority_keep_override_combine(
    upstreams: list[FakeUpstream], make_router: RouterFactory
) -> None:
    body = BODIES[3]  # "priority": 3
    results: dict[str, tuple[bytes, dict[str, Any]]] = {}
    for client in ("keep", "override", "combine"):
        for u in upstreams:
            u.requests.clear()
        sink = Records()
        router = await make_router(
            limits=TRUSTED, sink=sink, priority=[{**POOL, "mode": "on", "client": client}]
        )
        assert await _post(router.url, body) == 200
        [seen] = _received(upstreams)
        [rec] = sink.records
        assert rec.priority is not None
        results[client] = (seen, dict(rec.priority))
    seen, hint = results["keep"]
    assert seen == body and hint["outcome"] == "client_kept" and hint["client"] == 3
    seen, hint = results["override"]
    assert hint["outcome"] == "sent" and hint["value"] == hint["key_ms"]
    assert seen == body.replace(b'"priority": 3', b'"priority": %d' % hint["value"])
    seen, hint = results["combine"]
    assert hint["outcome"] == "sent" and hint["value"] == 3 * CLASS_STRIDE + hint["key_ms"]
    assert seen == body.replace(b'"priority": 3', b'"priority": %d' % hint["value"])
    # a client value that cannot be a class is left alone and said so
    for u in upstreams:
        u.requests.clear()
    sink = Records()
    router = await make_router(
        limits=TRUSTED, sink=sink, priority=[{**POOL, "mode": "on", "client": "combine"}]
    )
    odd = body.replace(b'"priority": 3', b'"priority": "high"')
    assert await _post(router.url, odd) == 200
    assert _received(upstreams) == [odd]
    assert sink.records[0].priority is not None
    assert sink.records[0].priority["outcome"] == "client_invalid"


async def test_canary_share_by_session_and_sglang_convention(
    upstreams: list[FakeUpstream], make_router: RouterFactory
) -> None:
    sink = Records()
    router = await make_router(
        limits=TRUSTED,
        sink=sink,
        priority=[{**POOL, "mode": "on", "share": 0.5, "convention": "sglang"}],
    )
    sessions = [f"s{i}" for i in range(16)]
    for s in sessions:
        for _ in range(2):
            assert await _post(router.url, BODIES[0], session=s) == 200
    outcomes: dict[str, set[str]] = {}
    for rec in sink.records:
        assert rec.priority is not None and rec.session is not None
        outcomes.setdefault(rec.session, set()).add(str(rec.priority["outcome"]))
        assert rec.priority["value"] == -rec.priority["key_ms"]  # SGLang: highest first
    for s in sessions:  # a session never flips, and follows routing's canary hash
        assert outcomes[s] == ({"sent"} if canary_share_of(s) < 0.5 else {"canary_out"})
    sent = sum(1 for s in sessions if canary_share_of(s) < 0.5)
    assert 0 < sent < len(sessions)
    got = _received(upstreams)
    assert sum(1 for g in got if g.startswith(b'{"priority":-')) == 2 * sent
    assert sum(1 for g in got if g == BODIES[0]) == 2 * (len(sessions) - sent)


async def test_engines_outside_every_pool_and_mode_off_get_nothing(
    upstreams: list[FakeUpstream], make_router: RouterFactory
) -> None:
    sink = Records()
    router = await make_router(
        limits=TRUSTED,
        sink=sink,
        priority=[
            {"name": "a", "engines": ["e0"], "mode": "off"},
        ],
    )
    for _ in range(4):
        assert await _post(router.url, BODIES[1]) == 200
    assert _received(upstreams) == [BODIES[1]] * 4
    assert all(r.priority is None for r in sink.records)


async def _metrics(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def test_untrusted_client_priority_is_removed_by_default(
    upstreams: list[FakeUpstream], make_router: RouterFactory
) -> None:
    """With no `limits.priority_trusted_networks`, a client's own `priority` reaches no
    engine, in a pool or not; trusting the client's network keeps it."""
    body = b'{"model":"m","priority": -100,"messages":[{"role":"user","content":"me first"}]}'
    stripped = b'{"model":"m","messages":[{"role":"user","content":"me first"}]}'
    for priority in ([], [{**POOL, "mode": "observe", "client": "keep"}]):
        for u in upstreams:
            u.requests.clear()
        router = await make_router(priority=priority)
        assert await _post(router.url, body) == 200
        assert _received(upstreams) == [stripped]
    for u in upstreams:
        u.requests.clear()
    router = await make_router(limits={"priority_trusted_networks": ["127.0.0.0/8"]})
    assert await _post(router.url, body) == 200
    assert _received(upstreams) == [body]
