"""A real publisher app and the real puller/push endpoint on loopback: deltas flow,
a report lost in transit is healed by a snapshot, a ring overrun asks for a snapshot,
an engine restart (new epoch) purges the old residency, pushes are verified."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import AsyncIterator, Callable, Sequence

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry
from reports_fixtures import E0, KEYS, keyring

from ramjet.reports import transport as tp
from ramjet.reports.bodies import DeltaBody, LoadBody, SwaStates, TierKeys
from ramjet.reports.config import PollConfig, PushConfig, ReportsConfig
from ramjet.reports.ingest import ReportIngest
from ramjet.reports.processor import ReportProcessor
from ramjet.reports.publisher import ReportPublisher
from ramjet.residency.store import MemoryStore, Table
from ramjet.residency.tables import ResidencyTables
from ramjet.types import PrefixKey, Tier, TrustGrade

K = [PrefixKey(500 + i) for i in range(30)]
TOK = [256] * 30


class FakeCaches:
    """The engine's cache state in router keys (what a snapshot reads)."""

    def __init__(self) -> None:
        self.blocks: dict[PrefixKey, Tier] = {}
        self.swa: set[PrefixKey] = set()

    def snapshot(self) -> tuple[Sequence[TierKeys], Sequence[SwaStates]]:
        by: dict[Tier, list[PrefixKey]] = {}
        for k, t in self.blocks.items():
            by.setdefault(t, []).append(k)
        res = [TierKeys(tier=t.label, keys=tuple(ks)) for t, ks in by.items()]  # type: ignore[arg-type]
        swa = [SwaStates(keys=tuple(self.swa), ttl_ms=60_000)] if self.swa else []
        return res, swa


class Engine:
    def __init__(
        self,
        epoch: int,
        ring_size: int = 4096,
        push_url: str | None = None,
        part_keys: int = 1 << 18,
    ) -> None:
        self.caches = FakeCaches()
        self.pub = ReportPublisher(
            E0,
            KEYS["e0-a"],
            "e0-a",
            epoch=epoch,
            snapshot=self.caches.snapshot,
            ring_size=ring_size,
            push_url=push_url,
            push_snapshot_interval_s=3600,
            snapshot_part_keys=part_keys,
        )
        self.drop_seq: int | None = None
        self.app = web.Application(middlewares=[self._lossy])
        self.pub.add_routes(self.app)
        self.runner: web.AppRunner | None = None
        self.port = 0

    @web.middleware
    async def _lossy(
        self, request: web.Request, handler: Callable[[web.Request], object]
    ) -> web.StreamResponse:
        resp = await handler(request)  # type: ignore[misc]
        assert isinstance(resp, web.Response)
        if request.path == tp.REPORTS_PATH and self.drop_seq is not None and resp.body:
            from ramjet.reports.envelope import decode

            kept = []
            for f in tp.iter_frames(resp.body):  # type: ignore[arg-type]
                if decode(f, 1 << 30).envelope.seq == self.drop_seq:
                    self.drop_seq = None  # lost once, in transit
                    continue
                kept.append(f)
            resp.body = tp.pack_frames(kept)
        return resp

    def store(self, keys: Sequence[PrefixKey], tier: Tier = Tier.HBM) -> int:
        for k in keys:
            self.caches.blocks[k] = tier
        return self.pub.publish_delta(
            DeltaBody(stored=[TierKeys(tier=tier.label, keys=tuple(keys))])  # type: ignore[arg-type]
        )

    def evict(self, keys: Sequence[PrefixKey]) -> int:
        for k in keys:
            self.caches.blocks.pop(k, None)
        return self.pub.publish_delta(DeltaBody(evicted=tuple(keys)))

    async def start(self, port: int = 0) -> str:
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        self.port = self.runner.addresses[0][1]
        await self.pub.start()
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        await self.pub.stop()
        if self.runner is not None:
            await self.runner.cleanup()


def router(
    push: PushConfig | None = None, max_keys: int = 1 << 18
) -> tuple[ResidencyTables, ReportProcessor]:
    reg = CollectorRegistry()
    tables = ResidencyTables(registry=reg)
    cfg = ReportsConfig(
        poll=PollConfig(wait_s=0.5, timeout_s=3, backoff_min_s=0.05, backoff_max_s=0.2),
        push=push or PushConfig(),
        max_keys=max_keys,
    )
    return tables, ReportProcessor(keyring(), tables, cfg, reg)


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


def held(tables: ResidencyTables) -> int:
    return tables.view(E0).global_match(K, TOK).total // 256


@pytest.fixture
async def engines() -> AsyncIterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for e in made:
        await e.stop()


async def test_pull_heals_loss_by_snapshot_and_purges_on_restart(engines: list[Engine]) -> None:
    eng = Engine(epoch=1)
    engines.append(eng)
    url = await eng.start()
    tables, proc = router()
    ingest = ReportIngest(proc, {E0: url})
    await ingest.start()
    try:
        eng.store(K[:5])
        await until(lambda: held(tables) == 5)
        assert proc.trust(E0) is TrustGrade.EXACT
        # a delta lost in transit: gap -> degraded -> snapshot -> exact again
        eng.drop_seq = eng.pub.seq + 1
        eng.store(K[5:8])
        eng.store(K[8:10], Tier.HOST)
        await until(lambda: held(tables) == 10 and proc.trust(E0) is TrustGrade.EXACT)
        reg = proc.metrics
        assert reg.gaps.labels(E0)._value.get() == 1
        assert tables.view(E0).global_match(K, TOK).host == 512
        # the engine restarts on the same port with an empty cache and a new epoch
        await eng.stop()
        eng2 = Engine(epoch=2)
        engines.append(eng2)
        await eng2.start(eng.port)
        eng2.store(K[:2])
        await until(lambda: proc.cursor(E0) is not None and proc.cursor(E0).epoch == 2)  # type: ignore[union-attr]
        await until(lambda: held(tables) == 2)
        assert proc.metrics.epoch_changes.labels(E0)._value.get() == 1
    finally:
        await ingest.stop()


def exact(tables: ResidencyTables) -> dict[PrefixKey, Tier]:
    store = tables.store
    assert isinstance(store, MemoryStore)
    return {k: e.tier for k, e in store.entries(Table.GLOBAL, E0, exact=True)}


async def test_snapshots_over_max_keys_travel_in_parts_pulled_and_pushed(
    engines: list[Engine],
) -> None:
    """A router whose `max_keys` (8) is below the engine's residency heals a lost report
    by a snapshot in parts (part 0 from GET /ramjet/snapshot, the rest from the ring),
    and takes a pushed one; neither is abandoned, and the evicted keys are dropped."""
    eng = Engine(epoch=11, part_keys=8)
    engines.append(eng)
    url = await eng.start()
    tables, proc = router(max_keys=8)
    ingest = ReportIngest(proc, {E0: url})
    await ingest.start()
    try:
        eng.store(K[:6])
        await until(lambda: len(exact(tables)) == 6)
        eng.drop_seq = eng.pub.seq + 1
        eng.evict(K[:2])  # lost in transit: only the snapshot says K[0], K[1] are gone
        for i in range(6, 30, 6):
            eng.store(K[i : i + 6], Tier.SSD)
        want = {k: Tier.HBM for k in K[2:6]} | {k: Tier.SSD for k in K[6:30]}
        await until(lambda: exact(tables) == want and proc.trust(E0) is TrustGrade.EXACT)
        assert proc.metrics.snapshots_fetched.labels(E0)._value.get() == 2  # start, gap
        assert proc.metrics.gaps.labels(E0)._value.get() == 1
        assert eng.pub.seq == 6 + 3  # 28 keys: part 0 at seq 6, three more parts in the ring
    finally:
        await ingest.stop()
    # pushed: a router with a push listener takes the engine's snapshot in parts
    tables2, proc2 = router(PushConfig(port=0), max_keys=8)
    push_in = ReportIngest(proc2, {})
    await push_in.start()
    pusher = Engine(epoch=12, push_url=push_in.push_url, part_keys=8)
    engines.append(pusher)
    pusher.caches.blocks = {k: Tier.HOST for k in K[:20]}
    await pusher.start()  # its push loop sends a snapshot first: 20 keys, 3 parts
    try:
        await until(lambda: exact(tables2) == pusher.caches.blocks)
        assert proc2.trust(E0) is TrustGrade.EXACT
        for p in (proc, proc2):
            for why in ("gap", "out_of_order", "restarted", "interrupted"):
                assert p.metrics.snapshots_abandoned.labels(E0, why)._value.get() == 0
    finally:
        await push_in.stop()


async def test_ring_overrun_asks_for_a_snapshot(engines: list[Engine]) -> None:
    eng = Engine(epoch=5, ring_size=3)
    engines.append(eng)
    url = await eng.start()
    tables, proc = router()
    ingest = ReportIngest(proc, {E0: url})
    await ingest.start()
    try:
        eng.store(K[:1])
        await until(lambda: held(tables) == 1)
        await ingest.stop()  # the router is away while the engine publishes a lot
        for i in range(1, 12):
            eng.store(K[i : i + 1])
        eng.evict(K[11:12])
        fetched = proc.metrics.snapshots_fetched.labels(E0)._value.get()
        await ingest.start()
        await until(lambda: held(tables) == 11)
        assert proc.metrics.snapshots_fetched.labels(E0)._value.get() == fetched + 1
        assert proc.trust(E0) is TrustGrade.EXACT
    finally:
        await ingest.stop()


async def test_long_poll_returns_when_a_report_is_published(engines: list[Engine]) -> None:
    eng = Engine(epoch=9)
    engines.append(eng)
    url = await eng.start()
    _, proc = router()
    ingest = ReportIngest(proc)
    await ingest.start()
    try:
        await ingest.fetch_snapshot(E0, url)
        t0 = time.monotonic()

        async def later() -> None:
            await asyncio.sleep(0.2)
            eng.pub.publish_load(
                LoadBody(
                    queued_prompt_tokens=3,
                    running_requests=1,
                    waiting_requests=0,
                    kv_utilization=0.1,
                )
            )

        task = asyncio.create_task(later())
        n = await ingest.poll_once(E0, url, wait_s=5)
        await task
        assert n == 1 and 0.15 < time.monotonic() - t0 < 2.0
        assert proc.load(E0) is not None
    finally:
        await ingest.stop()


async def test_push_listener_verifies_like_pull(engines: list[Engine]) -> None:
    tables, proc = router(PushConfig(port=0))
    ingest = ReportIngest(proc, {})
    await ingest.start()
    eng = Engine(epoch=3, push_url=ingest.push_url)
    engines.append(eng)
    await eng.start()
    try:
        eng.store(K[:4])
        await until(lambda: held(tables) == 4)
        assert proc.trust(E0) is TrustGrade.EXACT
        import aiohttp

        async with aiohttp.ClientSession() as s:
            forged = bytearray(eng.pub.frames_after(0)[0])
            forged[-1] ^= 1
            async with s.post(ingest.push_url, data=bytes(forged)) as r:
                assert r.status == 400 and (await r.json())["rejected"] == "bad_signature"
            big = bytes(proc.config.max_report_bytes + 1)
            async with s.post(ingest.push_url, data=io.BytesIO(big)) as r:
                assert r.status == 413
        assert held(tables) == 4
    finally:
        await ingest.stop()


async def test_no_push_listener_by_default() -> None:
    _, proc = router()
    ingest = ReportIngest(proc, {})
    assert ingest.push is None
    with pytest.raises(AssertionError, match="no push listener"):
        _ = ingest.push_url


async def test_runtime_built_from_policy_sections_pulls_keyed_engines(
    engines: list[Engine],
) -> None:
    from reports_fixtures import KEYS as TEST_KEYS

    from ramjet.reports.config import KeysConfig
    from ramjet.reports.keys import public_key_b64
    from ramjet.reports.runtime import ReportsRuntime

    eng = Engine(epoch=4)
    engines.append(eng)
    url = await eng.start()
    keys = KeysConfig.model_validate(
        {
            "engines": {
                "e0": [
                    {"key_id": "e0-a", "public_key": public_key_b64(TEST_KEYS["e0-a"].public_key())}
                ]
            }
        }
    )
    reg = CollectorRegistry()
    tables = ResidencyTables(registry=reg)
    rt = ReportsRuntime.build(
        ReportsConfig(poll=PollConfig(wait_s=0.5, timeout_s=3)),
        keys,
        tables,
        reg,
        engine_urls={"e0": url, "e9": "http://127.0.0.1:9"},  # e9 has no key: not pulled
    )
    assert rt.ingest.engines == {E0: url}
    await rt.start()
    try:
        eng.store(K[:3])
        await until(lambda: held(tables) == 3)
        assert rt.processor.trust(E0) is TrustGrade.EXACT
    finally:
        await rt.stop()
