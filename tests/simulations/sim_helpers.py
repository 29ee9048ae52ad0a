"""Small workloads and an engine spec for simulator tests (imported by test_sim_*)."""

from __future__ import annotations

from ramjet.policy.profile import CurvePoint, EngineProfile, TierCost
from simulations.lineup import ENTRANTS
from simulations.preset import EngineSpec
from simulations.simulator import Outcome, Simulation
from simulations.workload import Request, chain_keys, finish

BLOCK = 64
PROFILE = EngineProfile(
    prefill_curve=[
        CurvePoint(context_tokens=0, seconds_per_token=1e-4),
        CurvePoint(context_tokens=10_000, seconds_per_token=2e-4),
    ],
    prefill_overhead_s=0.003,
    replay_floor_s=0.02,
    global_kv_bytes_per_token=1000,
    swa_bytes_per_sequence=1e6,
    tiers={
        "host": TierCost(bandwidth_bytes_per_s=1e9, latency_s=0.001),
        "ssd": TierCost(bandwidth_bytes_per_s=1e8, latency_s=0.005),
    },
    decode_step_s=0.01,
)


def spec(**kw: object) -> EngineSpec:
    base = {
        "profile": PROFILE,
        "hbm_tokens": 1 << 30,
        "host_tokens": 1 << 30,
        "ssd_tokens": 1 << 30,
        "swa_sequences": 1 << 20,
        "swa_ttl_s": 60.0,
        "chunk_tokens": 512,
    }
    base.update(kw)
    return EngineSpec(**base)  # type: ignore[arg-type]


def req(
    t: float, ids: list[int], *, out: int = 0, session: str | None = None, tokens: int | None = None
) -> Request:
    n = tokens if tokens is not None else len(ids) * BLOCK
    return Request(0, t, n, out, chain_keys(ids), [BLOCK] * len(ids), session=session)


def workload(reqs: list[Request]) -> list[Request]:
    return finish(reqs, BLOCK)


def entrant_simulation(reqs: list[Request], name: str, **kw: object) -> Simulation:
    """A simulation of a lineup entrant (its policy, knowledge and cache sharing)."""
    ent = ENTRANTS[name]
    return Simulation(
        reqs,
        spec(),
        ent.make(0),
        block_tokens=BLOCK,
        knowledge=ent.knowledge,
        shared_cache=ent.shared_cache,
        **kw,  # type: ignore[arg-type]
    )


def run_entrant(reqs: list[Request], name: str, **kw: object) -> Outcome:
    """One simulated run of a lineup entrant."""
    return entrant_simulation(reqs, name, **kw).run()
