"""Decision records: what the router decided for a request, what it predicted, and what the
engine then reported it did; one JSON object per line in a size-rotating file.

Contract of one line (schema version `v: 1`; `docs/decisions.md` has an example):

- identity: `id` (request id), `t` (unix seconds at the end), `model`, `session`,
  `prompt_tokens`, `stream`;
- the decision: `mode`, `live` / `incumbent` / `candidate` (each `{engine, policy,
  notes}` or null), `live_role`, `candidate_error`, `candidate_ms`;
- the prediction: `predicted[engine]` is the candidate's `Decision.components` for every
  engine it weighed (`wait_s`, `work_s`, `restore_s`, `replay_s`, `prefill_s`, `cost_s`,
  `ttft_s`, `hbm_tokens`/`host_tokens`/`ssd_tokens`/`swa_tokens`, `resume_tokens`, ...);
  `incumbent_components` likewise for the incumbent when it gives any;
- the outcome: `engine` (that answered), `status`, `end`, `attempts`, router-observed
  `ttft_s` (forward start to first byte sent) and `duration_s`, and `realized`: the
  engine's `usage.prompt_work` (null when the response carried none). `realized_ttft_s`
  is the router's TTFT for a stream, else the engine's queue + restore + prefill time
  (a non-stream's first byte comes after the whole decode), `ttft_source` says which.
- the priority hint (`ramjet.app.priority`): `priority` is null when the engine is in no
  priority pool, else `{pool, mode, outcome, sent, engine, work_s, key_ms, value, client}`
  (`outcome`: sent, observe, canary_out, client_kept, client_invalid).

Realized usage is read from the tail of the body the client received
(`ramjet.proxy.exchange.ResponseTail`, the last 16 KiB): the last `"usage"` key there, decoded
with `json.JSONDecoder.raw_decode` from just after it. The last `"usage"` is the final
SSE chunk's or the non-stream body's (a `"usage"` inside string content is escaped as
`\\"usage\\"`, which does not match). Effort is bounded by the tail, not the body.

The log: `DecisionLog.submit` appends the (record, realized) pair to a bounded queue and
returns at once; a daemon thread, waking every `batch_s` (20 ms) or when `flush` asks,
builds each JSON line (encoded by msgspec, UTF-8, about 9x faster than the standard
library's encoder on these lines; a non-finite figure is written as null), appends
them and flushes once per batch, rotating when the file would pass `max_bytes` (`path` → `path.1`
→ ... → `path.<backups>`, the oldest dropped; `backups: 0` truncates). With `queue_size`
records accepted and not yet written, a new one is dropped and counted: the request path
never waits for the disk. The queue is a `collections.deque`: `submit` takes no lock and
wakes no thread (a wake-up per record cost the event loop futex calls, context switches
and GIL hand-offs under load), so a line reaches the file, and
`ramjet_decision_log_lines_total` counts it, up to `batch_s` after its request ended;
`flush` and `close` write everything accepted before they return.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import msgspec

from ramjet.decisions.prompt_work import COUNT_FIELDS, TTFT_MS_FIELDS, PromptWork
from ramjet.decisions.record import DecisionRecord
from ramjet.policy.base import Decision

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
_USAGE_KEY = b'"usage"'
_PROMPT_WORK = b"prompt_work"
"""What `parse_realized` looks for before it decodes anything (see there)."""
_DECODER = json.JSONDecoder()
_ENCODER = msgspec.json.Encoder()
_INT_FIELDS = COUNT_FIELDS
_MS_FIELDS = TTFT_MS_FIELDS  # restore_io_ms (a part of restore_ms) is not read


@dataclass(slots=True)
class RealizedWork(PromptWork):
    """The engine's own account of a prompt (`usage.prompt_work`, the schema in
    `ramjet.decisions.prompt_work`), with `usage.prompt_tokens`."""

    prompt_tokens: int | None = None
    """usage.prompt_tokens, when present."""

    def to_json(self) -> dict[str, Any]:
        """The decision line's `realized` object (the fields the router reads)."""
        out: dict[str, Any] = {f: getattr(self, f) for f in _INT_FIELDS + _MS_FIELDS}
        out["cached_tokens"] = self.cached_tokens
        if self.prompt_tokens is not None:
            out["prompt_tokens"] = self.prompt_tokens
        return out


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if f == f and f >= 0 else None  # NaN and negatives are not figures


def realized_from_usage(usage: Any) -> RealizedWork | None:
    """`RealizedWork` from a decoded `usage` object; None unless it has a `prompt_work`
    whose fields are all non-negative numbers where present."""
    if not isinstance(usage, dict):
        return None
    pw = usage.get("prompt_work")
    if not isinstance(pw, dict):
        return None
    kw: dict[str, Any] = {}
    for name in _INT_FIELDS + _MS_FIELDS:
        if name in pw:
            v = _number(pw[name])
            if v is None:
                return None
            kw[name] = int(v) if name in _INT_FIELDS else v
    pt = _number(usage.get("prompt_tokens"))
    return RealizedWork(**kw, prompt_tokens=None if pt is None else int(pt))


def find_usage(tail: bytes, max_tries: int = 4) -> Any:
    """The decoded value of the last `"usage"` key in `tail` (see module docstring), or
    None. Tries at most `max_tries` occurrences from the end (a cut object is skipped)."""
    end = len(tail)
    for _ in range(max_tries):
        i = tail.rfind(_USAGE_KEY, 0, end)
        if i < 0:
            return None
        end = i
        j = i + len(_USAGE_KEY)
        while j < len(tail) and tail[j] in b" \t\r\n":
            j += 1
        if j >= len(tail) or tail[j] != ord(":"):
            continue
        try:
            text = tail[j + 1 :].decode("utf-8", errors="replace").lstrip()
            value, _ = _DECODER.raw_decode(text)
        except ValueError:
            continue
        return value
    return None


def parse_realized(tail: bytes) -> RealizedWork | None:
    """The engine's `prompt_work` from the end of a response body, or None. A tail with
    neither the bytes `prompt_work` nor a `\\u` escape cannot decode to an object with
    that key, so it is not decoded (an engine that reports none, vLLM, costs a search)."""
    if not tail or (_PROMPT_WORK not in tail and b"\\u" not in tail):
        return None
    return realized_from_usage(find_usage(tail))


# -- the JSON line ----------------------------------------------------------------------


def _round(v: float) -> float:
    """`v` to 6 significant digits (`float(f"{v:.6g}")`). A whole float under 10**6 is
    already that, and most of a line's figures are (zeros, token counts, flags): they skip
    the formatting, zeros first (one float compare). An int or bool becomes a float, as
    formatting made it; -0.0 stays -0.0. Written for mypyc (`ramjet.native`): `float(v)`
    and `f == int(f)` compile to C, where a type test and `is_integer()` were generic
    calls (4.6 us for a prediction's 19 figures, now ~0.6)."""
    f = float(v)
    if f == 0.0 or (-1e6 < f < 1e6 and f == int(f)):
        return f
    return float(f"{f:.6g}")


_FIGURES: dict[float, float] = {}
"""Figures already formatted, by value, kept across lines (the writer thread is their
only user): requests of one size and load repeat their predictions' figures (`prefill_s`
of a prompt length, `wait_s` of a queue), and equal numbers format alike. Forgotten at
once at `_FIGURES_SIZE`."""
_FIGURES_SIZE = 4096


def _rounded(c: Mapping[str, float], memo: dict[float, float]) -> dict[str, float]:
    """`{k: _round(v)}` over `c`, `_round` inline. `memo` holds formatted figures (the
    line's, or `_FIGURES`): a prediction repeats its figures (`prefill_s` = `work_s`
    without a restore, `ttft_s` = `cost_s` without an externality), and equal numbers
    format alike. Zeros never reach it (-0.0 == 0.0). The out dict is a copy of `c`
    (same keys in the same order, made at its size, no growing) whose values are
    replaced where the figure differs: a float that is already its figure (a zero, a
    whole number: most of a line's) stays the same object; an int or bool becomes a
    float as `_round` makes it. A plain dict (every policy's components are) is walked
    as one, which compiles to a direct walk."""
    items: dict[str, float] = c if isinstance(c, dict) else dict(c)
    out: dict[str, float] = items.copy()
    raw = cast(dict[str, object], items)  # the values as they are: no float made per figure
    for k, v in raw.items():
        exact = type(v) is float
        f = cast(float, v) if exact else float(cast(Any, v))
        if f == 0.0 or (-1e6 < f < 1e6 and f == int(f)):
            if not exact:
                out[k] = f
        else:
            r = memo.get(f)
            if r is None:
                if len(memo) >= _FIGURES_SIZE:
                    memo.clear()
                r = memo[f] = float(f"{f:.6g}")
            out[k] = r
    return out


def _pick(d: Decision | None) -> dict[str, Any] | None:
    if d is None:
        return None
    return {"engine": d.engine, "policy": d.policy, "notes": list(d.notes)}


def _components(d: Decision | None, memo: dict[float, float]) -> dict[str, dict[str, float]]:
    if d is None:
        return {}
    return {str(e): _rounded(c, memo) for e, c in d.components.items()}


def realized_ttft(
    record: DecisionRecord, realized: RealizedWork | None
) -> tuple[float | None, str]:
    """(realized TTFT seconds, source): the router's for a stream, else the engine's."""
    if record.stream and record.ttft_s is not None:
        return record.ttft_s, "router"
    if realized is not None:
        return realized.engine_ttft_s, "engine"
    return None, "none"


def predicted_for(d: Decision | None, engine: str | None, name: str) -> float | None:
    """Component `name` the decision predicted for `engine`, if it weighed that engine."""
    if d is None or engine is None:
        return None
    comp: Mapping[str, float] | None = d.components.get(engine)  # type: ignore[call-overload]
    if comp is None or name not in comp:
        return None
    return float(comp[name])


def decision_entry(record: DecisionRecord, realized: RealizedWork | None) -> dict[str, Any]:
    """The JSON-able line for one record (schema: module docstring)."""
    rt, source = realized_ttft(record, realized)
    memo = _FIGURES
    live = _pick(record.live)  # the same object as one of the other two: one dict
    return {
        "v": SCHEMA_VERSION,
        "id": record.request_id,
        "t": round(record.time_unix, 6),
        "model": record.model,
        "session": record.session,
        "prompt_tokens": record.prompt_tokens,
        "stream": record.stream,
        "mode": record.mode,
        "live_role": record.live_role,
        "live": live,
        "incumbent": live if record.incumbent is record.live else _pick(record.incumbent),
        "candidate": live if record.candidate is record.live else _pick(record.candidate),
        "candidate_error": record.candidate_error,
        "candidate_ms": _round(record.candidate_s * 1e3),
        "predicted": _components(record.candidate, memo),
        "incumbent_components": _components(record.incumbent, memo),
        "engine": record.engine,
        "status": record.status,
        "end": record.end,
        "attempts": [[a.engine, a.status, a.error] for a in record.attempts],
        "ttft_s": None if record.ttft_s is None else _round(record.ttft_s),
        "duration_s": _round(record.duration_s),
        "realized": None if realized is None else realized.to_json(),
        "realized_ttft_s": None if rt is None else _round(rt),
        "ttft_source": source,
        "priority": None if record.priority is None else dict(record.priority),
    }


# -- the log ----------------------------------------------------------------------------


_BUFFER = 1 << 20
"""The log file's write buffer: a batch of lines leaves in one write at its flush (with
the default 8 KiB, one write per 4-5 lines)."""


class RotatingFile:
    """Appends lines to `path`, rotating before a line would take it past `max_bytes`.
    Not thread-safe: the log's writer thread is its only user."""

    def __init__(self, path: str | Path, max_bytes: int, backups: int) -> None:
        if max_bytes <= 0 or backups < 0:
            raise ValueError("max_bytes must be > 0 and backups >= 0")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self.rotations = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "ab", _BUFFER)  # noqa: SIM115 - held open across writes
        self._size = self._f.tell()

    def _rotate(self) -> None:
        self._f.close()
        if self.backups == 0:
            self._f = open(self.path, "wb", _BUFFER)  # noqa: SIM115
        else:
            for i in range(self.backups - 1, 0, -1):
                src = self.path.with_name(f"{self.path.name}.{i}")
                if src.exists():
                    os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
            self._f = open(self.path, "ab", _BUFFER)  # noqa: SIM115
        self._size = 0
        self.rotations += 1

    def write(self, line: bytes) -> None:
        if self._size > 0 and self._size + len(line) > self.max_bytes:
            self._rotate()
        self._f.write(line)
        self._size += len(line)

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()


Item = tuple["DecisionRecord", RealizedWork | None]


class DecisionLog:
    """The background JSON-lines writer (see module docstring). `on_written(n)`,
    `on_dropped()` and `on_rotated()` let the accounting count without this module
    owning metrics; they run on the writer thread (prometheus counters are thread-safe)."""

    def __init__(
        self,
        path: str | Path,
        *,
        max_bytes: int = 64 * 1024 * 1024,
        backups: int = 5,
        queue_size: int = 10_000,
        batch_s: float = 0.02,
        on_written: Callable[[int], None] | None = None,
        on_dropped: Callable[[], None] | None = None,
        on_rotated: Callable[[], None] | None = None,
    ) -> None:
        if not batch_s > 0:
            raise ValueError("batch_s must be > 0")
        self.file = RotatingFile(path, max_bytes, backups)
        self.dropped = 0
        self.written = 0
        self.queue_size = queue_size
        self.batch_s = batch_s
        # A deque the writer empties every `batch_s` (append is atomic: no lock, no
        # wake-up per record); the bound is the count of records accepted and not yet
        # written or given up (`_accepted - _done`).
        self._pending: collections.deque[Item] = collections.deque()
        self._wake = threading.Event()
        self._stopping = False
        self._on_written = on_written
        self._on_dropped = on_dropped
        self._on_rotated = on_rotated
        self._accepted = 0
        """Records accepted by `submit` (changed on the submitting thread only)."""
        self._done = 0
        """Of those, written or lost to a write error (changed by the writer, under _cv)."""
        self._cv = threading.Condition()
        self._writer = threading.Thread(target=self._run, name="ramjet-decision-log", daemon=True)
        self._writer.start()

    def submit(self, record: DecisionRecord, realized: RealizedWork | None) -> bool:
        """Queue one record; False (and counted) when `queue_size` records are already
        accepted and not yet written. Never blocks, takes no lock. Called from one thread
        (the router's event loop)."""
        if self._accepted - self._done >= self.queue_size:
            self.dropped += 1
            if self._on_dropped is not None:
                self._on_dropped()
            return False
        self._accepted += 1
        self._pending.append((record, realized))
        return True

    def _write_batch(self, items: list[Item]) -> None:
        rotations = self.file.rotations
        for record, realized in items:
            try:
                line = _ENCODER.encode(decision_entry(record, realized))
            except (TypeError, ValueError, msgspec.EncodeError):
                log.exception("decision record not serialisable: %s", record.request_id)
                continue
            self.file.write(line + b"\n")
        self.file.flush()
        self.written += len(items)
        if self._on_written is not None:
            self._on_written(len(items))
        if self._on_rotated is not None:
            for _ in range(self.file.rotations - rotations):
                self._on_rotated()

    def _run(self) -> None:
        pending, wake = self._pending, self._wake
        while True:
            wake.wait(self.batch_s)
            wake.clear()
            stop = self._stopping
            while pending:
                batch: list[Item] = []
                with contextlib.suppress(IndexError):
                    while len(batch) < 256:
                        batch.append(pending.popleft())
                try:
                    self._write_batch(batch)
                except OSError:
                    log.exception("decision log write failed; %d records lost", len(batch))
                finally:
                    with self._cv:
                        self._done += len(batch)
                        self._cv.notify_all()
            if stop:
                break
        self.file.close()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every submitted record is written; False on timeout."""
        target = self._accepted
        self._wake.set()
        with self._cv:
            return self._cv.wait_for(lambda: self._done >= target, timeout=timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued, then stop the thread and close the file."""
        self.flush(timeout_s)
        self._stopping = True
        self._wake.set()
        self._writer.join(timeout_s)


def read_log(path: str | Path) -> list[dict[str, Any]]:
    """Every decision line of `path` (a torn last line is skipped); raises OSError."""
    out: list[dict[str, Any]] = []
    with open(path, "rb") as f:
        for raw in f:
            try:
                entry = json.loads(raw)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("v") == SCHEMA_VERSION:
                out.append(entry)
    return out
