"""The KV-event wire format of vLLM and SGLang: frames, batches, events; decode and encode.

Framing (ZMQ multipart), as `ZmqEventPublisher` in vLLM's `vllm/distributed/kv_events.py`
and SGLang's `python/sglang/srt/disaggregation/kv_events.py` sends it:
- live (PUB -> SUB): `[topic, seq, payload]`, `seq` 8 bytes big-endian, the topic the
  config's `topic` (empty by default);
- replay (ROUTER -> DEALER): a DEALER sends `[b"", start_seq (8 bytes BE)]`; the engine
  answers one message per buffered batch with seq >= start_seq, then an end marker whose
  seq is `0xFF` x 8 (`(-1).to_bytes(8, "big", signed=True)`) with an empty payload.
  vLLM (0.32.0, seen) answers `[b"", topic, seq, payload]` and ends with
  `[b"", b"", END, b""]`, and so does SGLang 0.5.23 (seen from its own publisher); older
  vLLM and SGLang `[b"", seq, payload]`: both are accepted (`parse_replay`). A first
  replayed seq above the one asked for means the engine's buffer (`buffer_steps`
  batches) no longer holds it (history truncated).

Payload: msgpack of the batch, an **array** `[ts, events, dp_rank]` (msgspec
`array_like`): vLLM 0.32.0's `KVEventBatch` and SGLang's (`attn_dp_rank`) alike, seen on
the wire and in `tests/vectors/vllm_recorded.json`; a map `{ts, events,
data_parallel_rank}` is accepted too. Each event is a tagged map (`{"type":
"BlockStored", "block_hashes": [...], ...}`, msgspec `tag=True`, as vLLM 0.32.0 sends
it, and SGLang 0.5.23 too: `tests/vectors/sglang_events.json`) or a tag-first array
(`["BlockStored", block_hashes, parent_block_hash, ...]`, older builds); msgspec's
`omit_defaults` leaves out default fields, so shorter arrays (and maps without the
optional keys) are legal. Field order of the arrays:

    BlockStored      block_hashes, parent_block_hash, token_ids, block_size, lora_id,
                     medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
                     kv_cache_spec_sliding_window, locality, ownership, session_id
                     (and, in maps only, SGLang's cache_salt)
    BlockRemoved     block_hashes, medium, group_idx, locality, ownership
    AllBlocksCleared (no fields)

`session_id` is the request's `session_id` (vLLM sets it on stores when a request
carries one, also on the re-reports of `kv_cache_report_mode: "full"`); it does not
change what a block is. `cache_salt` is SGLang's: the salt of the request that stored
the blocks, by which SGLang namespaces their hashes (vLLM puts a salt in `extra_keys`);
the tracker reports neither, since a key from the tokens alone would claim the blocks
for requests without that salt. Engine hashes are msgpack integers (vLLM's default
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`: the digest's low 64 bits, often >= 2**63, so
msgpack uint64; SGLang's first 8 digest bytes, signed) or byte strings; both are kept as
they come (hashable).

Tolerance (what a newer engine may send), decided per event because each event of a
batch is self-describing while the batch has one seq and no per-event framing:
- an **unknown field** of a known event (a map key, or an array value past the last
  known position, named `[i]` by its array index) is ignored and listed in
  `EventBatch.unknown_fields` as `(event type, field)`; unknown keys of a batch map and
  values past `[ts, events, dp_rank]` are listed the same way under `EventBatch`;
- an event of an **unknown type** (a string tag not listed above) is skipped and listed in
  `EventBatch.skipped` (`Skipped.known` False);
- a **malformed** event (a known field of the wrong type or range, a missing required
  field, a non-string map key, no tag at all) is dropped with its reason, also in
  `skipped`; the batch's other events still decode. Losing a `BlockStored` only
  under-reports residency, but a lost `BlockRemoved` or `AllBlocksCleared` (or an event
  whose type cannot be told) may leave a block reported that the engine dropped, so such
  a drop sets `Skipped.resync` and `EventBatch.resync_from`: the consumer must forget its
  state and apply only the events after it (the sidecar starts a new epoch there).
What is not a batch at all (not msgpack, no event array, a bad `ts` or `dp_rank`, bad
frames) raises `WireError` for the whole message, with the path of the offending field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Annotated, Any

import msgspec

from ramjet.errors import RamjetError

END_SEQ = b"\xff" * 8
"""Seq bytes of the replay socket's end-of-replay marker."""

EngineHash = int | bytes


class WireError(RamjetError, ValueError):
    """A frame, batch or event that does not decode."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    """All tokens of the stored blocks, concatenated (block_size per block)."""
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    """vLLM GPU/CPU/STORAGE; SGLang GPU/CPU_PINNED/DISK/EXTERNAL; None means GPU."""
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    """Per block: extra hash inputs (multimodal hashes, cache salt) or None."""
    group_idx: int = 0
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    """The group's window in tokens (vLLM sends it with `kv_cache_spec_kind`)."""
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    """The request's session (vLLM); identifies who stored or re-reported the block."""
    cache_salt: str | None = None
    """SGLang: the salt of the request that stored the blocks. Its hashes are namespaced by
    it, so the blocks serve only requests with the same salt (the tracker keys none)."""

    @property
    def hash_only(self) -> bool:
        """A store that names blocks by engine hash alone (no tokens): vLLM's
        OffloadingConnector reports its CPU copies this way (`token_ids=[]`, no parent)."""
        return not self.token_ids


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None
    group_idx: int = 0
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped every block of every medium (it carries no fields)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared
_TYPES: dict[str, type[BlockStored] | type[BlockRemoved] | type[AllBlocksCleared]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}
_MAP_ONLY: dict[str, tuple[str, ...]] = {"BlockStored": ("cache_salt",)}
"""Fields known by name only (SGLang's, in maps): not positions of vLLM's array order,
and encoded only when set (as msgspec's `omit_defaults`)."""
_FIELDS = {
    name: tuple(f.name for f in fields(cls) if f.name not in _MAP_ONLY.get(name, ()))
    for name, cls in _TYPES.items()
}
"""Each event's positional fields, in the order of its tag-first array."""
_KNOWN = {name: (*names, *_MAP_ONLY.get(name, ())) for name, names in _FIELDS.items()}
_REQUIRED = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}


@dataclass(frozen=True, slots=True)
class Skipped:
    """An event of a batch that was not decoded."""

    index: int
    """Its position in the wire batch's event array."""
    at: int
    """How many decoded events precede it (its place in `EventBatch.events`)."""
    event: str
    """Its type tag; "" when it had no string tag."""
    reason: str
    known: bool
    """A known type that is malformed (False: an unknown type, skipped as designed)."""
    resync: bool
    """Dropping it may leave blocks reported that the engine no longer holds."""


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None = None
    skipped: tuple[Skipped, ...] = ()
    """Events not decoded: unknown types and malformed events, in batch order."""
    unknown_fields: tuple[tuple[str, str], ...] = ()
    """`(event type, field)` per ignored field occurrence ("EventBatch" for the batch's)."""

    @property
    def resync_from(self) -> int | None:
        """None, or the index into `events` after the last dropped event that may have
        removed blocks: state built before it can be stale, so a consumer forgets it and
        applies `events[resync_from:]` only."""
        cut = [s.at for s in self.skipped if s.resync]
        return max(cut) if cut else None


@dataclass(frozen=True, slots=True)
class Message:
    """One decoded ZMQ message: a batch and its sequence number."""

    seq: int
    batch: EventBatch
    topic: bytes = b""


# -- decoding ------------------------------------------------------------------------------

_decode = msgspec.msgpack.decode
_convert = msgspec.convert
_TOKENS = list[Annotated[int, msgspec.Meta(ge=0, lt=2**32)]]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _hash(v: Any, path: str) -> EngineHash:
    if _is_int(v):
        if not -(2**63) <= v < 2**64:
            raise WireError(f"{path}: hash out of 64-bit range")
        return int(v)
    if isinstance(v, bytes):
        return v
    raise WireError(f"{path}: a block hash must be an integer or bytes, got {type(v).__name__}")


def _hashes(v: Any, path: str) -> tuple[EngineHash, ...]:
    if not isinstance(v, list):
        raise WireError(f"{path}: must be an array of hashes")
    return tuple(_hash(h, f"{path}[{i}]") for i, h in enumerate(v))


def _opt_str(v: Any, path: str) -> str | None:
    if v is None or isinstance(v, str):
        return v
    raise WireError(f"{path}: must be a string or nil")


def _opt_int(v: Any, path: str) -> int | None:
    if v is None:
        return None
    if _is_int(v):
        return int(v)
    raise WireError(f"{path}: must be an integer or nil")


def _freeze(v: Any) -> Any:
    return tuple(_freeze(x) for x in v) if isinstance(v, list) else v


def _build(tag: str, values: dict[str, Any], path: str) -> Event:
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if tag == "BlockRemoved":
        group = values.get("group_idx", 0)
        return BlockRemoved(
            _hashes(values.get("block_hashes"), f"{path}.block_hashes"),
            _opt_str(values.get("medium"), f"{path}.medium"),
            0 if group is None else _nonneg(group, f"{path}.group_idx"),
            _opt_str(values.get("locality"), f"{path}.locality"),
            _opt_str(values.get("ownership"), f"{path}.ownership"),
        )
    hashes = _hashes(values.get("block_hashes"), f"{path}.block_hashes")
    parent = values.get("parent_block_hash")
    try:  # C-speed check (a Python loop over the tokens costs 3x more)
        tokens = _convert(values.get("token_ids"), _TOKENS, strict=True)
    except msgspec.ValidationError:
        raise WireError(f"{path}.token_ids: must be an array of 32-bit unsigned integers") from None
    size = _nonneg(values.get("block_size"), f"{path}.block_size")
    # A hash-only store (no tokens) names blocks the engine already described; vLLM's
    # OffloadingConnector sends block_size 0 or its offload block size there.
    if size == 0 and tokens:
        raise WireError(f"{path}.block_size: must be positive")
    if tokens and len(tokens) != size * len(hashes):
        raise WireError(
            f"{path}.token_ids: {len(tokens)} tokens for {len(hashes)} blocks of {size}"
        )
    extra = values.get("extra_keys")
    if extra is not None and not isinstance(extra, list):
        raise WireError(f"{path}.extra_keys: must be an array or nil")
    group = values.get("group_idx", 0)
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else _hash(parent, f"{path}.parent_block_hash"),
        token_ids=tuple(tokens),
        block_size=size,
        lora_id=_opt_int(values.get("lora_id"), f"{path}.lora_id"),
        medium=_opt_str(values.get("medium"), f"{path}.medium"),
        lora_name=_opt_str(values.get("lora_name"), f"{path}.lora_name"),
        extra_keys=None if extra is None else _freeze(extra),
        group_idx=0 if group is None else _nonneg(group, f"{path}.group_idx"),
        kv_cache_spec_kind=_opt_str(values.get("kv_cache_spec_kind"), f"{path}.kv_cache_spec_kind"),
        kv_cache_spec_sliding_window=_opt_int(
            values.get("kv_cache_spec_sliding_window"), f"{path}.kv_cache_spec_sliding_window"
        ),
        locality=_opt_str(values.get("locality"), f"{path}.locality"),
        ownership=_opt_str(values.get("ownership"), f"{path}.ownership"),
        session_id=_opt_str(values.get("session_id"), f"{path}.session_id"),
        cache_salt=_opt_str(values.get("cache_salt"), f"{path}.cache_salt"),
    )


def _nonneg(v: Any, path: str) -> int:
    if not _is_int(v) or v < 0:
        raise WireError(f"{path}: must be a non-negative integer")
    return int(v)


class UnknownEventType(WireError):
    """An event whose string tag names no known type (skipped, not malformed)."""

    def __init__(self, tag: str, path: str) -> None:
        super().__init__(f"{path}: unknown event type {tag!r}")
        self.tag = tag


def _event(raw: Any, path: str) -> tuple[Event, tuple[str, ...]]:
    """One event and the names of the fields it carried that are not known (ignored)."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise WireError(f"{path}.type: an event map needs a string type, got {tag!r}")
        if tag not in _TYPES:
            raise UnknownEventType(tag, f"{path}.type")
        names = _FIELDS[tag]
        extra = [k for k in raw if k != "type" and k not in _KNOWN[tag]]
        bad = [k for k in extra if not isinstance(k, str)]
        if bad:
            raise WireError(f"{path}: field names must be strings, got {bad[0]!r}")
        missing = [f for f in names[: _REQUIRED[tag]] if f not in raw]
        if missing:
            raise WireError(f"{path}: missing field(s) {', '.join(missing)}")
        return _build(tag, raw, path), tuple(sorted(extra))
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        if tag not in _TYPES:
            raise UnknownEventType(tag, f"{path}[0]")
        names = _FIELDS[tag]
        vals = raw[1:]
        if len(vals) < _REQUIRED[tag]:
            raise WireError(
                f"{path}: {tag} array has {len(vals)} fields, needs at least {_REQUIRED[tag]}"
            )
        # a newer engine appends its new fields (array_like keeps declaration order)
        trailing = tuple(f"[{i}]" for i in range(len(names) + 1, len(raw)))
        return _build(tag, dict(zip(names, vals, strict=False)), path), trailing
    raise WireError(f"{path}: an event must be a tagged map or a tag-first array")


def decode_event(raw: Any, path: str = "event") -> Event:
    """One event from its msgpack value: a tagged map or a tag-first array. Unknown fields
    are ignored; an unknown type raises `UnknownEventType`, anything malformed `WireError`."""
    return _event(raw, path)[0]


def _tag_of(raw: Any) -> str:
    tag = (
        raw.get("type")
        if isinstance(raw, dict)
        else raw[0]
        if isinstance(raw, list) and raw
        else None
    )
    return tag if isinstance(tag, str) else ""


def _decode_events(raw: list[Any]) -> tuple[list[Event], list[Skipped], list[tuple[str, str]]]:
    events: list[Event] = []
    skipped: list[Skipped] = []
    unknown: list[tuple[str, str]] = []
    for i, e in enumerate(raw):
        try:
            ev, extra = _event(e, f"events[{i}]")
        except UnknownEventType as exc:
            skipped.append(Skipped(i, len(events), exc.tag, str(exc), known=False, resync=False))
            continue
        except WireError as exc:
            tag = _tag_of(e)
            # a lost store under-reports; a lost removal or clear (or an event of unknown
            # shape) may leave stale residency
            resync = tag != "BlockStored"
            skipped.append(Skipped(i, len(events), tag, str(exc), known=True, resync=resync))
            continue
        events.append(ev)
        if extra:
            tag = type(ev).__name__
            unknown.extend((tag, f) for f in extra)
    return events, skipped, unknown


_BATCH_KEYS = frozenset({"ts", "events", "data_parallel_rank"})


def decode_batch(payload: bytes) -> EventBatch:
    """A batch from its msgpack payload; events that do not decode are in `skipped`."""
    try:
        raw = _decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"payload is not msgpack: {exc}") from None
    batch_extra: list[tuple[str, str]] = []
    if isinstance(raw, dict):
        batch_extra = [("EventBatch", str(k)) for k in raw if k not in _BATCH_KEYS]
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    elif isinstance(raw, list) and len(raw) > 3:
        batch_extra = [("EventBatch", f"[{i}]") for i in range(3, len(raw))]
    if not isinstance(raw, list) or len(raw) < 2:
        raise WireError("batch must be [ts, events, dp_rank]")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) >= 3 else None
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise WireError("batch.ts: must be a number")
    if not isinstance(events, list):
        raise WireError("batch.events: must be an array")
    dp_rank = _opt_int(rank, "batch.dp_rank")
    good, skipped, unknown = _decode_events(events)
    return EventBatch(float(ts), tuple(good), dp_rank, tuple(skipped), (*batch_extra, *unknown))


def _seq(raw: bytes) -> int:
    if len(raw) != 8:
        raise WireError(f"seq frame must be 8 bytes, got {len(raw)}")
    return int.from_bytes(raw, "big")


def parse_live(frames: Sequence[bytes]) -> Message:
    """A live message `[topic, seq, payload]`."""
    if len(frames) != 3:
        raise WireError(f"live message must have 3 frames [topic, seq, payload], got {len(frames)}")
    return Message(_seq(frames[1]), decode_batch(frames[2]), bytes(frames[0]))


def parse_replay(frames: Sequence[bytes]) -> Message | None:
    """A replay answer as a DEALER receives it: `[b"", topic, seq, payload]` (vLLM) or
    `[b"", seq, payload]` (SGLang, older vLLM). None for the end marker."""
    if len(frames) not in (3, 4) or frames[0] != b"":
        raise WireError(
            f"replay message must be [b'', (topic,) seq, payload], got {len(frames)} frames"
        )
    topic = bytes(frames[1]) if len(frames) == 4 else b""
    seq_raw = frames[-2]
    if seq_raw == END_SEQ:
        return None
    return Message(_seq(seq_raw), decode_batch(frames[-1]), topic)


# -- encoding (the reference engine's publisher, fixtures, benchmarks) --------------------

_encode = msgspec.msgpack.encode


def _event_values(ev: Event) -> tuple[str, list[Any]]:
    tag = type(ev).__name__
    return tag, [getattr(ev, f) for f in _FIELDS[tag]]


def _plain(v: Any) -> Any:
    return [_plain(x) for x in v] if isinstance(v, tuple) else v


def encode_event(ev: Event, *, tagged: bool = True) -> Any:
    """The msgpack value of an event: a tagged map (default) or a tag-first array whose
    trailing default-valued fields are omitted (as msgspec's `omit_defaults` does)."""
    tag, vals = _event_values(ev)
    names = _FIELDS[tag]
    if tagged:
        out: dict[str, Any] = {"type": tag}
        out.update((n, _plain(v)) for n, v in zip(names, vals, strict=True))
        for name in _MAP_ONLY.get(tag, ()):
            if getattr(ev, name) is not None:
                out[name] = getattr(ev, name)
        return out
    defaults = [f.default for f in fields(type(ev)) if f.name in names]
    n = len(vals)
    while n > _REQUIRED[tag] and vals[n - 1] == defaults[n - 1]:
        n -= 1
    return [tag, *(_plain(v) for v in vals[:n])]


def encode_batch(batch: EventBatch, *, tagged: bool = True) -> bytes:
    events = [encode_event(e, tagged=tagged) for e in batch.events]
    return _encode([batch.ts, events, batch.dp_rank])


def live_frames(seq: int, payload: bytes, topic: bytes = b"") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), payload]


def replay_frames(seq: int | None, payload: bytes = b"", topic: bytes | None = b"") -> list[bytes]:
    """What a DEALER receives for one replayed batch (seq None: the end marker); topic
    None leaves the topic frame out (SGLang's framing)."""
    seq_raw = END_SEQ if seq is None else seq.to_bytes(8, "big")
    head = [b""] if topic is None else [b"", topic]
    return [*head, seq_raw, payload]
