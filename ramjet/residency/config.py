"""The `residency:` section of the policy file (TTLs and memory caps of both tables) and
the `store:` section (where the tables live; the Redis link's settings)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PositiveSeconds = Annotated[float, Field(gt=0)]


class ResidencyConfig(BaseModel):
    """TTLs in seconds; caps in entries (one entry = one (engine, key) pair)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    global_ttl_s: PositiveSeconds = 72 * 3600.0
    """Expiry of a reported global-KV entry after its last confirmation (72 h)."""
    swa_ttl_s: PositiveSeconds = 300.0
    """SWA session expiry when the engine states none (and for routed SWA entries)."""
    swa_max_ttl_s: PositiveSeconds = 3600.0
    """Upper bound on any SWA expiry an engine reports."""
    approximate_ttl_s: PositiveSeconds = 300.0
    """Expiry of entries inferred from the router's own routing (no report behind them)."""
    pending_ttl_s: PositiveSeconds = 30.0
    """Life of a pending hold: the blocks of a request sent to an engine but not yet
    confirmed by its report (`ramjet.residency.pending`). Long enough to cover queueing
    and prefill plus a few report intervals; a report or a failure ends it sooner."""
    max_global_entries: Annotated[int, Field(ge=1)] = 1_000_000
    """Cap of the global table (exact and approximate entries, every engine) while the
    engines report no capacity, and its floor when they do (`capacity_headroom`)."""
    capacity_headroom: Annotated[float, Field(ge=1.0, le=100.0)] = 1.25
    """The in-process global table's cap is this x the engines' reported capacity (blocks,
    all tiers), within max_global_entries .. max_global_entries_ceiling."""
    max_global_entries_ceiling: Annotated[int, Field(ge=1)] = 400_000_000
    """Hard bound on the in-process global table whatever the engines report (about
    25-30 bytes a block: 400M is ~11 GiB)."""
    max_swa_entries: Annotated[int, Field(ge=1)] = 200_000
    max_pending_entries: Annotated[int, Field(ge=1)] = 500_000
    """Pending (engine, key) holds across both tables; the oldest tickets go first."""

    @model_validator(mode="after")
    def _check(self) -> ResidencyConfig:
        if self.swa_ttl_s > self.swa_max_ttl_s:
            raise ValueError("swa_ttl_s must not exceed swa_max_ttl_s")
        if self.max_global_entries_ceiling < self.max_global_entries:
            raise ValueError("max_global_entries_ceiling must be >= max_global_entries")
        return self


Annotated_ms = Annotated[int, Field(ge=1, le=600_000)]
"""A duration in milliseconds."""


class RedisSettings(BaseModel):
    """The `store:` section of a policy file when `kind: redis` (see docs/redis.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str = "redis://127.0.0.1:6379/0"
    cluster: bool = False
    """Use the Redis Cluster protocol (the url names any one node)."""
    key_prefix: str = Field(default="ramjet", pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    """Namespace for every key, so several deployments can share one Redis."""
    timeout_ms: Annotated_ms = 100
    connect_timeout_ms: Annotated_ms = 200
    breaker_failures: int = Field(default=3, ge=1, le=1000)
    breaker_open_ms: Annotated_ms = 500
    breaker_max_open_ms: Annotated_ms = 10_000
    sync_interval_ms: Annotated_ms = 50
    """How often a replica pulls the other replicas' changes into its local copy."""
    max_global_entries_per_engine: int = Field(default=500_000, ge=1)
    max_swa_entries_per_engine: int = Field(default=100_000, ge=1)
    log_max_entries: int = Field(default=10_000, ge=16)
    """Change-log entries kept per engine; a replica further behind resyncs in full."""
    log_max_age_s: float = Field(default=120.0, ge=1.0, le=86_400.0)
    """Change-log entries older than this are trimmed (replicas read the log every
    `sync_interval_ms`; one further behind resyncs in full), so a large snapshot's chunks
    do not stay in Redis memory beside the entries they wrote."""
    max_pending_writes: int = Field(default=10_000, ge=1)
    """Writes queued while Redis is unreachable; beyond it the oldest are dropped and
    the replica re-seeds Redis from its local copy on recovery."""
    retention_slack_s: float = Field(default=86_400.0, ge=0)
    """Bookkeeping keys (cursors, indexes, logs) live this long past the longest entry TTL."""
    shared_secret: str | None = Field(default=None, min_length=16, repr=False)
    """Key of the MACs every replica puts on what it writes to Redis and checks on what
    it reads (docs/redis.md, "Authentication"). Prefer `shared_secret_file`."""
    shared_secret_file: str | None = None
    """A file holding the shared secret (leading and trailing whitespace ignored)."""
    max_clock_skew_s: float = Field(default=300.0, gt=0)
    """An epoch (a report's wall-clock start time in ms) more than this far in the
    future is refused wherever Redis shows one: it would freeze the engine's reports."""
    snapshot_chunk_entries: int = Field(default=500, ge=16, le=100_000)
    """Entries per write batch sent to Redis: a snapshot, or any large write, goes in
    chunks of this many, each one script call well inside `timeout_ms`."""
    encoding: Literal["packed", "keys"] = "packed"
    """How entries are stored (docs/redis.md): `packed`, 27-byte records in one hash per
    engine and kind, bucketed by the key's first 16 bits (about 30 bytes per entry at
    scale); `keys`, one string key and one index member per entry (the encoding before
    issue 33, hundreds of bytes per entry). Every replica must use the same."""
    max_batch_attempts: int = Field(default=5, ge=1, le=1000)
    """A batch Redis refuses with an error reply (OOM, script error) this many times is
    dropped (counted) and its engines pulled again, so it cannot block the queue."""

    @model_validator(mode="after")
    def _check_secret(self) -> RedisSettings:
        if self.shared_secret is not None and self.shared_secret_file is not None:
            raise ValueError("store: set shared_secret or shared_secret_file, not both")
        return self

    def secret(self) -> bytes | None:
        """The shared secret's bytes (read from `shared_secret_file` when set), or None:
        unauthenticated (structure is still checked). Raises ValueError on a bad file."""
        if self.shared_secret is not None:
            return self.shared_secret.encode()
        if self.shared_secret_file is None:
            return None
        try:
            raw = Path(self.shared_secret_file).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"store.shared_secret_file: {exc}") from exc
        if len(raw) < 16:
            raise ValueError("store.shared_secret_file: the secret must be at least 16 bytes")
        if raw.startswith(b"REPLACE"):
            raise ValueError(
                "store.shared_secret_file: still the deploy manifest's placeholder; put a "
                "random secret in it (docs/redis.md, Authentication)"
            )
        return raw

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        if not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("store.url must start with redis://, rediss:// or unix://")
        return v


class StoreConfig(RedisSettings):
    """The policy file's `store:` section: where the residency tables live.

    `kind: memory` (default): in this process only. `kind: redis`: shared by every
    replica through Redis (`RedisSettings` fields; see docs/redis.md)."""

    kind: Literal["memory", "redis"] = "memory"
