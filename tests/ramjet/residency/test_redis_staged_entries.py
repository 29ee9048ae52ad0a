"""`StagedEntries` (a staged replace's queued entries over Redis) holds its arrays in
segments: views and iteration answer as one flat list of (key16, tier, expires_ms)
would, and no array grows past a segment (a whole snapshot's array was reallocated, a
copy of all of it, every 1/16 of its growth)."""

from __future__ import annotations

import random
from array import array
from collections.abc import Sequence
from typing import cast

import pytest

from ramjet.residency import redis_ops
from ramjet.residency.redis_ops import StagedEntries, _spelled
from ramjet.residency.redis_scripts import key16
from ramjet.types import PrefixKey


def _fill(rng: random.Random, sizes: list[int]) -> tuple[StagedEntries, list[tuple[str, int, int]]]:
    staged = StagedEntries()
    flat: list[tuple[str, int, int]] = []
    for n in sizes:
        keys = array("Q", (rng.getrandbits(64) for _ in range(n)))
        tier, exp = rng.randrange(3), rng.randrange(1, 10**13)
        # pieces come as array slices (a parsed report's keys) or as lists
        piece = (
            cast(Sequence[PrefixKey], keys) if rng.random() < 0.5 else list(map(PrefixKey, keys))
        )
        staged.add(piece, tier, exp)
        flat += [(key16(PrefixKey(k)), tier, exp) for k in keys]
    return staged, flat


@pytest.mark.parametrize("segment", [7, 64, redis_ops.STAGED_SEGMENT])
def test_views_and_iteration_match_a_flat_list(
    monkeypatch: pytest.MonkeyPatch, segment: int
) -> None:
    monkeypatch.setattr(redis_ops, "STAGED_SEGMENT", segment)
    rng = random.Random(segment)
    sizes = [rng.choice([0, 1, 5, 63, 64, 65, 500, 1024]) for _ in range(40)]
    if segment == redis_ops.STAGED_SEGMENT:
        sizes += [segment - 3, 1024, 2 * segment + 11]  # across the real segments
    staged, flat = _fill(rng, sizes)
    assert len(staged) == len(flat) and list(staged) == flat
    # the chunking's views (RedisStaging: step 1, from the cut to cut + limit), views
    # of views, an open end, past the end, and a stepped copy
    for _ in range(60):
        a = rng.randrange(len(flat) + 5)
        b = rng.randrange(a, len(flat) + 10)
        view = staged[a:b]
        assert len(view) == len(flat[a:b]) and list(view) == flat[a:b]
        c, d = rng.randrange(len(view) + 2), rng.randrange(len(view) + 3)
        assert list(view[c:d]) == flat[a:b][c:d] and len(view[c:d]) == len(flat[a:b][c:d])
        assert list(view[c:]) == flat[a:b][c:]
    assert list(staged[3::5]) == flat[3::5] and len(staged[3::5]) == len(flat[3::5])
    assert _spelled(["E", "g", 5, staged[2:9]]) == ["E", "g", 5, [list(e) for e in flat[2:9]]]
    with pytest.raises(RuntimeError):
        staged[1:4].add([PrefixKey(1)], 0, 1)


def test_no_array_grows_past_a_segment() -> None:
    """A 200k-entry replace staged in 1,024-key pieces: every array stays within
    `STAGED_SEGMENT` entries (a growth copies at most one segment), all full but the
    last, and later pieces never move the entries a view was cut over."""
    rng = random.Random(5)
    staged, flat = _fill(rng, [1024] * 195 + [300])
    seg = redis_ops.STAGED_SEGMENT
    assert len(staged.segs) == -(-len(flat) // seg) > 1
    for ks, ts, es in staged.segs[:-1]:
        assert len(ks) == len(ts) == len(es) == seg
    assert max(len(ks) for ks, _, _ in staged.segs) <= seg
    view = staged[seg - 10 : seg + 10]
    first = staged.segs[0][0]
    staged.add(cast(Sequence[PrefixKey], array("Q", [1, 2, 3])), 1, 7)
    assert staged.segs[0][0] is first and list(view) == flat[seg - 10 : seg + 10]
    assert list(staged)[-3:] == [(key16(PrefixKey(k)), 1, 7) for k in (1, 2, 3)]
