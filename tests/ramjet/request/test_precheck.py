"""`Prechecker`: a large body's counts from a child process, the body sent over a socket
(no pickle), one exchange at a time."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
from pathlib import Path

from ramjet.request.precheck import (
    CHILD_NICENESS,
    BodyCounts,
    CountLimits,
    Prechecker,
    body_counts,
    values_bound,
)

LIMITS = CountLimits(1 << 30, 1 << 30, 1 << 30, 1 << 30)


def _chat(messages: int, parts: int) -> bytes:
    content = [{"type": "text", "text": "w"}] * parts
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": content}] * messages}
    ).encode()


def test_values_bound_is_an_upper_bound_and_skips_text() -> None:
    body = json.dumps({"m": [1, [2, 3], {"a": "x, y, z", "b": []}], "n": None}).encode()
    # values: the root, "m", 1, [2, 3], 2, 3, {...}, "x, y, z", [], "n" = 10
    assert 10 <= values_bound(body, 1 << 30) == body.count(b",") + 2 * 5 + 1
    tight = values_bound(body, 1)  # over the limit: the commas in text no longer count
    assert 10 <= tight < values_bound(body, 1 << 30)
    many = json.dumps({"metadata": [7] * 100_000}).encode()
    assert values_bound(many, 1000) >= 100_000
    assert body_counts(many, CountLimits(10, 10, 10, 1000)).values >= 100_000
    assert body_counts(many).values == 0  # not asked for
    # another count over its limit already: the values are not bounded (cheaper)
    msgs = _chat(20, 1)
    assert body_counts(msgs, CountLimits(10, 10, 10, 1)).values == 0
    assert body_counts(msgs, CountLimits(20, 20, 10, 1)).values > 20


def test_values_bound_of_a_json_text_within_its_limit_by_length() -> None:
    # JSON (`valid`): len + 1 bounds the count outside strings, so no pass is needed;
    # past that, the same figure as without it (the verdict never changes)
    body = json.dumps({"m": [[], [], {"a": "[[[, , ,"}], "n": [1] * 50}).encode()
    assert values_bound(body, len(body) + 1, valid=True) == len(body) + 1
    assert values_bound(body, len(body) + 1) == body.count(b",") + 2 * (body.count(b"[") + 2) + 1
    for limit in (1, 60, len(body)):
        assert values_bound(body, limit, valid=True) == values_bound(body, limit)
    assert body_counts(body, CountLimits(1, 1, 1, len(body) + 1)).values == len(body) + 1


def test_body_counts_of_every_shape() -> None:
    assert body_counts(_chat(3, 2)) == BodyCounts(3, 6, 0)
    assert body_counts(b'{"prompt": [[1, 2, 3]]}') == BodyCounts(0, 0, 4)
    assert body_counts(b'{"prompt": ["a", "b", [1, 2]]}') == BodyCounts(0, 0, 5)
    assert body_counts(b'{"prompt": "text"}') == BodyCounts(0, 0, 0)
    # shapes the typed decode refuses are decoded whole and counted the same way
    odd = b'{"messages": [{"content": 5}, {"content": [1, 2]}, 3], "prompt": [1.5, [2]]}'
    assert body_counts(odd) == BodyCounts(3, 2, 3)
    bad = body_counts(b'{"messages": [')
    assert bad.error.startswith("request body is not valid JSON")
    assert "UTF-8" in body_counts(b'"\xff"').error


async def test_counts_in_the_child_survive_a_cancelled_caller_and_a_dead_child() -> None:
    pre = Prechecker()
    try:
        big = _chat(200_000, 1)  # several MB: its exchange takes a while
        small = _chat(2, 3)
        assert (await pre.count(small, LIMITS))[:4] == (2, 6, 0, "")
        # A caller cancelled while its body is with the child: the next caller still
        # gets its own counts (the exchange finished on the worker thread first).
        first = asyncio.ensure_future(pre.count(big, LIMITS))
        await asyncio.sleep(0.01)
        first.cancel()
        assert (await pre.count(small, LIMITS))[:4] == (2, 6, 0, "")
        assert (await pre.count(big, LIMITS))[:4] == (200_000, 200_000, 0, "")
        assert (await pre.count(b"{nope", LIMITS)).error
        assert pre.started == 1
        child = pre._child
        assert child is not None and child.proc.pid is not None
        os.kill(child.proc.pid, signal.SIGKILL)
        child.proc.join(5)
        assert (await pre.count(small, LIMITS))[:4] == (2, 6, 0, "")  # a new child
        assert pre.started == 2
    finally:
        pre.close()


async def test_the_child_runs_at_a_lower_cpu_priority() -> None:
    pre = Prechecker()
    try:
        assert (await pre.count(b"{}", LIMITS))[:4] == (0, 0, 0, "")
        child = pre._child
        assert child is not None and child.proc.pid is not None
        stat = Path(f"/proc/{child.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        assert int(stat[16]) == min(19, os.nice(0) + CHILD_NICENESS)  # field 19: nice
    finally:
        pre.close()


async def test_start_readies_the_child_before_the_first_body() -> None:
    pre = Prechecker()
    try:
        pre.start()
        for _ in range(200):
            if pre.started:
                break
            await asyncio.sleep(0.05)
        assert pre.started == 1 and pre._child is not None
        assert (await pre.count(_chat(2, 1), LIMITS))[:4] == (2, 2, 0, "")
        assert pre.started == 1  # no second child
    finally:
        pre.close()


async def test_a_child_started_as_the_prechecker_closes_is_not_left_running() -> None:
    pre = Prechecker()
    pre.start()
    pre.close()  # while the worker thread may still be starting the child
    await asyncio.sleep(0)
    for _ in range(100):
        child = pre._child
        if child is None and not pre._lock.locked():
            break
        await asyncio.sleep(0.05)
    assert pre._child is None
    for p in multiprocessing.active_children():
        assert p.name != "ramjet-count", "a counting child outlived its prechecker"
