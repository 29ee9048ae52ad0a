"""Decision records: usage parsing from a response tail (stream and not, cut, decoys),
the JSON line, the size-rotating log with its bounded queue, and the proxy's tail."""

from __future__ import annotations

import json
import math
import random
import struct
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from ramjet.decisions.log import (
    DecisionLog,
    RealizedWork,
    RotatingFile,
    _components,
    _round,
    decision_entry,
    find_usage,
    parse_realized,
    read_log,
)
from ramjet.decisions.record import DecisionRecord
from ramjet.policy.base import Decision
from ramjet.proxy.exchange import Attempt, ResponseTail
from ramjet.types import EngineId

PW = {
    "hbm_tokens": 512,
    "host_tokens": 256,
    "ssd_tokens": 0,
    "swa_tokens": 3,
    "replayed_tokens": 16,
    "prefilled_tokens": 40,
    "queue_ms": 12.5,
    "restore_ms": 1.25,
    "restore_io_ms": 0.5,
    "prefill_ms": 30.0,
    "epoch": 2,
}


def usage(pw: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "prompt_tokens": 811,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 771},
        "prompt_work": PW if pw is None else pw,
    }


def body(content: str = "hi") -> bytes:
    return json.dumps(
        {"id": "x", "choices": [{"message": {"content": content}}], "usage": usage()}
    ).encode()


def sse(content: str = "hi") -> bytes:
    chunks = [{"choices": [{"delta": {"content": c}}]} for c in content]
    chunks.append({"choices": [{"delta": {}, "finish_reason": "stop"}], "usage": usage()})
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + (
        b"data: [DONE]\n\n"
    )


def test_usage_parsed_from_non_stream_body_and_sse_tail() -> None:
    for raw in (body(), sse()):
        r = parse_realized(raw)
        assert r is not None
        assert r.hbm_tokens == 512 and r.host_tokens == 256 and r.swa_tokens == 3
        assert r.cached_tokens == 771 and r.prompt_tokens == 811 and r.epoch == 2
        assert r.engine_ttft_s == pytest.approx((12.5 + 1.25 + 30.0) / 1e3)


def test_usage_inside_content_is_not_mistaken_for_the_key() -> None:
    decoy = 'say "usage": {"prompt_work": {"hbm_tokens": 99999}}'
    r = parse_realized(body(decoy))
    assert r is not None and r.hbm_tokens == 512
    # content only, no usage key at all: nothing
    only = json.dumps({"choices": [{"message": {"content": decoy}}]}).encode()
    assert parse_realized(only) is None


def test_prompt_work_is_read_whichever_way_its_key_is_written() -> None:
    # `parse_realized` decodes nothing when the tail has neither the bytes `prompt_work`
    # nor a \\u escape; a key spelled with an escape is still read
    for raw in (body(), sse()):
        escaped = raw.replace(b'"prompt_work"', b'"prompt\\u005fwork"')
        assert b"prompt_work" not in escaped
        r = parse_realized(escaped)
        assert r is not None and r.hbm_tokens == 512 and r.prompt_tokens == 811
    plain = json.dumps({"usage": {"prompt_tokens": 3, "note": "a\u00e9b"}}).encode()
    assert b"\\u" in plain and parse_realized(plain) is None


def test_missing_cut_or_bad_usage_gives_none() -> None:
    assert parse_realized(b"") is None
    assert parse_realized(b'{"usage": {"prompt_tokens": 3}}') is None  # no prompt_work
    assert parse_realized(body()[:-30]) is None  # cut inside the usage object
    bad = json.dumps({"usage": usage({**PW, "hbm_tokens": -1})}).encode()
    assert parse_realized(bad) is None
    bad = json.dumps({"usage": usage({**PW, "queue_ms": "12"})}).encode()
    assert parse_realized(bad) is None
    assert find_usage(b'"usage" 12') is None  # no colon


def test_response_tail_keeps_the_last_bytes_without_growing() -> None:
    t = ResponseTail(limit=100)
    data = bytes(range(256)) * 40
    for i in range(0, len(data), 7):
        t.add(data[i : i + 7])
    assert t.bytes() == data[-100:]
    assert t._size < 100 + 7  # bounded: whole chunks, at most one chunk over
    small = ResponseTail(limit=100)
    small.add(b"abc")
    assert small.bytes() == b"abc"


def _record(rid: str = "r1", *, stream: bool = False, ttft: float | None = 0.2) -> DecisionRecord:
    e0, e1 = EngineId("e0"), EngineId("e1")
    cand = Decision(
        e1,
        "tier_aware",
        {e0: {"ttft_s": 0.5, "resume_tokens": 0.0}, e1: {"ttft_s": 0.125, "resume_tokens": 768}},
        ("default_profile:e0",),
    )
    inc = Decision(e0, "prefix_affinity")
    return DecisionRecord(
        request_id=rid,
        time_unix=1_700_000_000.5,
        model="m",
        session="s1",
        prompt_tokens=811,
        stream=stream,
        mode="observe",
        live_role="incumbent",
        live=inc,
        incumbent=inc,
        candidate=cand,
        candidate_error=None,
        candidate_s=0.0002,
        engine=e0,
        status=200,
        attempts=(Attempt(e0, 200),),
        ttft_s=ttft,
        duration_s=0.3,
        end="ok",
        response_tail=sse() if stream else body(),
    )


def test_entry_holds_picks_predictions_and_realized() -> None:
    rec = _record()
    e = decision_entry(rec, parse_realized(rec.response_tail))
    assert json.loads(json.dumps(e)) == e
    assert e["id"] == "r1" and e["mode"] == "observe" and e["session"] == "s1"
    assert e["live"]["engine"] == "e0" and e["candidate"]["engine"] == "e1"
    assert e["candidate"]["notes"] == ["default_profile:e0"]
    assert e["predicted"]["e1"]["ttft_s"] == 0.125
    assert e["realized"]["cached_tokens"] == 771
    # non-stream: the engine's own first-token time; stream: the router's
    assert e["ttft_source"] == "engine" and e["realized_ttft_s"] == pytest.approx(0.04375)
    s = decision_entry(_record(stream=True), None)
    assert s["ttft_source"] == "router" and s["realized_ttft_s"] == 0.2
    assert decision_entry(_record(ttft=None), None)["realized_ttft_s"] is None


def _old_round(v: float) -> float:
    """The line's rounding before the fast paths (commit 6d46593), kept as the reference."""
    if type(v) is float and -1e6 < v < 1e6 and v.is_integer():
        return v
    return float(f"{v:.6g}")


def _figures(n: int, seed: int) -> list[Any]:
    """Edge cases, then random bit patterns (every exponent: subnormals, huge, tiny, inf,
    nan), then figures of the sizes a line holds (seconds, milliseconds, token counts),
    rounding ties and near-ties, and ints and bools (formatted into floats)."""
    rng = random.Random(seed)
    edge: list[Any] = [0.0, -0.0, 5e-324, -5e-324, 2.2250738585072014e-308, 1.7976931348623157e308]
    edge += [math.inf, -math.inf, math.nan, -math.nan, 1e6, -1e6, 999999.0, 999999.5, 1e6 - 1e-10]
    edge += [999999.4999999999, 9999995.0, 0.1, 0.5, 1.5, 2.5, 0.0000125, 1.234565, 1.2345650001]
    edge += [123456.5, 1234565.0, 1e22, 1e23, 1e-5, 1e-300, 3.0, 1e300, 12345678.0, -2.5e-7]
    edge += [0, 1, -3, 10**7, 2**53 + 1, 10**400 // 10**100, True, False]
    out = edge + [-v for v in edge if isinstance(v, float)]
    for _ in range(n):
        out.append(struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0])
        out.append(rng.uniform(-1, 1) * 10.0 ** rng.randint(-12, 12))
        out.append(float(rng.randint(0, 10**9)))
        digits = rng.randint(1, 999999)  # a 6-digit figure and a tie or near-tie after it
        tail = rng.choice([0.5, 0.49999999, 0.50000001, 0.25, 0.75])
        out.append((digits + tail) * 10.0 ** rng.randint(-10, 10))
    return out


def test_rounding_writes_the_same_bytes_as_the_old_formatting() -> None:
    figures = _figures(40_000, seed=19)
    enc = msgspec.json.Encoder()
    for v in figures:  # nan and inf are written as null, as before
        assert enc.encode(_round(v)) == enc.encode(_old_round(v)), v
    # the per-line path: dicts of figures, repeats and equal numbers of another type
    # (1e7 and 10**7, 1.0 and True) through one shared memo, -0.0 next to 0.0
    rng = random.Random(7)
    pool = [*figures[:200], 0.0, -0.0, 1e7, 10**7, 1.0, True, 0, 0.125, 0.125, -0.0]
    for _ in range(2000):
        comps = {
            EngineId(f"e{i}"): {f"k{j}": rng.choice(pool) for j in range(rng.randint(0, 20))}
            for i in range(rng.randint(0, 3))
        }
        d = Decision(EngineId("e0"), "p", components=comps)
        old = {e: {k: _old_round(v) for k, v in c.items()} for e, c in comps.items()}
        assert enc.encode(_components(d, {})) == enc.encode(old)
    assert _components(None, {}) == {}


def test_rotating_file_rotates_and_keeps_n_backups(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    f = RotatingFile(path, max_bytes=100, backups=2)
    line = b"x" * 39 + b"\n"  # 40 bytes: two lines per file
    for _ in range(9):
        f.write(line)
    f.close()
    assert f.rotations == 4
    assert path.stat().st_size == 40  # the 9th line starts a fresh file
    assert (tmp_path / "d.jsonl.1").stat().st_size == 80
    assert (tmp_path / "d.jsonl.2").stat().st_size == 80
    assert not (tmp_path / "d.jsonl.3").exists()
    with pytest.raises(ValueError):
        RotatingFile(path, max_bytes=0, backups=1)
    g = RotatingFile(tmp_path / "t.jsonl", max_bytes=50, backups=0)
    for _ in range(3):
        g.write(line)
    g.close()
    assert (tmp_path / "t.jsonl").stat().st_size == 40 and g.rotations == 2


def test_log_writes_lines_and_rotates(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    counts = {"w": 0, "r": 0}
    lg = DecisionLog(
        path,
        max_bytes=8192,
        backups=3,
        on_written=lambda n: counts.__setitem__("w", counts["w"] + n),
        on_rotated=lambda: counts.__setitem__("r", counts["r"] + 1),
    )
    for i in range(20):
        rec = _record(f"r{i}")
        assert lg.submit(rec, parse_realized(rec.response_tail))
    assert lg.flush(5.0)
    lg.close()
    assert counts["w"] == 20 and counts["r"] >= 1
    files = sorted(tmp_path.glob("d.jsonl*"))
    ids = {e["id"] for f in files for e in read_log(f)}
    assert ids == {f"r{i}" for i in range(20)}
    assert all(f.stat().st_size <= 8192 for f in files)


def test_full_queue_drops_and_counts_without_blocking(tmp_path: Path) -> None:
    gate = threading.Event()
    dropped: list[int] = []

    def slow(n: int) -> None:  # the writer thread waits here after its first batch
        gate.wait(5.0)

    lg = DecisionLog(
        tmp_path / "d.jsonl", queue_size=2, on_dropped=lambda: dropped.append(1), on_written=slow
    )
    results = [lg.submit(_record(f"r{i}"), None) for i in range(10)]
    # the writer holds at most one batch, the queue two: the rest are dropped at once
    assert results.count(False) >= 7 and len(dropped) == results.count(False)
    assert lg.dropped == len(dropped)
    gate.set()
    lg.close()
    written = read_log(tmp_path / "d.jsonl")
    assert len(written) == results.count(True)


def test_writer_batches_records_instead_of_waking_per_record(tmp_path: Path) -> None:
    """`submit` wakes no thread: records wait for the writer's next `batch_s` tick (or a
    `flush`), and go out as one batch."""
    path = tmp_path / "d.jsonl"
    batches: list[int] = []
    lg = DecisionLog(path, batch_s=30.0, on_written=batches.append)
    for i in range(5):
        assert lg.submit(_record(f"r{i}"), None)
    time.sleep(0.2)
    assert batches == [] and path.read_bytes() == b""  # not written per record
    assert lg.flush(5.0)
    assert batches == [5]
    assert [e["id"] for e in read_log(path)] == [f"r{i}" for i in range(5)]
    lg.close()


def test_writer_writes_on_its_own_within_batch_s(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    lg = DecisionLog(path, batch_s=0.02)
    try:
        assert lg.submit(_record("r0"), None)
        deadline = time.monotonic() + 5.0
        while not path.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [e["id"] for e in read_log(path)] == ["r0"]
    finally:
        lg.close()
    with pytest.raises(ValueError, match="batch_s"):
        DecisionLog(tmp_path / "e.jsonl", batch_s=0.0)


def test_read_log_skips_torn_and_foreign_lines(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    good = json.dumps(decision_entry(_record(), RealizedWork()))
    p.write_text(good + "\n" + '{"v": 99}\n' + good[:20])
    assert [e["id"] for e in read_log(p)] == ["r1"]
