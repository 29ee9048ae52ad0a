"""The `residency:` section of the policy file: TTLs and memory caps of both tables."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

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
    max_swa_entries: Annotated[int, Field(ge=1)] = 200_000
    max_pending_entries: Annotated[int, Field(ge=1)] = 500_000
    """Pending (engine, key) holds across both tables; the oldest tickets go first."""

    @model_validator(mode="after")
    def _check(self) -> ResidencyConfig:
        if self.swa_ttl_s > self.swa_max_ttl_s:
            raise ValueError("swa_ttl_s must not exceed swa_max_ttl_s")
        return self
