"""The sidecar's control and pull endpoints (issue 29): `POST /reset_prefix_cache` needs
the bearer token of `--token-file` (off without one), the pulls need it when it is set
(a router sends `reports.pull_token_file`), and `GET /ramjet/snapshot`, which signs the
whole state under the publisher's lock, is signed at most once per interval whoever
asks. A `ramjet sidecar` process and a router's report runtime on loopback."""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client import CollectorRegistry
from zmq_endpoints import free_endpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from sidecars import SidecarProcess

from engine_stub.vllm_events import ZmqEventPublisher
from ramjet.reports.config import KeyEntry, KeysConfig, ReportsConfig
from ramjet.reports.envelope import decode, verify_signature
from ramjet.reports.keys import KeyError_, load_private_key, public_key_b64, write_keypair
from ramjet.reports.publisher import ReportPublisher
from ramjet.reports.runtime import ReportsRuntime
from ramjet.residency.config import ResidencyConfig
from ramjet.residency.tables import ResidencyTables
from ramjet.sidecar.wire import BlockStored
from ramjet.types import EngineId, TrustGrade

pytestmark = pytest.mark.timeout(60)
TOKEN = "s3cret-sidecar-token-0123"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sidecar(tmp: Path, ev: str, *extra: str) -> tuple[SidecarProcess, Path]:
    keys = tmp / "keys"
    priv = keys / "v0-sc.key"
    if not priv.exists():
        write_keypair(keys, "v0-sc")
    port = _free_port()
    argv = [sys.executable, "-m", "ramjet", "sidecar", "--engine-kind", "vllm",
            "--engine-id", "v0", "--engine-url", "http://127.0.0.1:9", "--events", ev,
            "--key", str(priv), "--key-id", "v0-sc", "--model", "m", "--block-tokens", "4",
            "--port", str(port), "--profile", "skip", "--no-scrape", *extra]  # fmt: skip
    return SidecarProcess(argv, port, tmp / f"sidecar-{port}.log"), priv


async def _call(method: str, url: str, token: str | None = None) -> tuple[int, bytes]:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession() as s, s.request(method, url, headers=headers) as r:
        return r.status, await r.read()


async def test_reset_is_off_without_a_token_file(tmp_path: Path) -> None:
    sc, _ = _sidecar(tmp_path, free_endpoint())
    try:
        status, body = await _call("POST", sc.url + "/reset_prefix_cache", TOKEN)
        assert status == 403 and b"--token-file" in body
        # pulls stay open without a token (what they serve is signed)
        assert (await _call("GET", sc.url + "/ramjet/snapshot"))[0] == 200
    finally:
        sc.stop()


async def test_token_guards_reset_and_pulls_and_a_router_pulls_with_it(tmp_path: Path) -> None:
    tok = tmp_path / "sidecar.token"
    tok.write_text(TOKEN + "\n")
    ev, rp = free_endpoint(), free_endpoint()
    publisher = ZmqEventPublisher(ev, rp)
    sc, priv = _sidecar(tmp_path, ev, "--replay", rp, "--token-file", str(tok))
    pub_key = load_private_key(priv).public_key()
    try:
        for path, method in (("/reset_prefix_cache", "POST"), ("/ramjet/snapshot", "GET"),
                             ("/ramjet/reports?after=0", "GET")):  # fmt: skip
            for given in (None, "wrong-token-wrong-token", TOKEN[:-1]):
                status, _ = await _call(method, sc.url + path, given)
                assert status == 401, (path, given, status)
        # the right token passes: the reset reaches the engine (none here: 502)
        assert (await _call("POST", sc.url + "/reset_prefix_cache", TOKEN))[0] == 502
        status, frame = await _call("GET", sc.url + "/ramjet/snapshot", TOKEN)
        assert status == 200 and verify_signature(decode(frame, 1 << 20), pub_key)

        # a router's report runtime: without the token its pulls fail, with it they work
        keys = KeysConfig(
            engines={"v0": [KeyEntry(key_id="v0-sc", public_key=public_key_b64(pub_key))]}
        )
        tok_rel = Path("sidecar.token")

        def runtime(**cfg: Any) -> ReportsRuntime:
            reg = CollectorRegistry()
            tables = ResidencyTables(ResidencyConfig(), registry=reg)
            rc = ReportsConfig.model_validate({"engines": {"v0": sc.url}, **cfg})
            return ReportsRuntime.build(rc, keys, tables, reg, base_dir=tmp_path)

        closed = runtime(poll={"wait_s": 0.2, "timeout_s": 2})
        opened = runtime(poll={"wait_s": 0.2, "timeout_s": 2}, pull_token_file=str(tok_rel))
        await closed.start()
        await opened.start()
        try:
            publisher.publish([BlockStored((1,), None, (1, 2, 3, 4), 4, medium="GPU")])
            deadline = time.monotonic() + 10
            v0 = EngineId("v0")
            while opened.processor.trust(v0) is not TrustGrade.EXACT:
                assert time.monotonic() < deadline, "router with the token never pulled"
                await asyncio.sleep(0.05)
            assert closed.processor.trust(v0) is TrustGrade.APPROXIMATE
            fails = closed.ingest._pull_failures.labels(v0)._value.get()
            assert fails >= 1
        finally:
            await closed.stop()
            await opened.stop()
        with pytest.raises(KeyError_):
            runtime(pull_token_file="missing.token")
    finally:
        sc.stop()
        publisher.close()


async def test_snapshots_over_http_are_signed_at_most_once_per_interval() -> None:
    held = [(i,) for i in range(3)]
    pub = ReportPublisher(
        EngineId("e0"),
        Ed25519PrivateKey.generate(),
        "e0-a",
        snapshot=lambda: ([], []),
        snapshot_min_interval_s=0.3,
    )
    from aiohttp import web

    app = web.Application()
    pub.add_routes(app)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = _free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}/ramjet/snapshot"
    try:
        # a flood while nothing changes: one signature, every answer the same frame
        t0 = time.monotonic()
        got = await asyncio.gather(*(_call("GET", url) for _ in range(50)))
        assert {s for s, _ in got} == {200} and len({f for _, f in got}) == 1
        assert pub.snapshots_signed == 1
        # the state moves between requests: no more than one signature per interval
        from ramjet.reports.bodies import DeltaBody

        for _ in held:
            pub.publish_delta(DeltaBody())
            assert (await _call("GET", url))[0] == 200
        assert pub.snapshots_signed == 4
        assert time.monotonic() - t0 >= 3 * 0.3  # 4 signatures: 3 intervals at least
    finally:
        await runner.cleanup()
