"""The read-only views a policy reads (`RequestView`, `EngineView`, `EngineLoad`,
`GlobalMatch`, `FleetStats`, `KeyedQueue`) and what it returns (`Decision`); the
contract is `ramjet.policy.base`'s docstring, and `ramjet.policy.base` exports all of
them. Apart from `base` so that they compile with mypyc (`ramjet.native`) while `base`'s
`@runtime_checkable` Protocol, which a test checks with `isinstance`, stays interpreted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ramjet.policy.calibration import TtftWeights
from ramjet.policy.profile import EngineProfile
from ramjet.types import EngineId, PrefixKey, TrustGrade


@dataclass(init=False, frozen=True, slots=True)
class GlobalMatch:
    """Longest resident global-KV prefix on one engine, in tokens, split by tier."""

    hbm: int = 0
    host: int = 0
    ssd: int = 0
    pending: int = 0
    """Of `hbm`, the tokens of requests the router has sent to the engine and no report
    has confirmed yet (`ramjet.residency.pending`): in HBM by the time a request routed
    now starts there, since the engine takes requests in order. Not a tier of its own."""
    blocks: int | None = field(default=None, compare=False)
    """How many leading blocks matched (pending included); None when the view does not
    count them. The cost model uses it to find the block after the match (see
    `ramjet.policy.cost`, SWA resume past g). Not compared: two matches of the same
    tokens are equal whether or not a view counted the blocks."""

    def __init__(
        self,
        hbm: int = 0,
        host: int = 0,
        ssd: int = 0,
        pending: int = 0,
        blocks: int | None = None,
    ) -> None:
        object.__setattr__(self, "hbm", hbm)
        object.__setattr__(self, "host", host)
        object.__setattr__(self, "ssd", ssd)
        object.__setattr__(self, "pending", pending)
        object.__setattr__(self, "blocks", blocks)

    @property
    def total(self) -> int:
        return self.hbm + self.host + self.ssd

    def by_tier(self) -> tuple[int, int, int]:
        return (self.hbm, self.host, self.ssd)


class ResidencyView(Protocol):
    """What one engine holds, as far as the router knows. Read-only, synchronous."""

    def global_match(
        self, block_keys: Sequence[PrefixKey], block_tokens: Sequence[int]
    ) -> GlobalMatch:
        """Longest prefix of `block_keys` resident on the engine, in tokens by tier.

        `block_tokens[i]` is the number of tokens block i covers. The match stops at the
        first block that is not resident (a resident block implies its predecessors).
        A view answers for one instant and one request: it may keep the answer for the
        same `block_keys` object, so the incumbent, the candidate and the router's
        in-flight figure share one lookup per engine (`EngineResidencyView` does).
        """
        ...

    def swa_match(self, boundary_keys: Sequence[tuple[int, PrefixKey]]) -> int:
        """Token offset of the furthest message boundary with live SWA state, else 0.

        `boundary_keys` is a list of (token offset, key), ascending by offset.
        """
        ...


@dataclass(init=False, frozen=True, slots=True)
class EngineLoad:
    """Load of one engine: engine-reported figures corrected by the router's own."""

    inflight_requests: int = 0
    """Requests the router has sent and not yet seen finish."""
    inflight_prompt_tokens: int = 0
    """Predicted uncached prompt tokens of the router's requests to this engine whose first
    token has not yet arrived: for each, its prompt minus the cached match the router
    predicted on this engine when it routed it (`candidates.uncached_prompt_tokens`).
    Prompt work still to do there, not whole prompts: an engine that hits its cache is
    not charged for the tokens it will not prefill."""
    queued_prompt_tokens: int | None = None
    """Engine-reported prompt tokens waiting or being prefilled; None if not reported."""
    running_requests: int | None = None
    """Engine-reported requests in the running batch; None if not reported."""
    kv_utilization: float = 0.0
    """Share of HBM global-KV capacity in use, 0..1."""
    waiting_requests: int | None = None
    """Engine-reported requests queued for prefill (not yet running); None if not
    reported. llm-d's queue scorer reads it."""
    decode_tokens: int | None = None
    """Context tokens of the requests decoding on the engine; None if not known (engines
    do not report it; the simulator knows it, and Dynamo's router counts it from its own
    routing)."""
    busy_s: float = 0.0
    """Seconds the engine has already worked on the outstanding prompt work counted above
    (since the later of the last first byte the router saw from it, the oldest such
    request's send and, for a reported queue, the report's arrival): the head of the
    queue is that far through its prefill (`cost.wait_seconds`). 0: unknown."""
    inflight_jobs: tuple[tuple[int, int], ...] = ()
    """(new tokens, context tokens) of each of the router's requests counted in
    `inflight_prompt_tokens`, oldest first: each is priced at its own context, as the
    engine prefills it (the tokens of two prompts do not attend to each other). Empty:
    not known (the wait prices the tokens as one prompt)."""

    def __init__(
        self,
        inflight_requests: int = 0,
        inflight_prompt_tokens: int = 0,
        queued_prompt_tokens: int | None = None,
        running_requests: int | None = None,
        kv_utilization: float = 0.0,
        waiting_requests: int | None = None,
        decode_tokens: int | None = None,
        busy_s: float = 0.0,
        inflight_jobs: tuple[tuple[int, int], ...] = (),
    ) -> None:
        object.__setattr__(self, "inflight_requests", inflight_requests)
        object.__setattr__(self, "inflight_prompt_tokens", inflight_prompt_tokens)
        object.__setattr__(self, "queued_prompt_tokens", queued_prompt_tokens)
        object.__setattr__(self, "running_requests", running_requests)
        object.__setattr__(self, "kv_utilization", kv_utilization)
        object.__setattr__(self, "waiting_requests", waiting_requests)
        object.__setattr__(self, "decode_tokens", decode_tokens)
        object.__setattr__(self, "busy_s", busy_s)
        object.__setattr__(self, "inflight_jobs", inflight_jobs)


@dataclass(init=False, frozen=True, slots=True)
class PoolView:
    """A shared tier an engine can pull from (`ramjet.config.FabricPoolConfig`), as that
    engine sees it: the pool's residency (from the pool's own signed reports) and the cost
    of a pull into this engine."""

    id: str
    tier: str
    """"host" or "ssd" (global KV), or "swa" (SWA state)."""
    bandwidth_bytes_per_s: float
    latency_s: float
    residency: ResidencyView
    trust: TrustGrade = TrustGrade.APPROXIMATE

    def __init__(
        self,
        id: str,
        tier: str,
        bandwidth_bytes_per_s: float,
        latency_s: float,
        residency: ResidencyView,
        trust: TrustGrade = TrustGrade.APPROXIMATE,
    ) -> None:
        object.__setattr__(self, "id", id)
        object.__setattr__(self, "tier", tier)
        object.__setattr__(self, "bandwidth_bytes_per_s", bandwidth_bytes_per_s)
        object.__setattr__(self, "latency_s", latency_s)
        object.__setattr__(self, "residency", residency)
        object.__setattr__(self, "trust", trust)

    def pull_seconds(self, nbytes: float) -> float:
        """Time to pull `nbytes` from the pool into the engine."""
        return 0.0 if nbytes <= 0 else self.latency_s + nbytes / self.bandwidth_bytes_per_s


@dataclass(init=False, frozen=True, slots=True)
class EngineView:
    id: EngineId
    healthy: bool
    load: EngineLoad
    residency: ResidencyView
    profile: EngineProfile | None = None
    """None until the engine has reported one; policies then use their defaults."""
    trust: TrustGrade = TrustGrade.APPROXIMATE
    models: frozenset[str] = frozenset()
    pools: tuple[PoolView, ...] = ()
    """Shared tiers the engine pulls from on a local miss (none: an island)."""

    def __init__(
        self,
        id: EngineId,
        healthy: bool,
        load: EngineLoad,
        residency: ResidencyView,
        profile: EngineProfile | None = None,
        trust: TrustGrade = TrustGrade.APPROXIMATE,
        models: frozenset[str] = frozenset(),
        pools: tuple[PoolView, ...] = (),
    ) -> None:
        object.__setattr__(self, "id", id)
        object.__setattr__(self, "healthy", healthy)
        object.__setattr__(self, "load", load)
        object.__setattr__(self, "residency", residency)
        object.__setattr__(self, "profile", profile)
        object.__setattr__(self, "trust", trust)
        object.__setattr__(self, "models", models)
        object.__setattr__(self, "pools", pools)


@dataclass(init=False, frozen=True, slots=True)
class RequestView:
    """What a policy may know about a request: its features, never its body."""

    request_id: str
    model: str
    prompt_tokens: int
    """Prompt length in tokens (exact for byte-level engines, estimated otherwise)."""
    block_keys: Sequence[PrefixKey]
    block_tokens: Sequence[int]
    """Tokens covered by each block key (all equal but possibly the last)."""
    boundary_keys: Sequence[tuple[int, PrefixKey]]
    """(token offset, key) at each message boundary, ascending."""
    session: str | None = None
    max_output_tokens: int | None = None

    def __init__(
        self,
        request_id: str,
        model: str,
        prompt_tokens: int,
        block_keys: Sequence[PrefixKey],
        block_tokens: Sequence[int],
        boundary_keys: Sequence[tuple[int, PrefixKey]],
        session: str | None = None,
        max_output_tokens: int | None = None,
    ) -> None:
        object.__setattr__(self, "request_id", request_id)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "prompt_tokens", prompt_tokens)
        object.__setattr__(self, "block_keys", block_keys)
        object.__setattr__(self, "block_tokens", block_tokens)
        object.__setattr__(self, "boundary_keys", boundary_keys)
        object.__setattr__(self, "session", session)
        object.__setattr__(self, "max_output_tokens", max_output_tokens)


@dataclass(init=False, frozen=True, slots=True)
class KeyedQueue:
    """An engine that serves by the priority hint's key (`ramjet.policy.priority_key`,
    docs/priority.md): its key parameters and the requests queued there with a key. The
    cost model's priority-aware wait reads it (`ramjet.policy.cost.keyed_wait`)."""

    aging: float
    horizon_s: float | None
    preemptive: bool
    """True: a better arrival takes the engine at the next chunk boundary (the reference
    engine's `chunk` variant); False: a started prefill runs to its end (vLLM's)."""
    entries: tuple[tuple[float, int, bool], ...] = ()
    """(key_s, predicted uncached prompt tokens left, started) per request waiting or in
    prefill; the key in the clock of `FleetStats.now_s`."""
    charge_jumps: bool = True
    """The cost charges each request this one would overtake here its service time
    (`ramjet.policy.cost.jump_seconds`, part of the externality); False: jumps are free."""

    def __init__(
        self,
        aging: float,
        horizon_s: float | None,
        preemptive: bool,
        entries: tuple[tuple[float, int, bool], ...] = (),
        charge_jumps: bool = True,
    ) -> None:
        object.__setattr__(self, "aging", aging)
        object.__setattr__(self, "horizon_s", horizon_s)
        object.__setattr__(self, "preemptive", preemptive)
        object.__setattr__(self, "entries", entries)
        object.__setattr__(self, "charge_jumps", charge_jumps)


@dataclass(init=False, frozen=True, slots=True)
class FleetStats:
    """Recent fleet-wide figures a policy may use (measured by the router or simulator)."""

    now_s: float = 0.0
    arrival_rate_per_s: float = 0.0
    """Recent request arrival rate across the fleet (EWMA)."""
    mean_wait_s: float = 0.0
    """Recent mean time requests waited before their prefill started (EWMA)."""
    work_rate: Mapping[EngineId, float] = field(default_factory=dict)
    """Per engine: predicted prompt work routed to it per second (EWMA; s/s, so a
    utilisation): what a packing engine's next steps will also carry."""
    keyed: Mapping[EngineId, KeyedQueue] = field(default_factory=dict)
    """Engines that serve by the priority hint's key (a pool in mode `on`): the cost
    model's wait counts only the work queued there with a lower key. Absent: FCFS."""
    calibration: Mapping[EngineId, TtftWeights] = field(default_factory=dict)
    """Per engine: the weights of the cost model's terms fitted online to realised TTFTs
    (`ramjet.policy.calibration`). Absent: the profile as probed."""
    calibration_decides: bool = False
    """True: the decisions rest on the calibrated terms; False: the calibrated TTFT is
    only predicted and recorded (`fleet_stats.calibrated_decisions`)."""

    def __init__(
        self,
        now_s: float = 0.0,
        arrival_rate_per_s: float = 0.0,
        mean_wait_s: float = 0.0,
        work_rate: Mapping[EngineId, float] | None = None,
        keyed: Mapping[EngineId, KeyedQueue] | None = None,
        calibration: Mapping[EngineId, TtftWeights] | None = None,
        calibration_decides: bool = False,
    ) -> None:
        object.__setattr__(self, "now_s", now_s)
        object.__setattr__(self, "arrival_rate_per_s", arrival_rate_per_s)
        object.__setattr__(self, "mean_wait_s", mean_wait_s)
        object.__setattr__(self, "work_rate", {} if work_rate is None else work_rate)
        object.__setattr__(self, "keyed", {} if keyed is None else keyed)
        object.__setattr__(self, "calibration", {} if calibration is None else calibration)
        object.__setattr__(self, "calibration_decides", calibration_decides)


@dataclass(init=False, frozen=True, slots=True)
class Decision:
    engine: EngineId
    policy: str
    components: Mapping[EngineId, Mapping[str, float]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    """Free-form flags, e.g. "default_profile:e1" or "imbalanced"."""

    def __init__(
        self,
        engine: EngineId,
        policy: str,
        components: Mapping[EngineId, Mapping[str, float]] | None = None,
        notes: tuple[str, ...] = (),
    ) -> None:
        object.__setattr__(self, "engine", engine)
        object.__setattr__(self, "policy", policy)
        object.__setattr__(self, "components", {} if components is None else components)
        object.__setattr__(self, "notes", notes)
