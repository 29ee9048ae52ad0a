"""How a residency store operation is spelled in Redis, and replayed on a mirror.

A batch (`Batch`) is one engine's list of operations, applied by the `APPLY` script
(`ramjet.residency.redis_scripts`) and logged in the engine's change log as JSON. Each
operation is a list whose first item is its code:

| op | meaning |
|---|---|
| `["p", kind, tier, confirmed_ms, expires_ms, [key16...]]` | put |
| `["r", table, [key16...]]` | remove |
| `["R", table, now_ms, [[key16, tier, expires_ms]...]]` | replace the exact entries |
| `["R", table, now_ms, [...], n]` | the first chunk of a replace cut in chunks: `n` `E` chunks follow |
| `["E", table, now_ms, [[key16, tier, expires_ms]...]]` | more entries of the `R` before it (a chunked snapshot) |
| `["P"]` | purge the engine |

Queued (not yet sent), the entries of a replace staged piece by piece may be a
`StagedEntries` instead of a list: spelled as above when a chunk is sealed for sending.

`kind` is a table code (`g` global, `s` SWA) and a source (`x` exact, `a` approximate);
`key16` is the prefix key as 16 hex digits. Times in Redis are Unix milliseconds; store
times are seconds of the caller's monotonic clock, and `Clocks` converts with the current
offset between the two clocks.

Sent to Redis, each record carries its MAC (`Sealer.seal`: a put gets a 7th item, the
list of its keys' MACs; a replace entry a 4th item), and each batch a MAC of its own in
the log. A replica checks a logged batch completely (`decode_ops`) before it applies any
of it, and skips what it cannot read or verify (`InvalidEntry`, counted by the sync).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import sys
import time
from array import array
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain, groupby
from typing import Any, TypeVar

from ramjet.errors import RamjetError
from ramjet.residency.redis_scripts import key16
from ramjet.residency.store import ExactStager, MemoryStore, Table
from ramjet.types import EngineId, PrefixKey, Tier

T = TypeVar("T")

TABLE_CODE = {Table.GLOBAL: "g", Table.SWA: "s"}
CODE_TABLE = {"g": Table.GLOBAL, "s": Table.SWA}


def kind(table: Table, exact: bool) -> str:
    return TABLE_CODE[table] + ("x" if exact else "a")


@dataclass
class Batch:
    engine: EngineId
    mode: str  # "seq" | "free" | "seed"
    epoch: int = -1
    seq: int = -1
    ops: list[list[Any]] = field(default_factory=list)
    lead: Batch | None = None
    """For a later chunk of a batch cut in chunks: the first chunk. The later chunks are
    sent only if Redis applied the first (`ok`); a refused report or seed drops them."""
    status: str = ""
    """Redis's answer to this batch once sent (`ok`, `dup`, `stale`, ...); `sending`
    from the moment the sync takes it up (no later write coalesces into it then)."""
    attempts: int = 0
    """Error replies Redis gave this batch (`RedisSettings.max_batch_attempts`)."""


@dataclass(frozen=True)
class Clocks:
    """The store's monotonic clock and the wall clock Redis times are kept in."""

    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time

    def to_wall_ms(self, t: float) -> int:
        return int((self.wall() + (t - self.clock())) * 1000)

    def to_local(self, ms: int) -> float:
        return self.clock() + (ms / 1000 - self.wall())


def put_op(
    clocks: Clocks,
    table: Table,
    exact: bool,
    tier: Tier,
    confirmed_at: float,
    expires_at: float,
    keys: Iterable[PrefixKey],
) -> list[Any]:
    """The logged form of a `put` (times in wall ms). The keys wait in the write queue
    as a typed array, spelled in `key16` only for the chunk being sent (`Sealer.seal`):
    a list of a string per key, queued until Redis took it, was walked item by item by
    the young collections that found it (13-20 ms passes while a 524k-key part was
    queued)."""
    return [
        "p",
        kind(table, exact),
        int(tier),
        clocks.to_wall_ms(confirmed_at),
        clocks.to_wall_ms(expires_at),
        array("Q", keys),
    ]


def remove_op(table: Table, keys: Iterable[PrefixKey]) -> list[Any]:
    """The logged form of a `remove`; keys as in `put_op`."""
    return ["r", TABLE_CODE[table], array("Q", keys)]


def replace_op(
    clocks: Clocks,
    table: Table,
    entries: Iterable[tuple[PrefixKey, Tier, float]],
    now: float,
) -> list[Any]:
    return [
        "R",
        TABLE_CODE[table],
        clocks.to_wall_ms(now),
        [[key16(k), int(t), clocks.to_wall_ms(exp)] for k, t, exp in entries],
    ]


STAGED_SEGMENT: int = 65_536
"""Entries per segment of a `StagedEntries` (its three arrays are kept in segments of
this many entries): one array grown to a whole snapshot's entries (524k keys: 4 MB of
keys, 4 MB of expiries) was reallocated every 1/16 of its size, each a copy of the
whole array in a piece's turn (1.6-2 ms pieces at 200-260k keys, scratch timing of
1,024-key pieces); a segment's growth copies at most 512 KB."""


class StagedEntries:
    """The entries of a replace staged piece by piece (`RedisStaging`), queued until a
    chunk of them is sent: keys, tiers and expiries (Unix ms) in three typed arrays per
    segment of `STAGED_SEGMENT` entries, 11 bytes an entry and nothing the cyclic GC
    walks. A list of a (key16, tier, expires_ms) tuple per key, held from the first
    piece until Redis took the last chunk, was walked item by item by every collection
    that reached it: 6.5 ms of a young pass in the commit's turn at 450k keys (its 900
    chunk slices were young), as much per gen-2 pass. Slicing gives a `StagedEntries`
    that is a view of the same segments (a chunk of the replace: no copy; a 524k-entry
    replace cut into 1,049 chunks of copied arrays, two C-heap allocations each, took
    2.7-23 ms of the commit's turn); iterating gives (key16, tier, expires_ms) as a
    replace op's list holds them, made only for the chunk being sent (`Sealer.seal`)."""

    __slots__ = ("hi", "lo", "segs")

    def __init__(self) -> None:
        self.segs: list[tuple[array[int], array[int], array[int]]] = []
        """(keys, tiers, expiries) per segment; every segment but the last is full."""
        self.lo = 0
        self.hi = -1
        """The view's entries are `lo` .. `hi` - 1 of the whole; -1: to its end (the
        staged whole, which `add` extends)."""

    def add(self, keys: Sequence[PrefixKey], tier: int, expires_ms: int) -> None:
        if self.hi >= 0:
            raise RuntimeError("a slice of staged entries is a view: add to the whole")
        segs = self.segs
        i, n = 0, len(keys)
        while i < n:
            if not segs or len(segs[-1][0]) >= STAGED_SEGMENT:
                segs.append((array("Q"), array("B"), array("q")))
            ks, ts, es = segs[-1]
            take = min(n - i, STAGED_SEGMENT - len(ks))
            ks.extend(keys[i : i + take] if i or take < n else keys)
            ts.extend(array("B", (tier,)) * take)
            es.extend(array("q", (expires_ms,)) * take)
            i += take

    def _total(self) -> int:
        segs = self.segs
        return (len(segs) - 1) * STAGED_SEGMENT + len(segs[-1][0]) if segs else 0

    def _end(self) -> int:
        return self._total() if self.hi < 0 else self.hi

    def __len__(self) -> int:
        return self._end() - self.lo

    def __getitem__(self, i: slice) -> StagedEntries:
        r = range(self.lo, self._end())[i]
        out = StagedEntries.__new__(StagedEntries)
        if r.step == 1:
            out.segs = self.segs
            out.lo, out.hi = r.start, max(r.start, r.stop)
        else:  # not what the chunking takes: a copy
            out.segs, out.lo, out.hi = [], 0, -1
            for j in r:
                ks, ts, es = self.segs[j // STAGED_SEGMENT]
                at = j % STAGED_SEGMENT
                out.add((PrefixKey(ks[at]),), ts[at], es[at])
        return out

    def __iter__(self) -> Iterator[tuple[str, int, int]]:
        return chain.from_iterable(self._pieces())

    def _pieces(self) -> Iterator[Iterator[tuple[str, int, int]]]:
        lo, hi = self.lo, self._end()
        while lo < hi:
            ks, ts, es = self.segs[lo // STAGED_SEGMENT]
            a = lo % STAGED_SEGMENT
            b = min(len(ks), a + hi - lo)
            yield zip(map(key16, ks[a:b]), ts[a:b], es[a:b], strict=True)
            lo += b - a


def _spelled(op: list[Any]) -> list[Any]:
    """The op with its queued keys (an array, `StagedEntries`) spelled as the lists
    JSON sends."""
    code = op[0]
    if code == "p" and isinstance(op[5], array):
        return [*op[:5], list(map(key16, op[5]))]
    if code == "r" and isinstance(op[2], array):
        return [code, op[1], list(map(key16, op[2]))]
    if code in ("R", "E") and isinstance(op[3], StagedEntries):
        return [*op[:3], [list(e) for e in op[3]], *op[4:]]
    return op


class InvalidEntry(RamjetError, ValueError):
    """A change-log entry or record this replica cannot read or verify; `reason` is the
    label of `ramjet_redis_rejected_total`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


REJECT_REASONS = ("mac", "malformed", "op", "kind", "tier", "epoch")
"""Why a replica skipped something it read from Redis (all counted, none applied):
`mac` missing or wrong MAC, `malformed` not the documented shape, `op` unknown op code,
`kind` unknown table or kind, `tier` unknown tier, `epoch` an epoch in the future."""

SEAL_STEP = 128
"""Records a step of `Sealer.seal_steps` (and of `json_steps`) takes before the event
loop gets a turn: a few tenths of a millisecond each."""

_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_HEXRUN = re.compile(r"[0-9a-f]*")
_LITTLE = sys.byteorder == "little"
_TIERS = frozenset(int(t) for t in Tier)


class Sealer:
    """MACs over what replicas share through Redis (docs/redis.md, "Authentication").

    - a batch (as logged): HMAC-SHA256 over engine, mode, epoch, seq and the ops JSON;
    - a record (one entry as stored, read back by a full pull): keyed BLAKE2b, 8 bytes,
      over engine, kind, key16, tier, confirmed ms and expiry ms;
    - a report-cursor field group (`{P:E}:vc`): HMAC-SHA256 over its values.
    The key is derived from the shared secret, so one secret serves all three. Without a
    secret (`authenticated` False) every MAC is "" and only structure is checked."""

    def __init__(self, secret: bytes | None) -> None:
        self.key = (
            hmac.new(secret, b"ramjet redis residency v1", hashlib.sha256).digest()
            if secret
            else None
        )

    @property
    def authenticated(self) -> bool:
        return self.key is not None

    def mac(self, *parts: object) -> str:
        if self.key is None:
            return ""
        msg = "\x1f".join(map(str, parts)).encode()
        return hmac.new(self.key, msg, hashlib.sha256).hexdigest()

    def record(self, engine: str, kind: str, k16: str, tier: int, conf_ms: int, exp_ms: int) -> str:
        if self.key is None:
            return ""
        msg = f"{engine}|{kind}|{k16}|{tier}|{conf_ms}|{exp_ms}".encode()
        return hashlib.blake2b(msg, key=self.key, digest_size=8).hexdigest()

    def check(self, given: str, *parts: object) -> bool:
        return self.key is None or hmac.compare_digest(given, self.mac(*parts))

    def check_record(
        self, given: str, engine: str, kind: str, k16: str, tier: int, conf_ms: int, exp_ms: int
    ) -> bool:
        return self.key is None or hmac.compare_digest(
            given, self.record(engine, kind, k16, tier, conf_ms, exp_ms)
        )

    def seal(self, engine: str, ops: list[list[Any]]) -> list[list[Any]]:
        """The ops as sent to Redis (`seal_steps`, all steps at once)."""
        return drain(self.seal_steps(engine, ops))

    def seal_steps(
        self, engine: str, ops: list[list[Any]], step: int = SEAL_STEP
    ) -> Generator[None, None, list[list[Any]]]:
        """The ops as sent to Redis, sealed `step` records at a time (the caller yields
        to the event loop at each `yield`; the sealed ops are the generator's return
        value): each record carries its MAC (puts: a parallel list as item 7; replace
        entries: item 4). Only spelled without a secret. What comes out is the same
        whatever the step: a step only says where the work may pause.

        A record's MAC is `record`'s, computed from a keyed hash state that has taken
        the part of the message the op's records share (engine and kind), copied per
        record: the key's block is hashed once per op, not once per record (a chunk is
        hundreds of records: the sealing was about half of the loop's CPU in a load).
        A chunk sealed whole was one turn of 21.5-27.5 ms, traced at 20M blocks
        (`snapshot_chunk_entries` allows 100,000 entries a chunk)."""
        key = self.key
        out: list[list[Any]] = []
        done = 0  # records since the last pause
        for op in ops:
            code = op[0]
            if code == "p":
                _, k, tier, conf, exp, ks = op[:6]
                spelled: list[str] = []
                macs: list[str] = []
                head = (
                    None
                    if key is None
                    else hashlib.blake2b(f"{engine}|{k}|".encode(), key=key, digest_size=8)
                )
                tail = f"|{tier}|{conf}|{exp}".encode()
                for i in range(0, len(ks), step):
                    if done >= step:
                        done = 0
                        yield
                    piece = ks[i : i + step]
                    k16s = list(map(key16, piece)) if isinstance(ks, array) else list(piece)
                    spelled += k16s
                    if head is not None:
                        macs += _macs(head, k16s, tail)
                    done += len(k16s)
                out.append([code, k, tier, conf, exp, spelled, *([macs] if key else op[6:])])
            elif code in ("R", "E"):
                kind, conf, all_entries = op[1] + "x", op[2], op[3]
                entries: list[list[Any]] = []
                for i in range(0, len(all_entries), step):
                    if done >= step:
                        done = 0
                        yield
                    piece = all_entries[i : i + step]
                    before = len(entries)
                    if key is None:
                        entries += [list(e) for e in piece]
                    else:
                        entries += _entry_macs(engine, kind, conf, key, piece)
                    done += len(entries) - before
                out.append([code, op[1], conf, entries, *op[4:]])
            else:
                out.append(_spelled(op))
        return out

    def batch_mac(self, engine: str, mode: str, epoch: int, seq: int, ops_json: str) -> str:
        return self.mac("batch", engine, mode, epoch, seq, ops_json)


def _entry_macs(
    engine: str, kind: str, conf: int, key: bytes, entries: Iterable[Sequence[Any]]
) -> list[list[Any]]:
    """Replace entries (key16, tier, expires_ms) with their `Sealer.record` MAC as a 4th
    item (`head`: a keyed BLAKE2b state that has taken "engine|kind|", copied)."""
    head = hashlib.blake2b(f"{engine}|{kind}|".encode(), key=key, digest_size=8)
    tails: dict[tuple[int, int], bytes] = {}
    out = []
    for k, t, e in entries:
        tail = tails.get((t, e))
        if tail is None:
            tail = tails[(t, e)] = f"|{t}|{conf}|{e}".encode()
        h = head.copy()
        h.update(k.encode() + tail)
        out.append([k, t, e, h.hexdigest()])
    return out


_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


def json_steps(ops: list[list[Any]], step: int = SEAL_STEP) -> Generator[None, None, str]:
    """`json.dumps(ops, separators=(",", ":"))`, the same string, encoded `step` items
    of a long list at a time (the caller yields to the loop at each `yield`): a
    sealed chunk's JSON (28 KB at 500 entries) was encoded in one turn (6 ms at 20M)."""
    parts: list[str] = []
    done = 0  # items since the last pause
    for op in ops:
        items: list[str] = []
        for item in op:
            if isinstance(item, list) and item:
                pieces: list[str] = []
                for i in range(0, len(item), step):
                    if done >= step:
                        done = 0
                        yield
                    piece = item[i : i + step]
                    pieces.append(_ENCODE(piece)[1:-1])
                    done += len(piece)
                items.append("[" + ",".join(pieces) + "]")
            else:
                items.append(_ENCODE(item))
        parts.append("[" + ",".join(items) + "]")
        done += 1
    return "[" + ",".join(parts) + "]"


def drain(steps: Generator[None, None, T]) -> T:
    """Run every step of a stepped computation now; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


def _macs(head: Any, keys16: list[str], tail: bytes) -> list[str]:
    """`Sealer.record` of each key: `head` (a keyed BLAKE2b state that has taken
    "engine|kind|") copied, then the key and `tail` ("|tier|confirmed|expires")."""
    out = []
    for k16 in keys16:
        h = head.copy()
        h.update(k16.encode() + tail)
        out.append(h.hexdigest())
    return out


def _int(v: Any) -> int:
    if type(v) is not int:
        raise InvalidEntry("malformed", f"not an integer: {v!r}")
    return v


def _keys16(v: Any) -> list[PrefixKey]:
    if not isinstance(v, list):
        raise InvalidEntry("malformed", "keys are not a list")
    # a logged chunk's keys (hundreds) checked and converted in a few C passes: every
    # key exactly 16 lowercase hex digits, the whole run one hex string; anything else
    # goes the key-by-key way below, which names the bad key (and decides alike)
    if all(type(k) is str for k in v) and all(len(k) == 16 for k in v):
        joined = "".join(v)
        if _HEXRUN.fullmatch(joined):
            keys = array("Q", bytes.fromhex(joined))
            if _LITTLE:
                keys.byteswap()
            return keys.tolist()  # type: ignore[return-value]  # PrefixKey is an int
    out = []
    for k in v:
        if not isinstance(k, str) or not _HEX16.match(k):
            raise InvalidEntry("malformed", f"bad key16 {k!r}")
        out.append(PrefixKey(int(k, 16)))
    return out


_TIER_OF = {int(t): t for t in Tier}


def _entries_fast(raw: list[Any]) -> list[tuple[PrefixKey, Tier, int]] | None:
    """A replace chunk's entries ([key16, tier, expires_ms(, mac)]...) checked and
    converted with the keys in one pass (`_keys16`); None if any entry is not exactly
    right (the caller then goes entry by entry and raises on the first bad one)."""
    if not all(type(e) is list and 3 <= len(e) <= 4 for e in raw):
        return None
    tiers = [e[1] for e in raw]
    exps = [e[2] for e in raw]
    if not all(type(t) is int and t in _TIER_OF for t in tiers):
        return None
    if not all(type(x) is int for x in exps):
        return None
    try:
        keys = _keys16([e[0] for e in raw])
    except InvalidEntry:
        return None
    return list(zip(keys, map(_TIER_OF.__getitem__, tiers), exps, strict=True))


def _table(code: Any) -> Table:
    t = CODE_TABLE.get(code) if isinstance(code, str) else None
    if t is None:
        raise InvalidEntry("kind", f"unknown table {code!r}")
    return t


def _tier(v: Any) -> Tier:
    if _int(v) not in _TIERS:
        raise InvalidEntry("tier", f"unknown tier {v!r}")
    return Tier(v)


def decode_ops(raw: str) -> list[tuple[Any, ...]]:
    """Parse and check a logged ops list completely before anything is applied. Returns
    (code, ...) tuples with store types (times still wall ms); raises `InvalidEntry`."""
    try:
        ops = json.loads(raw)
    except ValueError as exc:
        raise InvalidEntry("malformed", "ops are not JSON") from exc
    if not isinstance(ops, list):
        raise InvalidEntry("malformed", "ops are not a list")
    out: list[tuple[Any, ...]] = []
    for op in ops:
        if not isinstance(op, list) or not op or not isinstance(op[0], str):
            raise InvalidEntry("malformed", f"bad op {op!r:.80}")
        code = op[0]
        if code == "p" and len(op) in (6, 7):
            k = op[1]
            if not isinstance(k, str) or len(k) != 2 or k[1] not in "xa":
                raise InvalidEntry("kind", f"unknown kind {k!r}")
            out.append(
                (
                    "p",
                    _table(k[0]),
                    k[1] == "x",
                    _tier(op[2]),
                    _int(op[3]),
                    _int(op[4]),
                    _keys16(op[5]),
                )
            )
        elif code == "r" and len(op) == 3:
            out.append(("r", _table(op[1]), _keys16(op[2])))
        elif (code == "R" and len(op) in (4, 5)) or (code == "E" and len(op) == 4):
            if not isinstance(op[3], list):
                raise InvalidEntry("malformed", "replace entries are not a list")
            entries = _entries_fast(op[3])
            if entries is None:  # something is wrong: key by key, to name it
                entries = []
                for e in op[3]:
                    if not isinstance(e, list) or len(e) not in (3, 4):
                        raise InvalidEntry("malformed", f"bad replace entry {e!r:.80}")
                    entries.append((_keys16([e[0]])[0], _tier(e[1]), _int(e[2])))
            more = _int(op[4]) if len(op) == 5 else 0
            if more < 0:
                raise InvalidEntry("malformed", "negative chunk count")
            out.append((code, _table(op[1]), _int(op[2]), entries, more))
        elif code == "P" and len(op) == 1:
            out.append(("P",))
        elif code in ("p", "r", "R", "E", "P"):
            raise InvalidEntry("malformed", f"op {code!r} with {len(op)} items")
        else:
            raise InvalidEntry("op", f"unknown op code {code!r:.20}")
    return out


def decode_evictions(raw: str) -> list[tuple[Table, list[PrefixKey]]]:
    """The `x` field: [[kind, [key16...]]...], keys Redis evicted under its caps."""
    try:
        x = json.loads(raw)
    except ValueError as exc:
        raise InvalidEntry("malformed", "evictions are not JSON") from exc
    if not isinstance(x, list):
        raise InvalidEntry("malformed", "evictions are not a list")
    out = []
    for item in x:
        if not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str):
            raise InvalidEntry("malformed", "bad eviction")
        out.append((_table(item[0][:1]), _keys16(item[1])))
    return out


@dataclass
class StagedReplace:
    """A chunked replace being replayed: its `R` and `E` chunks go into a staged copy
    (`ResidencyStore.stage_exact`) swapped in when the last arrives, so a mirror never
    shows the first chunks of a snapshot alone."""

    stager: ExactStager
    remaining: int


Staged = dict[tuple[EngineId, Table], StagedReplace]


def settle(staged: Staged, engine: EngineId, keep: tuple[EngineId, Table] | None = None) -> None:
    """Swap in (as far as it got) every staged replace of `engine` but `keep`: another
    op of the engine comes between its chunks, and must apply after it, as in Redis."""
    for key in [k for k in staged if k[0] == engine and k != keep]:
        staged.pop(key).stager.commit()


def discard(staged: Staged, engine: EngineId) -> None:
    """Forget staged replaces of `engine` (the mirror's copy is about to be pulled)."""
    for key in [k for k in staged if k[0] == engine]:
        del staged[key]


def replay(
    local: MemoryStore,
    engine: EngineId,
    f: dict[str, str],
    clocks: Clocks,
    sealer: Sealer | None = None,
    staged: Staged | None = None,
) -> None:
    """Check, then replay, one logged batch (a change-log entry's fields) on the mirror
    `local`. Raises `InvalidEntry` (and changes nothing) for an entry this replica cannot
    read or verify. With `staged` (kept by the caller across entries), a chunked replace
    is swapped in whole when its last chunk arrives."""
    keeps = staged is not None  # without a caller's state a replace is applied at once
    staged = staged if staged is not None else {}
    sealer = sealer if sealer is not None else Sealer(None)
    raw = f.get("ops")
    if raw is None:
        raise InvalidEntry("malformed", "entry without ops")
    if sealer.authenticated and not sealer.check(
        f.get("mac", ""), "batch", engine, f.get("m", ""), f.get("e", ""), f.get("s", ""), raw
    ):
        raise InvalidEntry("mac", "batch MAC missing or wrong")
    ops = decode_ops(raw)
    evictions = decode_evictions(f.get("x", "[]"))
    # one offset between the clocks for the whole entry: `Clocks.to_local` reads both
    # clocks per call, and its answer moves by a tick between keys, so a replayed group
    # became a run of the compact index per key (an array each, tracked by the cyclic
    # GC: gen-2 collections of 100+ ms at 450k keys)
    offset = clocks.clock() - clocks.wall()

    def loc(ms: int) -> float:
        return ms / 1000 + offset

    for op in ops:
        code = op[0]
        if code == "E" and (engine, op[1]) in staged:
            settle(staged, engine, keep=(engine, op[1]))
            st = staged[(engine, op[1])]
            _stage(st.stager, op[3], loc)
            st.remaining -= 1
            if st.remaining <= 0:
                staged.pop((engine, op[1])).stager.commit()
            continue
        settle(staged, engine)
        if code == "p":
            _, table, exact, tier, conf, exp, keys = op
            local.put(table, engine, keys, tier, loc(conf), loc(exp), exact)
        elif code == "r":
            local.remove(op[1], engine, op[2])
        elif code == "R":
            stager = local.stage_exact(op[1], engine, loc(op[2])) if keeps and op[4] else None
            if stager is None:
                entries = [(k, t, loc(e)) for k, t, e in op[3]]
                local.replace_exact(op[1], engine, entries, loc(op[2]))
            else:
                _stage(stager, op[3], loc)
                staged[(engine, op[1])] = StagedReplace(stager, op[4])
        elif code == "E":  # its R was not seen here (a pull came between): plain puts
            now = loc(op[2])
            for k, t, e in op[3]:
                local.put(op[1], engine, (k,), t, now, loc(e), True)
        elif code == "P":
            local.purge(engine)
    if evictions:
        settle(staged, engine)
    for table, keys in evictions:
        local.remove(table, engine, keys)


def _stage(
    stager: ExactStager, entries: list[tuple[PrefixKey, Tier, int]], loc: Callable[[int], float]
) -> None:
    """A replace chunk's entries into `stager` in order, a run of entries alike in tier
    and expiry per `add` (a chunk's entries nearly all are: a snapshot group's): what
    an `add` per entry gives (consecutive keys of one expiry share a run either way),
    without a call per key."""
    for (t, e), run in groupby(entries, key=_tier_exp):
        stager.add([k for k, _, _ in run], t, loc(e))


def _tier_exp(entry: tuple[PrefixKey, Tier, int]) -> tuple[Tier, int]:
    return entry[1], entry[2]


def weight(op: list[Any]) -> int:
    """Entries an op writes (its share of a chunk)."""
    code = op[0]
    if code == "p":
        return max(1, len(op[5]))
    if code == "r":
        return max(1, len(op[2]))
    if code in ("R", "E"):
        return max(1, len(op[3]))
    return 1


class Chunker:
    """Cuts ops, added one at a time, into chunks of at most `limit` entries, in order:
    a long put or remove becomes several; a replace becomes an `R` (clear, first
    entries) and `E` continuations. Applying the chunks in order gives what the ops
    give (`split_ops`; a seed adds its ops piece by piece, yielding between)."""

    __slots__ = ("_cur", "_room", "chunks", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.chunks: list[list[list[Any]]] = []
        self._cur: list[list[Any]] = []
        self._room = limit

    def _push(self, op: list[Any]) -> None:
        w = weight(op)
        if w > self._room and self._cur:
            self.chunks.append(self._cur)
            self._cur, self._room = [], self.limit
        self._cur.append(op)
        self._room -= w

    def add(self, op: list[Any]) -> None:
        limit = self.limit
        code = op[0]
        if code == "p" and len(op[5]) > limit:
            for i in range(0, len(op[5]), limit):
                self._push([*op[:5], op[5][i : i + limit]])
        elif code == "r" and len(op[2]) > limit:
            for i in range(0, len(op[2]), limit):
                self._push([op[0], op[1], op[2][i : i + limit]])
        elif code == "R" and len(op[3]) > limit:
            more = (len(op[3]) - 1) // limit  # the E chunks that follow
            self._push(["R", op[1], op[2], op[3][:limit], more])
            for i in range(limit, len(op[3]), limit):
                self._push(["E", op[1], op[2], op[3][i : i + limit]])
        else:
            self._push(op)

    def done(self) -> list[list[list[Any]]]:
        """The chunks (the last one closed)."""
        if self._cur:
            self.chunks.append(self._cur)
            self._cur, self._room = [], self.limit
        return self.chunks


def split_ops(ops: list[list[Any]], limit: int) -> list[list[list[Any]]]:
    """`ops` cut into chunks of at most `limit` entries, in order (`Chunker`)."""
    chunker = Chunker(limit)
    for op in ops:
        chunker.add(op)
    return chunker.done()


def keys_from16(hex_keys: Iterable[str]) -> list[PrefixKey]:
    """Prefix keys from their `key16` spelling (16 hex digits) in Redis."""
    return [PrefixKey(int(k, 16)) for k in hex_keys]


def text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def fields(raw: Any) -> dict[str, str]:
    """A stream entry's field list (flat list from Lua, or a dict) as text."""
    if isinstance(raw, dict):
        return {text(k): text(v) for k, v in raw.items()}
    return {text(raw[i]): text(raw[i + 1]) for i in range(0, len(raw), 2)}
