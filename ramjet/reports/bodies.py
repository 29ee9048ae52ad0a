"""Report bodies: what a signed envelope carries, by kind (spec: `docs/protocol.md`).

Bodies are JSON (pydantic, `extra="forbid"`). Key lists are packed: a JSON string of
standard base64 over 8-byte big-endian unsigned keys, so a key costs 10.67 bytes on the
wire whatever its value. That makes the envelope's size cap a hard bound on the number
of keys a report can carry (4 MiB -> at most ~390k keys; a million keys need 10.7 MB
and are refused by the size check before anything is parsed). The explicit caps below
are checked while parsing: a key string is refused by its length before it is decoded.

Keys are the router's prefix keys (`ramjet.keys.prefix`): global KV one key per 256-token
block, SWA state keyed by message-boundary keys.

- `delta`:   what changed since the previous report (stored, moved, evicted; SWA
             states created with their TTL, expired).
- `snapshot`: the engine's whole residency by tier and its live SWA states, consistent
             with exactly the reports up to and including the envelope's `seq`.
- `load`:    queue and batch figures.
- `profile`: `ramjet.policy.profile.EngineProfile`, as is.
"""

from __future__ import annotations

import base64
import binascii
import struct
import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Annotated, Any, Literal, cast, overload

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator, model_validator

from ramjet.errors import ReportError
from ramjet.policy.profile import EngineProfile
from ramjet.types import PrefixKey, Tier

MAX_KEYS_PER_LIST = 1 << 19
"""Hard cap on keys in any one list (524,288), checked before decoding the string."""
MAX_KEYS_PER_BODY = 1 << 19
"""Hard cap on keys across a whole body."""
MAX_SNAPSHOT_PARTS = 4096
"""Most parts one snapshot may be cut into (`SnapshotBody.parts`, `split_snapshot`)."""
_MAX_B64 = (MAX_KEYS_PER_LIST * 8 + 2) // 3 * 4

TierName = Literal["hbm", "host", "ssd"]


def pack_keys(keys: Iterable[int]) -> str:
    """Keys -> base64 of 8-byte big-endian words."""
    seq = list(keys)
    return base64.b64encode(struct.pack(f">{len(seq)}Q", *seq)).decode("ascii")


_PIECE_B64 = 1 << 18
"""Base64 characters decoded per step of a long key list (196,608 bytes, 24,576 keys:
about a millisecond): a worker thread parsing a large body hands the GIL to the event
loop between steps (`ReportVerifier.check_async`). A multiple of 32 characters (3 keys)."""
_BIG_ENDIAN_HOST = sys.byteorder == "big"


class PackedKeys(Sequence[PrefixKey]):
    """A long key list as parsed from the wire (more than one `_PIECE_B64` step): the
    keys in one `array('Q')`, 8 bytes each, instead of a tuple of int objects (40 bytes
    each, 16 ms to make for 524k keys, and a tuple the cyclic collector walks item by
    item: ~20 ms the first time a collection finds it young). An immutable sequence of
    ints: indexing gives an int, slicing a tuple (the processor applies a snapshot in
    slices), equal to any sequence of the same keys."""

    __slots__ = ("_a",)

    def __init__(self, keys: array[int]) -> None:
        self._a = keys

    def __len__(self) -> int:
        return len(self._a)

    @overload
    def __getitem__(self, i: int) -> PrefixKey: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[PrefixKey, ...]: ...
    def __getitem__(self, i: int | slice) -> PrefixKey | tuple[PrefixKey, ...]:
        if isinstance(i, slice):
            return cast(tuple[PrefixKey, ...], tuple(self._a[i]))
        return cast(PrefixKey, self._a[i])

    def __iter__(self) -> Iterator[PrefixKey]:
        return cast(Iterator[PrefixKey], iter(self._a))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedKeys):
            return self._a == other._a
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return len(other) == len(self._a) and all(map(int.__eq__, self._a, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self._a))

    def __repr__(self) -> str:
        return f"PackedKeys({len(self._a)} keys)"


def _decode_piece(piece: str) -> bytes:
    try:
        raw = base64.b64decode(piece, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("keys must be standard base64") from None
    if len(raw) % 8:
        raise ValueError("packed keys must be a multiple of 8 bytes")
    return raw


def _unpack_keys(value: Any) -> Sequence[PrefixKey]:
    if isinstance(value, str):
        if len(value) > _MAX_B64:
            raise ValueError(f"more than {MAX_KEYS_PER_LIST} keys in one list")
        if len(value) <= _PIECE_B64:
            raw = _decode_piece(value)
            # PrefixKey is an int at run time: no per-key conversion
            return cast(tuple[PrefixKey, ...], struct.unpack(f">{len(raw) // 8}Q", raw))
        # in pieces, each decoded as the whole would be: padding only at the very end
        if value.find("=", 0, len(value) - 2) >= 0:
            raise ValueError("keys must be standard base64")
        keys: array[int] = array("Q")
        for i in range(0, len(value), _PIECE_B64):
            keys.frombytes(_decode_piece(value[i : i + _PIECE_B64]))
        if not _BIG_ENDIAN_HOST:
            keys.byteswap()
        return PackedKeys(keys)
    if isinstance(value, PackedKeys):  # a parsed body's list, passed on
        return value
    if isinstance(value, list | tuple):  # Python-side construction
        if len(value) > MAX_KEYS_PER_LIST:
            raise ValueError(f"more than {MAX_KEYS_PER_LIST} keys in one list")
        for k in value:
            if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < 2**64:
                raise ValueError("keys must be integers in [0, 2**64)")
        return cast(tuple[PrefixKey, ...], tuple(value))
    raise ValueError("keys must be a base64 string of packed 64-bit keys")


Keys = Annotated[
    Sequence[PrefixKey],
    PlainValidator(_unpack_keys),
    PlainSerializer(pack_keys, return_type=str, when_used="json"),
]
"""A key list: a tuple, or for a long list parsed from the wire a `PackedKeys`."""
TtlMs = Annotated[int, Field(gt=0, le=365 * 24 * 3600 * 1000)]


class _Body(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TierKeys(_Body):
    """Blocks now in `tier`; `ttl_ms`: how long the engine keeps them there, if bounded."""

    tier: TierName
    keys: Keys
    ttl_ms: TtlMs | None = None

    @property
    def tier_enum(self) -> Tier:
        return Tier.parse(self.tier)


class SwaStates(_Body):
    """SWA states at these boundary keys, live for `ttl_ms` from the report's issue."""

    keys: Keys
    ttl_ms: TtlMs


class DeltaBody(_Body):
    stored: Annotated[list[TierKeys], Field(max_length=4096)] = []
    moved: Annotated[list[TierKeys], Field(max_length=4096)] = []
    evicted: Keys = ()
    swa_created: Annotated[list[SwaStates], Field(max_length=4096)] = []
    swa_expired: Keys = ()

    def key_count(self) -> int:
        return (
            sum(len(t.keys) for t in self.stored)
            + sum(len(t.keys) for t in self.moved)
            + len(self.evicted)
            + sum(len(s.keys) for s in self.swa_created)
            + len(self.swa_expired)
        )

    def is_empty(self) -> bool:
        return self.key_count() == 0


class SnapshotBody(_Body):
    seq: Annotated[int, Field(ge=0, lt=2**64)]
    """The last sequence number this state includes; equals the envelope's seq."""
    residency: Annotated[list[TierKeys], Field(max_length=4096)] = []
    swa: Annotated[list[SwaStates], Field(max_length=4096)] = []
    profile: EngineProfile | None = None
    """The engine's last published profile: a router that starts after the profile report
    left the ring (or after a new epoch) gets it from the snapshot."""
    part: Annotated[int, Field(ge=0, lt=MAX_SNAPSHOT_PARTS)] = 0
    """Which part of a snapshot cut in `parts` (`split_snapshot`): the parts are separate
    reports of one epoch with consecutive seqs, part 0 first."""
    parts: Annotated[int, Field(ge=1, le=MAX_SNAPSHOT_PARTS)] = 1
    """How many parts the snapshot has; 1 (the default, left off the wire): a whole one."""

    @model_validator(mode="after")
    def _part_in_range(self) -> SnapshotBody:
        if self.part >= self.parts:
            raise ValueError(f"snapshot part {self.part} of {self.parts}: part must be < parts")
        return self

    def key_count(self) -> int:
        return sum(len(t.keys) for t in self.residency) + sum(len(s.keys) for s in self.swa)


NonNegInt = Annotated[int, Field(ge=0)]


class LoadBody(_Body):
    queued_prompt_tokens: NonNegInt
    """Prompt tokens waiting or being prefilled."""
    running_requests: NonNegInt
    waiting_requests: NonNegInt
    kv_utilization: Annotated[float, Field(ge=0, le=1)]
    """Share of HBM global-KV capacity in use."""
    decode_tokens_per_s: Annotated[float, Field(ge=0)] | None = None
    """Recent decode throughput of the whole batch."""
    spec_acceptance: Annotated[float, Field(ge=0, le=1)] | None = None
    """Recent speculative-decoding acceptance rate, if the engine speculates."""

    def key_count(self) -> int:
        return 0


class ProfileBody(EngineProfile):
    """A `profile` report carries `ramjet.policy.profile.EngineProfile` unchanged."""

    def key_count(self) -> int:
        return 0


Body = DeltaBody | SnapshotBody | LoadBody | ProfileBody
BODY_TYPES: dict[str, type[DeltaBody] | type[SnapshotBody] | type[LoadBody] | type[ProfileBody]] = {
    "delta": DeltaBody,
    "snapshot": SnapshotBody,
    "load": LoadBody,
    "profile": ProfileBody,
}


class BodyError(ReportError, ValueError):
    """A body that does not parse, breaks a bound, or contradicts its envelope."""


def parse_body(kind: str, raw: bytes, max_keys: int = MAX_KEYS_PER_BODY) -> Body:
    """Parse and bound a body of `kind`. Raises `BodyError`."""
    model = BODY_TYPES.get(kind)
    if model is None:
        raise BodyError(f"unknown kind {kind!r}")
    try:
        body: Body = model.model_validate_json(raw)
    except ValueError as exc:  # pydantic.ValidationError is a ValueError
        raise BodyError(f"{kind} body: {_first_error(exc)}") from None
    if body.key_count() > max_keys:
        raise BodyError(f"{kind} body carries more than {max_keys} keys")
    return body


def encode_body(body: Body) -> bytes:
    if isinstance(body, SnapshotBody):
        # a whole snapshot (one part) without a profile keeps the bytes it always had
        # (vectors, old routers): the fields it does not use are left off
        exclude = set() if body.parts > 1 else {"part", "parts"}
        if body.profile is None:
            exclude.add("profile")
        return body.model_dump_json(exclude=exclude).encode("utf-8")
    return body.model_dump_json(exclude_defaults=False).encode("utf-8")


def split_snapshot(
    seq: int,
    residency: Sequence[TierKeys],
    swa: Sequence[SwaStates],
    profile: EngineProfile | None = None,
    max_keys: int = MAX_KEYS_PER_BODY,
) -> list[SnapshotBody]:
    """One snapshot as the bodies to send: one whole body when it carries at most
    `max_keys` keys, else parts of at most `max_keys` keys each, with seqs `seq`,
    `seq + 1`, ... (part 0 first; the profile rides on part 0). Every producer of
    snapshots (`ReportPublisher`: the reference engine, `ramjet pool-reporter`, the vLLM
    sidecar) cuts them here. Raises `BodyError` past `MAX_SNAPSHOT_PARTS` parts."""
    if max_keys < 1:
        raise BodyError("max_keys must be at least 1")
    total = sum(len(g.keys) for g in residency) + sum(len(w.keys) for w in swa)
    if total <= max_keys:
        return [SnapshotBody(seq=seq, residency=list(residency), swa=list(swa), profile=profile)]
    parts = -(-total // max_keys)
    if parts > MAX_SNAPSHOT_PARTS:
        raise BodyError(
            f"a snapshot of {total} keys needs {parts} parts of {max_keys} keys: "
            f"more than {MAX_SNAPSHOT_PARTS}"
        )
    bodies: list[SnapshotBody] = []
    cur_res: list[TierKeys] = []
    cur_swa: list[SwaStates] = []
    room = max_keys

    def flush() -> None:
        nonlocal cur_res, cur_swa, room
        part = len(bodies)
        bodies.append(
            SnapshotBody(
                seq=seq + part,
                residency=cur_res,
                swa=cur_swa,
                profile=profile if part == 0 else None,
                part=part,
                parts=parts,
            )
        )
        cur_res, cur_swa, room = [], [], max_keys

    for g in residency:
        i = 0
        while i < len(g.keys):
            take = g.keys[i : i + room]
            cur_res.append(TierKeys(tier=g.tier, keys=take, ttl_ms=g.ttl_ms))
            room -= len(take)
            i += len(take)
            if room == 0:
                flush()
    for w in swa:
        i = 0
        while i < len(w.keys):
            take = w.keys[i : i + room]
            cur_swa.append(SwaStates(keys=take, ttl_ms=w.ttl_ms))
            room -= len(take)
            i += len(take)
            if room == 0:
                flush()
    if cur_res or cur_swa:
        flush()
    return bodies


def profile_body(profile: EngineProfile) -> ProfileBody:
    return ProfileBody.model_validate(profile.model_dump())


def _first_error(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        errs = errors()
        if errs:
            e = errs[0]
            loc = ".".join(str(p) for p in e.get("loc", ()))
            return f"{loc}: {e.get('msg', '')}"[:200]
    return str(exc)[:200]


def _whole_s(ttl_ms: int | None) -> int | None:
    return None if ttl_ms is None else -(-ttl_ms // 1000) * 1000


class DeltaBuilder:
    """Accumulates cache changes into one `DeltaBody` (the engine's reporter uses it).

    Later changes to a key supersede earlier ones within the same delta, so a key
    stored then evicted before the delta is sent is reported evicted only. TTLs are
    rounded up to whole seconds so keys group into few lists."""

    def __init__(self) -> None:
        self._global: dict[PrefixKey, tuple[str, Tier | None, int | None]] = {}
        self._swa: dict[PrefixKey, int | None] = {}

    def stored(self, key: PrefixKey, tier: Tier, ttl_ms: int | None = None) -> None:
        self._global[key] = ("stored", tier, _whole_s(ttl_ms))

    def moved(self, key: PrefixKey, tier: Tier, ttl_ms: int | None = None) -> None:
        prev = self._global.get(key)
        kind = "stored" if prev is not None and prev[0] == "stored" else "moved"
        self._global[key] = (kind, tier, _whole_s(ttl_ms))

    def evicted(self, key: PrefixKey) -> None:
        self._global[key] = ("evicted", None, None)

    def swa_created(self, key: PrefixKey, ttl_ms: int) -> None:
        self._swa[key] = _whole_s(max(1, ttl_ms))

    def swa_expired(self, key: PrefixKey) -> None:
        self._swa[key] = None

    def __len__(self) -> int:
        return len(self._global) + len(self._swa)

    def build(self) -> DeltaBody:
        """The accumulated delta; the builder is emptied."""
        groups: dict[tuple[str, Tier, int | None], list[PrefixKey]] = {}
        evicted: list[PrefixKey] = []
        for key, (kind, tier, ttl) in self._global.items():
            if tier is None:
                evicted.append(key)
            else:
                groups.setdefault((kind, tier, ttl), []).append(key)
        swa_groups: dict[int, list[PrefixKey]] = {}
        swa_gone: list[PrefixKey] = []
        for key, swa_ttl in self._swa.items():
            if swa_ttl is None:
                swa_gone.append(key)
            else:
                swa_groups.setdefault(swa_ttl, []).append(key)
        self._global.clear()
        self._swa.clear()

        def tier_lists(kind: str) -> list[TierKeys]:
            return [
                TierKeys(tier=t.label, keys=tuple(ks), ttl_ms=ttl)
                for (k, t, ttl), ks in sorted(groups.items(), key=lambda g: (g[0][1], g[0][2] or 0))
                if k == kind
            ]

        return DeltaBody(
            stored=tier_lists("stored"),
            moved=tier_lists("moved"),
            evicted=tuple(evicted),
            swa_created=[
                SwaStates(keys=tuple(ks), ttl_ms=t) for t, ks in sorted(swa_groups.items())
            ],
            swa_expired=tuple(swa_gone),
        )
