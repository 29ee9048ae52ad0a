"""The policies' parameter models: frozen pydantic models (`extra="forbid"`, a default for
every field) that the registry validates YAML parameters over (`ramjet.policy.registry`).

They live apart from the policies' pick code so that `tier_aware` and `baselines` compile
with mypyc (`ramjet.native.COMPILED`) while these stay interpreted: pydantic rejects a
compiled method on a model as an un-annotated field. Each is still importable from its
policy's module (`ramjet.policy.tier_aware.TierAwareParams`,
`ramjet.policy.baselines.PrefixAffinityParams`, ...).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from ramjet.policy.cost import V41_FLASH_TP4_ESTIMATE
from ramjet.policy.profile import EngineProfile


class _Params(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# -- baselines (`ramjet.policy.baselines`) ----------------------------------------------


class RoundRobinParams(_Params):
    """round_robin takes no parameters (any key is an error naming its path)."""


class LeastLoadedParams(_Params):
    request_weight_tokens: Annotated[int, Field(ge=0)] = 1024
    """Prompt-token equivalent of one in-flight request (its decode share of the batch)."""


class SessionHashParams(_Params):
    fallback: Literal["least_loaded", "round_robin"] = "least_loaded"
    """Policy for requests that carry no session id."""
    request_weight_tokens: Annotated[int, Field(ge=0)] = 1024
    """Passed to the `least_loaded` fallback."""


class PrefixAffinityParams(_Params):
    abs_margin_tokens: Annotated[int, Field(ge=0)] = 32768
    """An engine keeps affinity until its outstanding prompt tokens exceed the least
    loaded engine's by more than this many tokens ..."""
    rel_factor: Annotated[float, Field(ge=1.0)] = 1.5
    """... and by more than this factor."""
    min_match_tokens: Annotated[int, Field(ge=1)] = 1
    """Shorter matches count as no match."""


# -- tier_aware (`ramjet.policy.tier_aware`) --------------------------------------------


class TierAwareParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    default_profile: EngineProfile = V41_FLASH_TP4_ESTIMATE
    """Used for engines that have not reported a profile, or whose view is degraded."""
    chunk_tokens: Annotated[int, Field(gt=0)] = 8192
    """Engine prefill chunk: one decode step interleaves per chunk while requests decode."""
    externality_scale: Annotated[float, Field(ge=0)] = 1.0
    """Multiplies λ·W (both measured). 0 gives the selfish minimum-TTFT policy."""
    session_scale: Annotated[float, Field(ge=0)] = 0.0
    """Multiplies the session term R·W·(C_e/C_fair - 1) (`ramjet.policy.session_load`);
    0 (the default) turns it off: on the closed-loop agent replays it did not pay
    (docs/results.md, ablation rows `tier_aware:session`)."""
    session_idle_s: Annotated[float, Field(gt=0)] = 60.0
    """A session not seen for this long has ended (its length is learned)."""
    per_job_prefill: bool = True
    """Engines prefill one request per step (the reference engine): each queued request
    costs at least a chunk and a decode step (`cost.wait_seconds`). False for engines
    that pack prompts into a step's token budget (vLLM)."""
