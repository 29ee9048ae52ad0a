"""The cost model of ARCHITECTURE section 6: predicted prompt work, wait and TTFT per
engine, and the externality of wasted work.

For request r (n prompt tokens) on engine e, with profile P:

- g = longest resident global-KV prefix, split by tier (hbm, host, ssd tokens), clipped
  to n; q = furthest message boundary with live SWA state, valid when q <= g or, at
  byte level, when every full block before q is resident: q < g + T, T the tokens of
  the first unmatched block (`swa_reach`), and q < n. The engine pools the partial
  block's tail with the SWA state at a boundary (`engine_stub/prompt_cache.py`: valid
  iff q // T <= G), so a boundary inside the block after the match resumes exactly,
  restoring all of g; ARCHITECTURE's q <= g is the block-granular statement. A boundary
  further out (or at n) has no resumable state: no SWA credit (the engine replays from
  g). Without `reach` (`prompt_work` called alone) q is clipped to g, block-granular.
- restore(tokens by tier) = sum over host/ssd of bytes / bandwidth + latency.
- Three resume points, the cheapest wins (ties prefer the earlier in this list):
    swa:    from q with live SWA:  restore(share q/g of each tier) + prefill(n-q at q)
    global: from g with replay:    restore(all of g) + replay_floor + prefill(n-g at g)
    cold:   from 0:                prefill(n at 0)
  The swa option has no replay; the global option always pays the profiled floor (a
  warm global prefix is never free). Which tier holds which *positions* is not known, so
  the swa option restores the same share of each tier as q is of g.
- work_e = restore + replay + prefill: what the engine will spend on r's prompt.
- wait_e = the time until e starts r: the engine's outstanding prompt tokens (reported,
  corrected by the router's in-flight, see `candidates.outstanding_prompt_tokens`)
  priced by the profile's prefill curve: each of the router's in-flight requests at its
  own context (`EngineLoad.inflight_jobs`), tokens beyond them from context 0
  (`queued_seconds`), less the time the engine has already
  spent on that work (`EngineLoad.busy_s`: the head of the queue is that far into its
  prefill), plus decode interference: a chunked
  prefill engine runs one decode step for its running batch per prefill chunk, so while
  any request decodes, each `chunk_tokens` of queued and own new tokens adds one
  `decode_step_s`. An engine that prefills one request per step (`per_job`, the
  default: the reference engine) runs at least one chunk per request, so each waiting
  request (`EngineLoad.waiting_requests`), the one in prefill and this one add a step
  and each waiting request its own fixed overhead: short prompts cost a step each.
- Packing: an engine that packs several prompts into a step (`per_job=False`, vLLM)
  also puts the prompts that arrive while this one waits into this one's step, so its
  first token waits for their prefill too. Expected extra ≈ ρ_e · (wait_e + work_e),
  ρ_e the predicted prompt work routed to the engine per second (`FleetStats.work_rate`,
  an EWMA, capped at 1), and at most the prefill of the room its last step has left:
  the engine schedules the prompts it has started first, so a later arrival only fills
  the step budget (`chunk_tokens`) that this one's final chunk leaves free
  (`packing_room`). 0 for a one-job-per-step engine.
- Priority: on an engine that serves by the priority hint's key (`FleetStats.keyed`: a
  pool in mode `on`, docs/priority.md), wait_e counts only the queued work whose key is
  lower than this request's key on e (min(work_e, aging·horizon) + aging·now), a started
  prefill where the engine does not preempt it (vLLM) or its running chunk where it
  does, and any outstanding work without a known key (`keyed_ahead`); on a one-job-per-
  step engine, later arrivals with a lower key overtake it: + ρ_e · min(wait_e, h/aging,
  horizon) (`keyed_wait`). Absent from `keyed`: the FCFS wait above.
- Jumps: on such an engine r overtakes the waiting requests with a higher key, and each
  of them waits r's service time longer, priced as `wait_seconds` prices one more job
  ahead: work_e, plus on a one-job-per-step engine its fixed overhead and at least one
  decode step per chunk while the engine decodes (on a packing engine its token share of
  the steps) (`service_seconds`). Nothing in r's own TTFT says so, so the externality
  charges it (`jump_seconds`, with the queue's `charge_jumps`): jump_e = scale ·
  n_jumped_e · service_e. A started prefill is not counted (`keyed_jumped`). Under FCFS
  nothing queued can be jumped and the term is 0.
- TTFT_e = wait_e + work_e + packing_e, each term weighted by the engine's calibration
  (`FleetStats.calibration`, `ramjet.policy.calibration`): prefill by w_prefill, plus
  w_context times an attention-like context term (0 as profiled), restore and replay by
  w_resume, the wait by w_wait, packing by w_packing, plus a fixed
  per-request time. The raw, profile-priced terms are the calibration's features and are
  kept in the components (`x_*_s`, `ttft_raw_s`). With `FleetStats.calibration_decides`
  every other figure, the externality's Δ included, is calibrated; without it (the
  default) the decision rests on the profile as probed and only `ttft_s`, the recorded
  prediction, is calibrated. With no calibration the weights are 1 and the fixed term 0.
- Externality: r's wasted work Δ_e = work_e - min over engines of work delays the
  requests queued behind it. By Little's law about λ·W of them wait at any time, where λ
  is the fleet's measured arrival rate and W its measured mean wait (both from
  `FleetStats`, both EWMAs the router or simulator measures; not tuned constants):

      cost_e = wait_e + work_e + scale · λ · W · Δ_e  [+ jump_e]  [+ session_e]
                                                        (scale defaults to 1)

  session_e, given by `tier_aware` for requests of a session (`ramjet.policy.session_load`):
  R · W · (C_e / C_fair - 1), the extra wait the session's R expected later turns meet on
  an engine whose committed session work C_e is above its fair share.

  The engine of least cost wins; ties go to the shorter wait. Affinity needs no separate
  load gate: a busy engine's wait is in its cost.

Pools. An engine of a shared fabric (`EngineView.pools`, `ramjet.config.FabricConfig`)
pulls on a local miss: a host or SSD pool that holds a longer prefix than the engine
extends g by the difference, priced as bytes / the pool's bandwidth into that engine +
its latency (`pool_pull`, the longest pull, ties to the cheaper), and an SWA pool that
holds the session's state at a further boundary lets the engine resume there at the
cost of pulling the SWA state (`profile.swa_bytes_per_sequence`, `pool_swa`). HBM stays
local; a pool whose reports are degraded is not used.

Trust and profiles. An engine that has not reported a profile is priced with the
policy's default profile, or with a profile measured on another engine of the fleet when
that one is dearer for the request: an engine is never cheaper for lack of a measured
profile (the decision notes `default_profile:<engine>`). An engine
whose residency view is DEGRADED (reports were lost or went stale) is priced with
caution: the default profile, no SWA credit (minute-scale state is the first to go
stale), and every matched token charged as an SSD restore (notes `degraded:<engine>`).
APPROXIMATE views (no reports, the router's own routing) are used as they are.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ramjet.policy.base import (
    EngineLoad,
    EngineView,
    FleetStats,
    GlobalMatch,
    KeyedQueue,
    RequestView,
)
from ramjet.policy.calibration import CONTEXT_SCALE, PROFILE, TtftWeights
from ramjet.policy.candidates import outstanding_prompt_tokens
from ramjet.policy.curve import PrefillCurve
from ramjet.policy.priority_key import hint_key_s
from ramjet.policy.profile import CurvePoint, EngineProfile, TierCost
from ramjet.types import EngineId, TrustGrade

V41_FLASH_TP4_ESTIMATE = EngineProfile(
    # ~17.9k prompt tokens/s per TP4 engine at short context: the brief's "recomputing a
    # 50k-token prefix costs about 2.8 s"; sparse attention (top-512) keeps the marginal
    # token nearly flat, a mild rise for the window and indexer. Estimate.
    prefill_curve=[
        CurvePoint(context_tokens=0, seconds_per_token=5.4e-5),
        CurvePoint(context_tokens=131_072, seconds_per_token=6.0e-5),
        CurvePoint(context_tokens=1_048_576, seconds_per_token=8.0e-5),
    ],
    prefill_overhead_s=0.004,
    replay_floor_s=0.012,  # 128 tokens x 40 layers plus a forward pass's fixed cost. Estimate.
    replay_window_tokens=128,
    global_kv_bytes_per_token=890.0,  # REFERENCE_MODEL: (288 + 68) x 2.5
    swa_bytes_per_sequence=128 * 528 * 40,  # REFERENCE_MODEL: 2,703,360 bytes
    tiers={
        # PCIe 5 x16 host->GPU, ~50 GB/s effective per TP4 engine. Estimate.
        "host": TierCost(bandwidth_bytes_per_s=50e9, latency_s=0.0005),
        # NVMe: the brief's "50k-token restore from SSD costs about 10 ms" (44.5 MB).
        "ssd": TierCost(bandwidth_bytes_per_s=5e9, latency_s=0.001),
    },
    decode_step_s=0.025,  # one batched decode step of a TP4 engine. Estimate.
    spec_acceptance=0.7,
    spec_tokens_per_step=2.0,
)
"""DeepSeek-V4.1-Flash on one TP4 engine of RTX PRO 6000 Blackwell Server Edition:
the policy's default profile until an engine reports its own (figures: docs/simulation.md)."""


@dataclass(init=False, frozen=True, slots=True)
class Work:
    """Prompt work of one request on one engine, in seconds, at its cheapest resume point."""

    resume: str
    """"swa", "global" or "cold"."""
    resume_tokens: int
    """Tokens the engine resumes from (q, g or 0)."""
    restore_s: float
    replay_s: float
    prefill_s: float

    def __init__(
        self,
        resume: str,
        resume_tokens: int,
        restore_s: float,
        replay_s: float,
        prefill_s: float,
    ) -> None:
        object.__setattr__(self, "resume", resume)
        object.__setattr__(self, "resume_tokens", resume_tokens)
        object.__setattr__(self, "restore_s", restore_s)
        object.__setattr__(self, "replay_s", replay_s)
        object.__setattr__(self, "prefill_s", prefill_s)

    @property
    def work_s(self) -> float:
        return self.restore_s + self.replay_s + self.prefill_s


_CURVES: dict[int, tuple[EngineProfile, PrefillCurve]] = {}
"""`EngineProfile.curve()` by the profile's identity (the entry holds the profile, so its
id is not reused while kept): the cost model asks for a profile's curve several times
per engine per request, and `curve()` is a method of an interpreted pydantic model
(~0.3 us a call), this a dict look-up. A profile is frozen (a `model_copy` is another
object), so its curve is the one `curve()` made first. Forgotten at once at
`_CURVES_SIZE`."""
_CURVES_SIZE = 256


def _curve(profile: EngineProfile) -> PrefillCurve:
    """`profile.curve()`, kept by the profile's identity (`_CURVES`)."""
    key = id(profile)
    kept = _CURVES.get(key)
    if kept is not None and kept[0] is profile:
        return kept[1]
    curve = profile.curve()
    if len(_CURVES) >= _CURVES_SIZE:
        _CURVES.clear()
    _CURVES[key] = (profile, curve)
    return curve


def _restore(profile: EngineProfile, host: float, ssd: float) -> float:
    total = 0.0
    bpt = profile.global_kv_bytes_per_token
    for label, tokens in (("host", host), ("ssd", ssd)):
        if tokens > 0:
            # A profile that lacks this tier's figures: price it at the estimate's.
            cost = profile.tiers.get(label) or V41_FLASH_TP4_ESTIMATE.tiers[label]
            total += cost.restore_seconds(tokens * bpt)
    return total


def _clip(match: GlobalMatch, n: int) -> tuple[int, int, int]:
    hbm = min(match.hbm, n)
    host = min(match.host, n - hbm)
    ssd = min(match.ssd, n - hbm - host)
    return hbm, host, ssd


def swa_reach(request: RequestView, match: GlobalMatch) -> int:
    """The exclusive bound on a live SWA boundary past the match: g plus the tokens of
    the first unmatched block (every full block before a boundary under it is resident),
    or the prompt length when every full block matched (the boundary lies in the tail).
    Uses `match.blocks`; a view that does not count blocks is read as uniform blocks of
    the first block's size. O(1)."""
    g = match.total
    sizes = request.block_tokens
    b = match.blocks
    if b is None:
        b = g // sizes[0] if sizes and sizes[0] > 0 else len(sizes)
    return g + sizes[b] if b < len(sizes) else request.prompt_tokens


def prompt_work(
    profile: EngineProfile,
    prompt_tokens: int,
    match: GlobalMatch,
    swa_tokens: int,
    reach: int | None = None,
    pool_tokens: int = 0,
    pool_s: float = 0.0,
    swa_pull_s: float = 0.0,
) -> Work:
    """The cheapest of the swa, global and cold resume points (see module docstring).
    `reach` is `swa_reach`: a boundary q with g < q < min(reach, n) is credited, one
    further out is not; None clips q to g. A shared pool ("Pools" in the module
    docstring) extends the match by `pool_tokens` past the engine's own, pulled in
    `pool_s`; `swa_pull_s` is the pull of SWA state held in a shared SWA pool."""
    n = max(prompt_tokens, 0)
    hbm, host, ssd = _clip(match, n)
    pool = min(max(pool_tokens, 0), n - hbm - host - ssd)
    if pool < pool_tokens and pool_tokens > 0:
        pool_s *= pool / pool_tokens
    g = hbm + host + ssd + pool
    # Only the winner becomes a `Work` (this runs per engine per decision); each point is
    # compared by its sum restore + replay + prefill, as `Work.work_s` adds it.
    resume, tokens, restore, replay = "cold", 0, 0.0, 0.0
    curve = _curve(profile)  # the compiled curve, asked up to three times here
    prefill = curve.seconds(n, 0)
    best = restore + replay + prefill
    if g > 0:
        r, f = _restore(profile, host, ssd) + pool_s, profile.replay_floor_s
        p = curve.seconds(n - g, g)
        if r + f + p <= best:
            resume, tokens, restore, replay, prefill, best = "global", g, r, f, p, r + f + p
    q = min(swa_tokens, g)
    if reach is not None and swa_tokens > g:
        # past g: resumable within the block after g (restore all of g, no replay), else
        # the engine holds no usable state there and replays from g
        q = swa_tokens if swa_tokens < min(reach, n) else 0
    if q > 0:
        share = min(q / g, 1.0) if g > 0 else 0.0
        r = _restore(profile, host * share, ssd * share) + pool_s * share + swa_pull_s
        p = curve.seconds(n - q, q)
        if r + 0.0 + p <= best:
            resume, tokens, restore, replay, prefill = "swa", q, r, 0.0, p
    return Work(resume, tokens, restore, replay, prefill)


def pool_pull(
    request: RequestView, engine: EngineView, own: GlobalMatch, bytes_per_token: float
) -> tuple[int, float, str | None, GlobalMatch]:
    """The engine's best pull from its shared global-KV pools ("Pools"): (tokens past its
    own match, seconds to pull them, the pool's id, the match to reach SWA boundaries
    from); (0, 0, None, own) when no pool extends the match. Pools whose reports are
    degraded are not used."""
    n = request.prompt_tokens
    mine = min(own.total, n)
    best: tuple[int, float, str | None, GlobalMatch] = (0, 0.0, None, own)
    for p in engine.pools:
        if p.tier == "swa" or p.trust == TrustGrade.DEGRADED:
            continue
        pm = p.residency.global_match(request.block_keys, request.block_tokens)
        extra = min(pm.total, n) - mine
        if extra <= 0:
            continue
        s = p.pull_seconds(extra * bytes_per_token)
        if extra > best[0] or (extra == best[0] and s < best[1]):
            reach = GlobalMatch(mine + extra, 0, 0, blocks=pm.blocks)
            best = (extra, s, p.id, reach)
    return best


def pool_swa(request: RequestView, engine: EngineView, swa_bytes: float) -> tuple[int, float]:
    """(boundary tokens, pull seconds) of the furthest SWA state a shared SWA pool holds
    for the request; (0, 0) when none does."""
    best, best_s = 0, 0.0
    if not request.boundary_keys:
        return 0, 0.0
    for p in engine.pools:
        if p.tier != "swa" or p.trust == TrustGrade.DEGRADED:
            continue
        q = p.residency.swa_match(request.boundary_keys)
        if q > best:
            best, best_s = q, p.pull_seconds(swa_bytes)
    return best, best_s


def wait_seconds(
    profile: EngineProfile,
    engine: EngineView,
    new_tokens: int,
    chunk_tokens: int,
    per_job: bool = True,
    ahead: tuple[int, int] | None = None,
) -> float:
    """Time until the engine starts the request, plus decode interference on its prefill.

    `per_job`: the engine prefills one request per forward pass (the reference engine,
    the simulator's engines), so each queued request pays its own fixed overhead and at
    least one chunk: one decode step each while requests decode, however short its
    prompt. False: the engine packs several prompts into a step's token budget (vLLM's
    chunked prefill), so only tokens count. `ahead`: (prompt tokens, waiting requests)
    that run before this request on an engine that serves by key (`keyed_ahead`), in
    place of everything outstanding there (FCFS)."""
    jobs: tuple[tuple[int, int], ...] = ()
    if ahead is None:
        queued, waiting = outstanding_prompt_tokens(engine.load), engine.load.waiting_requests
        jobs = engine.load.inflight_jobs
    else:
        queued, waiting = ahead
    # the head of the queue is `busy_s` into its prefill already
    wait = max(queued_seconds(profile, queued, jobs) - engine.load.busy_s, 0.0) if queued else 0.0
    waiting = (waiting or 0) if per_job else 0
    if waiting > 0:
        wait += waiting * profile.prefill_overhead_s
    if _decoding(engine.load) > 0 and profile.decode_step_s > 0:
        chunks = math.ceil((queued + new_tokens) / chunk_tokens)
        if per_job:  # the waiting jobs, the one in prefill, and this one: a chunk each
            chunks = max(chunks, waiting + (1 if queued > 0 else 0) + 1)
        wait += chunks * profile.decode_step_s
    return wait


def queued_seconds(
    profile: EngineProfile, queued: int, jobs: tuple[tuple[int, int], ...] = ()
) -> float:
    """The prefill time of `queued` outstanding prompt tokens: each of the router's `jobs`
    (new tokens, context tokens) at its own context, and the tokens beyond theirs (another
    router's, a reported queue's) as one prompt from context 0; one prefill overhead."""
    curve = _curve(profile)
    if not jobs:
        return curve.seconds(queued, 0)
    # the jobs' sum, job by job in order, kept while the engine's jobs are unchanged
    total, counted = curve.jobs_seconds(jobs)
    if queued > counted:
        total += curve.seconds(queued - counted, 0) - curve.overhead_s
    return total


def packing_room(
    profile: EngineProfile, load: EngineLoad, new_tokens: int, chunk_tokens: int
) -> float:
    """The most that prompts arriving later can add to a request's first token on a
    packing engine: the prefill of the step budget its final chunk leaves free (the
    outstanding tokens and its own fill whole steps first; running prompts are scheduled
    before waiting ones)."""
    if chunk_tokens <= 0:
        return 0.0
    used = (outstanding_prompt_tokens(load) + max(new_tokens, 0)) % chunk_tokens
    room = chunk_tokens - used if used else 0
    return _curve(profile).seconds(room, 0) - profile.prefill_overhead_s if room else 0.0


def _decoding(load: EngineLoad) -> int:
    """Requests decoding on the engine (running, else in flight): while any does, each
    prefill chunk carries one decode step."""
    running = load.running_requests
    return running if running is not None else load.inflight_requests


def _work_rate(fleet: FleetStats, engine: EngineId) -> float:
    """ρ_e: the predicted prompt work routed to `engine` per second (`FleetStats.work_rate`),
    clipped to [0, 1] (a utilisation): the packing term's and the keyed wait's."""
    return min(max(fleet.work_rate.get(engine, 0.0), 0.0), 1.0)


def keyed_ahead(
    queue: KeyedQueue, key_s: float, load: EngineLoad, chunk_tokens: int
) -> tuple[int, int]:
    """On an engine that serves by key: (prompt tokens, waiting requests) that run before a
    request of key `key_s` arriving now. Queued requests with a lower key (or an equal
    one: they arrived first); a started prefill in full where it is not preempted
    (vLLM), else only its running chunk; and outstanding tokens that carry no known key
    (another router's, an un-hinted request's), as FCFS would."""
    tokens = known = waiting = known_waiting = 0
    for key, t, started in queue.entries:
        known += t
        known_waiting += 0 if started else 1
        if key <= key_s or (started and not queue.preemptive):
            tokens += t
            waiting += 0 if started else 1
        elif started:
            tokens += min(t, chunk_tokens)
    tokens += max(outstanding_prompt_tokens(load) - known, 0)
    waiting += max((load.waiting_requests or 0) - known_waiting, 0)
    return tokens, waiting


def keyed_wait(
    profile: EngineProfile,
    engine: EngineView,
    queue: KeyedQueue,
    work_s: float,
    new_tokens: int,
    chunk_tokens: int,
    per_job: bool,
    fleet: FleetStats,
) -> float:
    """The wait on an engine that serves by key (module docstring, "Priority"): the work
    ahead of this request's key, plus on a one-job-per-step engine what later arrivals
    with a lower key add, rho_e · min(wait, window), window = min(h / aging, horizon)
    the time within which an arrival may overtake it (a packing engine's packing term
    already counts the arrivals during the wait)."""
    key = hint_key_s(work_s, queue.aging, fleet.now_s, queue.horizon_s)
    ahead = keyed_ahead(queue, key, engine.load, chunk_tokens)
    wait = wait_seconds(profile, engine, new_tokens, chunk_tokens, per_job, ahead)
    if per_job:
        rho = _work_rate(fleet, engine.id)
        window = wait
        if queue.aging > 0:
            window = min(window, max(work_s, 0.0) / queue.aging)
            if queue.horizon_s is not None:
                window = min(window, queue.horizon_s)
        wait += rho * window
    return wait


def service_seconds(
    profile: EngineProfile,
    engine: EngineView,
    work_s: float,
    new_tokens: int,
    chunk_tokens: int,
    per_job: bool,
) -> float:
    """What each request a request overtakes waits longer, as `wait_seconds` prices one
    more job ahead of it: its work; on a one-job-per-step engine its own fixed overhead
    (`prefill_overhead_s`, per waiting job) and, while the engine decodes, a decode step
    per chunk of its new tokens, at least one; on a packing engine its token share of
    the steps."""
    service = work_s + (profile.prefill_overhead_s if per_job else 0.0)
    if _decoding(engine.load) <= 0 or profile.decode_step_s <= 0:
        return service
    if per_job:
        chunks = float(max(math.ceil(new_tokens / chunk_tokens), 1))  # float() for mypyc
    else:
        chunks = max(new_tokens, 0) / chunk_tokens
    return service + chunks * profile.decode_step_s


def keyed_jumped(queue: KeyedQueue, key_s: float) -> int:
    """The requests a request of key `key_s` arriving now overtakes on an engine that
    serves by key: those waiting with a higher key (an equal key arrived first). A
    started prefill is not counted, even where the engine preempts it: counting it
    (the literal reading) pushed short turns off engines running a long prefill, and
    doubled the moves and raised p99 on mini-SWE (docs/priority.md)."""
    return sum(1 for key, _, started in queue.entries if key > key_s and not started)


def jump_seconds(
    profile: EngineProfile,
    engine: EngineView,
    queue: KeyedQueue,
    work_s: float,
    new_tokens: int,
    chunk_tokens: int,
    per_job: bool,
    fleet: FleetStats,
    scale: float = 1.0,
) -> float:
    """The jump term of the externality (module docstring, "Jumps"): scale · n_jumped ·
    service, the wait the requests this one overtakes on `engine` add; 0 where the
    queue does not charge jumps."""
    if not queue.charge_jumps or scale <= 0:
        return 0.0
    key = hint_key_s(work_s, queue.aging, fleet.now_s, queue.horizon_s)
    n = keyed_jumped(queue, key)
    if n == 0:
        return 0.0
    return scale * n * service_seconds(profile, engine, work_s, new_tokens, chunk_tokens, per_job)


@dataclass(init=False, frozen=True, slots=True)
class EngineEstimate:
    """Every figure the candidate weighs for one engine (seconds unless named tokens)."""

    engine: EngineId
    work: Work
    match: GlobalMatch
    swa_tokens: int
    wait_s: float
    delta_s: float
    externality_s: float
    default_profile: bool
    degraded: bool
    session_s: float = 0.0
    """The session term (`ramjet.policy.session_load`): what the session's later turns
    are expected to wait more (or less) on this engine than on a fair share."""
    stand_in: EngineId | None = None
    """With `default_profile`: the engine whose measured profile priced this one (it was
    dearer than the default); None when the default did."""
    packing_s: float = 0.0
    """A packing engine (`per_job=False`): what the prompts that arrive while this one
    waits add to its step, ρ_e · (wait + work) (module docstring)."""
    jump_s: float | None = None
    """On an engine that serves by key (`FleetStats.keyed`): the jump term, what the
    requests this one overtakes wait longer (`jump_seconds`); already in
    `externality_s`. None elsewhere."""
    fixed_s: float = 0.0
    """The calibration's fixed per-request time (`TtftWeights.fixed_s`)."""
    raw: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)
    """The profile-priced terms before calibration, the calibration's features
    (`ramjet.policy.calibration.FEATURES`): prefill, the context term (prefill at
    context 0 x context / CONTEXT_SCALE), restore + replay, wait, packing."""
    beyond_profile: bool = False
    """The prompt is longer than the largest context the engine's profile was probed at:
    its prefill is extrapolated."""
    weights: TtftWeights = PROFILE
    """The calibration's weights applied to `raw` (`FleetStats.calibration`)."""
    pool_tokens: int = 0
    """Tokens past the engine's own match pulled from a shared pool (`pool_pull`)."""
    predicted_ttft_s: float | None = None
    """The calibrated prediction where the decision rests on the profile as probed
    (`FleetStats.calibration_decides` false): recorded as `ttft_s`, never picked on."""

    def __init__(
        self,
        engine: EngineId,
        work: Work,
        match: GlobalMatch,
        swa_tokens: int,
        wait_s: float,
        delta_s: float,
        externality_s: float,
        default_profile: bool,
        degraded: bool,
        session_s: float = 0.0,
        stand_in: EngineId | None = None,
        packing_s: float = 0.0,
        jump_s: float | None = None,
        fixed_s: float = 0.0,
        raw: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0),
        beyond_profile: bool = False,
        weights: TtftWeights = PROFILE,
        pool_tokens: int = 0,
        predicted_ttft_s: float | None = None,
    ) -> None:
        object.__setattr__(self, "engine", engine)
        object.__setattr__(self, "work", work)
        object.__setattr__(self, "match", match)
        object.__setattr__(self, "swa_tokens", swa_tokens)
        object.__setattr__(self, "wait_s", wait_s)
        object.__setattr__(self, "delta_s", delta_s)
        object.__setattr__(self, "externality_s", externality_s)
        object.__setattr__(self, "default_profile", default_profile)
        object.__setattr__(self, "degraded", degraded)
        object.__setattr__(self, "session_s", session_s)
        object.__setattr__(self, "stand_in", stand_in)
        object.__setattr__(self, "packing_s", packing_s)
        object.__setattr__(self, "jump_s", jump_s)
        object.__setattr__(self, "fixed_s", fixed_s)
        object.__setattr__(self, "raw", raw)
        object.__setattr__(self, "beyond_profile", beyond_profile)
        object.__setattr__(self, "weights", weights)
        object.__setattr__(self, "pool_tokens", pool_tokens)
        object.__setattr__(self, "predicted_ttft_s", predicted_ttft_s)

    @property
    def ttft_s(self) -> float:
        return self.wait_s + self.work.work_s + self.packing_s + self.fixed_s

    @property
    def cost_s(self) -> float:
        return self.ttft_s + self.externality_s + self.session_s

    def components(self) -> dict[str, float]:
        w, m = self.work, self.match
        work = w.restore_s + w.replay_s + w.prefill_s  # the properties' sums, in their order
        ttft = self.wait_s + work + self.packing_s + self.fixed_s
        x_prefill, x_context, x_resume, x_wait, x_packing = self.raw
        out: dict[str, float] = {
            "hbm_tokens": float(m.hbm),
            "host_tokens": float(m.host),
            "ssd_tokens": float(m.ssd),
            "pool_tokens": float(self.pool_tokens),
            "pending_tokens": float(m.pending),
            "swa_tokens": float(self.swa_tokens),
            "resume_tokens": float(w.resume_tokens),
            "resume_swa": 1.0 if w.resume == "swa" else 0.0,
            "restore_s": w.restore_s,
            "replay_s": w.replay_s,
            "prefill_s": w.prefill_s,
            "work_s": work,
            "wait_s": self.wait_s,
            "packing_s": self.packing_s,
            "ttft_s": ttft if self.predicted_ttft_s is None else self.predicted_ttft_s,
            "delta_s": self.delta_s,
            "externality_s": self.externality_s,
            "session_s": self.session_s,
            "cost_s": ttft + self.externality_s + self.session_s,
            "default_profile": 1.0 if self.default_profile else 0.0,
            "fixed_s": self.fixed_s,
            "x_prefill_s": x_prefill,
            "x_context_s": x_context,
            "x_resume_s": x_resume,
            "x_wait_s": x_wait,
            "x_packing_s": x_packing,
            "ttft_raw_s": x_prefill + x_resume + x_wait + x_packing,
            "w_prefill": self.weights.prefill,
            "w_context": self.weights.context,
            "w_resume": self.weights.resume,
            "w_wait": self.weights.wait,
            "w_packing": self.weights.packing,
            "calibration_samples": float(self.weights.samples),
        }
        if self.jump_s is not None:  # last, as a merge put it (a merge copied the dict)
            out["jump_s"] = self.jump_s
        return out


def externality_rate(fleet: FleetStats, scale: float = 1.0) -> float:
    """λ · W: requests delayed per second of wasted work (dimensionless)."""
    return scale * max(fleet.arrival_rate_per_s, 0.0) * max(fleet.mean_wait_s, 0.0)


def _stand_in(
    engines: Sequence[EngineView], default: EngineProfile, n: int
) -> tuple[EngineProfile, EngineId | None]:
    """The profile for an engine that has none (or is degraded): the dearest, for this
    request's cold prefill, of the default and every profile measured in the fleet, so
    an engine is never cheaper for lack of a measurement; and whose it is (None: the
    default's)."""
    best, cost, owner = default, _curve(default).seconds(n, 0), None
    for e in engines:
        p = e.profile
        if p is not None and e.trust != TrustGrade.DEGRADED:
            c = _curve(p).seconds(n, 0)
            if c > cost:
                best, cost, owner = p, c, e.id
    return best, owner


def estimate(
    request: RequestView,
    engines: Sequence[EngineView],
    fleet: FleetStats,
    *,
    default_profile: EngineProfile = V41_FLASH_TP4_ESTIMATE,
    chunk_tokens: int = 8192,
    externality_scale: float = 1.0,
    session_s: Mapping[EngineId, float] | None = None,
    per_job: bool = True,
) -> list[EngineEstimate]:
    """Per-engine estimates for `request`, in the order of `engines` (see module docstring).
    `session_s`: the session term per engine, added to the cost (absent: 0)."""
    n = request.prompt_tokens
    stand_in, stand_in_id = _stand_in(engines, default_profile, n)
    staged: list[
        tuple[
            EngineView,
            Work,
            GlobalMatch,
            int,
            float,
            float,
            tuple[TtftWeights, float, float | None],
            tuple[float, float, float, float, float],
            float | None,
            bool,
            bool,
            bool,
            int,
        ]
    ] = []
    for e in engines:
        degraded = e.trust == TrustGrade.DEGRADED
        use_default = e.profile is None or degraded
        profile = stand_in if use_default else e.profile
        assert profile is not None
        match = e.residency.global_match(request.block_keys, request.block_tokens)
        pooled, pool_s, reach_match, swa_pull_s = 0, 0.0, match, 0.0
        if degraded:
            match = GlobalMatch(0, 0, match.total)
            swa = 0
        else:
            swa = e.residency.swa_match(request.boundary_keys) if request.boundary_keys else 0
            if e.pools:  # shared tiers: pull a longer prefix, or SWA state, from a pool
                bpt = profile.global_kv_bytes_per_token
                pooled, pool_s, _, reach_match = pool_pull(request, e, match, bpt)
                q, q_s = pool_swa(request, e, profile.swa_bytes_per_sequence)
                if q > swa:
                    swa, swa_pull_s = q, q_s
        raw_work = prompt_work(
            profile, n, match, swa, swa_reach(request, reach_match), pooled, pool_s, swa_pull_s
        )
        new_tokens = max(n - raw_work.resume_tokens, 0)
        queue = fleet.keyed.get(e.id) if fleet.keyed else None
        jump: float | None = None
        if queue is None:
            raw_wait = wait_seconds(profile, e, new_tokens, chunk_tokens, per_job)
        else:  # the engine serves by the priority hint's key
            args = (profile, e, queue, raw_work.work_s, new_tokens, chunk_tokens, per_job, fleet)
            raw_wait = keyed_wait(*args)
            jump = jump_seconds(*args, externality_scale)
        raw_packing = 0.0
        if not per_job:  # later arrivals join this request's step (vLLM's packing)
            raw_packing = min(
                _work_rate(fleet, e.id) * (raw_wait + raw_work.work_s),
                packing_room(profile, e.load, new_tokens, chunk_tokens),
            )
        w = fleet.calibration.get(e.id, PROFILE) if fleet.calibration else PROFILE
        # the context feature: prefill at context 0 scaled by the context it runs on
        context = _curve(profile).seconds(new_tokens, 0) * raw_work.resume_tokens / CONTEXT_SCALE
        work, wait, packing, fixed = _calibrated(raw_work, context, w), 0.0, 0.0, w.fixed_s
        wait, packing = w.wait * raw_wait, w.packing * raw_packing
        predicted: float | None = None
        if not fleet.calibration_decides and w is not PROFILE:
            # the calibrated prediction is recorded; the decision rests on the profile
            predicted = wait + work.work_s + packing + fixed
            work, wait, packing, fixed = raw_work, raw_wait, raw_packing, 0.0
        raw = (
            raw_work.prefill_s,
            context,
            raw_work.restore_s + raw_work.replay_s,
            raw_wait,
            raw_packing,
        )
        beyond = n > profile.prefill_curve[-1].context_tokens if profile.prefill_curve else False
        staged.append(
            (
                e,
                work,
                match,
                swa,
                wait,
                packing,
                (w, fixed, predicted),
                raw,
                jump,
                use_default,
                degraded,
                beyond,
                pooled,
            )
        )
    least = min(s[1].work_s for s in staged)
    rate = externality_rate(fleet, externality_scale)
    out: list[EngineEstimate] = []
    for (
        e,
        work,
        match,
        swa,
        wait,
        packing,
        (weights, fixed, predicted),
        raw,
        jump,
        use_default,
        degraded,
        beyond,
        pooled,
    ) in staged:
        delta = work.work_s - least
        externality = rate * delta
        if jump:
            externality += jump
        extra = session_s.get(e.id, 0.0) if session_s else 0.0
        out.append(
            EngineEstimate(
                e.id,
                work,
                match,
                swa,
                wait,
                delta,
                externality,
                use_default,
                degraded,
                extra,
                stand_in=stand_in_id if use_default else None,
                packing_s=packing,
                jump_s=jump,
                fixed_s=fixed,
                raw=raw,
                beyond_profile=beyond,
                weights=weights,
                pool_tokens=pooled,
                predicted_ttft_s=predicted,
            )
        )
    return out


def _calibrated(work: Work, context: float, w: TtftWeights) -> Work:
    """`work` with its terms weighted by the engine's calibration (module docstring);
    `context` is the context feature (`ramjet.policy.calibration`)."""
    if w is PROFILE:
        return work
    return Work(
        work.resume,
        work.resume_tokens,
        w.resume * work.restore_s,
        w.resume * work.replay_s,
        w.prefill * work.prefill_s + w.context * context,
    )
