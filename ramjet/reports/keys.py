"""The router's key ring: which public key may sign for which engine.

Keys come only from configuration (inline or PEM files named by the policy file);
nothing in a report can add a key. A key id belongs to exactly one engine; several key
ids may be active for one engine at once (rotation: add the new key, switch the engine,
then list the old id under `retired`). Retired ids are refused even if still listed.

Revocation without a restart: a policy reload (SIGHUP, `POST /admin/reload`) reloads
the key ring, key files included (`ReportProcessor.replace_keyring`). A key id that is
no longer accepted as the same key (removed, retired, other key material) is revoked:
every engine whose current view that key signed any report of is purged and starts over
from its next report (a snapshot), so nothing the revoked key said keeps steering.

`lookup` answers with a key or the rejection reason: "retired_key", "unknown_key",
"wrong_engine_key" (the key id is another engine's).
"""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ramjet.errors import ConfigError
from ramjet.reports.config import KeyEntry, KeysConfig
from ramjet.types import EngineId


class KeyError_(ConfigError, ValueError):
    """A key that cannot be loaded (bad encoding, not Ed25519, unreadable file)."""


def parse_public_key(text: str | bytes) -> Ed25519PublicKey:
    """PEM (SubjectPublicKeyInfo) or base64 of the 32 raw bytes."""
    data = text.encode("ascii", "replace") if isinstance(text, str) else text
    if b"-----BEGIN" in data:
        try:
            key = serialization.load_pem_public_key(data)
        except ValueError as exc:
            raise KeyError_(f"bad PEM public key: {exc}") from None
        if not isinstance(key, Ed25519PublicKey):
            raise KeyError_("public key is not Ed25519")
        return key
    try:
        raw = base64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise KeyError_("public key is neither PEM nor base64") from None
    if len(raw) != 32:
        raise KeyError_(f"raw Ed25519 public key must be 32 bytes, got {len(raw)}")
    return Ed25519PublicKey.from_public_bytes(raw)


def public_key_b64(key: Ed25519PublicKey) -> str:
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode("ascii")


def load_private_key(path: str | Path) -> Ed25519PrivateKey:
    """An engine's signing key from a PKCS#8 PEM file (as `ramjet keys generate` writes)."""
    try:
        data = Path(path).read_bytes()
        key = serialization.load_pem_private_key(data, password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise KeyError_(f"{path}: cannot load private key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyError_(f"{path}: private key is not Ed25519")
    return key


def write_keypair(out_dir: Path, key_id: str) -> tuple[Path, Path, Ed25519PrivateKey]:
    """Write `<key_id>.key` (PKCS#8 PEM, mode 0600) and `<key_id>.pub` (PEM) into
    `out_dir`; refuses to overwrite either."""
    out_dir.mkdir(parents=True, exist_ok=True)
    priv_path, pub_path = out_dir / f"{key_id}.key", out_dir / f"{key_id}.pub"
    for p in (priv_path, pub_path):
        if p.exists():
            raise FileExistsError(f"{p} exists; refusing to overwrite a key")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(priv_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    os.chmod(priv_path, 0o600)  # whatever the umask
    pub_path.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return priv_path, pub_path, key


@dataclass(frozen=True, slots=True)
class _Held:
    engine: EngineId
    key: Ed25519PublicKey


class KeyRing:
    """Public keys by key id, each bound to one engine; retired ids refused."""

    def __init__(
        self,
        keys: dict[str, tuple[EngineId, Ed25519PublicKey]],
        retired: set[str] | frozenset[str] = frozenset(),
    ) -> None:
        self._keys = {kid: _Held(engine, key) for kid, (engine, key) in keys.items()}
        self._retired = frozenset(retired)

    @classmethod
    def from_config(cls, config: KeysConfig, base_dir: Path | None = None) -> KeyRing:
        """Load every listed key; file paths are relative to `base_dir` (the policy
        file's folder). Raises `KeyError_` naming the engine and key id."""
        keys: dict[str, tuple[EngineId, Ed25519PublicKey]] = {}
        for engine, entries in config.engines.items():
            for entry in entries:
                try:
                    keys[entry.key_id] = (EngineId(engine), _load_entry(entry, base_dir))
                except KeyError_ as exc:
                    raise KeyError_(f"keys.engines.{engine}[{entry.key_id}]: {exc}") from None
        return cls(keys, set(config.retired))

    def active(self) -> dict[str, tuple[EngineId, bytes]]:
        """Key id -> (engine, raw public key bytes) of every key not retired."""
        return {
            kid: (h.engine, _raw(h.key))
            for kid, h in self._keys.items()
            if kid not in self._retired
        }

    def revoked_by(self, new: KeyRing) -> frozenset[str]:
        """Key ids active here that `new` no longer accepts as the same key: removed,
        retired, moved to another engine, or with other key material."""
        now = new.active()
        return frozenset(kid for kid, held in self.active().items() if now.get(kid) != held)

    def engines(self) -> frozenset[EngineId]:
        """Engines with at least one active key."""
        return frozenset(h.engine for kid, h in self._keys.items() if kid not in self._retired)

    def lookup(self, key_id: str, engine: EngineId) -> Ed25519PublicKey | str:
        """The key that may verify `engine`'s report signed under `key_id`, or the
        rejection reason."""
        if key_id in self._retired:
            return "retired_key"
        held = self._keys.get(key_id)
        if held is None:
            return "unknown_key"
        if held.engine != engine:
            return "wrong_engine_key"
        return held.key


def _raw(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _load_entry(entry: KeyEntry, base_dir: Path | None) -> Ed25519PublicKey:
    if entry.public_key is not None:
        return parse_public_key(entry.public_key)
    assert entry.public_key_file is not None
    path = entry.public_key_file
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    try:
        return parse_public_key(path.read_bytes())
    except OSError as exc:
        raise KeyError_(f"cannot read {path}: {exc.strerror}") from None
