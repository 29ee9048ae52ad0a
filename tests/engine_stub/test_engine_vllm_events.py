"""The reference engine's vLLM-format cache events (`engine_stub.vllm_events`) read by
the real sidecar tracker: a salted prompt's blocks are published as vLLM publishes them
(the salt hashed into the first block), so the sidecar never takes them for the unsalted
prompt's blocks."""

from __future__ import annotations

import threading
import time
from typing import Any

from engine_stub.events import CacheEvent, CacheEvents
from engine_stub.vllm_events import VllmEventBridge
from ramjet.keys.prefix import compute_keys, key_seed, render_completion
from ramjet.keys.tokens import chain_keys, token_key_seed
from ramjet.reports.bodies import DeltaBuilder
from ramjet.sidecar.tracker import VLLM_MEDIA, ResidencyTracker
from ramjet.sidecar.wire import BlockStored, Event
from ramjet.types import Tier

B = 4


class Collect:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def publish(self, events: list[Event]) -> None:
        self.events += events


def test_salted_blocks_get_vllms_salted_hashes_and_the_sidecar_maps_none() -> None:
    events, out = CacheEvents(), Collect()
    bridge = VllmEventBridge(events, out, model="m", block_tokens=B, flush_s=3600)  # type: ignore[arg-type]
    tokens = list(range(1, 2 * B + 1))
    text = render_completion("x" * 600)
    keys: dict[str | None, Any] = {
        s: compute_keys(text, key_seed("m", salt=s)).blocks[:2] for s in (None, "a")
    }

    def store(salt: str | None) -> list[BlockStored]:
        events.describe(keys[salt], tokens, salt)
        for k in keys[salt]:
            events.emit(CacheEvent("stored", k, time.time(), Tier.HBM, n_tokens=B))
        bridge.flush()
        got = [e for e in out.events if isinstance(e, BlockStored)]
        out.events.clear()
        return got

    plain, salted = store(None), store("a")
    assert plain[0].extra_keys is None and salted[0].extra_keys == (("a",),)
    assert {h for e in plain for h in e.block_hashes}.isdisjoint(
        h for e in salted for h in e.block_hashes
    )
    tracker = ResidencyTracker("m", VLLM_MEDIA, B)
    tracker.apply(plain + salted, DeltaBuilder())
    want = chain_keys(tokens, token_key_seed("m"), B)
    assert tracker.resident() == dict.fromkeys(want, Tier.HBM)
    # the unsalted blocks go; the salted ones stay, and must not keep the keys resident
    for k in keys[None]:
        events.emit(CacheEvent("evicted", k, time.time(), Tier.HBM))
    bridge.flush()
    tracker.apply(out.events, DeltaBuilder())
    assert tracker.resident() == {}
    # each flush ended its batch's timer: no thread is left waiting out the hour
    timers = [t for t in threading.enumerate() if isinstance(t, threading.Timer)]
    for t in timers:
        t.join(timeout=5)
    assert not [t for t in timers if t.is_alive()]
