"""Shared pieces for the report tests: fixed Ed25519 keys, clocks, a processor."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client import CollectorRegistry

from ramjet.reports.bodies import Body, DeltaBody, LoadBody, SnapshotBody, TierKeys, encode_body
from ramjet.reports.config import ReportsConfig
from ramjet.reports.envelope import Envelope, ReportKind, sign
from ramjet.reports.keys import KeyRing
from ramjet.reports.processor import ReportProcessor
from ramjet.residency.config import ResidencyConfig
from ramjet.residency.tables import ResidencyTables
from ramjet.types import EngineId, PrefixKey

E0, E1 = EngineId("e0"), EngineId("e1")
WALL0 = 1_800_000_000.0


def key(name: str) -> Ed25519PrivateKey:
    """A deterministic test key: seed = sha256(name)."""
    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(name.encode()).digest())


KEYS = {kid: key(kid) for kid in ("e0-a", "e0-b", "e0-old", "e1-a", "stranger")}


def keyring() -> KeyRing:
    return KeyRing(
        {
            "e0-a": (E0, KEYS["e0-a"].public_key()),
            "e0-b": (E0, KEYS["e0-b"].public_key()),  # rotation: both active
            "e0-old": (E0, KEYS["e0-old"].public_key()),
            "e1-a": (E1, KEYS["e1-a"].public_key()),
        },
        retired={"e0-old"},
    )


@dataclass
class Clocks:
    wall: float = WALL0
    mono: float = 500.0

    def wall_clock(self) -> float:
        return self.wall

    def clock(self) -> float:
        return self.mono

    def advance(self, s: float) -> None:
        self.wall += s
        self.mono += s


@dataclass
class Rig:
    clocks: Clocks
    tables: ResidencyTables
    processor: ReportProcessor
    registry: CollectorRegistry
    seqs: dict[tuple[EngineId, int], int] = field(default_factory=dict)

    def rejected(self, reason: str, engine: str = "e0") -> float:
        v = self.registry.get_sample_value(
            "ramjet_reports_rejected_total", {"engine": engine, "reason": reason}
        )
        return v or 0.0

    def accepted(self, engine: str, kind: str) -> float:
        v = self.registry.get_sample_value(
            "ramjet_reports_accepted_total", {"engine": engine, "kind": kind}
        )
        return v or 0.0


def rig(**cfg: object) -> Rig:
    clocks = Clocks()
    registry = CollectorRegistry()
    tables = ResidencyTables(ResidencyConfig(), clock=clocks.clock, registry=registry)
    config = ReportsConfig.model_validate(cfg)
    proc = ReportProcessor(keyring(), tables, config, registry, clocks.wall_clock, clocks.clock)
    return Rig(clocks, tables, proc, registry)


def frame(
    body: Body,
    *,
    kind: ReportKind | None = None,
    engine: EngineId = E0,
    key_id: str = "e0-a",
    signer: str | None = None,
    epoch: int = 7,
    seq: int = 1,
    issued_at_ms: int | None = None,
    wall: float = WALL0,
) -> bytes:
    if kind is None:
        kind = {
            DeltaBody: "delta",
            SnapshotBody: "snapshot",
            LoadBody: "load",
        }.get(type(body), "profile")  # type: ignore[assignment]
    assert kind is not None
    issued = int(wall * 1000) if issued_at_ms is None else issued_at_ms
    env = Envelope(engine, key_id, epoch, seq, issued, kind, encode_body(body))
    return sign(env, KEYS[signer or key_id])


def stored(*keys: int, tier: str = "hbm") -> DeltaBody:
    return DeltaBody(stored=[TierKeys(tier=tier, keys=tuple(PrefixKey(k) for k in keys))])  # type: ignore[arg-type]


def load_body(queued: int = 10) -> LoadBody:
    return LoadBody(
        queued_prompt_tokens=queued, running_requests=1, waiting_requests=0, kv_utilization=0.5
    )
