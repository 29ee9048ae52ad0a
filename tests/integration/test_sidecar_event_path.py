"""The sidecar's KV-event path (issue 29): two engine hashes for one router key must not
kill it, and a dead path must show in the sidecar's health and in the router's trust.

- `ramjet sidecar` as a process, fed by a real ZMQ publisher (the reference engine's
  vLLM-events publisher) with two engine blocks of the same tokens (one router key),
  both removed: the event thread died on a KeyError and the router kept the frozen key
  (and never learnt the next store) while load reports kept flowing;
- the sidecar in process, its event thread killed by a fault (an exception out of the
  tracker), a router processor pulling it over HTTP: /health answers 503 with the error,
  the engine's residency is purged at the router and its trust degrades while the path is
  down; the path restarts, replays, and trust is exact again.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry
from zmq_endpoints import free_endpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from sidecars import SidecarProcess

from engine_stub.vllm_events import ZmqEventPublisher
from ramjet.keys.tokens import chain_keys, token_key_seed
from ramjet.reports.config import ReportsConfig
from ramjet.reports.ingest import ReportIngest
from ramjet.reports.keys import KeyRing, load_private_key, write_keypair
from ramjet.reports.processor import ReportProcessor
from ramjet.residency.config import ResidencyConfig
from ramjet.residency.store import MemoryStore, Table
from ramjet.residency.tables import ResidencyTables
from ramjet.sidecar.runner import Sidecar, SidecarSettings
from ramjet.sidecar.wire import BlockRemoved, BlockStored
from ramjet.types import EngineId, TrustGrade

pytestmark = pytest.mark.timeout(60)

V0 = EngineId("v0")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _key(tokens: list[int]) -> int:
    return int(chain_keys(tokens, token_key_seed("m", None), 4)[0])


def _router(pub_key: Any, url: str, **cfg: Any) -> tuple[ReportProcessor, ReportIngest]:
    reg = CollectorRegistry()
    tables = ResidencyTables(ResidencyConfig(), registry=reg)
    config = ReportsConfig.model_validate({"engines": {"v0": url}, **cfg})
    proc = ReportProcessor(KeyRing({"v0-sc": (V0, pub_key)}), tables, config, reg)
    ingest = ReportIngest(proc, tick_interval_s=0.05, registry=reg)
    return proc, ingest


def _held(proc: ReportProcessor) -> set[int]:
    store = proc.tables.store
    assert isinstance(store, MemoryStore)
    return {int(k) for k, _ in store.entries(Table.GLOBAL, V0, exact=True)}


async def _until(cond: Any, timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out: {what}"
        await asyncio.sleep(0.05)


async def test_two_engine_hashes_one_router_key_keep_the_event_path_alive(
    tmp_path: Path,
) -> None:
    priv, _pub, _ = write_keypair(tmp_path / "keys", "v0-sc")
    ev, rp = free_endpoint(), free_endpoint()
    publisher = ZmqEventPublisher(ev, rp)
    port = _free_port()
    argv = [sys.executable, "-m", "ramjet", "sidecar", "--engine-kind", "vllm",
            "--engine-id", "v0", "--engine-url", "http://127.0.0.1:9", "--events", ev,
            "--replay", rp, "--key", str(priv), "--key-id", "v0-sc", "--model", "m",
            "--block-tokens", "4", "--port", str(port), "--profile", "skip", "--no-scrape",
            "--load-interval", "0.1"]  # fmt: skip
    sc = SidecarProcess(argv, port, tmp_path / "sidecar.log")
    proc, ingest = _router(load_private_key(priv).public_key(), sc.url, stale_after_s=1.0)
    await ingest.start()
    try:
        await asyncio.sleep(0.3)  # slow joiner
        same = [1, 2, 3, 4]
        k_same, k_next = _key(same), _key([5, 6, 7, 8])
        # the engine keyed the same tokens twice (two hashes), then dropped both
        publisher.publish([BlockStored((11,), None, tuple(same), 4, medium="GPU")])
        publisher.publish([BlockStored((12,), None, tuple(same), 4, medium="GPU")])
        await _until(lambda: k_same in _held(proc), what="router holds the stored key")
        publisher.publish([BlockRemoved((11,), "GPU"), BlockRemoved((12,), "GPU")])
        publisher.publish([BlockStored((13,), None, (5, 6, 7, 8), 4, medium="GPU")])
        await _until(lambda: sc.health()["last_event_seq"] == 3, what=str(sc.log.read_text()))
        h = sc.health()
        assert h["events"]["alive"] is True and h["resident_blocks"] == 1, h
        await _until(lambda: _held(proc) == {k_next}, what=f"router holds {_held(proc)}")
        assert proc.trust(V0) is TrustGrade.EXACT
        assert "Traceback" not in sc.log.read_text()
    finally:
        await ingest.stop()
        sc.stop()
        publisher.close()


async def test_dead_event_path_shows_in_health_and_degrades_router_trust(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    ev, rp = free_endpoint(), free_endpoint()
    publisher = ZmqEventPublisher(ev, rp)
    s = SidecarSettings(
        engine_kind="vllm", engine_id="v0", engine_url="http://127.0.0.1:9", events_url=ev,
        replay_url=rp, key_id="v0-sc", model="m", block_tokens=4, scrape_metrics=False,
        profile="skip", load_interval_s=0.1, event_restart_min_s=2.0,
    )  # fmt: skip
    sc = Sidecar(s, key)
    app = web.Application()
    sc.add_routes(app)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = _free_port()
    await sc.start()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    proc, ingest = _router(key.public_key(), url, stale_after_s=0.5, stale_ttl_s=30)
    await ingest.start()

    # the fault: the tracker raises on a batch that stores block 666 (once)
    real_apply = sc.tracker.apply
    fired: list[bool] = []

    def apply(events: Any, out: Any) -> None:
        if not fired and any(isinstance(e, BlockStored) and 666 in e.block_hashes for e in events):
            fired.append(True)
            raise RuntimeError("tracker bug")
        real_apply(events, out)

    monkeypatch.setattr(sc.tracker, "apply", apply)

    async def health() -> tuple[int, dict[str, Any]]:
        async with aiohttp.ClientSession() as http, http.get(url + "/health") as r:
            return r.status, await r.json()

    try:
        await asyncio.sleep(0.3)
        k1 = _key([1, 2, 3, 4])
        publisher.publish([BlockStored((1,), None, (1, 2, 3, 4), 4, medium="GPU")])
        await _until(lambda: _held(proc) == {k1}, what="router holds k1")
        await _until(lambda: proc.trust(V0) is TrustGrade.EXACT, what="exact")
        assert (await health())[0] == 200
        epoch = proc.cursor(V0).epoch  # type: ignore[union-attr]

        publisher.publish([BlockStored((666,), None, (9, 9, 9, 9), 4, medium="GPU")])
        await _until(lambda: not sc.events_alive, what="path down")
        status, h = await health()
        assert status == 503 and h["events"]["alive"] is False, h
        assert "tracker bug" in h["events"]["error"], h
        # the router forgets the frozen view and stops trusting the engine
        await _until(lambda: proc.cursor(V0).epoch > epoch, what="new epoch")  # type: ignore[union-attr]
        assert _held(proc) == set()
        await _until(lambda: proc.trust(V0) is TrustGrade.DEGRADED, what="degraded")
        text = await _text(url + "/metrics")
        assert "ramjet_sidecar_events_down 1.0" in text

        # restarted: the replay rebuilds the residency, load flows, trust is exact again
        await _until(lambda: sc.events_alive, what="path up again")
        k666 = _key([9, 9, 9, 9])
        await _until(lambda: _held(proc) == {k1, k666}, what=f"router holds {_held(proc)}")
        await _until(lambda: proc.trust(V0) is TrustGrade.EXACT, what="exact again")
        status, h = await health()
        assert status == 200 and h["events"]["restarts"] == 1, h
        assert "ramjet_sidecar_events_down 0.0" in await _text(url + "/metrics")
    finally:
        await ingest.stop()
        await sc.stop()
        await runner.cleanup()
        publisher.close()


async def _text(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(url) as r:
        return await r.text()
