"""The `usage.prompt_work` schema: where an engine's prompt tokens came from and what
restoring and computing them cost. One definition for both sides of the wire: the
reference engine fills a `PromptWork` per request and writes `to_json()` into every
response's `usage`; the router reads it back (`ramjet.decisions.log.realized_from_usage`)
into its `RealizedWork`, a `PromptWork` plus `usage.prompt_tokens`.

Fields (all non-negative): token counts by source (`hbm_tokens`, `host_tokens`,
`ssd_tokens` of global KV by the engine's own tiers; `pool_tokens` of global KV pulled
from a pool shared with other engines (ARCHITECTURE 5b); `swa_tokens` resumed from pooled
SWA state past the last full block; `replayed_tokens`; `prefilled_tokens`), the engine's
`epoch`, and milliseconds: `queue_ms` (arrival to start), `restore_ms` (bringing cached
state back), of it `restore_io_ms` (copying blocks out of their tiers and pools), of that
`pool_io_ms` (reading shared pools), `prefill_ms`. `pool_swa_tokens`: the prompt position
whose SWA state came from a shared SWA pool (0: none, or it came from the engine's own).
`pools` (engine-side detail, not read by the router): per pool id, `{tokens, bytes, ms}`
pulled from it for this prompt (for an SWA pool, `tokens` is `pool_swa_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TOKEN_FIELDS = (
    "hbm_tokens",
    "host_tokens",
    "ssd_tokens",
    "pool_tokens",
    "swa_tokens",
    "replayed_tokens",
    "prefilled_tokens",
)
COUNT_FIELDS = (*TOKEN_FIELDS, "pool_swa_tokens", "epoch")
"""Integer fields."""
TTFT_MS_FIELDS = ("queue_ms", "restore_ms", "prefill_ms")
"""Millisecond fields that add up to the engine's time to first token."""
# digits each millisecond field keeps on the wire (restore_io_ms is a finer part)
_MS_DIGITS = {
    "queue_ms": 3,
    "restore_ms": 3,
    "restore_io_ms": 4,
    "pool_io_ms": 4,
    "prefill_ms": 3,
}


@dataclass(slots=True)
class PromptWork:
    """Where the prompt's tokens came from and what it cost (usage.prompt_work)."""

    hbm_tokens: int = 0
    host_tokens: int = 0
    ssd_tokens: int = 0
    pool_tokens: int = 0
    """Global-KV tokens pulled from pools shared with other engines (not in hbm/host/ssd)."""
    swa_tokens: int = 0
    """Tokens past the last full block resumed from pooled SWA state (no block key)."""
    replayed_tokens: int = 0
    prefilled_tokens: int = 0
    queue_ms: float = 0.0
    restore_ms: float = 0.0
    restore_io_ms: float = 0.0
    """Of restore_ms: copying blocks out of their tiers (host copy, SSD file reads)."""
    prefill_ms: float = 0.0
    epoch: int = 0
    pool_io_ms: float = 0.0
    """Of restore_io_ms: reading blocks and SWA state out of shared pools."""
    pool_swa_tokens: int = 0
    """The prompt position resumed from SWA state pulled from a shared SWA pool (0: none)."""
    pools: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per pool id: {tokens, bytes, ms} pulled from it (written only when non-empty)."""

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the engine did not compute from scratch (all tiers and SWA)."""
        return (
            self.hbm_tokens
            + self.host_tokens
            + self.ssd_tokens
            + self.pool_tokens
            + self.swa_tokens
        )

    @property
    def engine_ttft_s(self) -> float:
        """Arrival at the engine to its first token: queue + restore + prefill."""
        return (self.queue_ms + self.restore_ms + self.prefill_ms) / 1e3

    def to_json(self) -> dict[str, Any]:
        """The wire form, as the engine writes it into `usage.prompt_work`."""
        out: dict[str, Any] = {f: getattr(self, f) for f in TOKEN_FIELDS}
        out.update((f, round(getattr(self, f), d)) for f, d in _MS_DIGITS.items())
        out["pool_swa_tokens"] = self.pool_swa_tokens
        out["epoch"] = self.epoch
        if self.pools:
            out["pools"] = {p: dict(v) for p, v in self.pools.items()}
        return out
