"""Counting what a large body holds before it is decoded, in a process of its own.

A body of a million tiny messages (or content parts, or prompt items) costs a C decode
pass that holds the GIL for its whole length (about 0.3 s for 32 MB on a busy 2-core
machine), and a thread does not help: the event loop waits for the GIL as long. So
`Prechecker` counts a large body in a child process (`multiprocessing` spawn, one worker,
started off the event loop when `ramjet serve` starts, `Prechecker.start`, else on the
first large body, and again after it dies), and nothing comes back but the counts (`BodyCounts`).

The body goes to the child through a socket, written by a thread of its own with
`os.write`, which lets go of the GIL while the kernel copies: no pickle of the body (a
32 MB pickle held the GIL for 20-50 ms, stalling every stream on the loop).

The count (`body_counts`) is a typed decode that skips every field it does not count:
one small object per message or content part, an int per prompt item. A body the typed
decode cannot read is decoded whole, in the child too, and counted from its objects, or
refused as invalid JSON: the parent never decodes an unreadable large body itself. The
child runs niced (`CHILD_NICENESS`): on a busy machine its counting yields the CPU to the
router and the engines, so one huge body slows its own refusal, not other streams.
`ramjet.request.parse` runs the same count in-process for bodies below the child's
threshold (or if the child fails).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import re
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import msgspec

log = logging.getLogger(__name__)


class BodyCounts(NamedTuple):
    """What bounds the work of decoding and rendering a body (see `body_counts`)."""

    messages: int
    """Top-level `messages` (0 if none)."""
    parts: int
    """Content parts over every message's `content` array."""
    prompt_items: int
    """Items of a `prompt` array, and of the arrays in it (0 for a string prompt)."""
    error: str = ""
    """Not empty: the body is not valid JSON (the decoder's message)."""
    values: int = 0
    """At least the number of JSON values in the body (every array element, object
    member value and container, in any field): `values_bound`'s figure, a bound on what
    the full decode allocates. Only computed when asked for (`body_counts`)."""


class CountLimits(NamedTuple):
    """The limits `body_counts` checks against (`ramjet.request.parse.ParseLimits`'s)."""

    messages: int
    parts: int
    prompt_items: int
    values: int


class _Skipped(msgspec.Struct, gc=False):
    """A content part (or anything object-like), every field skipped: only counted."""


class _Message(msgspec.Struct, gc=False):
    content: str | list[_Skipped | str] | None = None


class _Envelope(msgspec.Struct, gc=False):
    """The fields of a body that bound the work of decoding the rest."""

    messages: list[_Message] | None = None
    prompt: str | list[int | str | list[int]] | None = None


def _prompt_items_typed(prompt: str | list[int | str | list[int]] | None) -> int:
    if not isinstance(prompt, list):
        return 0
    return len(prompt) + sum(len(p) for p in prompt if isinstance(p, list))


def _counts_of(obj: Any) -> BodyCounts:
    """`BodyCounts` of a body decoded whole (a shape the typed decode refused)."""
    if not isinstance(obj, dict):
        return BodyCounts(0, 0, 0)
    messages = obj.get("messages")
    n = parts = 0
    if isinstance(messages, list):
        n = len(messages)
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                parts += len(content)
    prompt = obj.get("prompt")
    items = 0
    if isinstance(prompt, list):
        items = len(prompt) + sum(len(p) for p in prompt if isinstance(p, list))
    return BodyCounts(n, parts, items)


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_COUNTED = bytes(c for c in range(256) if c not in b",[{")
"""Every byte but a comma and an opening bracket (`_bound_of`'s `translate` drops them)."""


def _bound_of(body: bytes) -> int:
    """Commas plus twice the opening brackets, plus one: from one C pass that keeps only
    those bytes (`bytes.count` takes a pass per byte value, each slower than this one)."""
    kept = body.translate(None, _NOT_COUNTED)
    commas = kept.count(b",")
    return commas + 2 * (len(kept) - commas) + 1


def values_bound(body: bytes, limit: int, valid: bool = False) -> int:
    """An upper bound on the JSON values in `body` (each container holds at most one
    more element than it has commas): from its raw commas and brackets (one C pass),
    and, only when that passes `limit`, from those outside its strings (a regex pass:
    commas in text do not count).

    `valid`: `body` is known to be JSON. Outside its strings every opening bracket then
    has a closing one, so those commas and brackets bound it by `len(body) + 1`; when
    that is within `limit`, it is returned without a pass (no verdict changes: the
    count outside strings is what a refusal needs to pass)."""
    if valid and len(body) + 1 <= limit:
        return len(body) + 1
    raw = _bound_of(body)
    if raw <= limit:
        return raw
    return _bound_of(_JSON_STRING.sub(b'""', body))


def _with_values(c: BodyCounts, body: bytes, limits: CountLimits | None) -> BodyCounts:
    """`c` with `values_bound`, when `limits` asks for it and no other count of `c`
    breaks them already (those are cheaper). `body` has been decoded: it is JSON."""
    if limits is None or (
        c.messages > limits.messages
        or c.parts > limits.parts
        or c.prompt_items > limits.prompt_items
    ):
        return c
    return c._replace(values=values_bound(body, limits.values, valid=True))


def _typed(body: bytes) -> _Envelope | None:
    """The body as the counted shape, or None where it has another (then decoded whole)."""
    try:
        return msgspec.json.decode(body, type=_Envelope)
    except (msgspec.MsgspecError, RecursionError, UnicodeDecodeError):
        return None


def body_counts(body: bytes, limits: CountLimits | None = None) -> BodyCounts:
    """What `body` holds (`BodyCounts`): a typed decode that skips what it does not
    count, else (a shape it refuses) a whole decode, else the JSON error. With `limits`,
    also `values_bound` (only if the other counts are within them)."""
    env = _typed(body)
    if env is not None:
        msgs = env.messages or ()
        parts = sum(len(m.content) for m in msgs if isinstance(m.content, list))
        c = BodyCounts(len(msgs), parts, _prompt_items_typed(env.prompt))
        return _with_values(c, body, limits)
    try:
        return _with_values(_counts_of(msgspec.json.decode(body)), body, limits)
    except RecursionError:
        return BodyCounts(0, 0, 0)  # the parse refuses it, cheaply (msgspec stops early)
    except UnicodeDecodeError as e:
        return BodyCounts(0, 0, 0, f"request body is not valid UTF-8: {e.reason}")
    except msgspec.MsgspecError as e:
        return BodyCounts(0, 0, 0, f"request body is not valid JSON: {e}")


_COUNTS = struct.Struct("<qqqq")
_LIMITS = struct.Struct("<qqqq")
CHILD_NICENESS = 10
"""Added to the child's nice value (`os.nice`)."""


def _serve(conn: multiprocessing.connection.Connection) -> None:
    """The child: count each body it is sent, answer with the counts (and error). It
    runs at a lower CPU priority: on a busy machine the streams' work comes first."""
    with contextlib.suppress(OSError):
        os.nice(CHILD_NICENESS)
    while True:
        try:
            limits = CountLimits(*_LIMITS.unpack(conn.recv_bytes()))
            body = conn.recv_bytes()
        except (EOFError, OSError):
            return
        c = body_counts(body, limits)
        del body
        conn.send_bytes(
            _COUNTS.pack(c.messages, c.parts, c.prompt_items, c.values) + c.error.encode()
        )


class _Child:
    """One child process and its end of the socket (used from one thread at a time)."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, theirs = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_serve, args=(theirs,), daemon=True, name="ramjet-count")
        self.proc.start()
        theirs.close()

    def count(self, body: bytes, limits: CountLimits) -> BodyCounts:
        # `send_bytes` writes with os.write in a loop: the GIL is let go while the
        # kernel copies each piece.
        self.conn.send_bytes(_LIMITS.pack(*limits))
        self.conn.send_bytes(body)
        raw = self.conn.recv_bytes()
        n, parts, items, values = _COUNTS.unpack_from(raw)
        return BodyCounts(n, parts, items, raw[_COUNTS.size :].decode(), values)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.close()
        if self.proc.is_alive():
            self.proc.terminate()
        self.proc.join(timeout=5)


class Prechecker:
    """`body_counts` in a child process (see the module docstring). Called on the event
    loop; the exchanges with the child run on one thread of its own, one at a time."""

    def __init__(self) -> None:
        self._thread: ThreadPoolExecutor | None = None
        self._child: _Child | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.started = 0
        """Child processes started so far (tests read it)."""

    def _thread_pool(self) -> ThreadPoolExecutor:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="ramjet-count")
        return self._thread

    def start(self) -> None:
        """Start the child now, on the worker thread (`ramjet serve` does at its start),
        so that the first large body does not wait for a process to start, nor compete
        with other streams for the CPU that takes."""
        self._thread_pool().submit(self._start_child)

    def _start_child(self) -> None:
        try:
            with self._lock:
                self._ensure_child()
        except Exception:  # the first large body tries again, and falls back if need be
            log.exception("starting the counting child failed")

    def _ensure_child(self) -> _Child:
        child = self._child
        if child is None:
            if self._closed:
                raise OSError("the counting child is closed")
            child = self._child = _Child()
            self.started += 1
            if self._closed:  # closed while it started: `close` may not have seen it
                self._child = None
                child.close()
                raise OSError("the counting child is closed")
        return child

    def _exchange(self, body: bytes, limits: CountLimits) -> BodyCounts:
        """On the worker thread: the child's counts of `body` (a dead child is replaced
        once; a second failure raises)."""
        with self._lock:
            for attempt in (0, 1):
                child = self._ensure_child()
                try:
                    return child.count(body, limits)
                except (EOFError, OSError):
                    self._child = None
                    child.close()
                    if attempt:
                        raise
            raise AssertionError("unreachable")

    async def count(self, body: bytes, limits: CountLimits) -> BodyCounts:
        """`body_counts(body, limits)`, computed in the child (raises if the child
        fails). A
        caller cancelled while its body is with the child leaves the exchange to finish
        on the worker thread (the next one waits for it)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._thread_pool(), self._exchange, body, limits
        )

    def close(self) -> None:
        self._closed = True
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.shutdown(wait=False, cancel_futures=True)
        child, self._child = self._child, None
        if child is not None:
            child.close()
