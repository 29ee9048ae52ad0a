"""Wiring the engine to the signed-report publisher (`ramjet.reports.publisher`).

The engine's signing key comes from `--key FILE` (a PEM or raw 32-byte Ed25519 private
key) with `--key-id`, or, without one, an ephemeral key generated at start whose public
half is logged (a router can only trust it if an operator copies it into the policy).

Cache events (`engine.events`) accumulate in a `DeltaBuilder` and are published as
delta reports every 100 ms; snapshots and load reports are built from the caches and the
scheduler on demand; the profile is published once at start. The publisher's epoch is
the engine's (wall-clock ms at start, so a restart's epoch is higher).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import threading
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from engine_stub.engine import Engine
from engine_stub.events import CacheEvent
from ramjet.reports.bodies import DeltaBuilder, LoadBody, SwaStates, TierKeys
from ramjet.reports.publisher import ReportPublisher
from ramjet.runtime.tasks import cancel_and_wait
from ramjet.types import EngineId, PrefixKey

log = logging.getLogger("engine_stub.reports")


def load_or_generate_key(key_file: Path | None) -> tuple[Ed25519PrivateKey, bool]:
    """The signing key (PKCS#8 PEM as `ramjet keys generate` writes), and whether it is
    ephemeral."""
    if key_file is None:
        return Ed25519PrivateKey.generate(), True
    from ramjet.reports.keys import load_private_key

    return load_private_key(key_file), False


def public_b64(key: Ed25519PrivateKey) -> str:
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def _chunks(keys: list[PrefixKey], n: int = 4096) -> list[list[PrefixKey]]:
    return [keys[i : i + n] for i in range(0, len(keys), n)]


class EngineReporter:
    """Feeds one `ReportPublisher` from the engine: cache events accumulate in a
    `DeltaBuilder` (worker thread) and are published every `flush_s` on the event loop;
    snapshots and load are read on demand; the profile is published once at start."""

    def __init__(self, engine: Engine, publisher: ReportPublisher, flush_s: float = 0.1) -> None:
        self.engine = engine
        self.publisher = publisher
        self.flush_s = flush_s
        self._builder = DeltaBuilder()
        self._lock = threading.Lock()
        engine.events.subscribe(self._on_event)

    def _on_event(self, ev: CacheEvent) -> None:
        ttl_ms = None if ev.expires_at is None else max(1, int((ev.expires_at - ev.at) * 1000))
        with self._lock:
            b = self._builder
            if ev.kind == "stored" and ev.tier is not None:
                b.stored(ev.key, ev.tier, ttl_ms)
            elif ev.kind == "moved" and ev.tier is not None:
                b.moved(ev.key, ev.tier, ttl_ms)
            elif ev.kind == "evicted":
                b.evicted(ev.key)
            elif ev.kind == "swa_created":
                b.swa_created(ev.key, ttl_ms or 1)
            elif ev.kind == "swa_expired":
                b.swa_expired(ev.key)

    def flush(self) -> int:
        with self._lock:
            if not len(self._builder):
                return 0
            body = self._builder.build()
        return self.publisher.publish_delta(body)

    def snapshot(self) -> tuple[list[TierKeys], list[SwaStates]]:
        now = time.time()
        groups: dict[tuple[str, int], list[PrefixKey]] = {}
        for key, tier, expires in self.engine.kv.snapshot():
            ttl = max(1, int(expires - now)) * 1000
            groups.setdefault((tier.label, ttl), []).append(key)
        residency = [
            TierKeys(tier=t, keys=tuple(ks), ttl_ms=ttl)
            for (t, ttl), keys in sorted(groups.items())
            for ks in _chunks(keys)
        ]
        swa_groups: dict[int, list[PrefixKey]] = {}
        for key, _n, expires in self.engine.swa.snapshot():
            swa_groups.setdefault(max(1, int(expires - now)) * 1000, []).append(key)
        swa = [
            SwaStates(keys=tuple(ks), ttl_ms=t)
            for t, keys in sorted(swa_groups.items())
            for ks in _chunks(keys)
        ]
        return residency, swa

    def load(self) -> LoadBody:
        e = self.engine
        waiting, running = e.scheduler.counts()
        cap = max(1, e.kv.capacity_blocks[0] * e.kv.block_tokens)
        spec = e.speculator
        return LoadBody(
            queued_prompt_tokens=e.scheduler.queued_prompt_tokens(),
            running_requests=running,
            waiting_requests=waiting,
            kv_utilization=min(1.0, e.kv.resident_tokens()[0] / cap),
            decode_tokens_per_s=e.scheduler.decode_tokens_per_s,
            spec_acceptance=None if spec is None else max(0.0, min(1.0, spec.acceptance)),
        )

    async def _flusher(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            try:
                self.flush()
            except Exception:  # a bad delta must not stop the reports
                log.exception("delta report failed")


def attach_reports(
    app: web.Application, engine: Engine, *, key_file: Path | None, key_id: str | None
) -> EngineReporter:
    """Create the engine's publisher, mount its routes (`GET /ramjet/reports`,
    `GET /ramjet/snapshot`) and run it with the app."""
    key, ephemeral = load_or_generate_key(key_file)
    kid = key_id or f"{engine.settings.engine_id}-ephemeral"
    if ephemeral:
        log.warning("no --key given: ephemeral Ed25519 key %s, public key %s", kid, public_b64(key))
    holder: list[EngineReporter] = []
    publisher = ReportPublisher(
        EngineId(engine.settings.engine_id),
        key,
        kid,
        epoch=engine.epoch,
        snapshot=lambda: holder[0].snapshot(),
        load=lambda: holder[0].load(),
    )
    reporter = EngineReporter(engine, publisher)
    holder.append(reporter)
    publisher.add_routes(app)

    async def run(app: web.Application) -> Any:
        await publisher.start()
        if engine.profile is not None:
            publisher.publish_profile(engine.profile)
        task = asyncio.create_task(reporter._flusher())
        yield
        await cancel_and_wait((task,))
        reporter.flush()
        await publisher.stop()

    app.cleanup_ctx.append(run)
    return reporter
