"""The sidecar in process against a real ZMQ publisher: events become signed deltas
under the sidecar's key; an engine restart (seq back to 0) starts a new epoch whose
snapshot holds only what the restarted engine stored."""

from __future__ import annotations

import asyncio
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from zmq_endpoints import free_endpoint

from engine_stub.vllm_events import ZmqEventPublisher
from ramjet.keys.tokens import chain_keys, token_key_seed
from ramjet.reports.bodies import DeltaBody, SnapshotBody, parse_body
from ramjet.reports.envelope import decode, verify_signature
from ramjet.sidecar.runner import Sidecar, SidecarSettings
from ramjet.sidecar.wire import BlockStored

pytestmark = pytest.mark.timeout(30)


async def _until(cond, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def _stored(h: int, toks: list[int]) -> BlockStored:
    return BlockStored((h,), None, tuple(toks), 4, medium="GPU")


async def test_sidecar_signs_deltas_and_restarts_epoch() -> None:
    ev, rp = free_endpoint(), free_endpoint()
    key = Ed25519PrivateKey.generate()
    pub = ZmqEventPublisher(ev, rp)
    s = SidecarSettings(
        engine_kind="vllm", engine_id="v0", engine_url="http://127.0.0.1:9", events_url=ev,
        profile="skip",
        replay_url=rp, key_id="v0-sc", model="m", block_tokens=4, scrape_metrics=False,
    )  # fmt: skip
    sc = Sidecar(s, key)
    await sc.start()
    try:
        await asyncio.sleep(0.3)  # slow joiner
        pub.publish([_stored(1, [1, 2, 3, 4])])
        deltas = lambda: [  # noqa: E731
            d
            for f in sc.publisher.frames_after(0)
            if (d := decode(f, 1 << 20)).envelope.kind == "delta"
        ]
        await _until(lambda: deltas())
        epoch1 = sc.publisher.epoch
        signed = deltas()[0]
        assert signed.envelope.engine_id == "v0" and signed.envelope.key_id == "v0-sc"
        assert verify_signature(signed, key.public_key())
        body = parse_body("delta", signed.envelope.body)
        assert isinstance(body, DeltaBody)
        k1 = chain_keys([1, 2, 3, 4], token_key_seed("m"), 4)[0]
        assert body.stored[0].keys == (k1,)

        pub.close()  # the engine restarts: a new publisher numbers from 0 again
        await asyncio.sleep(0.1)
        pub = ZmqEventPublisher(ev, rp)
        await asyncio.sleep(0.3)
        pub.publish([_stored(2, [5, 6, 7, 8])])
        await _until(lambda: sc.publisher.epoch > epoch1 and sc.publisher.seq >= 1)
        snap = decode(sc.publisher.snapshot_frame(), 1 << 20)
        sb = parse_body("snapshot", snap.envelope.body)
        assert isinstance(sb, SnapshotBody)
        k2 = chain_keys([5, 6, 7, 8], token_key_seed("m"), 4)[0]
        assert [(t.tier, t.keys) for t in sb.residency] == [("hbm", (k2,))]
        assert sc.stream.stats["restarts"] == 1
    finally:
        await sc.stop()
        pub.close()
