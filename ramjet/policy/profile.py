"""An engine's profiled costs: the figures the cost model predicts TTFT from.

One definition, shared by the reference engine's profiler (which measures it), the
signed `profile` report body (which carries it), the cost model (which reads it) and the
simulator (which is calibrated by it).

Prefill curve. Prefilling `n` new tokens on top of `c` tokens already in context costs

    prefill_seconds(n, c) = overhead_s + integral from c to c+n of rate(x) dx

where `rate(x)` (seconds per token at context length x) is piecewise linear through the
profiled points and extrapolated past the last one along the last segment's slope
(attention makes the marginal token dearer as context grows), but no steeper than the
trend of the whole curve (first to last point) and never falling: one noisy last
segment must not run the prediction away. A flat curve is a constant tokens/s engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ramjet.policy.curve import PrefillCurve
from ramjet.types import Tier

PositiveFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]


class CurvePoint(BaseModel):
    """Marginal prefill cost at one context length."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    context_tokens: Annotated[int, Field(ge=0)]
    seconds_per_token: NonNegFloat


class TierCost(BaseModel):
    """Restoring global KV from a tier: bytes / bandwidth + latency."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    bandwidth_bytes_per_s: PositiveFloat
    latency_s: NonNegFloat = 0.0

    def restore_seconds(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


class EngineProfile(BaseModel):
    """Profiled costs of one engine. Times in seconds, sizes in bytes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prefill_curve: Annotated[list[CurvePoint], Field(min_length=1)]
    prefill_overhead_s: NonNegFloat = 0.0
    replay_floor_s: NonNegFloat
    """Cost of rebuilding SWA state by replaying the last window: paid on any warm
    global hit whose SWA state is gone. Never zero on a real engine."""
    replay_window_tokens: Annotated[int, Field(gt=0)] = 128
    global_kv_bytes_per_token: PositiveFloat
    swa_bytes_per_sequence: NonNegFloat = 0.0
    tiers: dict[str, TierCost] = Field(default_factory=dict)
    """Restore cost per non-HBM tier, by tier label ("host", "ssd"). HBM costs nothing."""
    decode_step_s: NonNegFloat = 0.0
    spec_acceptance: Annotated[float, Field(ge=0, le=1)] = 0.0
    spec_tokens_per_step: Annotated[float, Field(ge=1)] = 1.0

    @model_validator(mode="after")
    def _check_curve(self) -> EngineProfile:
        ctx = [p.context_tokens for p in self.prefill_curve]
        if ctx != sorted(ctx) or len(set(ctx)) != len(ctx):
            raise ValueError("prefill_curve context_tokens must be strictly increasing")
        for name in self.tiers:
            Tier.parse(name)
        return self

    # -- the curve ---------------------------------------------------------------

    def curve(self) -> PrefillCurve:
        """The curve and overhead as a `PrefillCurve` (compiled: `ramjet.policy.curve`),
        made once per curve: the cost model reads it several times per engine per
        request. Kept beside the fields (as a cached_property would be) with the list and
        overhead it was made from, so a `model_copy` with another curve or overhead makes
        its own."""
        pts, over = self.prefill_curve, self.prefill_overhead_s
        memo = self.__dict__.get("_curve_memo")
        if memo is None or memo[0] is not pts or memo[1] != over:
            xs = tuple(float(p.context_tokens) for p in pts)
            memo = (pts, over, PrefillCurve(xs, tuple(p.seconds_per_token for p in pts), over))
            self.__dict__["_curve_memo"] = memo
        curve: PrefillCurve = memo[2]
        return curve

    def _rate(self, x: float) -> float:
        return self.curve().rate(x)

    def prefill_seconds(self, new_tokens: int, context_tokens: int = 0) -> float:
        """Time to prefill `new_tokens` on top of `context_tokens` cached ones
        (`PrefillCurve.seconds`: answers are kept)."""
        return self.curve().seconds(new_tokens, context_tokens)

    def restore_seconds(self, tokens_by_tier: Sequence[int]) -> float:
        """Restore time for (hbm, host, ssd) token counts; HBM is free."""
        total = 0.0
        for tier in (Tier.HOST, Tier.SSD):
            n = tokens_by_tier[tier]
            if n > 0:
                cost = self.tiers.get(tier.label)
                if cost is None:
                    raise KeyError(f"profile has no restore cost for tier {tier.label!r}")
                total += cost.restore_seconds(n * self.global_kv_bytes_per_token)
        return total


def mean_profile(profiles: Sequence[EngineProfile]) -> EngineProfile:
    """One profile for engines of one kind (`EngineConfig.profile_group`): the mean of
    theirs. The rate at every context is the mean of their rates (a curve through the
    union of their points: exact, each rate being linear between its points, up to the
    longest probe); every other figure is the mean, a tier's cost the mean over the
    profiles that have it. Identical engines probed at different moments differ by the
    noise of each probe (1.4-1.8x on a loaded host); priced apart, the one whose probe
    ran luckier takes every request it can."""
    if not profiles:
        raise ValueError("no profiles to average")
    if len(profiles) == 1:
        return profiles[0]
    k = len(profiles)
    xs = sorted({p.context_tokens for prof in profiles for p in prof.prefill_curve})
    curve = [
        CurvePoint(context_tokens=x, seconds_per_token=sum(p._rate(x) for p in profiles) / k)
        for x in xs
    ]

    def mean(values: Sequence[float]) -> float:
        return sum(values) / len(values)

    tiers: dict[str, TierCost] = {}
    for label in sorted({t for p in profiles for t in p.tiers}):
        have = [p.tiers[label] for p in profiles if label in p.tiers]
        tiers[label] = TierCost(
            bandwidth_bytes_per_s=mean([t.bandwidth_bytes_per_s for t in have]),
            latency_s=mean([t.latency_s for t in have]),
        )
    return EngineProfile(
        prefill_curve=curve,
        prefill_overhead_s=mean([p.prefill_overhead_s for p in profiles]),
        replay_floor_s=mean([p.replay_floor_s for p in profiles]),
        replay_window_tokens=max(p.replay_window_tokens for p in profiles),
        global_kv_bytes_per_token=mean([p.global_kv_bytes_per_token for p in profiles]),
        swa_bytes_per_sequence=mean([p.swa_bytes_per_sequence for p in profiles]),
        tiers=tiers,
        decode_step_s=mean([p.decode_step_s for p in profiles]),
        spec_acceptance=mean([p.spec_acceptance for p in profiles]),
        spec_tokens_per_step=mean([p.spec_tokens_per_step for p in profiles]),
    )
