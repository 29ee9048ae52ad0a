"""The sidecar's decoder and tracker against SGLang's own event module.

`tests/vectors/sglang_events.json` (written by `scripts/sglang_record_fixtures.py`, SGLang
0.5.23's `sglang.srt.disaggregation.kv_events` run on CPU): batches built from its classes
and encoded as its publisher encodes them, and the frames its `ZmqEventPublisher` put on
a PUB socket and answered on its replay socket for those batches.

- each class-built batch decodes to the classes' own field values, with no field unknown
  (SGLang's `cache_salt` included) and signed 64-bit hashes kept as sent;
- the publisher's live frames and its replay answer (topic frame, end marker) parse;
- a store carrying a `cache_salt` is not reported: SGLang namespaces its hashes by the
  request's salt, so those blocks serve only requests with the same salt, and a router
  key from the tokens alone would claim them for every request;
- SGLang's media map to tiers (CPU_PINNED host, DISK and EXTERNAL SSD).
"""

from __future__ import annotations

import base64

import pytest
from event_vectors import as_plain, frames, load

from ramjet.reports.bodies import DeltaBuilder
from ramjet.sidecar.tracker import SGLANG_MEDIA, ResidencyTracker
from ramjet.sidecar.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    parse_live,
    parse_replay,
)
from ramjet.types import Tier

DATA = load("sglang_events.json")


def case_events(name: str) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    return list(decode_batch(base64.b64decode(DATA["cases"][name]["payload_b64"])).events)


@pytest.mark.parametrize("name", sorted(DATA["cases"]))
def test_batches_from_sglangs_own_classes(name: str) -> None:
    case = DATA["cases"][name]
    b = decode_batch(base64.b64decode(case["payload_b64"]))
    assert b.skipped == () and b.unknown_fields == (), (b.skipped, b.unknown_fields)
    assert (b.ts, b.dp_rank) == (case["ts"], case["attn_dp_rank"])
    assert len(b.events) == len(case["events"])
    for ev, want in zip(b.events, case["events"], strict=True):
        mine = as_plain(ev)
        for k, v in want.items():
            assert mine[k] == v, (name, k, mine[k], v)


def test_signed_hashes_are_kept_as_sent() -> None:
    [stored] = case_events("stored_every_field")
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes[0] == -(2**63) + 5 and stored.parent_block_hash == -42


def test_the_publishers_live_frames_and_replay_answer_parse() -> None:
    live = [parse_live(frames(e)) for e in DATA["live"]]
    assert [m.seq for m in live] == list(range(len(DATA["cases"])))
    assert {m.topic for m in live} == {b"kv-events"}
    for m, case in zip(live, DATA["cases"].values(), strict=True):
        # the publisher's encoding is the classes'; it stamps its own rank where None
        want = decode_batch(base64.b64decode(case["payload_b64"]))
        assert m.batch.events == want.events and m.batch.ts == want.ts
        assert m.batch.dp_rank == (0 if want.dp_rank is None else want.dp_rank)
    replay = [parse_replay(frames(e)) for e in DATA["replay"]]
    assert replay[-1] is None and all(m is not None for m in replay[:-1])
    assert [m.seq for m in replay[:-1] if m is not None] == [m.seq for m in live]
    assert {m.topic for m in replay[:-1] if m is not None} == {b"kv-events"}


def test_a_salted_store_is_not_reported() -> None:
    t = ResidencyTracker("tiny", SGLANG_MEDIA, 16)
    t.apply(case_events("stored_every_field"), DeltaBuilder())
    assert t.resident() == {}
    assert t.stats["cache_salt"] == 3 and t.stats["stored"] == 0
    # the same tokens stored without a salt are reported
    [salted] = case_events("stored_every_field")
    assert isinstance(salted, BlockStored)
    plain = BlockStored(
        block_hashes=(1, 2, 3), parent_block_hash=None, token_ids=salted.token_ids, block_size=16
    )
    t.apply([plain], DeltaBuilder())
    assert len(t.resident()) == 3


def test_sglang_media_map_to_tiers() -> None:
    t = ResidencyTracker("tiny", SGLANG_MEDIA, 16)
    t.apply(case_events("first_block_defaults"), DeltaBuilder())  # medium None: GPU
    assert list(t.resident().values()) == [Tier.HBM]
    host, disk, external = case_events("host_disk_external_copies")
    t.apply([host], DeltaBuilder())
    key = next(k for k, v in t.resident().items() if v == Tier.HOST)
    t.apply([disk], DeltaBuilder())
    assert t.tier_of(key) == Tier.HOST  # the best copy: host over disk
    t.apply(case_events("removed_and_cleared")[1:2], DeltaBuilder())  # the host copy goes
    assert t.tier_of(key) == Tier.SSD
    t.apply([external], DeltaBuilder())
    assert Tier.SSD in t.resident().values() and t.stats["unknown_medium"] == 0
    t.apply(case_events("removed_and_cleared")[2:], DeltaBuilder())
    assert t.resident() == {}
