"""The `reports:` and `keys:` sections of the policy file.

reports:
  max_report_bytes: 4194304   # frame cap, checked before parsing or verifying
  max_keys: 262144            # keys per body, checked while parsing
  max_age_s: 120              # issue time older than this: rejected
  max_future_skew_s: 5        # issue time further in the future: rejected
  rate_per_s: 500             # per-engine token bucket (verified reports)
  burst: 2000
  stale_after_s: 10           # no report for this long: trust DEGRADED
  stale_ttl_s: 60             # ... for this long: residency stops steering
  poll: {wait_s: 20, timeout_s: 30, max_batch: 512, backoff_min_s: 0.2, backoff_max_s: 5}
  engines: {e0: "http://127.0.0.1:8001"}   # engines to pull from (base URLs)
  push: {host: 127.0.0.1, port: null, rate_per_s: 50, burst: 100}   # push listener, off
  pull_token_file: null       # bearer token sent on pulls (sidecars' --token-file)
keys:
  engines:
    e0:
      - {key_id: e0-2026a, public_key: "<base64 of the 32 raw bytes>"}
      - {key_id: e0-2026b, public_key_file: keys/e0-2026b.pub}   # PEM
  retired: [e0-2025]
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ramjet.types import ID_PATTERN

Pos = Annotated[float, Field(gt=0)]


class PollConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    wait_s: Annotated[float, Field(ge=0, le=60)] = 20.0
    """Long-poll wait the router asks for."""
    timeout_s: Pos = 30.0
    """Client timeout of one poll (must exceed wait_s)."""
    max_batch: Annotated[int, Field(ge=1, le=10_000)] = 512
    backoff_min_s: Pos = 0.2
    backoff_max_s: Pos = 5.0

    @model_validator(mode="after")
    def _check(self) -> PollConfig:
        if self.timeout_s <= self.wait_s:
            raise ValueError("poll.timeout_s must exceed poll.wait_s")
        if self.backoff_max_s < self.backoff_min_s:
            raise ValueError("poll.backoff_max_s must be >= poll.backoff_min_s")
        return self


class PushConfig(BaseModel):
    """`reports.push`: the listener for report pushes (`ramjet.reports.push`). Off by
    default: the router pulls; pushes never ride on the client port."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int | None = Field(default=None, ge=0, le=65535)
    """None: no push listener (the default; engines are pulled). 0: any free port."""
    rate_per_s: float = Field(default=50.0, gt=0)
    """Frames per second per source address, counted before reading or verifying."""
    burst: int = Field(default=100, ge=1)
    max_sources: int = Field(default=4096, ge=1)
    max_connections: int = Field(default=256, ge=1)
    idle_s: float = Field(default=10.0, gt=0)


class ReportsConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_report_bytes: Annotated[int, Field(ge=1024, le=64 << 20)] = 4 << 20
    max_keys: Annotated[int, Field(ge=1, le=1 << 19)] = 1 << 18
    max_age_s: Pos = 120.0
    max_future_skew_s: Annotated[float, Field(ge=0)] = 5.0
    rate_per_s: Pos = 500.0
    burst: Annotated[int, Field(ge=1)] = 2000
    stale_after_s: Pos = 10.0
    stale_ttl_s: Pos = 60.0
    poll: PollConfig = PollConfig()
    engines: dict[str, str] = {}
    """Engines to pull reports from: engine id -> base URL (http://host:port)."""
    push: PushConfig = PushConfig()
    pull_token_file: Path | None = None
    """File holding the bearer token sent with every pull (`Authorization: Bearer`), for
    sidecars started with `--token-file`; relative to the policy file's folder."""

    @model_validator(mode="after")
    def _check(self) -> ReportsConfig:
        if self.stale_ttl_s < self.stale_after_s:
            raise ValueError("stale_ttl_s must be >= stale_after_s")
        for engine, url in self.engines.items():
            if not ID_PATTERN.fullmatch(engine):
                raise ValueError(f"engines: bad engine id {engine!r}")
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engines.{engine}: URL must start with http:// or https://")
        return self


class KeyEntry(BaseModel):
    """One public key: inline (base64 of the 32 raw bytes, or PEM text) or a PEM file."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key_id: str
    public_key: str | None = None
    public_key_file: Path | None = None

    @field_validator("key_id")
    @classmethod
    def _kid(cls, v: str) -> str:
        if not ID_PATTERN.fullmatch(v):
            raise ValueError(f"key_id must match {ID_PATTERN.pattern}")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> KeyEntry:
        if (self.public_key is None) == (self.public_key_file is None):
            raise ValueError("give exactly one of public_key and public_key_file")
        return self


class KeysConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    engines: dict[str, list[KeyEntry]] = {}
    """Engine id -> its active public keys (several during a rotation)."""
    retired: list[str] = []
    """Key ids that must be refused, wherever they are listed."""

    @model_validator(mode="after")
    def _unique(self) -> KeysConfig:
        seen: dict[str, str] = {}
        for engine, entries in self.engines.items():
            if not ID_PATTERN.fullmatch(engine):
                raise ValueError(f"engines: bad engine id {engine!r}")
            for e in entries:
                if e.key_id in seen:
                    raise ValueError(
                        f"key_id {e.key_id!r} listed for both {seen[e.key_id]!r} and {engine!r}"
                    )
                seen[e.key_id] = engine
        return self
