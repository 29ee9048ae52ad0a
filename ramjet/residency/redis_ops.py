"""How a residency store operation is spelled in Redis, and replayed on a mirror.

A batch (`Batch`) is one engine's list of operations, applied by the `APPLY` script
(`ramjet.residency.redis_scripts`) and logged in the engine's change log as JSON. Each
operation is a list whose first item is its code:

| op | meaning |
|---|---|
| `["p", kind, tier, confirmed_ms, expires_ms, [key16...]]` | put |
| `["r", table, [key16...]]` | remove |
| `["R", table, now_ms, [[key16, tier, expires_ms]...]]` | replace the exact entries |
| `["P"]` | purge the engine |

`kind` is a table code (`g` global, `s` SWA) and a source (`x` exact, `a` approximate);
`key16` is the prefix key as 16 hex digits. Times in Redis are Unix milliseconds; store
times are seconds of the caller's monotonic clock, and `Clocks` converts with the current
offset between the two clocks.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ramjet.residency.redis_scripts import key16
from ramjet.residency.store import MemoryStore, Table
from ramjet.types import EngineId, PrefixKey, Tier

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
    """The logged form of a `put` (times in wall ms, keys in `key16`)."""
    return [
        "p",
        kind(table, exact),
        int(tier),
        clocks.to_wall_ms(confirmed_at),
        clocks.to_wall_ms(expires_at),
        [key16(k) for k in keys],
    ]


def remove_op(table: Table, keys: Iterable[PrefixKey]) -> list[Any]:
    return ["r", TABLE_CODE[table], [key16(k) for k in keys]]


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


def replay(local: MemoryStore, engine: EngineId, f: dict[str, str], clocks: Clocks) -> None:
    """Replay one logged batch (a change-log entry's fields) on the mirror `local`."""
    for op in json.loads(f["ops"]):
        code = op[0]
        if code == "p":
            op_kind = op[1]
            local.put(
                CODE_TABLE[op_kind[0]],
                engine,
                keys_from16(op[5]),
                Tier(op[2]),
                clocks.to_local(op[3]),
                clocks.to_local(op[4]),
                op_kind[1] == "x",
            )
        elif code == "r":
            local.remove(CODE_TABLE[op[1]], engine, keys_from16(op[2]))
        elif code == "R":
            local.replace_exact(
                CODE_TABLE[op[1]],
                engine,
                [(PrefixKey(int(k, 16)), Tier(t), clocks.to_local(exp)) for k, t, exp in op[3]],
                clocks.to_local(op[2]),
            )
        elif code == "P":
            local.purge(engine)
    for op_kind, evicted in json.loads(f.get("x", "[]")):
        local.remove(CODE_TABLE[op_kind[0]], engine, keys_from16(evicted))


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
