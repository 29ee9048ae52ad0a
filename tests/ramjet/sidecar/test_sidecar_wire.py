"""KV-event decoding: recorded messages (tests/vectors/kv_events.json) in both encodings
and both replay framings, a payload assembled byte by byte from the msgpack spec,
refusals of malformed batches, and tolerance: unknown fields and event types are ignored
and listed, a malformed event is dropped alone (with a resync point when it could have
removed blocks)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from ramjet.sidecar.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    WireError,
    decode_batch,
    encode_batch,
    parse_live,
    parse_replay,
)

VECTORS = json.loads(
    (Path(__file__).resolve().parents[2] / "vectors" / "kv_events.json").read_text("utf-8")
)


def _frames(case: dict[str, object]) -> list[bytes]:
    return [bytes.fromhex(h) for h in case["frames_hex"]]  # type: ignore[attr-defined]


def _check_events(events: tuple[object, ...]) -> None:
    a, b, h, c, d, e = events
    assert a == BlockStored(
        block_hashes=(11, 2**64 - 1),
        parent_block_hash=None,
        token_ids=(1, 2, 3, 4, 5, 6, 7, 8),
        block_size=4,
        medium="GPU",
        kv_cache_spec_kind="full_attention",
    )
    assert isinstance(b, BlockStored)
    assert b.block_hashes == (b"\x01" * 8,) and b.parent_block_hash == 2**64 - 1
    assert (b.lora_id, b.lora_name, b.group_idx, b.medium) == (3, "lora-a", 1, "CPU")
    assert b.kv_cache_spec_kind == "sliding_window" and b.extra_keys == (None,)
    assert b.kv_cache_spec_sliding_window == 128 and not b.hash_only
    # vLLM's OffloadingConnector shape: hash only, no tokens, block_size 0
    assert isinstance(h, BlockStored) and h.hash_only
    assert (h.block_hashes, h.token_ids, h.block_size, h.medium) == ((11,), (), 0, "CPU")
    assert c == BlockRemoved((11,), "GPU", 0)
    assert d == BlockRemoved((2**64 - 1,), "CPU_PINNED", 1)
    assert e == AllBlocksCleared()


@pytest.mark.parametrize("case", VECTORS["messages"], ids=lambda c: c["name"])
def test_recorded_messages_decode(case: dict[str, object]) -> None:
    frames = _frames(case)
    if case["kind"] == "live":
        msg = parse_live(frames)
        assert msg.topic == b"kv@v0"
    elif case["kind"] == "replay":
        msg = parse_replay(frames)
        assert msg is not None
        assert msg.topic == (b"kv@v0" if "with_topic" in str(case["name"]) else b"")
    else:
        assert parse_replay(frames) is None
        return
    assert msg.seq == 7
    assert msg.batch.ts == VECTORS["batch"]["ts"] and msg.batch.dp_rank == 0
    _check_events(msg.batch.events)
    # the encoder reproduces the recorded bytes exactly
    tagged = case["encoding"] == "tagged_map"
    assert encode_batch(msg.batch, tagged=tagged) == frames[-1]


def _fixstr(s: str) -> bytes:
    raw = s.encode()
    assert len(raw) < 32
    return bytes([0xA0 | len(raw)]) + raw


def test_hand_assembled_msgpack_both_encodings() -> None:
    """Bytes written from the msgpack spec, not by any encoder of ours."""
    ts = b"\xcb" + struct.pack(">d", 12.5)
    # tag-first array, trailing defaults omitted: ["BlockStored", [7], nil, [1,2], 2]
    arr = b"\x95" + _fixstr("BlockStored") + b"\x91\x07" + b"\xc0" + b"\x92\x01\x02" + b"\x02"
    # tagged map: {"type": "BlockRemoved", "block_hashes": [uint64 max], "medium": "CPU"}
    mp = (
        b"\x83"
        + _fixstr("type") + _fixstr("BlockRemoved")
        + _fixstr("block_hashes") + b"\x91\xcf" + b"\xff" * 8
        + _fixstr("medium") + _fixstr("CPU")
    )  # fmt: skip
    payload = b"\x93" + ts + b"\x92" + arr + mp + b"\xc0"
    batch = decode_batch(payload)
    assert batch.ts == 12.5 and batch.dp_rank is None
    assert batch.events == (
        BlockStored((7,), None, (1, 2), 2),
        BlockRemoved((2**64 - 1,), "CPU", 0),
    )


def test_hand_assembled_vllm_map_batch_with_window_and_hash_only_store() -> None:
    """vLLM's current shapes (vllm/distributed/kv_events.py): the batch is a map, a store
    carries `kv_cache_spec_sliding_window`, and the OffloadingConnector's CPU store has no
    tokens, no parent and block_size 0."""
    swa = (
        b"\x87"
        + _fixstr("type") + _fixstr("BlockStored")
        + _fixstr("block_hashes") + b"\x91\x05"
        + _fixstr("parent_block_hash") + b"\xc0"
        + _fixstr("token_ids") + b"\x92\x01\x02"
        + _fixstr("block_size") + b"\x02"
        + _fixstr("kv_cache_spec_kind") + _fixstr("sliding_window")
        + b"\xbc" + b"kv_cache_spec_sliding_window" + b"\xcd\x01\x00"
    )  # fmt: skip
    cpu = (
        b"\x88"
        + _fixstr("type") + _fixstr("BlockStored")
        + _fixstr("block_hashes") + b"\x91\x05"
        + _fixstr("parent_block_hash") + b"\xc0"
        + _fixstr("token_ids") + b"\x90"
        + _fixstr("block_size") + b"\x00"
        + _fixstr("lora_id") + b"\xc0"
        + _fixstr("medium") + _fixstr("CPU")
        + _fixstr("lora_name") + b"\xc0"
    )  # fmt: skip
    payload = (
        b"\x83"
        + _fixstr("ts") + b"\x01"
        + _fixstr("events") + b"\x92" + swa + cpu
        + b"\xb2" + b"data_parallel_rank" + b"\x01"
    )  # fmt: skip
    batch = decode_batch(payload)
    assert batch.dp_rank == 1
    a, b = batch.events
    assert isinstance(a, BlockStored) and a.kv_cache_spec_sliding_window == 256
    assert a.token_ids == (1, 2) and not a.hash_only
    assert b == BlockStored((5,), None, (), 0, None, "CPU", None) and b.hash_only


@pytest.mark.parametrize(
    "payload, match",
    [
        (b"\xc1", "not msgpack"),
        (b"\x92\xa1x\x90", "ts"),
        (b"\x91\x01", "batch must be"),
        (b"\x92\x01\x01", "events: must be an array"),
        (b"\x93\x01\x90\xa1x", "dp_rank"),
    ],
)
def test_malformed_batches_are_refused_whole(payload: bytes, match: str) -> None:
    with pytest.raises(WireError, match=match):
        decode_batch(payload)


_GOOD = b"\x92\xacBlockRemoved\x91\x09"  # ["BlockRemoved", [9]]


@pytest.mark.parametrize(
    "event, match, tag, resync",
    [
        (b"\x81\xa4type\xacBlockRemoved", "missing field", "BlockRemoved", True),
        (
            b"\x83\xa4type\xacBlockRemoved\xacblock_hashes\x90\xa6medium\x01",
            "medium: must be a string",
            "BlockRemoved",
            True,
        ),
        (
            b"\x82\xa4type\xacBlockRemoved\x01\x01",
            "field names must be strings",
            "BlockRemoved",
            True,
        ),
        (b"\x81\xa4type\x01", "string type", "", True),
        (b"\x07", "tagged map or a tag-first array", "", True),
        # 3 tokens for 1 block of 2
        (b"\x95\xabBlockStored\x91\x07\xc0\x93\x01\x02\x03\x02", "3 tokens", "BlockStored", False),
        # tokens for a block of size 0
        (b"\x95\xabBlockStored\x91\x07\xc0\x92\x01\x02\x00", "positive", "BlockStored", False),
        (
            b"\x95\xabBlockStored\x91\xa1x\xc0\x92\x01\x02\x02",
            "integer or bytes",
            "BlockStored",
            False,
        ),
        (
            b"\x95\xabBlockStored\x91\x07\xc0\x92\x01\xff\x02",
            "32-bit unsigned",
            "BlockStored",
            False,
        ),
        (b"\x93\xabBlockStored\x91\x07\xc0", "needs at least 4", "BlockStored", False),
    ],
)
def test_malformed_event_is_dropped_alone(event: bytes, match: str, tag: str, resync: bool) -> None:
    """One bad event loses itself, not its batch; dropping anything but a store (which
    only under-reports) asks the consumer to resync after it."""
    batch = decode_batch(b"\x92\x01\x93" + _GOOD + event + _GOOD)
    assert batch.events == (BlockRemoved((9,)), BlockRemoved((9,)))
    (s,) = batch.skipped
    assert (s.index, s.at, s.event, s.known, s.resync) == (1, 1, tag, True, resync)
    assert match in s.reason and s.reason.startswith("events[1]")
    assert batch.resync_from == (1 if resync else None)
    assert batch.unknown_fields == ()


def test_unknown_fields_and_types_are_ignored_and_listed() -> None:
    """What a newer engine may add: a map key, a trailing array value, a new event type,
    a new batch key. All known content still decodes."""
    stored = (
        b"\x86"
        + _fixstr("type") + _fixstr("BlockStored")
        + _fixstr("block_hashes") + b"\x91\x05"
        + _fixstr("parent_block_hash") + b"\xc0"
        + _fixstr("token_ids") + b"\x92\x01\x02"
        + _fixstr("block_size") + b"\x02"
        + _fixstr("pin_reason") + _fixstr("hot")
    )  # fmt: skip
    # ["BlockRemoved", [5], "GPU", 0, "loc", "own", "new-a", "new-b"]: locality and
    # ownership (vLLM 0.32.0), then two values past them
    removed = b"\x98\xacBlockRemoved\x91\x05\xa3GPU\x00\xa3loc\xa3own\xa5new-a\xa5new-b"
    pinned = b"\x82" + _fixstr("type") + _fixstr("BlockPinned") + _fixstr("n") + b"\x01"
    cleared_new = b"\x92\xb0AllBlocksCleared\x01"  # a field where none is known
    payload = (
        b"\x84"
        + _fixstr("ts") + b"\x01"
        + _fixstr("events") + b"\x94" + stored + pinned + removed + cleared_new
        + b"\xb2" + b"data_parallel_rank" + b"\x00"
        + _fixstr("engine_epoch") + b"\x03"
    )  # fmt: skip
    batch = decode_batch(payload)
    assert batch.events == (
        BlockStored((5,), None, (1, 2), 2),
        BlockRemoved((5,), "GPU", 0, "loc", "own"),
        AllBlocksCleared(),
    )
    assert batch.unknown_fields == (
        ("EventBatch", "engine_epoch"),
        ("BlockStored", "pin_reason"),
        ("BlockRemoved", "[6]"),
        ("BlockRemoved", "[7]"),
        ("AllBlocksCleared", "[1]"),
    )
    (s,) = batch.skipped
    assert (s.index, s.at, s.event, s.known, s.resync) == (1, 1, "BlockPinned", False, False)
    assert "unknown event type 'BlockPinned'" in s.reason
    assert batch.resync_from is None
    # a tag-first batch array with a value past dp_rank
    more = decode_batch(b"\x94\x01\x90\x00\x07")
    assert more.dp_rank == 0 and more.unknown_fields == (("EventBatch", "[3]"),)


def test_resync_point_is_after_the_last_lost_removal() -> None:
    bad = b"\x81\xa4type\xacBlockRemoved"  # no block_hashes
    store = b"\x95\xabBlockStored\x91\x07\xc0\x92\x01\x02\x02"
    bad_store = b"\x95\xabBlockStored\x91\x07\xc0\x92\x01\x02\x03"
    batch = decode_batch(b"\x92\x01\x96" + store + bad + store + bad + store + bad_store)
    assert len(batch.events) == 3 and [s.index for s in batch.skipped] == [1, 3, 5]
    assert batch.resync_from == 2  # events[2:] (the store after the second lost removal)


@pytest.mark.parametrize("case", VECTORS["tolerance"], ids=lambda c: c["name"])
def test_recorded_newer_engine_batches(case: dict[str, object]) -> None:
    """tests/vectors/kv_events.json `tolerance`: batches as a newer engine might send
    them (extra fields, an unknown type, one malformed event), with what must decode."""
    batch = decode_batch(bytes.fromhex(str(case["payload_hex"])))
    want = case["expect"]
    assert isinstance(want, dict)
    assert [type(e).__name__ for e in batch.events] == want["events"]
    assert [list(f) for f in batch.unknown_fields] == want["unknown_fields"]
    assert [[s.index, s.event, s.known, s.resync] for s in batch.skipped] == want["skipped"]
    assert batch.resync_from == want["resync_from"]


def test_bad_framing_is_refused() -> None:
    ok = _frames(VECTORS["messages"][0])
    with pytest.raises(WireError, match="3 frames"):
        parse_live(ok[1:])
    with pytest.raises(WireError, match="8 bytes"):
        parse_live([ok[0], b"\x00" * 4, ok[2]])
    with pytest.raises(WireError, match="replay message"):
        parse_replay(ok)  # no empty delimiter frame
