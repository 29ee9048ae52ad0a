"""Large frames off the event loop: `ReportVerifier.check_async` verifies and parses a
frame of `OFFLOAD_BYTES` or more in a worker thread and judges it exactly as `check`
does; an engine's frames are still judged in the order they arrived; a long key list
parses, in pieces, into `PackedKeys`, refused on the same inputs as in one piece."""

from __future__ import annotations

import asyncio
import base64
import random
import struct

import pytest
from reports_fixtures import E0, frame, rig, stored

from ramjet.reports.bodies import (
    _PIECE_B64,
    BodyError,
    DeltaBody,
    PackedKeys,
    SnapshotBody,
    TierKeys,
    encode_body,
    parse_body,
)
from ramjet.reports.verify import OFFLOAD_BYTES, Accepted, Reason, Rejected
from ramjet.residency.store import Table
from ramjet.types import PrefixKey, Tier

N = 60_000  # 640 kB of packed keys: over OFFLOAD_BYTES, and over one decode piece
KEYS = tuple(PrefixKey(random.Random(5).getrandbits(64)) for _ in range(N))


def _snapshot(seq: int, keys: tuple[PrefixKey, ...] = KEYS) -> SnapshotBody:
    return SnapshotBody(seq=seq, residency=[TierKeys(tier="host", keys=keys)])


def test_a_long_key_list_parses_into_packed_keys_equal_to_the_keys() -> None:
    body = parse_body("snapshot", encode_body(_snapshot(3)))
    assert isinstance(body, SnapshotBody)
    keys = body.residency[0].keys
    assert isinstance(keys, PackedKeys) and len(keys) == N
    assert keys == KEYS and KEYS == keys and list(keys) == list(KEYS)  # noqa: SIM300
    assert keys[0] == KEYS[0] and keys[-1] == KEYS[-1]
    assert keys[10:20] == KEYS[10:20] and isinstance(keys[10:20], tuple)
    assert keys != KEYS[:-1] and keys != (*KEYS[:-1], KEYS[-1] ^ 1)
    # it round-trips to the same bytes, and passes on into a new body as it is
    assert encode_body(body) == encode_body(_snapshot(3))
    assert TierKeys(tier="ssd", keys=keys).keys is keys
    # a short list stays a tuple
    short = parse_body("delta", encode_body(stored(1, 2, 3)))
    assert isinstance(short, DeltaBody) and short.stored[0].keys == (1, 2, 3)
    assert type(short.stored[0].keys) is tuple


@pytest.mark.parametrize(
    "damage",
    [
        "padding in the middle",  # '=' at the end of an inner piece: one piece would refuse it
        "a stray character in a later piece",
        "a length off by one",
        "a length of 4 bytes",
    ],
)
def test_a_long_key_list_is_refused_where_one_piece_would_be(damage: str) -> None:
    raw = struct.pack(f">{N}Q", *KEYS)
    text = base64.b64encode(raw).decode()
    assert len(text) > 2 * _PIECE_B64
    if damage == "padding in the middle":
        text = text[: _PIECE_B64 - 2] + "==" + text[_PIECE_B64:]
    elif damage == "a stray character in a later piece":
        text = text[: _PIECE_B64 + 5] + "*" + text[_PIECE_B64 + 6 :]
    elif damage == "a length off by one":
        text = text[:-1]
    else:
        text = base64.b64encode(raw + b"\x00" * 4).decode()
    # the reference: the whole string decoded at once, as before pieces
    with pytest.raises(ValueError):
        whole = base64.b64decode(text, validate=True)
        if len(whole) % 8:
            raise ValueError("not whole keys")
    body = b'{"seq":1,"residency":[{"tier":"hbm","keys":"' + text.encode() + b'"}]}'
    with pytest.raises(BodyError):
        parse_body("snapshot", body)


async def test_check_async_judges_a_large_frame_as_check_does() -> None:
    r = rig()
    good = frame(_snapshot(0), seq=0)
    assert len(good) >= OFFLOAD_BYTES
    forged = bytearray(good)
    forged[200] ^= 1  # inside the body: the signature no longer holds
    bad_body = frame(
        SnapshotBody(seq=5, residency=[TierKeys(tier="hbm", keys=KEYS)]), seq=0
    )  # body seq differs from the envelope's
    for f, want in (
        (bytes(forged), Reason.BAD_SIGNATURE),
        (bad_body, Reason.MALFORMED_BODY),
    ):
        sync, off = r.processor.verifier.check(f), await r.processor.verifier.check_async(f)
        assert isinstance(sync, Rejected) and isinstance(off, Rejected)
        assert sync.reason is off.reason is want
    ok = await r.processor.submit_async(good)
    assert isinstance(ok, Accepted) and ok.body == _snapshot(0)
    held = r.tables.store.get_many(Table.GLOBAL, E0, KEYS[:100], r.clocks.mono, False)
    assert all(e is not None and e.tier is Tier.HOST for e in held)
    # the same frame again is a replay, judged off the loop too
    again = await r.processor.submit_async(good)
    assert isinstance(again, Rejected) and again.reason is Reason.REPLAYED


async def test_an_engines_frames_are_judged_in_arrival_order() -> None:
    """A small delta that arrives while the engine's large snapshot is off the loop
    waits for it: the snapshot is accepted and applied, then the delta on top."""
    r = rig()
    wall_ms = int(r.clocks.wall * 1000)
    snap = frame(_snapshot(0), seq=0, issued_at_ms=wall_ms)
    later = frame(stored(1, tier="ssd"), seq=1, issued_at_ms=wall_ms + 1)
    outcomes: list[object] = []

    async def send(f: bytes) -> None:
        outcomes.append(await r.processor.submit_async(f))

    first = asyncio.create_task(send(snap))
    await asyncio.sleep(0)  # the snapshot is in its worker thread now
    await send(later)
    await first
    assert [type(o) for o in outcomes] == [Accepted, Accepted]
    # (the snapshot returns last: once applied, the delta replayed onto it)
    assert sorted(o.envelope.seq for o in outcomes if isinstance(o, Accepted)) == [0, 1]
    got = r.tables.store.get_many(Table.GLOBAL, E0, [PrefixKey(1), KEYS[0]], r.clocks.mono, False)
    assert [e.tier if e else None for e in got] == [Tier.SSD, Tier.HOST]
    assert r.processor.cursor(E0).seq == 1  # type: ignore[union-attr]
