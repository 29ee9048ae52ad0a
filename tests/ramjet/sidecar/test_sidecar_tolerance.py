"""A sidecar fed batches a newer (or broken) engine might send, over a real ZMQ PUB
socket: unknown fields and event types are applied around and counted on /metrics; a
malformed removal starts a new epoch holding only what came after it; label values from
the engine are bounded."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import msgspec
import pytest
import zmq
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client import CollectorRegistry
from zmq_endpoints import free_endpoint

from ramjet.keys.tokens import chain_keys, token_key_seed
from ramjet.sidecar.metrics import MAX_LABEL_CHARS, MAX_SERIES, OTHER, SidecarMetrics
from ramjet.sidecar.runner import Sidecar, SidecarSettings
from ramjet.sidecar.wire import EventBatch, Skipped, live_frames
from ramjet.types import Tier

pytestmark = pytest.mark.timeout(30)


async def _until(cond, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def _store(h: int, toks: list[int], **extra: object) -> dict[str, object]:
    return {
        "type": "BlockStored",
        "block_hashes": [h],
        "parent_block_hash": None,
        "token_ids": toks,
        "block_size": 4,
        **extra,
    }


def _key(toks: list[int]) -> int:
    return chain_keys(toks, token_key_seed("m"), 4)[0]


async def test_sidecar_applies_around_unknowns_and_resyncs_on_a_lost_removal() -> None:
    ev = free_endpoint()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(ev)
    registry = CollectorRegistry()
    s = SidecarSettings(
        engine_kind="vllm", engine_id="v0", engine_url="http://127.0.0.1:9", events_url=ev,
        profile="skip",
        replay_url=None, key_id="v0-sc", model="m", block_tokens=4, scrape_metrics=False,
    )  # fmt: skip
    sc = Sidecar(s, Ed25519PrivateKey.generate(), registry)
    app = web.Application()
    sc.add_routes(app)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    await sc.start()
    try:
        await asyncio.sleep(0.3)  # slow joiner
        a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
        first = {
            "ts": 1.0,
            "events": [_store(1, a, cache_level=2), {"type": "BlockPinned", "block_hashes": [1]}],
            "data_parallel_rank": 0,
        }
        pub.send_multipart(live_frames(0, msgspec.msgpack.encode(first)))
        await _until(lambda: sc.stream.stats["batches"] == 1)
        assert sc.tracker.resident() == {_key(a): Tier.HBM}
        epoch1 = sc.publisher.epoch

        # b stored, then a removal whose hashes are not an array: the engine may have
        # dropped a or b, so both are forgotten; c (after it) is applied in a new epoch
        lost = {"type": "BlockRemoved", "block_hashes": 1}
        second = [2.0, [_store(2, b), lost, _store(3, c)], 0]
        pub.send_multipart(live_frames(1, msgspec.msgpack.encode(second)))
        await _until(lambda: sc.stream.stats["batches"] == 2)
        assert sc.publisher.epoch > epoch1
        assert sc.tracker.resident() == {_key(c): Tier.HBM}
        assert sc.stream.stats["malformed"] == 0  # the batch itself was fine

        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                assert resp.status == 200
                text = await resp.text()
            async with http.get(f"http://127.0.0.1:{port}/health") as resp:
                health = await resp.json()
        lines = set(text.splitlines())
        assert (
            'ramjet_sidecar_unknown_fields_total{event="BlockStored",field="cache_level"} 1.0'
            in lines
        )
        assert 'ramjet_sidecar_unknown_events_total{event="BlockPinned"} 1.0' in lines
        assert 'ramjet_sidecar_malformed_events_total{event="BlockRemoved"} 1.0' in lines
        assert "ramjet_sidecar_resyncs_total 1.0" in lines
        assert health["decoder"] == {
            "unknown_fields": 1,
            "unknown_events": 1,
            "malformed_events": 1,
            "resyncs": 1,
        }
    finally:
        await sc.stop()
        await runner.cleanup()
        pub.close(linger=0)
        ctx.term()


def test_metric_labels_from_the_engine_are_bounded() -> None:
    registry = CollectorRegistry()
    m = SidecarMetrics(registry)
    long = "f" * 500
    fields = tuple(("BlockStored", f"new_{i}") for i in range(MAX_SERIES + 10))
    skipped = (Skipped(0, 0, "X" * 500, "unknown", known=False, resync=False),)
    m.observe(EventBatch(0.0, (), None, skipped, ((long, long), *fields)))
    series = [
        s.labels
        for metric in registry.collect()
        if metric.name == "ramjet_sidecar_unknown_fields"
        for s in metric.samples
        if s.name.endswith("_total")
    ]
    assert len(series) == MAX_SERIES + 1  # MAX_SERIES distinct, then one _other
    assert {"event": "f" * MAX_LABEL_CHARS, "field": "f" * MAX_LABEL_CHARS} in series
    assert registry.get_sample_value(
        "ramjet_sidecar_unknown_fields_total", {"event": OTHER, "field": OTHER}
    ) == float(11)
    assert (
        registry.get_sample_value(
            "ramjet_sidecar_unknown_events_total", {"event": "X" * MAX_LABEL_CHARS}
        )
        == 1.0
    )
    assert m.stats["unknown_fields"] == MAX_SERIES + 11
    assert registry.get_sample_value("ramjet_sidecar_resyncs_total") == 0.0
