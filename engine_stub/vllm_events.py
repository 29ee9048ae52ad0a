"""The reference engine's cache events in vLLM's KV-event wire format (`--kv-events`).

So that Ramjet's sidecar (`ramjet sidecar --engine-kind vllm`) is tested end to end
against a real engine process, the engine can publish what its global-KV store does the
way vLLM does: a ZMQ PUB socket sending `[topic, seq (8 bytes BE), msgpack batch]`, and a
ROUTER replay socket answering a DEALER's `[b"", start_seq]` with every buffered batch
from that seq on (`[b"", topic, seq, payload]`, vLLM's framing since PR #45177; SGLang's
without the topic with `replay_topic=False`) and then the end marker `0xFF` x 8. Batches
are numbered from 0 per process, so a restart starts again at 0. Encoding and framing
are `ramjet.sidecar.wire`'s, the one implementation the sidecar decodes with.

Mapping the engine's events (`engine_stub.events`) to vLLM's:
- `stored` at tier T            -> BlockStored(medium T)
- `moved` from F to T           -> BlockStored(medium T), then BlockRemoved(medium F): a
  demotion or promotion makes a copy and drops the old one, as vLLM's offloading and
  SGLang's host cache do;
- `evicted` from T              -> BlockRemoved(medium T).
Media: HBM "GPU", host "CPU", SSD "STORAGE". The engine's SWA pool is not published
(with bounded replay the SWA layers leave prefix caching).

Block hashes follow vLLM's `sha256_cbor` (`ramjet.sidecar.engine_hashes`), with NONE_HASH
derived from the model name, published as the low 64 bits. The token ids of each block
come from `CacheEvents.describe`, which the server calls with every prompt's block keys
and tokens before the blocks are stored; a block the engine stores without them (SSD
blocks re-indexed at start) is not published, which under-reports, never over-reports.
A salted request's first block carries its `cache_salt` as extra keys, as vLLM's does,
so its hashes differ from the unsalted prompt's and the sidecar maps none of its blocks.

Fault injection for tests: `drop_live` names batch seqs that go to the replay buffer
but not out on the live socket (a lost message the sidecar must heal from replay).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

import zmq

from engine_stub.events import CacheEvent, CacheEvents
from ramjet.sidecar.engine_hashes import vllm_block_hashes, vllm_event_hash, vllm_none_hash
from ramjet.sidecar.wire import (
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    encode_batch,
    live_frames,
    replay_frames,
)
from ramjet.types import PrefixKey, Tier

log = logging.getLogger("engine_stub.vllm_events")

MEDIUM = {Tier.HBM: "GPU", Tier.HOST: "CPU", Tier.SSD: "STORAGE"}

_Block = tuple[bytes, bytes | None, tuple[int, ...], tuple[str, ...] | None]
"""A described block: its digest, its parent's (None: first), tokens, extra keys."""


class ZmqEventPublisher:
    """PUB + ROUTER replay sockets owned by one thread; `publish` is thread-safe."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        *,
        topic: bytes = b"",
        buffer_steps: int = 10_000,
        tagged: bool = True,
        replay_topic: bool = True,
        drop_live: Iterable[int] = (),
    ) -> None:
        self.topic = topic
        self.tagged = tagged
        self.replay_topic = replay_topic
        self.drop_live = frozenset(drop_live)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._q: queue.SimpleQueue[EventBatch | None] = queue.SimpleQueue()
        self._seq = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self._router: zmq.Socket[bytes] | None = None
        if replay_endpoint is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(replay_endpoint)
        # a PAIR over inproc wakes the owning thread when a batch is queued
        self._wake_addr = f"inproc://kv-events-wake-{id(self)}"
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.connect(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[Event]) -> None:
        if events:
            self._q.put(EventBatch(time.time(), tuple(events), None))
            with self._wake_lock:
                self._wake_tx.send(b"", zmq.NOBLOCK)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_rx, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        while not self._stop:
            ready = dict(poller.poll(100))
            if self._wake_rx in ready:
                with contextlib.suppress(zmq.Again):
                    while True:
                        self._wake_rx.recv(zmq.NOBLOCK)
            self._drain()
            if self._router is not None and self._router in ready:
                self._serve_replay()
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                batch = self._q.get_nowait()
            except queue.Empty:
                return
            if batch is None:
                continue
            seq = self._seq
            self._seq += 1
            payload = encode_batch(batch, tagged=self.tagged)
            self._buffer.append((seq, payload))
            if seq not in self.drop_live:
                self._pub.send_multipart(live_frames(seq, payload, self.topic))

    def _serve_replay(self) -> None:
        assert self._router is not None
        with contextlib.suppress(zmq.Again):
            while True:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
                if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                    continue  # not a replay request
                ident, start = frames[0], int.from_bytes(frames[2], "big")
                topic = self.topic if self.replay_topic else None
                for seq, payload in list(self._buffer):
                    if seq >= start:
                        self._router.send_multipart([ident, *replay_frames(seq, payload, topic)])
                self._router.send_multipart([ident, *replay_frames(None, b"", topic)])

    def close(self) -> None:
        self._stop = True
        with self._wake_lock:
            self._wake_tx.send(b"", zmq.NOBLOCK)
        self._thread.join(timeout=5)
        for s in (self._pub, self._router, self._wake_rx, self._wake_tx):
            if s is not None:
                s.close(linger=0)
        self._ctx.term()


class VllmEventBridge:
    """Turns the engine's cache events into vLLM BlockStored/BlockRemoved batches."""

    def __init__(
        self,
        events: CacheEvents,
        publisher: ZmqEventPublisher,
        *,
        model: str,
        block_tokens: int,
        flush_s: float = 0.005,
        max_blocks: int = 1 << 20,
    ) -> None:
        self.publisher = publisher
        self.block_tokens = block_tokens
        self._none = vllm_none_hash("sha256_cbor", model)
        # router key -> (digest, parent digest or None, tokens, extra keys); LRU-bounded
        self._blocks: OrderedDict[PrefixKey, _Block] = OrderedDict()
        self._max = max_blocks
        self._pending: list[Event] = []
        self._lock = threading.Lock()
        self._flush_s = flush_s
        self._timer: threading.Timer | None = None
        self.unpublished = 0
        events.subscribe_blocks(self._describe)
        events.subscribe(self._on_event)

    def _describe(
        self, keys: Sequence[PrefixKey], tokens: Sequence[int], salt: str | None = None
    ) -> None:
        b = self.block_tokens
        with self._lock:
            parent: bytes | None = None
            for i, key in enumerate(keys):
                known = self._blocks.get(key)
                if known is not None:
                    self._blocks.move_to_end(key)
                    parent = known[0]
                    continue
                block = tuple(tokens[i * b : (i + 1) * b])
                # vLLM hashes a request's cache_salt into its first block (extra keys),
                # so every block of a salted prompt differs from the unsalted one's
                extra = (salt,) if i == 0 and salt is not None else None
                (digest,) = vllm_block_hashes(
                    block, b, "sha256_cbor", self._none, parent, None if extra is None else [extra]
                )
                self._blocks[key] = (digest, parent, block, extra)
                parent = digest
            while len(self._blocks) > self._max:
                self._blocks.popitem(last=False)

    def _stored(self, key: PrefixKey, tier: Tier) -> Event | None:
        info = self._blocks.get(key)
        if info is None:
            self.unpublished += 1
            return None
        digest, parent, tokens, extra = info
        return BlockStored(
            block_hashes=(vllm_event_hash(digest),),
            parent_block_hash=None if parent is None else vllm_event_hash(parent),
            token_ids=tokens,
            block_size=self.block_tokens,
            medium=MEDIUM[tier],
            extra_keys=None if extra is None else (extra,),
            kv_cache_spec_kind="full_attention",
        )

    def _removed(self, key: PrefixKey, tier: Tier) -> Event | None:
        info = self._blocks.get(key)
        if info is None:
            return None
        return BlockRemoved((vllm_event_hash(info[0]),), MEDIUM[tier])

    def _on_event(self, ev: CacheEvent) -> None:
        out: list[Event | None] = []
        with self._lock:
            if ev.kind == "stored" and ev.tier is not None:
                out.append(self._stored(ev.key, ev.tier))
            elif ev.kind == "moved" and ev.tier is not None and ev.from_tier is not None:
                out += [self._stored(ev.key, ev.tier), self._removed(ev.key, ev.from_tier)]
            elif ev.kind == "evicted" and ev.tier is not None:
                out.append(self._removed(ev.key, ev.tier))
            else:
                return
            self._pending += [e for e in out if e is not None]
            # one batch per engine step: events arriving within flush_s go together
            if self._timer is None and self._pending:
                self._timer = threading.Timer(self._flush_s, self.flush)
                self._timer.daemon = True
                self._timer.start()

    def flush(self) -> None:
        """Publish what is pending now. A flush before the batch's timer fired (the
        engine closing, a test) cancels that timer: it would fire later, early for the
        next batch, and a thread would wait out `flush_s` for nothing."""
        with self._lock:  # publish under the lock: batches leave in the order they formed
            pending, self._pending = self._pending, []
            timer, self._timer = self._timer, None
            self.publisher.publish(pending)
        if timer is not None:
            timer.cancel()  # a no-op from the timer's own thread (it has fired)

    def close(self) -> None:
        self.flush()
        self.publisher.close()
