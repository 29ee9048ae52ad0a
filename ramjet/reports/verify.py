"""The checks a report frame passes before it may change anything.

Order (cheapest first; each failure is one `Reason`, counted by the processor):

1. size over `max_report_bytes`            -> oversize          (before any parsing)
2. frame layout                            -> malformed, missing_signature
3. engine id differs from the transport's  -> engine_mismatch   (pulled from engine X)
4. key id: retired / unknown / another's   -> retired_key, unknown_key, wrong_engine_key
5. Ed25519 over the canonical bytes        -> bad_signature
6. issue time older than `max_age_s` or
   later than `max_future_skew_s`          -> too_old, future   (wall clock, injected)
7. epoch later than the issue time plus
   `max_future_skew_s` (an epoch is a start
   time in ms, or any smaller counter)     -> epoch_future
8. a delta/load/profile with seq 0         -> malformed         (numbers start at 1)
9. another epoch than the engine's current (`epoch_change`): a lower one is taken (an
   engine restarted under a clock stepped back) only when the current epoch has been
   silent for `stale_after_s` and the report is issued after the last accepted one; a
   higher one when issued no earlier than the last accepted report
                                           -> epoch_old, replayed
10. sequence: a non-snapshot must have seq > the last accepted seq of the epoch;
   a snapshot seq >= it and an issue time later than the last accepted report's
   (the publisher makes issue times strictly increasing within an epoch)
                                           -> replayed          (old, replayed, reordered)
11. per-engine token bucket                -> rate_limited      (after authentication and
                                              the replay checks, so neither forged nor
                                              replayed frames drain an engine's budget)
12. body parse and bounds; a snapshot's
    body seq must equal the envelope's     -> malformed_body

`ReportVerifier.check` reads the engine's `Cursor` and changes nothing but the rate
bucket; committing an accepted report is the processor's job. `check_async` is the same
with a large frame's verify and parse in a worker thread (the event loop is never held
by one frame for more than a few milliseconds).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from ramjet.reports.bodies import Body, BodyError, SnapshotBody, parse_body
from ramjet.reports.config import ReportsConfig
from ramjet.reports.envelope import (
    Envelope,
    EnvelopeError,
    SignedEnvelope,
    decode,
    verify_signature,
)
from ramjet.reports.keys import KeyRing
from ramjet.types import EngineId

OFFLOAD_BYTES = 512 << 10
"""`check_async` verifies and parses a frame of this size or more in a worker thread:
below it the one-step check holds the loop for a few milliseconds (about 4 ms at this
size, 40-70 ms for a max-size frame of 5.6 MB)."""


class Reason(enum.StrEnum):
    OVERSIZE = "oversize"
    MALFORMED = "malformed"
    MISSING_SIGNATURE = "missing_signature"
    BAD_SIGNATURE = "bad_signature"
    UNKNOWN_KEY = "unknown_key"
    RETIRED_KEY = "retired_key"
    WRONG_ENGINE_KEY = "wrong_engine_key"
    ENGINE_MISMATCH = "engine_mismatch"
    RATE_LIMITED = "rate_limited"
    TOO_OLD = "too_old"
    FUTURE = "future"
    EPOCH_OLD = "epoch_old"
    EPOCH_FUTURE = "epoch_future"
    REPLAYED = "replayed"
    MALFORMED_BODY = "malformed_body"


@dataclass(frozen=True, slots=True)
class Cursor:
    """What the router has accepted from one engine so far."""

    epoch: int
    seq: int
    """Last accepted sequence number in `epoch` (a snapshot's seq counts)."""
    issued_at_ms: int
    """Issue time of the last accepted report."""


@dataclass(frozen=True, slots=True)
class Accepted:
    envelope: Envelope
    body: Body


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: Reason
    detail: str
    engine: EngineId | None = None
    """The engine the frame claimed to come from, once it was decoded."""


def epoch_change(
    cursor: Cursor, epoch: int, issued_at_ms: int, silent_s: float = float("inf")
) -> Reason | None:
    """Whether a report of `epoch` issued at `issued_at_ms` may follow `cursor` as far as
    epochs go (None: yes; same epoch: yes, the sequence decides), the engine's current
    epoch having been silent for `silent_s`. Epochs are not ordered by value alone: an
    engine restarted under a clock stepped back starts a lower one. A lower epoch is taken
    once the current one is silent (`stale_after_s`: its process is gone) and when issued
    after the last accepted report (an older process's frames were issued before it); a
    higher one when issued no earlier than the last accepted report (not a replayed frame
    of a process that came before)."""
    if epoch < cursor.epoch and (issued_at_ms <= cursor.issued_at_ms or silent_s <= 0):
        return Reason.EPOCH_OLD
    if epoch > cursor.epoch and issued_at_ms < cursor.issued_at_ms:
        return Reason.REPLAYED
    return None


def cursor_newer(a: Cursor, b: Cursor) -> bool:
    """Whether state `a` is later than `b` (replicas sharing cursors move forward only)."""
    if a.epoch == b.epoch:
        return a.seq > b.seq
    return epoch_change(b, a.epoch, a.issued_at_ms) is None


class TokenBucket:
    """`rate` tokens per second up to `burst`; clock in seconds (monotonic)."""

    __slots__ = ("burst", "last", "rate", "tokens")

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate, self.burst = rate, float(burst)
        self.tokens, self.last = float(burst), now

    def take(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class ReportVerifier:
    def __init__(
        self,
        keyring: KeyRing,
        config: ReportsConfig,
        cursor_of: Callable[[EngineId], Cursor | None],
        wall_clock: Callable[[], float],
        clock: Callable[[], float],
        last_report_of: Callable[[EngineId], float | None] = lambda e: None,
    ) -> None:
        """`last_report_of`: monotonic time of the engine's last accepted report (None:
        unknown, so a lower epoch is never taken)."""
        self.keyring = keyring
        self.config = config
        self._cursor_of = cursor_of
        self._wall = wall_clock
        self._clock = clock
        self._last_report_of = last_report_of
        self._buckets: dict[EngineId, TokenBucket] = {}
        self._order: dict[EngineId, asyncio.Lock] = {}
        """Per engine (of the key ring): held while one of its frames is off the loop."""
        self._inflight: dict[EngineId, int] = {}
        """Per engine: frames in `check_async` waiting for or holding `_order`."""

    def check(self, frame: bytes, expected_engine: EngineId | None = None) -> Accepted | Rejected:
        opened = self._open(frame, expected_engine)
        if isinstance(opened, Rejected):
            return opened
        return self._judge(*opened)

    async def check_async(
        self, frame: bytes, expected_engine: EngineId | None = None
    ) -> Accepted | Rejected:
        """`check`, with the two long steps of a large frame (`OFFLOAD_BYTES` or more)
        off the event loop: the Ed25519 verify (OpenSSL releases the GIL over the body's
        hash) and the body parse (its keys decoded in pieces, so the GIL changes hands
        between them) each run in a worker thread, while the checks that read or write
        state (cursor, rate bucket) stay on the loop. The engine's frames are still
        judged in the order they arrived: while one of its frames is off the loop, the
        next wait for it (and the caller commits the outcome before they resume)."""
        opened = self._open(frame, expected_engine)
        if isinstance(opened, Rejected):
            return opened
        signed, key = opened
        engine = signed.envelope.engine_id
        large = len(frame) >= OFFLOAD_BYTES
        if not large and not self._inflight.get(engine):
            return self._judge(signed, key)
        lock = self._order.get(engine)
        if lock is None:
            lock = self._order[engine] = asyncio.Lock()
        self._inflight[engine] = self._inflight.get(engine, 0) + 1
        try:
            async with lock:
                if not large:
                    return self._judge(signed, key)
                return await self._judge_off_loop(signed, key)
        finally:
            self._inflight[engine] -= 1

    def _judge(self, signed: SignedEnvelope, key: Ed25519PublicKey) -> Accepted | Rejected:
        """Checks 5-12 in one step."""
        env = signed.envelope
        if not verify_signature(signed, key):
            return Rejected(Reason.BAD_SIGNATURE, f"key id {env.key_id!r}", env.engine_id)
        refused = self._admit(env)
        if refused is not None:
            return refused
        return self._parse(env)

    async def _judge_off_loop(
        self, signed: SignedEnvelope, key: Ed25519PublicKey
    ) -> Accepted | Rejected:
        """Checks 5-12 with the signature and the body in a worker thread; the cursor is
        read again once the body is parsed (a purge may have come meanwhile)."""
        env = signed.envelope
        if not await asyncio.to_thread(verify_signature, signed, key):
            return Rejected(Reason.BAD_SIGNATURE, f"key id {env.key_id!r}", env.engine_id)
        refused = self._admit(env)
        if refused is not None:
            return refused
        outcome = await asyncio.to_thread(self._parse, env)
        if isinstance(outcome, Rejected):
            return outcome
        return self._sequence(env) or outcome

    def _open(
        self, frame: bytes, expected_engine: EngineId | None
    ) -> tuple[SignedEnvelope, Ed25519PublicKey] | Rejected:
        """Checks 1-4: size, layout, engine, key id."""
        cfg = self.config
        if len(frame) > cfg.max_report_bytes:
            return Rejected(Reason.OVERSIZE, f"{len(frame)} bytes > {cfg.max_report_bytes}")
        try:
            signed = decode(frame, cfg.max_report_bytes)
        except EnvelopeError as exc:
            return Rejected(Reason(exc.reason), exc.detail)
        env = signed.envelope
        engine = env.engine_id
        if expected_engine is not None and engine != expected_engine:
            return Rejected(Reason.ENGINE_MISMATCH, f"expected {expected_engine}", engine)
        key = self.keyring.lookup(env.key_id, engine)
        if isinstance(key, str):
            return Rejected(Reason(key), f"key id {env.key_id!r}", engine)
        return signed, key

    def _admit(self, env: Envelope) -> Rejected | None:
        """Checks 6-11 of a frame whose signature holds: issue time, epoch, sequence, the
        rate bucket."""
        cfg = self.config
        engine = env.engine_id
        now_ms = self._wall() * 1000.0
        age_ms = now_ms - env.issued_at_ms
        if age_ms > cfg.max_age_s * 1000.0:
            return Rejected(Reason.TOO_OLD, f"issued {age_ms / 1000:.1f} s ago", engine)
        if -age_ms > cfg.max_future_skew_s * 1000.0:
            return Rejected(Reason.FUTURE, f"issued {-age_ms / 1000:.1f} s ahead", engine)
        if env.epoch > env.issued_at_ms + cfg.max_future_skew_s * 1000.0:
            return Rejected(
                Reason.EPOCH_FUTURE,
                f"epoch {env.epoch} is after the issue time {env.issued_at_ms}",
                engine,
            )
        if env.kind != "snapshot" and env.seq == 0:
            return Rejected(Reason.MALFORMED, "sequence numbers start at 1", engine)
        refused = self._sequence(env)
        if refused is not None:
            return refused
        now = self._clock()
        bucket = self._buckets.get(engine)
        if bucket is None:
            bucket = self._buckets[engine] = TokenBucket(cfg.rate_per_s, cfg.burst, now)
        if not bucket.take(now):
            return Rejected(Reason.RATE_LIMITED, f"over {cfg.rate_per_s}/s", engine)
        return None

    def _sequence(self, env: Envelope) -> Rejected | None:
        """Checks 9-10 against the engine's cursor now."""
        engine = env.engine_id
        cursor = self._cursor_of(engine)
        if cursor is None:
            return None
        last = self._last_report_of(engine)
        quiet = 0.0 if last is None else self._clock() - last - self.config.stale_after_s
        refused = epoch_change(cursor, env.epoch, env.issued_at_ms, quiet)
        if refused is not None:
            return Rejected(refused, f"epoch {env.epoch} after {cursor.epoch}", engine)
        if env.epoch == cursor.epoch:
            stale = (
                env.seq < cursor.seq or env.issued_at_ms <= cursor.issued_at_ms
                if env.kind == "snapshot"
                else env.seq <= cursor.seq
            )
            if stale:
                return Rejected(Reason.REPLAYED, f"seq {env.seq} after {cursor.seq}", engine)
        return None

    def _parse(self, env: Envelope) -> Accepted | Rejected:
        """Check 12: the body. Reads no state (it may run in a worker thread)."""
        try:
            body = parse_body(env.kind, env.body, self.config.max_keys)
        except BodyError as exc:
            return Rejected(Reason.MALFORMED_BODY, str(exc), env.engine_id)
        if isinstance(body, SnapshotBody) and body.seq != env.seq:
            return Rejected(
                Reason.MALFORMED_BODY, "snapshot seq differs from envelope", env.engine_id
            )
        return Accepted(env, body)
