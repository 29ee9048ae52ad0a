"""The named policies a run can compare, each with the residency knowledge it gets.

`<peer>:exact` gives a peer exact residency (isolates its policy); `<peer>:real` gives it
the knowledge that peer really has (ANCHORS.md; figures in docs/simulation.md). Ramjet's
own policies are built by `ramjet.policy.registry.create_policy` and see exact residency
(authenticated engine reports). `oracle:tier_aware` and `oracle:least_work` run
`tier_aware` and least-work routing on engines that share one cache and one SWA pool:
they know where every block is and may use it on either engine at no transfer cost,
which no online router can have; the gap to the better of them (the `oracle` row,
`simulations.checks`) is the cost of partitioning the cache between engines.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from ramjet.policy.base import RoutingPolicy
from ramjet.policy.registry import create_policy, validate_params
from simulations.fabric import Fabric
from simulations.peers.dynamo import DynamoKv
from simulations.peers.llmd import LlmdScorers
from simulations.peers.prodstack import ProdstackPrefix
from simulations.peers.smg import SmgCacheAware, SmgLeastLoad
from simulations.preset import PACKING_SCHEDULERS, EngineSpec
from simulations.simulator import Knowledge

EXACT = Knowledge("exact")
NONE = Knowledge("none")
SMG_TREE = Knowledge("routed", capacity_tokens=(1 << 26) // 4 // 2)
DYNAMO_TTL = Knowledge("routed", ttl_s=120.0)
LLMD_LRU = Knowledge("routed", capacity_tokens=31_250 * 64, max_match_tokens=256 * 64)
HBM_ONLY = Knowledge("hbm_only")
LOCAL = Knowledge("local")
LLMD_CPU_WEIGHT = 0.8
"""llm-d's tier weight for a CPU (pool) hit on the shared fabric (gpu 1.0)."""


@dataclass(frozen=True)
class Entrant:
    name: str
    make: Callable[[int], RoutingPolicy]
    knowledge: Knowledge = field(default=EXACT)
    shared_cache: bool = False
    origin: str = "ramjet"
    tier_aware: Mapping[str, object] | None = None
    """A `tier_aware` entrant's own params over the defaults (None: another policy), from
    which `on` makes it again for the engines."""
    tierless: bool = False
    """A peer that knows no tiers (SMG, production-stack): on the shared fabric its
    `:exact` mode sees its engine's own HBM, not the pools (`on_fabric`)."""
    calibrate: bool | None = None
    """Overrides the run's `fleet_stats.calibrate` for this entrant (the router's online
    TTFT calibration; None: the run's). Set by a `--variant` with `"calibrate": false`."""
    fabric_make: Callable[[int], RoutingPolicy] | None = None
    """How the peer is built on the shared fabric, where it differs (llm-d's tier
    weights)."""

    def on_fabric(self, fabric: Fabric) -> Entrant:
        """This entrant as it behaves on `fabric`: unchanged on islands; on the shared
        fabric a tierless peer's exact knowledge is its engine's own (`LOCAL`) and a peer
        with its own fabric behaviour is built that way."""
        if not fabric.shared:
            return self
        out = self
        if self.tierless and self.knowledge == EXACT:
            out = replace(out, knowledge=LOCAL)
        if self.fabric_make is not None:
            out = replace(out, make=self.fabric_make)
        return out

    def on(self, spec: EngineSpec) -> Entrant:
        """This entrant as an operator configures it for the engines it routes to
        (`policies/vllm_pair.yaml`): `tier_aware`'s `chunk_tokens` is the engines' chunk
        (`spec.chunk_tokens`, vLLM's `--max-num-batched-tokens`), and in front of engines
        that pack prompts into a step (vLLM's model) it runs with `per_job_prefill:
        false`. A parameter the entrant's params set themselves (an ablation) keeps its
        value. Every other entrant is returned as made."""
        if self.tier_aware is None:
            return self
        engines: dict[str, object] = {"chunk_tokens": spec.chunk_tokens}
        if spec.scheduler in PACKING_SCHEDULERS:
            engines["per_job_prefill"] = False
        return replace(self, make=_ramjet("tier_aware", {**engines, **self.tier_aware}, self.name))


def _ramjet(
    name: str, params: Mapping[str, object] | None = None, label: str | None = None
) -> Callable[[int], RoutingPolicy]:
    def make(seed: int) -> RoutingPolicy:
        policy = create_policy(name, dict(params or {}))
        if label:
            policy.name = label
        return policy

    return make


def _tier_aware(
    name: str,
    params: Mapping[str, object] | None = None,
    *,
    shared_cache: bool = False,
    origin: str = "ramjet",
) -> Entrant:
    """A `tier_aware` entrant named `name` (its rows' and decisions' name), `params` over
    the policy's defaults."""
    own = dict(params or {})
    return Entrant(
        name,
        _ramjet("tier_aware", own, name),
        shared_cache=shared_cache,
        origin=origin,
        tier_aware=own,
    )


ENTRANTS: dict[str, Entrant] = {
    e.name: e
    for e in [
        _tier_aware("tier_aware"),
        _tier_aware("tier_aware_selfish", {"externality_scale": 0.0}),
        _tier_aware("tier_aware:tokens", {"per_job_prefill": False}),
        _tier_aware("tier_aware:session", {"session_scale": 1.0}),
        Entrant("prefix_affinity", _ramjet("prefix_affinity")),
        Entrant("round_robin", _ramjet("round_robin"), NONE),
        Entrant("least_loaded", _ramjet("least_loaded"), NONE),
        Entrant("session_hash", _ramjet("session_hash"), NONE),
        Entrant(
            "smg_cache_aware:exact", lambda s: SmgCacheAware(), EXACT, origin="peer", tierless=True
        ),
        Entrant("smg_cache_aware:real", lambda s: SmgCacheAware(), SMG_TREE, origin="peer"),
        Entrant("smg_least_load", lambda s: SmgLeastLoad(), NONE, origin="peer"),
        Entrant("dynamo_kv:exact", lambda s: DynamoKv(), EXACT, origin="peer"),
        Entrant("dynamo_kv:real", lambda s: DynamoKv(), DYNAMO_TTL, origin="peer"),
        Entrant(
            "llmd_scorers:exact",
            lambda s: LlmdScorers(),
            EXACT,
            origin="peer",
            fabric_make=lambda s: LlmdScorers(cpu_weight=LLMD_CPU_WEIGHT),
        ),
        Entrant(
            "llmd_scorers:real",
            lambda s: LlmdScorers(),
            LLMD_LRU,
            origin="peer",
            fabric_make=lambda s: LlmdScorers(cpu_weight=LLMD_CPU_WEIGHT),
        ),
        Entrant(
            "prodstack_prefix:exact",
            lambda s: ProdstackPrefix(seed=s),
            EXACT,
            origin="peer",
            tierless=True,
        ),
        Entrant(
            "prodstack_prefix:real", lambda s: ProdstackPrefix(seed=s), HBM_ONLY, origin="peer"
        ),
        _tier_aware("oracle:tier_aware", shared_cache=True, origin="bound"),
        Entrant(
            "oracle:least_work",
            _ramjet("least_loaded", None, "oracle:least_work"),
            EXACT,
            shared_cache=True,
            origin="bound",
        ),
        Entrant(
            "oracle:spread",
            _ramjet("round_robin", None, "oracle:spread"),
            EXACT,
            shared_cache=True,
            origin="bound",
        ),
    ]
}


def resolve(spec: str) -> list[Entrant]:
    """`all`, or a comma list of names; a bare peer name means both of its modes."""
    if spec.strip() == "all":
        return list(ENTRANTS.values())
    out: list[Entrant] = []
    for raw in spec.split(","):
        name = raw.strip()
        if not name:
            continue
        if name in ENTRANTS:
            out.append(ENTRANTS[name])
            continue
        modes = [e for n, e in ENTRANTS.items() if n.split(":")[0] == name]
        if not modes:
            raise ValueError(f"unknown policy {name!r}; known: all, {', '.join(ENTRANTS)}")
        out.extend(modes)
    return out


def variant(spec: str) -> Entrant:
    """An extra `tier_aware` row for ablations: `NAME=JSON`, JSON the policy's params
    over its defaults (e.g. `tier_aware:x0.5={"externality_scale": 0.5}`), validated
    now; the key `calibrate` (true/false) sets the run's online TTFT calibration for
    this row alone. NAME must not be a lineup name or an oracle/bound row's."""
    name, sep, raw = spec.partition("=")
    name = name.strip()
    if not sep or not name:
        raise ValueError(f"--variant {spec!r}: expected NAME=JSON")
    if name in ENTRANTS or name.startswith(("oracle", "bound:")):
        raise ValueError(f"--variant {name!r}: the name is taken")
    try:
        params = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--variant {name!r}: params are not JSON: {exc}") from None
    if not isinstance(params, dict):
        raise ValueError(f"--variant {name!r}: params must be a JSON object")
    calibrate = params.pop("calibrate", None)
    if calibrate is not None and not isinstance(calibrate, bool):
        raise ValueError(f"--variant {name!r}: calibrate must be true or false")
    validate_params("tier_aware", params, path=f"--variant {name}")  # a ValueError
    return replace(_tier_aware(name, params), calibrate=calibrate)
