"""RedisStore and the shared cursors on a real three-master Redis Cluster.

Every engine's keys share one hash tag, so each script runs on one node; different
engines land on different nodes. Two replicas share residency, the scripts survive a
SCRIPT FLUSH on every node, and every key carries a TTL.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from redis_server import RedisProcess, redis_cluster

from ramjet.residency.config import ResidencyConfig
from ramjet.residency.redis_link import RedisLink, RedisSettings
from ramjet.residency.redis_store import RedisStore
from ramjet.residency.store import Table
from ramjet.types import EngineId, PrefixKey, Tier

pytestmark = pytest.mark.redis
ENGINES = [EngineId(f"e{i}") for i in range(6)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[list[RedisProcess]]:
    with redis_cluster(3) as nodes:
        yield nodes


def store(nodes: list[RedisProcess]) -> RedisStore:
    reg = CollectorRegistry()
    settings = RedisSettings(url=nodes[0].url, cluster=True, timeout_ms=500, key_prefix="rjc")
    return RedisStore(RedisLink(settings, reg), ResidencyConfig(), ENGINES, reg)


async def test_two_replicas_share_residency_on_a_cluster(cluster: list[RedisProcess]) -> None:
    a, b = store(cluster), store(cluster)
    try:
        assert isinstance(a.link.client, RedisCluster)
        now = a.clock()
        for i, engine in enumerate(ENGINES):
            with a.report(engine, 1, 1):
                a.put(
                    Table.GLOBAL,
                    engine,
                    [PrefixKey(i * 100 + k) for k in range(20)],
                    Tier.HOST,
                    now,
                    now + 600,
                    True,
                )
                a.put(Table.SWA, engine, [PrefixKey(i)], Tier.HBM, now, now + 60, True)
        await a.sync_once()
        await b.sync_once()
        for i, engine in enumerate(ENGINES):
            got = b.get(Table.GLOBAL, engine, PrefixKey(i * 100 + 19), b.clock(), False)
            assert got is not None and got.tier is Tier.HOST
            assert b.get(Table.SWA, engine, PrefixKey(i), b.clock(), False) is not None

        # the engines' keys are spread over the nodes, each engine on one node
        holders: dict[str, set[int]] = {}
        for n, node in enumerate(cluster):
            r = Redis(port=node.port)
            try:
                async for key in r.scan_iter(match="{rjc:*", count=1000):
                    holders.setdefault(key.decode().split("}")[0], set()).add(n)
                    assert await r.pttl(key) > 0, key  # every key has a TTL
            finally:
                await r.aclose()
        assert len(holders) == len(ENGINES)
        assert all(len(v) == 1 for v in holders.values())
        assert len(set().union(*holders.values())) >= 2

        # script cache flushed on every node: reloaded where needed, nothing lost
        for node in cluster:
            r = Redis(port=node.port)
            try:
                await r.script_flush()
            finally:
                await r.aclose()
        with a.report(ENGINES[0], 1, 2):
            a.remove(Table.GLOBAL, ENGINES[0], [PrefixKey(5)])
        await a.sync_once()
        await b.sync_once()
        assert b.get(Table.GLOBAL, ENGINES[0], PrefixKey(5), b.clock(), False) is None
        assert b.get(Table.GLOBAL, ENGINES[0], PrefixKey(6), b.clock(), False) is not None
        assert not a.degraded and not b.degraded
    finally:
        for s in (a, b):
            await s.link.close()
