"""Views for policy unit tests: engines whose residency answers fixed figures.

Imported by the `test_policy_*` files (pytest puts this folder on sys.path).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ramjet.policy.base import EngineLoad, EngineView, GlobalMatch, RequestView
from ramjet.policy.profile import EngineProfile
from ramjet.types import EngineId, PrefixKey, TrustGrade


@dataclass(frozen=True)
class FixedResidency:
    """Answers the same match and SWA offset for any request."""

    match: GlobalMatch = GlobalMatch()  # noqa: RUF009 (frozen, immutable)
    swa_offset: int = 0

    def global_match(
        self, block_keys: Sequence[PrefixKey], block_tokens: Sequence[int]
    ) -> GlobalMatch:
        return self.match

    def swa_match(self, boundary_keys: Sequence[tuple[int, PrefixKey]]) -> int:
        return self.swa_offset


def engine(
    name: str,
    *,
    hbm: int = 0,
    host: int = 0,
    ssd: int = 0,
    swa: int = 0,
    queued: int | None = None,
    inflight: int = 0,
    inflight_tokens: int = 0,
    healthy: bool = True,
    profile: EngineProfile | None = None,
    trust: TrustGrade = TrustGrade.EXACT,
    models: frozenset[str] = frozenset(),
) -> EngineView:
    return EngineView(
        id=EngineId(name),
        healthy=healthy,
        load=EngineLoad(
            inflight_requests=inflight,
            inflight_prompt_tokens=inflight_tokens,
            queued_prompt_tokens=queued,
        ),
        residency=FixedResidency(GlobalMatch(hbm, host, ssd), swa),
        profile=profile,
        trust=trust,
        models=models,
    )


def request(
    tokens: int = 4096,
    *,
    session: str | None = None,
    model: str = "m",
    block: int = 256,
    boundaries: Sequence[int] = (),
) -> RequestView:
    nblocks = tokens // block
    keys = [PrefixKey(i + 1) for i in range(nblocks)]
    return RequestView(
        request_id="r1",
        model=model,
        prompt_tokens=tokens,
        block_keys=keys,
        block_tokens=[block] * nblocks,
        boundary_keys=[(b, PrefixKey(10_000 + b)) for b in boundaries],
        session=session,
    )


def curve_profile(*rates: tuple[int, float], **extra: object) -> EngineProfile:
    """A profile whose prefill curve is `rates` ((context tokens, seconds per token), ...);
    `extra`: any other field (a replay floor of 0 and 1 KV byte per token unless given)."""
    fields: dict[str, object] = {"replay_floor_s": 0.0, "global_kv_bytes_per_token": 1.0}
    fields.update(extra)
    return EngineProfile.model_validate(
        {"prefill_curve": [{"context_tokens": c, "seconds_per_token": r} for c, r in rates]}
        | fields
    )
