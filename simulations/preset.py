"""Engine calibration: the profile every engine runs at, and its cache capacities.

Two sources: the named preset `v41-flash-tp4-rtx6000` (the cost figures are the policy's
own default profile, `ramjet.policy.cost.V41_FLASH_TP4_ESTIMATE`; the capacities come
from `plan.Deployment` at 310 GiB loaded weights), or a reference-engine profile file (an
`EngineProfile` JSON, as the engine's profiler writes it) with capacities given in
tokens. `docs/simulation.md` lists every figure and whether it is measured or estimated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from pydantic import ValidationError

from ramjet.config import DEFAULT_AGING, DEFAULT_HORIZON_S
from ramjet.policy.cost import V41_FLASH_TP4_ESTIMATE
from ramjet.policy.profile import EngineProfile
from simulations.plan import Deployment

PACKING_SCHEDULERS = ("vllm-fcfs", "vllm-priority")
"""Engine models that pack several prompts into one step's token budget, as vLLM does
(`simulations.engine`); the others prefill one request per step, as the reference engine."""

PRESETS = ("v41-flash-tp4-rtx6000",)


@dataclass(frozen=True)
class EngineSpec:
    """One simulated engine's calibration. Tokens and seconds."""

    profile: EngineProfile
    hbm_tokens: int
    host_tokens: int
    ssd_tokens: int
    swa_sequences: int
    swa_ttl_s: float = 300.0
    chunk_tokens: int = 8192
    scheduler: str = "fcfs"
    """"fcfs", "priority" (the router's hint: predicted prompt work, with aging; preempted
    at chunk boundaries), "vllm-priority" (vLLM V1's: the hint orders waiting jobs only)
    or "vllm-fcfs" (vLLM's step packing in arrival order); `simulations.engine`."""
    aging: float = DEFAULT_AGING
    """Priority hint aging: seconds of predicted work forgiven per second waited."""
    horizon_s: float | None = DEFAULT_HORIZON_S
    """Priority hint horizon: no job is overtaken by one that arrived more than this many
    seconds after it (`ramjet.policy.priority_key`); None: aging alone bounds it."""


def v41_preset() -> EngineSpec:
    d = Deployment()
    return EngineSpec(
        profile=V41_FLASH_TP4_ESTIMATE,
        hbm_tokens=d.hbm_kv_tokens,
        host_tokens=d.host_kv_tokens,
        ssd_tokens=d.ssd_kv_tokens,
        swa_sequences=d.swa_sessions,
    )


def load_profile(path: str | Path) -> EngineProfile:
    p = Path(path)
    try:
        return EngineProfile.model_validate(json.loads(p.read_text()))
    except (OSError, json.JSONDecodeError, ValidationError) as exc:
        raise ValueError(f"{p}: not an EngineProfile JSON: {exc}") from None


def engine_spec(
    preset: str | None = "v41-flash-tp4-rtx6000",
    profile_file: str | None = None,
    *,
    bytes_per_token: float | None = None,
    **overrides: object,
) -> EngineSpec:
    """The preset, or a profile file over the preset's capacities, with overrides.

    `bytes_per_token` rescales the profile's bytes per token and the tier capacities
    (same bytes, fewer tokens): the "what if KV were this big" experiment.
    """
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
    spec = v41_preset()
    if profile_file is not None:
        spec = replace(spec, profile=load_profile(profile_file))
    if bytes_per_token is not None:
        ratio = spec.profile.global_kv_bytes_per_token / bytes_per_token
        spec = replace(
            spec,
            profile=spec.profile.model_copy(update={"global_kv_bytes_per_token": bytes_per_token}),
            hbm_tokens=int(spec.hbm_tokens * ratio),
            host_tokens=int(spec.host_tokens * ratio),
            ssd_tokens=int(spec.ssd_tokens * ratio),
        )
    clean = {k: v for k, v in overrides.items() if v is not None}
    return replace(spec, **clean)  # type: ignore[arg-type]
