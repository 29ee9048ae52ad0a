"""Following an engine's KV-event stream: sequence numbers, gaps, replay, restarts.

`EventStream.run` (a thread) subscribes to the engine's PUB socket and hands every batch
to `on_batch`, in sequence order, exactly once:

- **start**: right after subscribing, the replay socket is asked for everything it still
  holds (from seq 0), so a sidecar started or restarted beside a running engine knows
  its cache before the engine's next step (an idle engine publishes nothing); live
  batches the replay already covered are then skipped once, not taken for a restart;
- **first contact** with seq s > 0 (no replay at start): batches 0..s-1 are asked of
  the replay socket first (the engine may have cached blocks before the sidecar started);
- **gap** (seq s > last + 1: ZMQ dropped messages, e.g. past the high-water mark): the
  missing batches are fetched from the replay socket (DEALER sends `[b"", last+1]`) and
  applied before s;
- **truncated history**: the first replayed seq is above the one asked for (or the
  replay socket does not answer within `replay_timeout_s`): what happened in between is
  lost, so `on_reset("truncated")` is called (the sidecar forgets its state and starts a
  new epoch whose snapshot is what it learns from then on), then what replay still has
  is applied;
- **engine restart** (seq s <= last: numbering began again at 0): `on_reset("restart")`,
  then the batch is handled as a first contact.

After each burst of messages (the socket drained) `on_flush` runs once, so the sidecar
signs one delta per burst rather than per batch. Messages that do not decode are counted
in `stats` and skipped: a malformed batch changes nothing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from ramjet.sidecar.wire import Message, WireError, parse_live, parse_replay

log = logging.getLogger(__name__)


class EventStream:
    def __init__(
        self,
        events_url: str,
        replay_url: str | None,
        *,
        on_batch: Callable[[Message], None],
        on_reset: Callable[[str], None],
        on_flush: Callable[[], object] = lambda: None,
        topic: bytes = b"",
        replay_timeout_s: float = 2.0,
        max_burst: int = 256,
    ) -> None:
        import zmq  # the [sidecar] extra; imported here so the router never needs it

        self._zmq: Any = zmq
        self.events_url = events_url
        self.replay_url = replay_url
        self.on_batch = on_batch
        self.on_reset = on_reset
        self.on_flush = on_flush
        self.topic = topic
        self.replay_timeout_s = replay_timeout_s
        self.max_burst = max_burst
        self.last: int | None = None
        self.stats: Counter[str] = Counter()
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self.connected = threading.Event()
        self._replayed_to: int | None = None
        """The last seq the start-up replay applied, until the first live batch."""

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        zmq = self._zmq
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        try:
            sub.connect(self.events_url)
            self.catch_up()
            self.connected.set()
            while not self._stop.is_set():
                if not sub.poll(100):
                    continue
                n = 0
                with contextlib.suppress(zmq.Again):
                    while n < self.max_burst:
                        self.handle_live(sub.recv_multipart(zmq.NOBLOCK))
                        n += 1
                self.on_flush()
        finally:
            sub.close(linger=0)
            self.close()

    def catch_up(self) -> None:
        """Apply what the replay socket holds from seq 0 (at start; see the module doc)."""
        got = self.replay(0) if self.replay_url is not None else None
        if not got:
            return  # no replay socket, no answer (a gap heals later) or nothing yet
        if got[0].seq != 0:
            self.stats["truncated"] += 1
            log.warning("replay starts at seq %d: history before it is lost", got[0].seq)
            self.on_reset("truncated")
        expect = got[0].seq
        for m in got:
            if m.seq != expect:
                break
            self._apply(m)
            expect = m.seq + 1
        self.stats["healed"] += expect - got[0].seq
        self._replayed_to = self.last
        self.on_flush()

    def close(self) -> None:
        """Release the ZMQ context (after `run` returned, or when it never ran)."""
        if not self._ctx.closed:
            self._ctx.term()

    # -- sequencing ------------------------------------------------------------------------

    def handle_live(self, frames: list[bytes]) -> None:
        try:
            msg = parse_live(frames)
        except WireError as exc:
            self.stats["malformed"] += 1
            log.warning("malformed live message: %s", exc)
            return
        self.stats["live"] += 1
        replayed, self._replayed_to = self._replayed_to, None
        if replayed is not None and msg.seq <= replayed:
            self.stats["replayed_live"] += 1  # already applied by the start-up replay
            self._replayed_to = replayed
            return
        if self.last is not None and msg.seq <= self.last:
            self.stats["restarts"] += 1
            log.info("event seq went back from %d to %d: engine restarted", self.last, msg.seq)
            self.on_reset("restart")
            self.last = None
        if self.last is None:
            if msg.seq > 0:
                self._heal(0, msg.seq)
        elif msg.seq > self.last + 1:
            self.stats["gaps"] += 1
            self._heal(self.last + 1, msg.seq)
        self._apply(msg)

    def _apply(self, msg: Message) -> None:
        self.on_batch(msg)
        self.last = msg.seq
        self.stats["batches"] += 1

    def _heal(self, start: int, until: int) -> None:
        """Apply batches start..until-1 from the replay socket."""
        got = self.replay(start) if self.replay_url is not None else None
        msgs = [m for m in (got or []) if start <= m.seq < until]
        if got is None or not msgs or msgs[0].seq != start:
            self.stats["truncated"] += 1
            log.warning("replay cannot cover seq %d..%d: history truncated", start, until - 1)
            self.on_reset("truncated")
        else:
            self.stats["healed"] += len(msgs)
        expect: int | None = None
        for m in msgs:
            if expect is not None and m.seq != expect:
                break  # a hole inside the replay: stop; the next live batch shows a gap
            self._apply(m)
            expect = m.seq + 1

    def replay(self, start: int) -> list[Message] | None:
        """Ask the replay socket for batches from `start`; None when it does not answer
        (with its end marker) within `replay_timeout_s`."""
        zmq = self._zmq
        if self.replay_url is None:
            return None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_url)
        out: list[Message] = []
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not dealer.poll(int(left * 1000) + 1):
                    self.stats["replay_timeouts"] += 1
                    return None
                try:
                    msg = parse_replay(dealer.recv_multipart())
                except WireError as exc:
                    self.stats["malformed"] += 1
                    log.warning("malformed replay message: %s", exc)
                    continue
                if msg is None:
                    self.stats["replay_answers"] += 1
                    return out
                out.append(msg)
        finally:
            dealer.close(linger=0)
