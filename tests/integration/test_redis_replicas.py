"""Two real router replicas sharing residency through a real Redis (RELIABILITY rows 23-25).

Workload: concurrent multi-turn chat sessions, each turn sent to the OTHER replica than
the previous one, so every residency-driven decision depends on what the other replica
learnt. Decisions are compared with what the other replica would have picked at the same
moment (its own tables, the same policy): with Redis they agree on >= 99%; with each
replica's own memory store (the control) they do not.

The chaos test runs 64 concurrent streams while Redis is stopped (SIGSTOP), resumed,
killed, restarted empty and has its script cache flushed: no client sees an error, the
degradation gauge rises and falls, the replicas resync, and afterwards every key in Redis
has a TTL.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from fake_upstream import FakeUpstream
from redis_server import RedisProcess, redis_server
from router_rig import Records, router_config

from ramjet.app.server import RouterServer
from ramjet.policy.base import EngineLoad, EngineView, FleetStats
from ramjet.policy.baselines import PrefixAffinity
from ramjet.request.parse import ParseLimits, parse_request, to_request_view
from ramjet.residency.factory import ResidencyRuntime, build_residency
from ramjet.types import EngineId

pytestmark = pytest.mark.redis
CHAT = "/v1/chat/completions"


@pytest.fixture
def redis_proc() -> Iterator[RedisProcess]:
    with redis_server() as s:
        yield s


@dataclass
class Replica:
    server: RouterServer
    residency: ResidencyRuntime
    registry: CollectorRegistry
    records: Records


@dataclass
class Fleet:
    replicas: list[Replica]
    agree: int = 0
    disagree: int = 0
    unmatched: int = 0
    errors: list[str] = field(default_factory=list)
    ok: int = 0


@pytest.fixture
async def make_replicas(
    upstreams: list[FakeUpstream], redis_proc: RedisProcess
) -> AsyncIterator[Any]:
    started: list[Replica] = []

    async def make(kind: str, n: int = 2, encoding: str = "keys") -> list[Replica]:
        # the per-key encoding by default: the fault test below reads its key layout
        store = {
            "kind": kind,
            "encoding": encoding,
            "url": redis_proc.url,
            "timeout_ms": 100,
            "breaker_open_ms": 100,
            "breaker_max_open_ms": 400,
            "sync_interval_ms": 20,
        }
        for _ in range(n):
            cfg = router_config(
                [u.url for u in upstreams],
                incumbent={"name": "prefix_affinity"},
                store=store,
                # engine timeouts are not under test here: keep a loaded 2-core box from
                # turning a slow event loop into 504s
                timeouts={"first_byte_s": 5.0, "idle_s": 5.0, "send_s": 5.0},
            )
            reg = CollectorRegistry()
            runtime = build_residency(cfg, reg)
            records = Records()
            server = RouterServer(
                cfg, registry=CollectorRegistry(), residency=runtime.tables, sink=records
            )
            await runtime.start()
            await server.start()
            started.append(Replica(server, runtime, reg, records))
        return started[-n:]

    try:
        yield make
    finally:
        for r in started:
            await r.server.stop(drain_s=0.2)
            await r.residency.stop()


def body(session: int, turn: int) -> dict[str, Any]:
    system = f"You are the agent for repository r{session}. " + ("map:" + "x" * 60 + "\n") * 12
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    for k in range(turn + 1):
        messages.append({"role": "user", "content": f"s{session} turn {k}: " + "tool output " * 20})
        if k < turn:
            messages.append({"role": "assistant", "content": f"answer {k} " * 10})
    return {"model": "m", "messages": messages, "stream": True, "max_tokens": 8}


def counterfactual(other: Replica, payload: dict[str, Any], request_id: str) -> EngineId | None:
    """What `other` would pick for this request now (None: no resident prefix anywhere)."""
    import json

    raw = json.dumps(payload).encode()
    parsed = parse_request(CHAT, raw, {"content-type": "application/json"}, ParseLimits())
    rv = to_request_view(parsed, request_id)
    views = [
        EngineView(
            id=EngineId(e.id),
            healthy=True,
            load=EngineLoad(),
            residency=other.residency.tables.view(EngineId(e.id)),
        )
        for e in other.server.config.engines
    ]
    decision = PrefixAffinity().pick(rv, views, FleetStats())
    return None if "no_match" in decision.notes else decision.engine


async def run_sessions(
    fleet: Fleet,
    sessions: int,
    turns: int,
    think_s: float,
    stop: asyncio.Event | None = None,
    jitter_s: float = 0.0,
) -> None:
    rng = random.Random(7)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:

        async def one(s: int) -> None:
            turn = 0
            while (stop is None and turn < turns) or (stop is not None and not stop.is_set()):
                target = fleet.replicas[(s + turn) % len(fleet.replicas)]
                other = fleet.replicas[(s + turn + 1) % len(fleet.replicas)]
                payload = body(s, turn % 12)
                rid = f"s{s}-t{turn}"
                predicted = counterfactual(other, payload, rid) if stop is None else None
                try:
                    async with http.post(
                        target.server.url + CHAT, json=payload, headers={"X-Request-Id": rid}
                    ) as resp:
                        text = await resp.text()
                        if resp.status != 200 or "data: [DONE]" not in text:
                            fleet.errors.append(f"{rid}: {resp.status} {text[-200:]!r}")
                        else:
                            fleet.ok += 1
                except (aiohttp.ClientError, TimeoutError) as exc:
                    fleet.errors.append(f"{rid}: {exc!r}")
                if stop is None:
                    live = next(
                        (r.live for r in target.records.records if r.request_id == rid), None
                    )
                    if live is None or "no_match" in live.notes:
                        fleet.unmatched += 1
                    elif predicted == live.engine:
                        fleet.agree += 1
                    else:
                        fleet.disagree += 1
                turn += 1
                await asyncio.sleep(think_s + rng.random() * jitter_s)

        await asyncio.gather(*(one(s) for s in range(sessions)))


@pytest.mark.parametrize("encoding", ["keys", "packed"])
async def test_two_replicas_agree_through_redis_and_not_without(
    make_replicas: Any, encoding: str
) -> None:
    shared = Fleet(await make_replicas("redis", encoding=encoding))
    await asyncio.sleep(0.3)  # let start-up (probes, first syncs) settle
    await run_sessions(shared, sessions=20, turns=6, think_s=0.25, jitter_s=0.05)
    assert not shared.errors, shared.errors[:5]
    decided = shared.agree + shared.disagree
    assert decided >= 90, (shared.agree, shared.disagree, shared.unmatched)
    assert shared.agree / decided >= 0.99, (shared.agree, shared.disagree)
    print(f"redis: {shared.agree}/{decided} residency-driven decisions agree")

    # control: the same workload with each replica's own memory store
    alone = Fleet(await make_replicas("memory"))
    await run_sessions(alone, sessions=20, turns=6, think_s=0.02, jitter_s=0.05)
    assert not alone.errors, alone.errors[:5]
    decided_alone = alone.agree + alone.disagree
    print(f"memory control: {alone.agree}/{decided_alone} agree")
    assert decided_alone == 0 or alone.agree / decided_alone < 0.9


def sample(reg: CollectorRegistry, name: str, **labels: str) -> float:
    return reg.get_sample_value(name, labels) or 0.0


def resyncs(reg: CollectorRegistry) -> float:
    total = 0.0
    for metric in reg.collect():
        if metric.name == "ramjet_redis_resyncs":
            total += sum(s.value for s in metric.samples if s.name.endswith("_total"))
    return total


async def test_redis_paused_killed_and_flushed_under_64_streams(
    make_replicas: Any, redis_proc: RedisProcess
) -> None:
    fleet = Fleet(await make_replicas("redis"))
    regs = [r.registry for r in fleet.replicas]
    stop = asyncio.Event()
    load = asyncio.create_task(run_sessions(fleet, sessions=64, turns=0, think_s=0.05, stop=stop))
    degraded_seen = False

    async def watch(seconds: float, until_degraded_s: float = 0.0) -> None:
        """Sample the gauge for `seconds`, and longer (up to `until_degraded_s`) while
        no replica has reported degradation yet: timeouts fire late on a loaded box."""
        nonlocal degraded_seen
        start = time.monotonic()
        while True:
            degraded_seen |= any(sample(g, "ramjet_redis_degraded") == 1 for g in regs)
            waited = time.monotonic() - start
            if waited >= seconds and (degraded_seen or waited >= until_degraded_s):
                return
            await asyncio.sleep(0.02)

    try:
        await watch(0.4)
        resync_before = sum(resyncs(g) for g in regs)
        redis_proc.pause()  # hung Redis: calls time out, breaker opens, routing goes on
        await watch(0.8, until_degraded_s=5.0)
        assert degraded_seen  # within the pause, however loaded the machine
        redis_proc.resume()
        await watch(0.5)
        redis_proc.kill()  # dead Redis, and it comes back empty
        await watch(0.5)
        redis_proc.start()
        await watch(0.6)
        await fleet.replicas[0].residency.store.link.client.script_flush()  # type: ignore[union-attr]
        await watch(0.5)
    finally:
        stop.set()
        await load
    assert not fleet.errors, fleet.errors[:5]
    assert fleet.ok > 200
    # both replicas recover: breaker closed, queue drained, resynced after the outage
    deadline = time.monotonic() + 5
    while any(
        r.residency.store is not None and (r.residency.store.degraded or r.residency.store.pending)
        for r in fleet.replicas
    ):
        assert time.monotonic() < deadline, "replicas did not recover"
        await asyncio.sleep(0.05)
    for g in regs:
        assert sample(g, "ramjet_redis_degraded") == 0
    assert sum(resyncs(g) for g in regs) > resync_before
    assert sum(sample(g, "ramjet_redis_script_reloads_total") for g in regs) >= 1
    # every key in Redis carries a TTL
    client = fleet.replicas[0].residency.store.link.client  # type: ignore[union-attr]
    names = [k async for k in client.scan_iter(count=1000)]
    assert names
    for name in names:
        assert await client.pttl(name) > 0, name
    # and the replicas converge again: the other replica sees what one routed
    await asyncio.sleep(0.2)
    a, b = (r.residency.tables for r in fleet.replicas)
    from ramjet.residency.store import Table

    for engine in ("e0", "e1"):
        assert a.store.size(Table.GLOBAL) > 0
        ka = {k async for k in client.scan_iter(match="{ramjet:" + engine + "}:ga:*")}
        assert ka
        for raw in list(ka)[:50]:
            key = int(raw.decode().rsplit(":", 1)[1], 16)
            got_a = a.store.get(Table.GLOBAL, EngineId(engine), key, a.clock(), True)  # type: ignore[arg-type]
            got_b = b.store.get(Table.GLOBAL, EngineId(engine), key, b.clock(), True)  # type: ignore[arg-type]
            assert got_a is not None and got_b is not None
