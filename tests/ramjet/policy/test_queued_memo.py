"""The wait's sum over the router's jobs in flight (`cost.queued_seconds`) is kept by the
jobs tuple (`PrefillCurve.jobs_seconds`) and the engine's tuple is made once per change
(`EngineState.jobs`): the figures must be the same floats as the plain job-by-job sum,
whether summed, kept or summed again, and a view must never see a stale tuple."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ramjet.config import EngineConfig
from ramjet.fleet.engines import EngineState, Ticket
from ramjet.fleet.signals import NoSignals
from ramjet.policy.cost import V41_FLASH_TP4_ESTIMATE, queued_seconds
from ramjet.policy.curve import JOBS_MEMO_SIZE
from ramjet.policy.profile import CurvePoint, EngineProfile


def reference(profile: EngineProfile, queued: int, jobs: tuple[tuple[int, int], ...]) -> float:
    """`queued_seconds` as it was written before the sum was kept: job by job."""
    if not jobs:
        return profile.prefill_seconds(queued, 0)
    over = profile.prefill_overhead_s
    total, counted = over, 0
    for n, context in jobs:
        if n > 0:
            total += profile.prefill_seconds(n, context) - over
            counted += n
    if queued > counted:
        total += profile.prefill_seconds(queued - counted, 0) - over
    return total


@st.composite
def profiles(draw: st.DrawFn) -> EngineProfile:
    k = draw(st.integers(1, 4))
    xs = sorted(draw(st.sets(st.integers(0, 2_000_000), min_size=k, max_size=k)))
    ys = draw(st.lists(st.floats(1e-6, 1e-3), min_size=k, max_size=k))
    over = draw(st.sampled_from([0.0, 0.004, draw(st.floats(0.0, 0.05))]))
    return EngineProfile(
        prefill_curve=[
            CurvePoint(context_tokens=x, seconds_per_token=y) for x, y in zip(xs, ys, strict=True)
        ],
        prefill_overhead_s=over,
        replay_floor_s=0.01,
        global_kv_bytes_per_token=1000,
    )


JOBS = st.lists(st.tuples(st.integers(-5, 200_000), st.integers(0, 3_000_000)), max_size=40).map(
    tuple
)


@settings(max_examples=300, deadline=None)
@given(profile=profiles(), jobs=JOBS, extra=st.integers(-50_000, 100_000))
def test_kept_sum_is_the_job_by_job_float(
    profile: EngineProfile, jobs: tuple[tuple[int, int], ...], extra: int
) -> None:
    queued = max(sum(max(n, 0) for n, _ in jobs) + extra, 0)
    want = reference(profile, queued, jobs).hex()
    assert queued_seconds(profile, queued, jobs).hex() == want  # summed
    assert queued_seconds(profile, queued, jobs).hex() == want  # kept, the same tuple
    again = tuple(list(jobs))  # equal jobs, another tuple (when not empty): summed again
    assert queued_seconds(profile, queued, again).hex() == want
    assert (
        queued_seconds(profile, queued + 7, jobs).hex()
        == reference(profile, queued + 7, jobs).hex()
    )


def test_kept_sums_are_forgotten_at_the_bound() -> None:
    """Past `JOBS_MEMO_SIZE` tuples the memo starts again; every figure stays exact."""
    p = V41_FLASH_TP4_ESTIMATE
    kept = [tuple((100 + i, j) for j in range(3)) for i in range(JOBS_MEMO_SIZE + 5)]
    for jobs in kept + kept[:10]:
        q = sum(n for n, _ in jobs) + 11
        assert queued_seconds(p, q, jobs).hex() == reference(p, q, jobs).hex()
    curve = p.curve()
    assert len(curve._jobs) <= JOBS_MEMO_SIZE


def _engine() -> EngineState:
    return EngineState(EngineConfig(id="e0", url="http://127.0.0.1:1"))


def test_engine_jobs_tuple_is_kept_until_a_ticket_changes_it() -> None:
    engine = _engine()
    assert engine.jobs() == ()
    a = Ticket(engine, 300, 0.0, 0)
    first: tuple[tuple[int, int], ...] = engine.jobs()
    assert engine.jobs() is first and first == ((300, 0),)
    view = NoSignals().load(engine, 0.1)
    assert view.inflight_jobs is first  # every view of the same jobs shares the tuple
    b = Ticket(engine, 500, 0.0, 1000)
    second: tuple[tuple[int, int], ...] = engine.jobs()
    assert second is not first and second == ((300, 0), (500, 1000))
    Ticket(engine, 0, 0.0, 0)  # no prompt work: not a job, the tuple stays
    assert engine.jobs() is second
    a.first_byte(0.2)
    assert engine.jobs() == ((500, 1000),)
    assert NoSignals().load(engine, 0.3).inflight_jobs == ((500, 1000),)
    b.close()
    assert engine.jobs() == () and NoSignals().load(engine, 0.4).inflight_jobs == ()


def test_wait_follows_the_jobs_through_changes() -> None:
    """The wait priced from each view equals the plain sum over that view's jobs, as
    tickets open and their first bytes come (a kept sum never outlives its jobs)."""
    p = V41_FLASH_TP4_ESTIMATE
    engine = _engine()
    tickets = [Ticket(engine, 1000 + 97 * i, 0.0, 50_000 * i) for i in range(12)]
    for t in tickets[::3] + tickets[1::3] + tickets[2::3]:
        load = NoSignals().load(engine, None)
        q = load.inflight_prompt_tokens
        for _ in range(2):
            got = queued_seconds(p, q, load.inflight_jobs)
            assert got.hex() == reference(p, q, tuple(engine.inflight_jobs.values())).hex()
        t.first_byte(None)
