"""Wiring the engine to the signed-report publisher (`ramjet.reports.publisher`).

The engine's signing key comes from `--key FILE` (a PEM or raw 32-byte Ed25519 private
key) with `--key-id`, or, without one, an ephemeral key generated at start whose public
half is logged (a router can only trust it if an operator copies it into the policy).

Until the publisher module exists the engine serves without report routes and says so in
its log; the cache events still flow through `CacheEvents` (`engine.events`), so wiring
is: subscribe the publisher to `engine.events`, hand it `engine.cache_snapshot`,
`engine.load` and `engine.profile`, and mount its routes on the app.
"""

from __future__ import annotations

import base64
import importlib
import logging
from pathlib import Path
from typing import Any

from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from engine_stub.engine import Engine

log = logging.getLogger("engine_stub.reports")


def load_or_generate_key(key_file: Path | None) -> tuple[Ed25519PrivateKey, bool]:
    """The signing key, and whether it is ephemeral."""
    if key_file is None:
        return Ed25519PrivateKey.generate(), True
    data = key_file.read_bytes()
    if len(data) == 32:
        return Ed25519PrivateKey.from_private_bytes(data), False
    key = serialization.load_pem_private_key(data, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{key_file}: not an Ed25519 private key")
    return key, False


def public_b64(key: Ed25519PrivateKey) -> str:
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def attach_reports(
    app: web.Application, engine: Engine, *, key_file: Path | None, key_id: str | None
) -> Any:
    key, ephemeral = load_or_generate_key(key_file)
    kid = key_id or f"{engine.settings.engine_id}-ephemeral"
    if ephemeral:
        log.warning("no --key given: ephemeral Ed25519 key %s, public key %s", kid, public_b64(key))
    try:
        publisher_mod = importlib.import_module("ramjet.reports.publisher")
    except ImportError:
        log.warning("ramjet.reports.publisher is not available: serving without signed reports")
        return None
    factory = getattr(publisher_mod, "attach_engine_publisher", None)
    if factory is None:
        log.warning("ramjet.reports.publisher has no attach_engine_publisher(): reports not wired")
        return None
    return factory(app, engine=engine, key=key, key_id=kid)
