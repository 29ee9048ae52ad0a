"""Workloads: trace files → `Request`s in arrival order.

Formats (auto-detected by extension and fields, see `load_trace`):

- Mooncake jsonl: `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (one
  id per `block_tokens`-token block, 512 by default, the last possibly partial). In the
  real production traces timestamps are rounded to ~3 s buckets; `jitter_s` spreads the
  requests of a bucket uniformly (seeded) over it. The bundled synthetic trace has
  millisecond timestamps already, so the default is no jitter.
- Agent jsonl: the same plus `session_id` and `turn`, 64-token blocks; optionally
  `service_ms`, the time the original run took from sending the turn to its last token
  (closed-loop replay subtracts it from the gap to the next turn: `simulations.sessions`).
- Azure CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`): lengths and arrivals only;
  prefix identity and sessions are generated, seeded (`azure_sessions`).

Prefix keys: hash ids are chained into `PrefixKey`s exactly as the router chains block
keys (`key_i = xxh3_64(id_i, seed=key_{i-1})`), so block i's key names the whole prefix
up to block i and a resident block implies its predecessors.

Message boundaries: a trace has no message text, so the boundaries a request's
`RequestView` carries are the full-block offsets at which an earlier request's prompt
ended (where that request's SWA state would be kept, at block granularity). Every
request's own SWA state is stored at its last full block (`swa_key`).
"""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

import xxhash

from ramjet.types import PrefixKey

_xxh3 = xxhash.xxh3_64_intdigest
_SEED = 0x52414D4A4554  # "RAMJET"


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


@dataclass(slots=True)
class Request:
    """One request of a workload. Times in seconds, lengths in tokens."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    block_keys: list[PrefixKey]
    block_tokens: list[int]
    session: str | None = None
    boundaries: tuple[tuple[int, PrefixKey], ...] = ()
    """(token offset, key) of earlier requests' ends inside this prompt, ascending."""
    swa_key: PrefixKey | None = None
    """Key of this request's last full block: where its SWA state is kept."""
    swa_offset: int = 0
    view: object | None = None
    """The `RequestView` built for it (cached: it does not depend on simulated state)."""
    turn: int | None = None
    """Position in its session (agent traces), 0 first."""
    service_s: float | None = None
    """The original run's time from send to last token, where the trace records it."""


def chain_keys(hash_ids: Iterable[int]) -> list[PrefixKey]:
    keys: list[PrefixKey] = []
    prev = _SEED
    for h in hash_ids:
        prev = _xxh3(int(h).to_bytes(8, "little", signed=False), seed=prev)
        keys.append(PrefixKey(prev))
    return keys


def _blocks(n: int, nblocks: int, block: int) -> list[int]:
    if nblocks == 0:
        return []
    last = n - (nblocks - 1) * block
    return [block] * (nblocks - 1) + [max(1, min(block, last))]


def finish(requests: list[Request], block: int) -> list[Request]:
    """Sort by arrival, renumber, and derive boundaries and SWA keys (see module doc)."""
    requests.sort(key=lambda r: r.arrival_s)
    ends: set[PrefixKey] = set()
    for i, r in enumerate(requests):
        r.index = i
        full = r.prompt_tokens // block
        full = min(full, len(r.block_keys))
        bounds = []
        for b in range(full):
            if r.block_keys[b] in ends:
                bounds.append(((b + 1) * block, r.block_keys[b]))
        r.boundaries = tuple(bounds)
        if full > 0:
            r.swa_key = r.block_keys[full - 1]
            r.swa_offset = full * block
            ends.add(r.swa_key)
    return requests


def load_jsonl(
    path: Path, block: int | None, jitter_s: float, seed: int
) -> tuple[list[Request], int]:
    rng = random.Random(seed)
    out: list[Request] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                ts = float(obj["timestamp"]) / 1000.0
                n = int(obj["input_length"])
                o = int(obj["output_length"])
                ids = [int(h) for h in obj["hash_ids"]]
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceError(f"{path}:{lineno}: {exc!r}") from None
            if n < 0 or o < 0:
                raise TraceError(f"{path}:{lineno}: negative length")
            if block is None:
                block = 64 if "session_id" in obj else 512
            if jitter_s > 0:
                ts = (ts // jitter_s) * jitter_s + rng.random() * jitter_s
            session = obj.get("session_id")
            try:
                turn = None if obj.get("turn") is None else int(obj["turn"])
                service = obj.get("service_ms")
                service_s = None if service is None else float(service) / 1000.0
            except (ValueError, TypeError) as exc:
                raise TraceError(f"{path}:{lineno}: {exc!r}") from None
            if (turn is not None and turn < 0) or (service_s is not None and service_s < 0):
                raise TraceError(f"{path}:{lineno}: negative turn or service_ms")
            out.append(
                Request(
                    index=0,
                    arrival_s=ts,
                    prompt_tokens=n,
                    output_tokens=o,
                    block_keys=chain_keys(ids),
                    block_tokens=_blocks(n, len(ids), block),
                    session=str(session) if session is not None else None,
                    turn=turn,
                    service_s=service_s,
                )
            )
    if block is None:
        raise TraceError(f"{path}: no requests")
    return finish(out, block), block


def _parse_time(text: str) -> float:
    # "2023-11-16 18:17:03.9799600": seven fractional digits, more than fromisoformat takes
    head, _, frac = text.strip().partition(".")
    base = datetime.fromisoformat(head).timestamp()
    return base + (float("0." + frac) if frac else 0.0)


def azure_sessions(
    rows: list[tuple[float, int, int]],
    block: int,
    seed: int,
    follow_p: float = 0.6,
    idle_s: float = 300.0,
) -> list[Request]:
    """Generated prefix identity for length-only traces (seeded).

    Each request, with probability `follow_p`, continues a session that was active in
    the last `idle_s` seconds and whose previous prompt is no longer than this one
    (chosen uniformly): it shares that prompt's full blocks as its prefix. Otherwise it
    opens a new session whose prompt starts with one of 8 shared system prompts
    (512-4096 tokens) when it is long enough. The remaining blocks are fresh.
    """
    rng = random.Random(seed)
    fresh = iter(range(1 << 40, 1 << 62))
    templates = [[next(fresh) for _ in range(rng.randint(1, 8))] for _ in range(8)]
    open_sessions: list[tuple[float, int, list[int], str]] = []
    out: list[Request] = []
    for ts, n, o in rows:
        nblocks = max(1, -(-n // block))
        open_sessions = [s for s in open_sessions if ts - s[0] <= idle_s]
        fits = [i for i, s in enumerate(open_sessions) if s[1] <= n]
        if fits and rng.random() < follow_p:
            i = rng.choice(fits)
            _, prev_n, prev_ids, sid = open_sessions.pop(i)
            ids = prev_ids[: prev_n // block]
        else:
            sid = f"s{len(out)}"
            tpl = rng.choice(templates)
            ids = list(tpl) if len(tpl) < nblocks else []
        ids = ids[:nblocks] + [next(fresh) for _ in range(nblocks - min(len(ids), nblocks))]
        open_sessions.append((ts, n, ids, sid))
        out.append(Request(0, ts, n, o, chain_keys(ids), _blocks(n, nblocks, block), session=sid))
    return out


def load_azure(path: Path, block: int | None, seed: int) -> tuple[list[Request], int]:
    block = block or 512
    rows: list[tuple[float, int, int]] = []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        for lineno, rec in enumerate(reader, 2):
            try:
                rows.append(
                    (
                        _parse_time(rec["TIMESTAMP"]),
                        int(rec["ContextTokens"]),
                        int(rec["GeneratedTokens"]),
                    )
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceError(f"{path}:{lineno}: {exc!r}") from None
    if not rows:
        raise TraceError(f"{path}: no requests")
    t0 = min(r[0] for r in rows)
    rows = sorted((t - t0, n, o) for t, n, o in rows)
    return finish(azure_sessions(rows, block, seed), block), block


def load_trace(
    path: str | Path, *, block_tokens: int | None = None, jitter_s: float = 0.0, seed: int = 0
) -> tuple[list[Request], int]:
    """Requests in arrival order (first at its own timestamp) and the block size."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"{p}: no such file")
    if p.suffix == ".csv":
        return load_azure(p, block_tokens, seed)
    return load_jsonl(p, block_tokens, jitter_s, seed)


def scale_rate(requests: list[Request], factor: float) -> list[Request]:
    """The same requests arriving `factor` times as fast (new objects; keys shared)."""
    if factor <= 0:
        raise ValueError("rate scale must be positive")
    t0 = requests[0].arrival_s if requests else 0.0
    return [replace(r, arrival_s=(r.arrival_s - t0) / factor) for r in requests]


def replicate(requests: list[Request], copies: int, block: int, seed: int = 0) -> list[Request]:
    """`copies` independent copies of a session trace, for load sweeps of closed-loop work.

    Compressing an agent trace's arrival times makes a turn arrive before the previous
    one was answered, which no agent does. Instead each copy gets its own prefix keys
    (re-chained with the copy number as salt) and session ids, and each session of each
    copy is shifted by a seeded offset that keeps it inside the trace's span, so turns
    keep their real gaps while sessions overlap more. Requests without a session are
    shifted one by one. Copy 0 is the trace itself.
    """
    if copies < 1:
        raise ValueError("copies must be at least 1")
    rng = random.Random(seed)
    t0 = min(r.arrival_s for r in requests)
    t1 = max(r.arrival_s for r in requests)
    out: list[Request] = []
    for c in range(copies):
        by_session: dict[str | None, list[Request]] = {}
        for r in requests:
            by_session.setdefault(
                r.session if r.session is not None else f"#r{r.index}", []
            ).append(r)
        for sid, group in by_session.items():
            lo = min(r.arrival_s for r in group)
            hi = max(r.arrival_s for r in group)
            shift = 0.0 if c == 0 else rng.uniform(t0 - lo, t1 - hi)
            for r in group:
                keys = (
                    r.block_keys
                    if c == 0
                    else [PrefixKey(_xxh3(k.to_bytes(8, "little"), seed=c)) for k in r.block_keys]
                )
                session = None if r.session is None else (r.session if c == 0 else f"{sid}#{c}")
                out.append(
                    Request(
                        0,
                        r.arrival_s + shift,
                        r.prompt_tokens,
                        r.output_tokens,
                        keys,
                        r.block_tokens,
                        session,
                        turn=r.turn,
                        service_s=r.service_s,
                    )
                )
    return finish(out, block)
