"""Revoking a report key without a restart (issue 29): a real router pulls an engine's
signed reports over HTTP; the policy file retires the key (or its key file changes) and
`POST /admin/reload` purges at once what that key signed, refuses it from then on, and
the engine's own key starts the view over (a fresh snapshot). Real Ed25519 key files."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from ramjet.app.server import RouterServer
from ramjet.config import load_policy
from ramjet.reports.bodies import DeltaBuilder, TierKeys
from ramjet.reports.keys import write_keypair
from ramjet.reports.publisher import ReportPublisher
from ramjet.residency.store import MemoryStore, Table
from ramjet.residency.tables import ResidencyTables
from ramjet.types import EngineId, PrefixKey, Tier

pytestmark = pytest.mark.timeout(60)
E0 = EngineId("e0")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _held(server: RouterServer) -> set[int]:
    tables = server.router.residency
    assert isinstance(tables, ResidencyTables)
    store = tables.store
    assert isinstance(store, MemoryStore)
    return {int(k) for k, _ in store.entries(Table.GLOBAL, E0, exact=True)}


async def _until(cond: Any, timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out: {what}"
        await asyncio.sleep(0.05)


class Engine:
    """A report publisher on loopback holding a set of keys (its 'cache')."""

    def __init__(self, priv: Any, key_id: str) -> None:
        self.keys: set[int] = set()
        self.pub = ReportPublisher(E0, priv, key_id, epoch=1000, snapshot=self._snapshot)
        self.port = _free_port()

    def _snapshot(self) -> tuple[list[TierKeys], list[Any]]:
        return [TierKeys(tier="hbm", keys=tuple(PrefixKey(k) for k in sorted(self.keys)))], []

    def store(self, *keys: int) -> None:
        b = DeltaBuilder()
        for k in keys:
            self.keys.add(k)
            b.stored(PrefixKey(k), Tier.HBM)
        self.pub.publish_delta(b.build())

    async def start(self) -> None:
        app = web.Application()
        self.pub.add_routes(app)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        await self.pub.start()

    async def stop(self) -> None:
        await self.pub.stop()
        await self.runner.cleanup()


def _policy(path: Path, url: str, keys: list[str], retired: list[str]) -> None:
    data = {
        "engines": [{"id": "e0", "url": url}],
        "incumbent": {"name": "round_robin"},
        "admin": {"token": "s3cret"},
        "reports": {"engines": {"e0": url}, "poll": {"wait_s": 1, "timeout_s": 5}},
        "keys": {
            "engines": {"e0": [{"key_id": k, "public_key_file": f"keys/{k}.pub"} for k in keys]},
            "retired": retired,
        },
    }
    path.write_text(yaml.safe_dump(data))


async def _reload(server: RouterServer) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(server.url + "/admin/reload", headers={"Authorization": "Bearer s3cret"}) as r,
    ):
        return r.status, await r.json()


async def test_retiring_a_key_on_reload_purges_what_it_signed(tmp_path: Path) -> None:
    _, _, stolen = write_keypair(tmp_path / "keys", "e0-b")
    _, _, real = write_keypair(tmp_path / "keys", "e0-a")
    bad = Engine(stolen, "e0-b")  # whoever holds e0-b serves e0's reports
    await bad.start()
    pf = tmp_path / "policy.yaml"
    url = f"http://127.0.0.1:{bad.port}"
    _policy(pf, url, ["e0-a", "e0-b"], [])
    server = RouterServer(load_policy(pf), policy_path=str(pf))
    await server.start()
    try:
        bad.store(11, 12)
        await _until(lambda: _held(server) == {11, 12}, what="router holds e0-b's keys")
        _policy(pf, url, ["e0-a", "e0-b"], ["e0-b"])
        status, body = await _reload(server)
        assert status == 200, body
        assert body["keys"] == {"revoked": ["e0-b"], "purged": ["e0"]}, body
        assert "keys" not in body["needs_restart"]
        assert _held(server) == set()
        bad.store(13)  # refused from now on
        await asyncio.sleep(1.5)
        assert _held(server) == set()
        rej = server.router.metrics.registry.get_sample_value(
            "ramjet_reports_rejected_total", {"engine": "e0", "reason": "retired_key"}
        )
        assert rej is not None and rej >= 1
    finally:
        await server.stop(drain_s=0.2)
        await bad.stop()
    _ = real


async def test_a_replaced_key_file_revokes_the_old_key_on_reload(tmp_path: Path) -> None:
    priv_old, pub_path, old = write_keypair(tmp_path / "keys", "e0-a")
    eng = Engine(old, "e0-a")
    await eng.start()
    pf = tmp_path / "policy.yaml"
    url = f"http://127.0.0.1:{eng.port}"
    _policy(pf, url, ["e0-a"], [])
    server = RouterServer(load_policy(pf), policy_path=str(pf))
    await server.start()
    try:
        eng.store(21)
        await _until(lambda: _held(server) == {21}, what="router holds e0-a's keys")
        # the operator replaces the key file (a compromised key, same id)
        priv_old.unlink()
        pub_path.unlink()
        _, _, new = write_keypair(tmp_path / "keys", "e0-a")
        status, body = await _reload(server)
        assert status == 200 and body["keys"] == {"revoked": ["e0-a"], "purged": ["e0"]}, body
        assert _held(server) == set()
        # a broken key file is refused and changes nothing
        pub_path.write_text("not a key")
        status, body = await _reload(server)
        assert status == 400, body
        # the old key's reports are refused (its signature no longer verifies)
        eng.store(22)
        await asyncio.sleep(1.5)
        assert _held(server) == set()
    finally:
        await server.stop(drain_s=0.2)
        await eng.stop()
    _ = new
