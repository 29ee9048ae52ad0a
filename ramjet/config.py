"""The policy file's typed, frozen tree (pydantic v2), and `load_policy`.

Every model forbids unknown keys, so a typo is an error at load. Errors are collected
into one `PolicyFileError` whose lines name each offending field by its full path in the
file (`engines[1].url`, `timeouts.idle_s`), so an operator fixes the file without reading
code. Durations are seconds (`_s`), sizes bytes (`_bytes`), shares 0..1.

Policy names and their parameters are validated by `ramjet.policy.registry` (which owns
each policy's parameter model); this module only holds `{name, params}`.

The `residency:` section's model is `ramjet.residency.config.ResidencyConfig` (owned by
the residency tables); `reports:` and `keys:` are `ramjet.reports.config`'s
`ReportsConfig` and `KeysConfig` (owned by the reports part).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ramjet.errors import ConfigError
from ramjet.keys.config import KeyPoolConfig, check_pools
from ramjet.reports.config import KeysConfig, ReportsConfig
from ramjet.residency.config import ResidencyConfig, StoreConfig

_ENGINE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_URL = re.compile(r"^https?://[^/\s?#]+(:\d+)?/?$")


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineConfig(_Frozen):
    id: str
    """Operator-chosen name, unique in the file (e.g. "e0")."""
    url: str
    """Base URL of the engine's OpenAI-compatible server, scheme and authority only."""
    models: tuple[str, ...] = ()
    """Models served; empty means "ask the engine" (its /v1/models)."""
    weight: float = Field(default=1.0, gt=0)
    profile_group: str | None = None
    """Engines of one kind (same model, parallelism, hardware): priced with one profile,
    the mean of the group's probed profiles (`ramjet.fleet.signals.GroupedProfiles`).
    None: the engine's own."""

    @field_validator("id", "profile_group")
    @classmethod
    def _check_id(cls, v: str | None) -> str | None:
        if v is not None and not _ENGINE_ID.match(v):
            raise ValueError("must be 1-64 characters of letters, digits, '_', '.', '-'")
        return v

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        if not _URL.match(v):
            raise ValueError("must be http(s)://host[:port] with no path, query or fragment")
        return v.rstrip("/")


class ModeConfig(_Frozen):
    kind: Literal["observe", "canary", "enforce"] = "observe"
    share: float = Field(default=0.0, ge=0.0, le=1.0)
    """canary only: share of sessions the candidate decides (deterministic by session)."""
    candidate_budget_s: float = Field(default=0.005, gt=0)
    """observe: a candidate pick slower than this is discarded and counted as slow."""
    slow_cooldown_s: float = Field(default=5.0, ge=0)
    """observe: after 3 slow picks in a row the candidate is skipped for this long."""

    @model_validator(mode="after")
    def _check_share(self) -> ModeConfig:
        if self.kind != "canary" and self.share != 0.0:
            raise ValueError("share is only meaningful with kind: canary")
        return self


class PolicyRef(_Frozen):
    name: str
    params: dict[str, Any] = Field(default_factory=dict)


class TimeoutsConfig(_Frozen):
    connect_s: float = Field(default=1.0, gt=0)
    first_byte_s: float = Field(default=60.0, gt=0)
    """From sending the request to the first response body byte (includes prefill). A
    non-stream request that sets `max_tokens` gets more (`token_s`)."""
    token_s: float = Field(default=0.5, ge=0)
    """A non-stream request's first byte comes after its whole generation: its deadline
    is `first_byte_s + token_s * max_tokens` (at most `generation_s`). Passing a deadline
    so extended is not an engine fault and is not retried (the work has started)."""
    generation_s: float = Field(default=3600.0, gt=0)
    """Cap on a non-stream request's extended deadline (`token_s`)."""
    idle_s: float = Field(default=30.0, gt=0)
    """Longest gap between two response chunks; no total timeout on streams."""
    send_s: float = Field(default=30.0, gt=0)
    """Longest a write to a slow client may block before the stream is ended."""
    header_deadline_s: float = Field(default=10.0, gt=0)
    """A client must finish sending request headers within this (slowloris), else 408."""
    body_s: float = Field(default=30.0, gt=0)
    """A client must finish sending the request body within this, else 408."""
    linger_s: float = Field(default=1.0, ge=0)
    """After refusing a request whose body was not read, drain it this long, then close
    (closing at once could reset the connection before the client reads the refusal)."""
    drain_s: float = Field(default=30.0, ge=0)
    """On shutdown, in-flight requests get this long before their streams are ended."""
    probe_s: float = Field(default=2.0, gt=0)
    """Timeout of one active health probe."""


class RetryConfig(_Frozen):
    budget_ratio: float = Field(default=0.2, ge=0, le=1)
    """Concurrent retries allowed as a share of active requests (Envoy's retry budget)."""
    min_retries: int = Field(default=3, ge=0)
    """Concurrent retries always allowed, whatever the active count."""
    max_attempts: int = Field(default=2, ge=1, le=5)
    """Attempts per request including the first; each retry goes to another engine."""
    max_retry_after_s: float = Field(default=30.0, gt=0)
    """Cap on an engine's Retry-After (backpressure hold-off)."""


class LimitsConfig(_Frozen):
    max_body_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    max_headers: int = Field(default=100, gt=0)
    max_header_line_bytes: int = Field(default=8190, gt=0)
    max_header_bytes: int = Field(default=32 * 1024, gt=0)
    """Sum of all header lines; over it is 431."""
    max_concurrent: int = Field(default=1024, gt=0)
    """Requests being forwarded at once; more wait in the queue."""
    queue: int = Field(default=256, ge=0)
    """Requests that may wait for a slot; beyond it, immediate 503."""
    queue_timeout_s: float = Field(default=1.0, ge=0)
    stream_buffer_bytes: int = Field(default=256 * 1024, gt=0)
    """Bytes buffered towards a slow client before the upstream read pauses."""
    connections_per_engine: int = Field(default=1024, gt=0)
    max_messages: int = Field(default=10_000, gt=0)
    """Most chat messages in one request (400 `too_many_messages` beyond), checked
    before the body is decoded into objects."""
    max_content_parts: int = Field(default=20_000, gt=0)
    """Most content parts over all of a chat request's `content` arrays (400
    `too_many_content_parts` beyond), checked as `max_messages` is."""
    max_prompt_items: int = Field(default=1 << 20, gt=0)
    """Most items of a completion request's `prompt` array and the arrays in it (token
    ids; 400 `too_many_prompt_items` beyond), checked as `max_messages` is."""
    max_json_values: int = Field(default=2_000_000, gt=0)
    """Most JSON values (array elements, member values, containers) in a body over
    `parse_thread_bytes`, in any field (400 `too_many_values` beyond): bounded before the
    body is decoded, whose C decode holds the GIL for every value it makes."""
    max_json_depth: int = Field(default=64, gt=0)
    """Deepest nesting of arrays/objects in a body (400 `nesting_too_deep` beyond)."""
    max_inflight_body_bytes: int = Field(default=256 * 1024 * 1024, gt=0)
    """One budget for every request body held at once (being read, parsed or
    forwarded), whichever server read it; a body that does not fit is refused with 503
    `overloaded` and Retry-After."""
    max_pending_per_client: int = Field(default=256, gt=0)
    """Connections from one client address that have not sent a whole request (head and
    body) yet; one more is refused with 429 `too_many_pending` and closed."""
    max_silent_per_client: int = Field(default=256, gt=0)
    """Connections from one client address that have sent no byte since they connected
    (each also bounded by `timeouts.header_deadline_s`); past it, that client's oldest
    silent connections are closed (0.1 s later, so that a burst of connections whose
    requests are on their way loses none), so a new connection that brings a request
    is never locked out by idle ones."""
    parse_threads: int = Field(default=2, gt=0)
    """Threads that parse, render and key large bodies off the event loop."""
    parse_thread_bytes: int = Field(default=256 * 1024, ge=0)
    """Bodies larger than this are parsed on those threads; smaller ones on the loop."""
    priority_trusted_networks: tuple[str, ...] = ()
    """Client addresses (CIDR networks, e.g. "10.1.0.0/16", "127.0.0.1/32") whose own
    `priority` field is trusted: kept, then handled by its engine pool's `client`
    setting (docs/priority.md). Every other client's `priority` is removed before the
    request is routed, so no client can jump an engine's queue unless the operator says
    so. Empty (the default): no client is trusted."""

    @field_validator("priority_trusted_networks")
    @classmethod
    def _check_networks(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for net in v:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError as exc:
                raise ValueError(f"not a network: {net!r} ({exc})") from None
        return v


class HealthConfig(_Frozen):
    probe_path: str = "/health"
    probe_interval_s: float = Field(default=2.0, gt=0)
    consecutive_failures: int = Field(default=5, ge=1)
    """5xx/connect failures in a row that eject an engine (Envoy's consecutive_5xx)."""
    ejection_base_s: float = Field(default=5.0, gt=0)
    ejection_max_s: float = Field(default=300.0, gt=0)
    max_ejected_share: float = Field(default=0.5, ge=0, le=1)
    panic_threshold: float = Field(default=0.5, ge=0, le=1)
    """Below this share of healthy engines, route to all (Envoy's panic mode)."""

    @field_validator("probe_path")
    @classmethod
    def _check_path(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError("must start with '/'")
        return v


class LoggingConfig(_Frozen):
    level: Literal["debug", "info", "warning", "error"] = "info"
    access_log: bool = False
    decisions_path: str | None = None
    """JSON-lines decision log (`ramjet.decisions.log`); None disables it."""
    decisions_max_bytes: int = Field(default=64 * 1024 * 1024, gt=0)
    """The log rotates before a line would take it past this size."""
    decisions_backups: int = Field(default=5, ge=0)
    """Rotated files kept (path.1 ... path.N); 0 truncates instead."""
    decisions_queue: int = Field(default=10_000, gt=0)
    """Records waiting for the writer thread; beyond it records are dropped and counted."""


class FleetStatsConfig(_Frozen):
    """Time constants of the fleet estimators the cost model reads (λ and W of its λ·W·Δ
    externality term, `ramjet.policy.fleet_stats`). The simulator reads the same fields."""

    arrival_tau_s: float = Field(default=10.0, gt=0)
    """Arrival-rate EWMA time constant: an arrival adds 1/τ, the value decays as exp(-dt/τ)."""
    wait_tau_s: float = Field(default=10.0, gt=0)
    """Mean-wait EWMA time constant: a sample moves the mean (1 - exp(-dt/τ)) of the way."""
    work_tau_s: float = Field(default=2.0, gt=0)
    """Per-engine routed-work-rate EWMA time constant (the packing term of engines with
    `per_job_prefill: false`): about the span in which later prompts still join a step."""
    calibrate: bool = True
    """Fit the cost model's term weights per engine online to realised TTFTs
    (`ramjet.policy.calibration`): the recorded predictions (`ttft_s`, the error metrics,
    `ramjet report`) are the calibrated ones; false: the profiles as probed."""
    calibrated_decisions: bool = False
    """Also decide on the calibrated terms. Off by default: in the simulator, deciding on
    them raised tier_aware's p99 on mini-SWE (0.53 s against 0.34) and Mooncake (102 s
    against 65) at equal or better means (docs/policies.md, "Online calibration")."""
    calibration_forgetting: float = Field(default=0.95, gt=0.5, le=1.0)
    """The calibration's forgetting factor: a sample's weight falls by this per later
    sample on its engine (0.95: about the last 20 requests count)."""
    calibration_clip: float = Field(default=2.5, gt=0)
    """A sample's relative error is clipped to this many running mean |errors| before it
    moves the weights, so one outlier cannot swing them."""


class AdminConfig(_Frozen):
    token: str | None = None
    """Bearer token for admin endpoints; None disables them."""


DEFAULT_AGING = 0.05
DEFAULT_HORIZON_S = 20.0
"""The priority hint's defaults (`PriorityConfig`; the key: `ramjet.policy.priority_key`),
the choice of the aging x horizon sweep of `benchmarks/priority_sim.py`
(docs/results/history-priority.md):
on the Mooncake trace at 68% utilisation, routed as a pool in mode `on` is (keyed wait,
jumps charged), the lowest mean TTFT whose worst TTFT stays within 1.1x and p99 within 1x
of FCFS's, for both the chunk-preemptive and vLLM's scheduler."""


class PriorityConfig(_Frozen):
    """Priority hints for one pool of engines (`ramjet.app.priority`, docs/priority.md).

    The hint is the cost model's predicted prompt work on the engine the request is routed
    to; the key sent is `round(1000 * (min(work_s, aging * horizon_s) + aging *
    arrival_unix_s))`, integer milliseconds of wall-clock time, so several router
    replicas agree."""

    name: str = Field(min_length=1, max_length=64)
    engines: tuple[str, ...] = Field(min_length=1)
    mode: Literal["off", "observe", "on"] = "observe"
    """off: nothing; observe: the would-be hint is logged and counted, never sent; on: sent."""
    convention: Literal["vllm", "sglang", "reference"] = "vllm"
    """How the engine reads `priority`: vllm and reference run the lowest value first,
    sglang the highest (the router sends the negated key)."""
    aging: float = Field(default=DEFAULT_AGING, ge=0.0, le=100.0)
    """Seconds of predicted work forgiven per second waited (0: pure least-work-first)."""
    horizon_s: float | None = Field(default=DEFAULT_HORIZON_S, gt=0.0, le=86400.0)
    """No request is overtaken by one that arrived more than this many seconds after it
    (the hint's work is capped at aging x horizon_s); null: no cap, only aging bounds it.
    The defaults (0.05, 20 s) are the sweep's choice (docs/results/history-priority.md)."""
    client: Literal["keep", "override", "combine"] = "keep"
    """A request that carries its own `priority`: keep it (no hint), override it with the
    hint, or combine: the client's value is a class above the hint."""
    share: float = Field(default=1.0, ge=0.0, le=1.0)
    """mode on: the share of sessions (by the same session hash as routing's canary) whose
    requests carry the hint; the others are observed only."""
    keyed_wait: bool = True
    """mode on: routing knows these engines serve by the hint's key, so the cost model
    prices a request's wait by the work queued there with a lower key
    (`ramjet.policy.cost.keyed_wait`); false: it prices FCFS waits."""
    charge_jumps: bool = True
    """With keyed_wait: a request's cost also carries what each queued request it would
    overtake waits longer, its service time (`ramjet.policy.cost.jump_seconds`, part of
    the externality); false: jumps are free (docs/priority.md)."""

    @model_validator(mode="after")
    def _horizon_needs_aging(self) -> PriorityConfig:
        if self.aging == 0 and "horizon_s" in self.model_fields_set and self.horizon_s:
            raise ValueError(
                "horizon_s bounds how long aging lets later arrivals overtake, and at "
                "aging 0 nothing ages (pure least-work-first); set aging > 0 or drop horizon_s"
            )
        return self


class PoolMemberConfig(_Frozen):
    """One member's path from a pool, where it differs from the pool's default."""

    bandwidth_bytes_per_s: float | None = Field(default=None, gt=0)
    latency_s: float | None = Field(default=None, ge=0)


class FabricPoolConfig(_Frozen):
    """A tier shared by a set of engines on one server (ARCHITECTURE 5b): a host-memory or
    SSD pool of global KV, or the SWA pool. Its residency comes from signed reports whose
    envelope names the pool as the reporter (`id`, with keys under `keys.engines.<id>`);
    the cost model prices pulling a prefix from it into each member by the bandwidth and
    latency here (a member's own entry in `members` overrides them)."""

    id: str
    """Unique among engines and pools; the reporting identity of the pool's reports."""
    tier: Literal["host", "ssd", "swa"]
    engines: tuple[str, ...] = Field(min_length=1)
    """The members: engines that read and write the pool."""
    bandwidth_bytes_per_s: float = Field(gt=0)
    """Pull bandwidth from the pool into one member (probed where possible)."""
    latency_s: float = Field(default=0.0, ge=0)
    """Fixed cost of one pull."""
    members: dict[str, PoolMemberConfig] = {}
    """Per-member overrides of bandwidth and latency (keys: member engine ids)."""

    @field_validator("id")
    @classmethod
    def _check_id(cls, v: str) -> str:
        if not _ENGINE_ID.match(v):
            raise ValueError("must be 1-64 characters of letters, digits, '_', '.', '-'")
        return v

    def cost_into(self, engine: str) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s) of a pull into `engine`."""
        m = self.members.get(engine)
        bw = m.bandwidth_bytes_per_s if m is not None and m.bandwidth_bytes_per_s else None
        lat = m.latency_s if m is not None and m.latency_s is not None else None
        return (bw or self.bandwidth_bytes_per_s, self.latency_s if lat is None else lat)


class FabricConfig(_Frozen):
    """The fleet's shared tiers. No pools: every engine is an island (as before)."""

    pools: tuple[FabricPoolConfig, ...] = ()

    def pools_of(self, engine: str) -> tuple[FabricPoolConfig, ...]:
        return tuple(p for p in self.pools if engine in p.engines)

    def check(self, engines: Sequence[str]) -> None:
        known = set(engines)
        seen: set[str] = set()
        for i, p in enumerate(self.pools):
            where = f"fabric.pools[{i}]"
            if p.id in known:
                raise ValueError(f"{where}.id: {p.id!r} is an engine id; a pool needs its own")
            if p.id in seen:
                raise ValueError(f"{where}.id: pool {p.id!r} declared twice")
            seen.add(p.id)
            for e in p.engines:
                if e not in known:
                    raise ValueError(f"{where}.engines: {e!r} is not a declared engine")
            if len(set(p.engines)) != len(p.engines):
                raise ValueError(f"{where}.engines: a member is listed twice")
            for e in p.members:
                if e not in p.engines:
                    raise ValueError(f"{where}.members.{e}: not a member of the pool")


class PolicyConfig(_Frozen):
    engines: tuple[EngineConfig, ...] = Field(min_length=1)
    mode: ModeConfig = ModeConfig()
    incumbent: PolicyRef
    candidate: PolicyRef | None = None
    residency: ResidencyConfig = ResidencyConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    retry: RetryConfig = RetryConfig()
    limits: LimitsConfig = LimitsConfig()
    health: HealthConfig = HealthConfig()
    logging: LoggingConfig = LoggingConfig()
    admin: AdminConfig = AdminConfig()
    fleet_stats: FleetStatsConfig = FleetStatsConfig()
    """Fleet estimator time constants (router and simulator alike)."""
    store: StoreConfig = StoreConfig()
    """Where the residency tables live: memory (default) or redis (docs/redis.md)."""
    reports: ReportsConfig = ReportsConfig()
    """Signed engine reports: limits, skew, rate, staleness, pull (`ramjet.reports.config`)."""
    keys: KeysConfig = KeysConfig()
    """Engines' report public keys and retired key ids (`ramjet.reports.config`)."""
    key_pools: tuple[KeyPoolConfig, ...] = ()
    """Key mode per engine pool: text or token-block keys (`ramjet.keys.pools`)."""
    priority: tuple[PriorityConfig, ...] = ()
    """Priority hints per engine pool (`PriorityConfig`); engines in no pool get none."""
    fabric: FabricConfig = FabricConfig()
    """Tiers shared by several engines (host, SSD, SWA pools); none: islands."""

    @field_validator("mode", mode="before")
    @classmethod
    def _mode_shorthand(cls, v: Any) -> Any:
        return {"kind": v} if isinstance(v, str) else v

    @field_validator("engines")
    @classmethod
    def _unique_ids(cls, v: tuple[EngineConfig, ...]) -> tuple[EngineConfig, ...]:
        ids = [e.id for e in v]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"engine ids must be unique; repeated: {', '.join(dup)}")
        return v

    @model_validator(mode="after")
    def _check(self) -> PolicyConfig:
        if self.mode.kind in ("canary", "enforce") and self.candidate is None:
            raise ValueError(f"mode {self.mode.kind} needs a candidate policy")
        check_pools(self.key_pools, (e.id for e in self.engines))
        check_pools(self.priority, [e.id for e in self.engines], "priority pool")
        self.fabric.check([e.id for e in self.engines])
        known = {e.id for e in self.engines} | {p.id for p in self.fabric.pools}
        for who in self.keys.engines:
            # a pool reports under its own keys: a reporter that is neither a declared
            # engine nor a declared pool would fill residency that nothing prices
            if who not in known:
                raise ValueError(f"keys.engines.{who}: not a declared engine or fabric pool")
        return self


class PolicyFileError(ConfigError, ValueError):
    """A policy file that does not load. `problems` holds (field path, message) pairs."""

    def __init__(self, source: str, problems: Sequence[tuple[str, str]]) -> None:
        self.source = source
        self.problems = tuple(problems)
        lines = "\n".join(f"  {p or '<root>'}: {m}" for p, m in self.problems)
        super().__init__(f"{source}: invalid policy file\n{lines}")


def field_path(loc: Sequence[int | str]) -> str:
    """pydantic's error location as a path in the file: ("engines", 1, "url") → engines[1].url."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def parse_policy(data: Any, source: str = "<policy>") -> PolicyConfig:
    """Validate a decoded policy document; raises `PolicyFileError`."""
    if not isinstance(data, Mapping):
        raise PolicyFileError(source, [("", "the document must be a mapping")])
    try:
        return PolicyConfig.model_validate(dict(data))
    except ValidationError as exc:
        problems = [(field_path(e["loc"]), e["msg"]) for e in exc.errors()]
        raise PolicyFileError(source, problems) from None


def load_policy(path: str | Path) -> PolicyConfig:
    """Read and validate a YAML policy file; raises `PolicyFileError` (also for I/O and YAML)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyFileError(str(p), [("", f"cannot read: {exc.strerror or exc}")]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PolicyFileError(str(p), [("", f"not valid YAML: {exc}")]) from None
    return parse_policy(data, str(p))


def effective_policy(config: PolicyConfig) -> dict[str, Any]:
    """The fully defaulted tree as plain data (what `ramjet policy check` prints)."""
    data: dict[str, Any] = config.model_dump(mode="json")
    if data.get("admin", {}).get("token"):
        data["admin"]["token"] = "***"
    return data
