"""Measured profiles through the Redis-shared report path (issue 15, problem 8 for
replicas). A router that starts after its engines' sidecars gets their profiles from
the snapshot it pulls (the pull path); a replica that shares report state through Redis
may never pull that snapshot itself (it absorbs the shared cursor first and polls after
it, or its own claim of the snapshot loses to another replica's), so the shared record
must carry the snapshot's profile as it carries a profile report's. Before, only a
`profile` report set it: such a replica priced the engine with the default profile, and
an engine that had one was then dearer than one that had none.

Real redis-server, real signed frames, two `SharedReports` replicas."""

from __future__ import annotations

import time
from typing import Any

import pytest
from policy_fakes import engine, request

# the snapshot tests' Redis rig: a redis-server and its links (fixtures), a replica, the key
from test_reports_redis_snapshot import PRIV, links, replica, server  # noqa: F401

from ramjet.policy.base import FleetStats
from ramjet.policy.cost import V41_FLASH_TP4_ESTIMATE, estimate
from ramjet.policy.profile import CurvePoint, EngineProfile
from ramjet.reports.bodies import DeltaBody, SnapshotBody, TierKeys, encode_body, profile_body
from ramjet.reports.envelope import Envelope, sign
from ramjet.reports.redis_cursors import SharedReports
from ramjet.reports.verify import Accepted, Rejected
from ramjet.types import EngineId, PrefixKey

pytestmark = pytest.mark.redis
E0, E1 = EngineId("e0"), EngineId("e1")
MEASURED = EngineProfile(  # a small CPU engine: ~4x dearer per token than the estimate
    prefill_curve=[
        CurvePoint(context_tokens=0, seconds_per_token=8e-5),
        CurvePoint(context_tokens=1024, seconds_per_token=2.7e-4),
    ],
    prefill_overhead_s=0.01,
    replay_floor_s=0.002,
    global_kv_bytes_per_token=1.0,
    decode_step_s=0.004,
)
NEWER = MEASURED.model_copy(update={"prefill_overhead_s": 0.02})


@pytest.fixture
def two(server: Any, links: list[Any]) -> tuple[Any, SharedReports, Any, SharedReports]:  # noqa: F811
    """Two replicas sharing one Redis: (processor A, A, processor B, B)."""
    sa, pa, a = replica(server, 0)
    sb, pb, b = replica(server, 0)
    links += [sa, sb]
    return pa, a, pb, b


def signed(seq: int, kind: str, body: bytes, issued_ms: int | None = None) -> bytes:
    issued = int(time.time() * 1000) if issued_ms is None else issued_ms
    env = Envelope(E0, "k0", 1, seq, issued, kind, body)  # type: ignore[arg-type]
    return sign(env, PRIV)


def snapshot(seq: int, profile: EngineProfile | None, issued_ms: int | None = None) -> bytes:
    body = SnapshotBody(
        seq=seq, residency=[TierKeys(tier="hbm", keys=[PrefixKey(5)])], swa=[], profile=profile
    )
    return signed(seq, "snapshot", encode_body(body), issued_ms)


def delta(seq: int) -> bytes:
    return signed(seq, "delta", encode_body(DeltaBody(evicted=[PrefixKey(9)])))


def same(got: EngineProfile | None, want: EngineProfile) -> bool:
    return got is not None and got.model_dump() == want.model_dump()


async def test_a_replica_that_only_syncs_gets_the_profile_of_a_snapshot(two: Any) -> None:
    # the sidecar published its profile (report 1) before any router ran, then deltas;
    # A, started later, pulls a snapshot, which carries the profile
    pa, a, pb, b = two
    assert isinstance(await a.submit(snapshot(3, MEASURED), E0), Accepted)
    assert same(pa.profile(E0), MEASURED)
    # B learns e0 from Redis: cursor, trust and the measured profile
    await b.sync_once()
    c = pb.cursor(E0)
    assert c is not None and (c.epoch, c.seq) == (1, 3)
    assert same(pb.profile(E0), MEASURED)
    # a later delta (no profile) keeps it; a later profile report replaces it
    assert isinstance(await a.submit(delta(4), E0), Accepted)
    await b.sync_once()
    assert same(pb.profile(E0), MEASURED)
    assert isinstance(
        await a.submit(signed(5, "profile", encode_body(profile_body(NEWER))), E0), Accepted
    )
    await b.sync_once()
    assert same(pb.profile(E0), NEWER)


async def test_a_replica_whose_snapshot_claim_loses_still_gets_the_profile(two: Any) -> None:
    _pa, a, pb, b = two
    issued = int(time.time() * 1000)
    frame = snapshot(2, MEASURED, issued)
    assert isinstance(await a.submit(frame, E0), Accepted)
    # B pulled the very same snapshot (same issue time): the shared cursor refuses it
    outcome = await b.submit(frame, E0)
    assert isinstance(outcome, Rejected) and outcome.reason.value == "replayed"
    assert same(pb.profile(E0), MEASURED)  # absorbed with the refusal


async def test_a_snapshot_without_a_profile_keeps_the_shared_one(two: Any) -> None:
    _pa, a, pb, b = two
    now = int(time.time() * 1000)
    assert isinstance(await a.submit(snapshot(2, MEASURED, now), E0), Accepted)
    assert isinstance(await a.submit(snapshot(2, None, now + 5), E0), Accepted)
    await b.sync_once()
    assert same(pb.profile(E0), MEASURED)


async def test_the_engine_without_a_measured_profile_is_not_the_cheaper_one(two: Any) -> None:
    """On the replica that learnt e0's profile from Redis, e1 (no profile reported) is
    priced no cheaper than e0 for the same work: before, e0 was priced by the measured
    CPU profile only when a profile report had been claimed, and e1 by the ~4x cheaper
    built-in estimate, so every request went to e1."""
    _pa, a, pb, b = two
    assert isinstance(await a.submit(snapshot(3, MEASURED), E0), Accepted)
    await b.sync_once()
    views = [engine("e0", profile=pb.profile(E0)), engine("e1", profile=pb.profile(E1))]
    assert views[0].profile is not None and views[1].profile is None
    req = request(2000)
    ests = {e.engine: e for e in estimate(req, views, FleetStats())}
    assert ests[E0].default_profile is False and ests[E1].default_profile is True
    assert ests[E1].cost_s >= ests[E0].cost_s
    assert ests[E0].work.work_s > V41_FLASH_TP4_ESTIMATE.prefill_seconds(2000) * 2
