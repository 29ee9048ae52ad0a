"""Signed reports through two real router replicas sharing one real Redis.

Rig: a real redis-server, two `RouterServer` replicas on loopback over `build_residency`
(`store.kind: redis`, or `memory` as the control), a real signing `ReportPublisher` for
e0 in a small aiohttp app that both replicas pull from, and hand-signed frames for e1
pushed to the replicas' push listeners (`reports.push`, `POST /ramjet/reports`).

- Push: a report pushed to replica A and then the same frame pushed to replica B is
  refused by B as `replayed` (counted by reason) and applied once; B learns it from
  Redis (residency and cursor) and accepts the next report. With memory stores both
  replicas apply it (the control: the test can tell the two apart).
- Pull: every report the publisher signs is pulled by both replicas and applied once
  across them (twice with memory stores); both replicas' exact tables agree afterwards.
- `ramjet serve --policy` on a copy of `policies/replicated.yaml` (Redis URL and an
  inline key filled in) runs the factory, the report runtime and the shared cursors: a
  pulled report's claim lands in Redis, a replay pushed to it is refused.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis
import yaml
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fake_upstream import FakeUpstream
from prometheus_client import CollectorRegistry
from router_rig import router_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from redis_server import RedisProcess, free_port, redis_server

from ramjet.app.server import RouterServer
from ramjet.fleet.signals import REPORTS_KEY
from ramjet.reports.bodies import DeltaBody, TierKeys, encode_body
from ramjet.reports.envelope import Envelope, sign
from ramjet.reports.keys import public_key_b64
from ramjet.reports.publisher import ReportPublisher
from ramjet.residency.factory import ResidencyRuntime, build_residency
from ramjet.residency.store import Table
from ramjet.types import EngineId, PrefixKey, TrustGrade

pytestmark = pytest.mark.redis
E0, E1 = EngineId("e0"), EngineId("e1")
KEY0 = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
KEY1 = Ed25519PrivateKey.from_private_bytes(bytes(range(32, 64)))
ROOT = Path(__file__).resolve().parents[2]


def keys_of(tag: str, n: int) -> tuple[PrefixKey, ...]:
    return tuple(PrefixKey(hash((tag, i)) & ((1 << 64) - 1)) for i in range(n))


@pytest.fixture
def redis_proc() -> Iterator[RedisProcess]:
    with redis_server() as s:
        yield s


@dataclass
class Pub:
    pub: ReportPublisher
    runner: web.AppRunner
    url: str
    held: list[PrefixKey]


async def start_publisher() -> Pub:
    held: list[PrefixKey] = []
    pub = ReportPublisher(
        E0,
        KEY0,
        "e0-a",
        snapshot=lambda: ([TierKeys(tier="hbm", keys=tuple(held))] if held else [], []),
        load_interval_s=3600,
    )
    app = web.Application()
    pub.add_routes(app)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    await pub.start()
    return Pub(pub, runner, f"http://127.0.0.1:{runner.addresses[0][1]}", held)


def key_section() -> dict[str, Any]:
    return {
        "engines": {
            "e0": [{"key_id": "e0-a", "public_key": public_key_b64(KEY0.public_key())}],
            "e1": [{"key_id": "e1-a", "public_key": public_key_b64(KEY1.public_key())}],
        }
    }


@dataclass
class Replica:
    server: RouterServer
    residency: ResidencyRuntime

    @property
    def processor(self) -> Any:
        return self.server.app[REPORTS_KEY].processor

    def sample(self, name: str, **labels: str) -> float:
        v = self.server.router.metrics.registry.get_sample_value(name, labels)
        return 0.0 if v is None else v

    def accepted(self, engine: str, kind: str) -> float:
        return self.sample("ramjet_reports_accepted_total", engine=engine, kind=kind)

    def rejected(self, engine: str, reason: str) -> float:
        return self.sample("ramjet_reports_rejected_total", engine=engine, reason=reason)

    def exact(self, engine: EngineId) -> dict[PrefixKey, int]:
        store = self.server.router.residency.store
        local = getattr(store, "local", store)  # RedisStore's mirror, or the MemoryStore
        return {k: int(e.tier) for k, e in local.entries(Table.GLOBAL, engine, True)}


@pytest.fixture
async def rig(
    upstreams: list[FakeUpstream], redis_proc: RedisProcess
) -> AsyncIterator[Callable[[str], Any]]:
    made: list[Replica] = []
    pubs: list[Pub] = []

    async def make(kind: str) -> tuple[Replica, Replica, Pub]:
        p = await start_publisher()
        pubs.append(p)
        cfg = router_config(
            [u.url for u in upstreams],
            incumbent={"name": "prefix_affinity"},
            store={"kind": kind, "url": redis_proc.url, "sync_interval_ms": 20},
            keys=key_section(),
            # e0 is pulled from its publisher; e1 has a key but no pull target: push only
            reports={
                "engines": {"e0": p.url},
                "poll": {"wait_s": 0.5, "timeout_s": 2.0, "backoff_min_s": 0.05,
                         "backoff_max_s": 0.1},
                "push": {"port": 0},
            },
        )  # fmt: skip
        for _ in range(2):
            reg = CollectorRegistry()
            runtime = build_residency(cfg, reg)
            server = RouterServer(cfg, registry=CollectorRegistry(), residency=runtime.tables)
            await runtime.start()
            await server.start()
            made.append(Replica(server, runtime))
        return made[-2], made[-1], p

    try:
        yield make
    finally:
        for r in made:
            await r.server.stop(drain_s=0.2)
            await r.residency.stop()
        for p in pubs:
            await p.pub.stop()
            await p.runner.cleanup()


async def until(cond: Callable[[], bool], timeout: float = 8.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not in time: {what}"
        await asyncio.sleep(0.02)


def e1_frame(epoch: int, seq: int, body: DeltaBody) -> bytes:
    env = Envelope(E1, "e1-a", epoch, seq, int(time.time() * 1000), "delta", encode_body(body))
    return sign(env, KEY1)


async def push(s: aiohttp.ClientSession, r: Replica, frame: bytes) -> tuple[int, Any]:
    async with s.post(r.server.app[REPORTS_KEY].push_url, data=frame) as resp:
        return resp.status, await resp.json()


@pytest.mark.parametrize("kind", ["redis", "memory"])
async def test_a_report_is_applied_once_across_replicas(
    rig: Callable[[str], Any], kind: str
) -> None:
    a, b, p = await rig(kind)
    shared = kind == "redis"
    for r in (a, b):
        assert (r.server.app[REPORTS_KEY].shared is not None) is shared

    # -- push: the same frame to A, then to B -------------------------------------------
    epoch = int(time.time() * 1000)
    k1, k2 = keys_of("push-1", 8), keys_of("push-2", 4)
    f1 = e1_frame(epoch, 1, DeltaBody(stored=[TierKeys(tier="host", keys=k1)]))
    f2 = e1_frame(epoch, 2, DeltaBody(stored=[TierKeys(tier="hbm", keys=k2)]))
    async with aiohttp.ClientSession() as s:
        assert await push(s, a, f1) == (202, {"accepted": 1})
        status_b, answer_b = await push(s, b, f1)
        if shared:
            assert (status_b, answer_b) == (400, {"rejected": "replayed"})
        else:
            assert (status_b, answer_b) == (202, {"accepted": 1})  # the control applies it twice
        assert await push(s, a, f1) == (400, {"rejected": "replayed"})  # and A refuses replays
        applied = a.accepted("e1", "delta") + b.accepted("e1", "delta")
        assert applied == (1 if shared else 2)
        assert a.rejected("e1", "replayed") == 1
        assert b.rejected("e1", "replayed") == (1 if shared else 0)
        if shared:
            # B learns the report from Redis: its residency and its cursor
            await until(lambda: b.exact(E1) == a.exact(E1) != {}, what="B's e1 residency")
            assert set(b.exact(E1)) == set(k1)
            await until(lambda: b.processor.trust(E1) is TrustGrade.EXACT, what="B's e1 trust")
        # the next report is B's to apply (after A's, whichever store)
        assert await push(s, b, f2) == (202, {"accepted": 2})
        assert await push(s, a, f2) == (
            (400, {"rejected": "replayed"}) if shared else (202, {"accepted": 2})
        )

    # -- pull: both replicas long-poll the same publisher ----------------------------------
    await until(
        lambda: all(r.processor.cursor(E0) is not None for r in (a, b)), what="first snapshots"
    )
    n = 12
    for i in range(n):
        ks = keys_of(f"pull-{i}", 6)
        p.held.extend(ks)
        p.pub.publish_delta(DeltaBody(stored=[TierKeys(tier="hbm", keys=ks)]))
        await asyncio.sleep(0.03)  # reports a few ms apart, as an engine sends them

    def caught_up() -> bool:
        return all((c := r.processor.cursor(E0)) is not None and c.seq >= n for r in (a, b))

    await until(caught_up, what="both cursors at the publisher's seq")
    pulled = a.accepted("e0", "delta") + b.accepted("e0", "delta")
    replays = a.rejected("e0", "replayed") + b.rejected("e0", "replayed")
    print(
        f"\n[{kind}] pulled deltas applied: A {a.accepted('e0', 'delta'):.0f} + "
        f"B {b.accepted('e0', 'delta'):.0f} = {pulled:.0f} of {n}; refused as replayed: "
        f"{replays:.0f}"
    )
    assert pulled == (n if shared else 2 * n)
    for r in (a, b):
        assert r.rejected("e0", "bad_signature") == 0

    # both replicas' tables agree (residency of both engines, exact entries)
    want0 = set(p.held)
    await until(lambda: all(set(r.exact(E0)) == want0 for r in (a, b)), what="e0 residency on both")
    await until(lambda: a.exact(E0) == b.exact(E0) and a.exact(E1) == b.exact(E1), what="agree")
    assert set(a.exact(E1)) == set(k1) | set(k2)
    if shared:
        await until(
            lambda: all(r.processor.trust(e) is TrustGrade.EXACT for r in (a, b) for e in (E0, E1)),
            what="trust on both",
        )
        cursors = {(r.processor.cursor(E0).seq, r.processor.cursor(E1).seq) for r in (a, b)}
        assert cursors == {(n, 2)}


async def test_serve_with_the_replicated_policy_shares_report_cursors(
    redis_proc: RedisProcess, tmp_path: Path
) -> None:
    p = await start_publisher()
    policy = yaml.safe_load((ROOT / "policies" / "replicated.yaml").read_text())
    policy["store"]["url"] = redis_proc.url
    policy["keys"] = key_section()
    push_port = free_port()
    policy["reports"] = {
        "engines": {"e0": p.url},
        "poll": {"wait_s": 0.5, "timeout_s": 2.0, "backoff_min_s": 0.05, "backoff_max_s": 0.1},
        "push": {"port": push_port},
    }
    policy.setdefault("timeouts", {})["drain_s"] = 0.5
    path = tmp_path / "replicated.yaml"
    path.write_text(yaml.safe_dump(policy))
    port = free_port()
    ramjet = str(Path(sys.executable).parent / "ramjet")
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [ramjet, "serve", "--policy", str(path), "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    r = redis.Redis(port=redis_proc.port)
    try:
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as s:
            deadline = time.monotonic() + 20
            while True:
                assert proc.poll() is None, log.read_text(errors="replace")[-2000:]
                try:
                    async with s.get(url + "/healthz") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() < deadline, "ramjet serve did not come up"
                await asyncio.sleep(0.1)
            ks = keys_of("serve", 5)
            p.held.extend(ks)
            seq = p.pub.publish_delta(DeltaBody(stored=[TierKeys(tier="hbm", keys=ks)]))
            vc = "{ramjet:e0}:vc"
            deadline = time.monotonic() + 10
            while r.hget(vc, "seq") != str(seq).encode():
                assert time.monotonic() < deadline, f"no shared claim in Redis: {r.hgetall(vc)}"
                await asyncio.sleep(0.05)
            assert int(r.hget(vc, "epoch") or 0) == p.pub.epoch
            assert r.pttl(vc) > 0
            # the report's residency reached Redis as one sequenced batch
            deadline = time.monotonic() + 10
            while r.hget("{ramjet:e0}:st", "seq") != str(seq).encode():
                assert time.monotonic() < deadline, "no residency batch in Redis"
                await asyncio.sleep(0.05)
            # a replay pushed to the served router is refused by the shared cursor
            frame = p.pub.frames_after(seq - 1)[0]
            push_url = f"http://127.0.0.1:{push_port}/ramjet/reports"
            async with s.post(push_url, data=frame) as resp:
                assert resp.status == 400 and (await resp.json())["rejected"] == "replayed"
            async with s.get(url + "/metrics") as resp:
                text = await resp.text()
            assert 'ramjet_reports_rejected_total{engine="e0",reason="replayed"} 1.0' in text
            assert "ramjet_reports_unclaimed_total" in text  # SharedReports is mounted
            assert "ramjet_redis_degraded 0.0" in text  # the Redis store runs the tables
        # SIGTERM stops it promptly (drain 0.5 s, then the report pulls, the push listener
        # and the Redis syncs), with every loop ending on its first cancel; the
        # publisher keeps answering meanwhile (this loop is not blocked)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        served = log.read_text(errors="replace")
        assert proc.returncode == 0, f"ramjet serve did not stop cleanly:\n{served[-2000:]}"
        assert "ran on after its cancellation" not in served, served[-2000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        r.close()
        await p.pub.stop()
        await p.runner.cleanup()
