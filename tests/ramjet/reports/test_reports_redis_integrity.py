"""The shared report cursor (`{P:E}:vc`) is MACed and checked (issue 29), against a real
redis-server and real Ed25519 frames: a cursor, load or profile written by something
without the replicas' secret, or an epoch in the future, steers nothing and is counted;
the engine's real reports are still accepted."""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers"))
from redis_server import RedisProcess, redis_server

from ramjet.reports.bodies import DeltaBuilder, LoadBody, encode_body
from ramjet.reports.envelope import Envelope, sign
from ramjet.reports.keys import KeyRing
from ramjet.reports.processor import ReportProcessor
from ramjet.reports.redis_cursors import SharedReports
from ramjet.reports.verify import Accepted
from ramjet.residency.config import ResidencyConfig
from ramjet.residency.redis_link import RedisLink, RedisSettings
from ramjet.residency.redis_store import RedisStore
from ramjet.residency.store import Table
from ramjet.residency.tables import ResidencyTables
from ramjet.types import EngineId, PrefixKey, Tier

pytestmark = pytest.mark.redis
E0 = EngineId("e0")
PRIV = Ed25519PrivateKey.generate()
RING = KeyRing({"k0": (E0, PRIV.public_key())})
VC = "{ramjet:e0}:vc"
EPOCH = int(time.time() * 1000)


@dataclass
class Replica:
    store: RedisStore
    processor: ReportProcessor
    shared: SharedReports
    registry: CollectorRegistry

    def refused(self, reason: str) -> float:
        v = self.registry.get_sample_value(
            "ramjet_reports_shared_rejected_total", {"reason": reason}
        )
        return v or 0.0


def replica(server: RedisProcess) -> Replica:
    reg = CollectorRegistry()
    cfg = ResidencyConfig()
    settings = RedisSettings(
        url=server.url,
        timeout_ms=300,
        breaker_open_ms=50,
        shared_secret="vc-test-secret-0123456789",
    )
    store = RedisStore(RedisLink(settings, reg), cfg, engines=(E0,), registry=reg)
    processor = ReportProcessor(RING, ResidencyTables(cfg, store), registry=reg)
    return Replica(store, processor, SharedReports(processor, store, (E0,), reg), reg)


@pytest.fixture
def server() -> Iterator[RedisProcess]:
    with redis_server() as s:
        yield s


@pytest.fixture
async def pair(server: RedisProcess) -> AsyncIterator[tuple[Replica, Replica]]:
    a, b = replica(server), replica(server)
    try:
        yield a, b
    finally:
        for r in (a, b):
            await r.store.link.close()


def frame(seq: int, kind: str = "delta", keys: tuple[int, ...] = ()) -> bytes:
    if kind == "delta":
        d = DeltaBuilder()
        for k in keys:
            d.stored(PrefixKey(k), Tier.HOST)
        body = encode_body(d.build())
    else:
        body = encode_body(
            LoadBody(
                queued_prompt_tokens=7, running_requests=1, waiting_requests=0, kv_utilization=0.5
            )
        )
    env = Envelope(E0, "k0", EPOCH, seq, int(time.time() * 1000), kind, body)  # type: ignore[arg-type]
    return sign(env, PRIV)


@pytest.mark.parametrize("forged_epoch", ["future", "unsigned"])
async def test_a_forged_cursor_does_not_freeze_the_engines_reports(
    pair: tuple[Replica, Replica], forged_epoch: str
) -> None:
    a, b = pair
    assert isinstance(await a.shared.submit(frame(1, keys=(1,)), E0), Accepted)
    # someone with write access to Redis moves the shared cursor ahead: a future epoch
    # (refused by every check), or a plausible one without a valid MAC
    epoch = EPOCH + (10 * 365 * 86_400_000 if forged_epoch == "future" else 1)
    await a.store.link.client.hset(
        VC, mapping={"epoch": epoch, "seq": 99, "issued": 0, "gap": 0, "at": 1, "mac": "00"}
    )
    await b.shared.sync_once()  # b does not adopt it
    cur = b.processor.cursor(E0)
    assert cur is None or cur.epoch == EPOCH
    # the engine's next real report is accepted (before: epoch_old, on every replica)
    out = await b.shared.submit(frame(2, keys=(2,)), E0)
    assert isinstance(out, Accepted), out
    await b.store.sync_once()
    await a.store.sync_once()
    assert a.store.get(Table.GLOBAL, E0, PrefixKey(2), a.store.clock(), False) is not None
    assert int(await a.store.link.client.hget(VC, "epoch")) == EPOCH
    assert b.refused("mac") + b.refused("epoch") >= 1


async def test_a_forged_load_is_not_absorbed(pair: tuple[Replica, Replica]) -> None:
    a, b = pair
    assert isinstance(await a.shared.submit(frame(1, "load"), E0), Accepted)
    await b.shared.sync_once()
    load = b.processor.load(E0)
    assert load is not None and load.queued_prompt_tokens == 7
    forged = encode_body(
        LoadBody(queued_prompt_tokens=0, running_requests=0, waiting_requests=0, kv_utilization=0.0)
    ).decode()
    now_ms = int(time.time() * 1000) + 5_000
    await a.store.link.client.hset(VC, mapping={"load": forged, "load_at": now_ms})
    await b.shared.sync_once()
    load = b.processor.load(E0)
    assert load is not None and load.queued_prompt_tokens == 7  # the forged one never took
    assert b.refused("mac") >= 1
