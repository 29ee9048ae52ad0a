"""Following the event sequence over real ZMQ sockets (the reference engine's vLLM-format
publisher): live batches in order, a dropped batch healed from replay (with and without
the topic frame), truncated history, an engine restart."""

from __future__ import annotations

import threading
import time

import pytest
from zmq_endpoints import free_endpoint

from engine_stub.vllm_events import ZmqEventPublisher
from ramjet.sidecar.stream import EventStream
from ramjet.sidecar.wire import BlockRemoved, EventBatch, Message, encode_batch, live_frames


def _batch(i: int) -> EventBatch:
    return EventBatch(float(i), (BlockRemoved((i,), "GPU"),), None)


class Rig:
    def __init__(self, **pub_kw: object) -> None:
        self.ev, self.rp = free_endpoint(), free_endpoint()
        self.pub = ZmqEventPublisher(self.ev, self.rp, **pub_kw)  # type: ignore[arg-type]
        self.got: list[int] = []
        self.resets: list[str] = []
        self.stream = EventStream(
            self.ev, self.rp, on_batch=self._on, on_reset=self.resets.append, replay_timeout_s=2
        )

    def _on(self, m: Message) -> None:
        self.got.append(m.seq)

    def close(self) -> None:
        self.stream.close()
        self.pub.close()


@pytest.fixture
def rig_factory():  # type: ignore[no-untyped-def]
    rigs: list[Rig] = []

    def make(**kw: object) -> Rig:
        r = Rig(**kw)
        rigs.append(r)
        return r

    yield make
    for r in rigs:
        r.close()


def test_live_stream_with_a_dropped_batch_is_healed_from_replay(rig_factory) -> None:  # type: ignore[no-untyped-def]
    r = rig_factory(drop_live={2}, topic=b"kv")
    r.stream.topic = b"kv"
    th = threading.Thread(target=r.stream.run, daemon=True)
    th.start()
    assert r.stream.connected.wait(5)
    time.sleep(0.3)  # ZMQ's slow joiner: let the subscription reach the PUB socket
    for i in range(5):
        r.pub.publish(list(_batch(i).events))
    deadline = time.monotonic() + 5
    while len(r.got) < 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    r.stream.stop()
    th.join(5)
    assert r.got == [0, 1, 2, 3, 4]
    assert r.stream.stats["gaps"] == 1 and r.stream.stats["healed"] == 1 and not r.resets


def _wait_buffered(pub: ZmqEventPublisher, n: int) -> None:
    deadline = time.monotonic() + 5
    while len(pub._buffer) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(pub._buffer) >= n


@pytest.mark.parametrize("replay_topic", [True, False])
def test_gap_heals_with_both_replay_framings(rig_factory, replay_topic: bool) -> None:  # type: ignore[no-untyped-def]
    r = rig_factory(replay_topic=replay_topic)
    for i in range(4):
        r.pub.publish(list(_batch(i).events))
    _wait_buffered(r.pub, 4)
    live = lambda s: live_frames(s, encode_batch(_batch(s)))  # noqa: E731
    r.stream.handle_live(live(0))
    r.stream.handle_live(live(3))  # 1 and 2 were lost
    assert r.got == [0, 1, 2, 3] and not r.resets


def test_first_contact_mid_stream_catches_up_from_replay(rig_factory) -> None:  # type: ignore[no-untyped-def]
    r = rig_factory()
    for i in range(3):
        r.pub.publish(list(_batch(i).events))
    _wait_buffered(r.pub, 3)
    r.stream.handle_live(live_frames(3, encode_batch(_batch(3))))
    assert r.got == [0, 1, 2, 3] and not r.resets


def test_truncated_history_resets_then_applies_what_replay_has(rig_factory) -> None:  # type: ignore[no-untyped-def]
    r = rig_factory(buffer_steps=2)
    for i in range(6):
        r.pub.publish(list(_batch(i).events))
    _wait_buffered(r.pub, 2)
    time.sleep(0.1)
    r.stream.handle_live(live_frames(0, encode_batch(_batch(0))))
    r.stream.handle_live(live_frames(6, encode_batch(_batch(6))))  # 1..5 lost; buffer: 4, 5
    assert r.resets == ["truncated"] and r.got == [0, 4, 5, 6]
    assert r.stream.stats["truncated"] == 1


def test_seq_going_back_is_an_engine_restart(rig_factory) -> None:  # type: ignore[no-untyped-def]
    r = rig_factory()
    for s in (0, 1):
        r.stream.handle_live(live_frames(s, encode_batch(_batch(s))))
    r.pub.publish(list(_batch(0).events))
    _wait_buffered(r.pub, 1)
    r.stream.handle_live(live_frames(0, encode_batch(_batch(0))))
    assert r.resets == ["restart"] and r.got == [0, 1, 0]


def test_no_replay_answer_counts_as_truncated() -> None:
    s = EventStream(free_endpoint(), free_endpoint(), on_batch=lambda m: None,
                    on_reset=lambda why: None, replay_timeout_s=0.2)  # fmt: skip
    t0 = time.monotonic()
    try:
        assert s.replay(0) is None
    finally:
        s.close()
    assert time.monotonic() - t0 < 2


def test_malformed_live_message_changes_nothing(rig_factory) -> None:  # type: ignore[no-untyped-def]
    r = rig_factory()
    r.stream.handle_live([b"", b"\x00" * 8, b"\xc1"])
    r.stream.handle_live([b"only two", b"frames"])
    assert r.got == [] and r.stream.last is None and r.stream.stats["malformed"] == 2
