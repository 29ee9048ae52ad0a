"""Closed-loop session replay, fan-out, the oracle and the no-policy-beats-a-bound check."""

from __future__ import annotations

import csv
import itertools
import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest
from sim_helpers import BLOCK, run_entrant, spec

from simulations import __main__ as cli
from simulations.bounds import floor
from simulations.checks import Replay, saturated, violations, with_oracle
from simulations.compare import read_rows
from simulations.sessions import closed_loop_plan, scale_for_load, scaled, session_groups
from simulations.simulator import Simulation
from simulations.summary import Row, summarize
from simulations.workload import Request, chain_keys, finish

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def agent_trace(sessions: int = 6, turns: int = 8, seed: int = 1) -> list[Request]:
    """Sessions whose turn k+1 extends turn k's prompt (as in the agent traces), with
    trace gaps far shorter than a turn's service time at high load."""
    rng = random.Random(seed)
    out = []
    fresh = iter(range(10_000, 1 << 30))
    for s in range(sessions):
        ids = [next(fresh) for _ in range(rng.randint(4, 12))]
        t = s * 0.7
        for k in range(turns):
            ids = ids + [next(fresh) for _ in range(rng.randint(1, 4))]
            out.append(
                Request(
                    0,
                    t,
                    len(ids) * BLOCK,
                    rng.randint(0, 30),
                    chain_keys(ids),
                    [BLOCK] * len(ids),
                    session=f"s{s}",
                    turn=k,
                )
            )
            t += rng.uniform(0.05, 0.3)
    return finish(out, BLOCK)


@pytest.mark.parametrize("fanout", [1, 3])
@pytest.mark.parametrize("scale", [0.5, 5.0, 1e4])
def test_no_turn_starts_before_the_previous_turn_of_its_session_finished(
    scale: float, fanout: int
) -> None:
    plan = closed_loop_plan(agent_trace(), BLOCK, sessions=14, fanout=fanout, fanout_share=0.5)
    reqs = scaled(plan, scale)
    out = run_entrant(reqs, "tier_aware", loop=plan.loop)
    loop = plan.loop
    by_session: dict[str | None, list[int]] = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r.index)
    checked = 0
    for i, ps in enumerate(loop.parents):
        if ps == 0:
            assert out.arrival[i] == pytest.approx(reqs[i].arrival_s)
            continue
        parents = [p for p, cs in enumerate(loop.children) if i in cs]
        assert len(parents) == ps
        last = max(out.finish[p] for p in parents)
        assert out.arrival[i] >= last
        assert out.arrival[i] == pytest.approx(last + loop.think_s[i])
        checked += 1
    assert checked > 14 * 5
    # and per session: every turn starts after every earlier turn's last token
    for idx in by_session.values():
        turns = sorted(idx, key=lambda i: out.arrival[i])
        for a, b in itertools.pairwise(turns):
            if reqs[a].turn != reqs[b].turn:
                assert out.arrival[b] >= out.finish[a]
    assert all(not math.isnan(t) for t in out.ttft)


def test_load_is_set_by_session_rate_and_think_times_are_never_shrunk() -> None:
    plan = closed_loop_plan(agent_trace(), BLOCK, sessions=12)
    fl = floor(plan.requests, spec().profile)
    low = scale_for_load(plan, fl.work_s, 0.2, 2)
    high = scale_for_load(plan, fl.work_s, 0.8, 2)
    assert high == pytest.approx(4 * low)
    a, b = scaled(plan, low), scaled(plan, high)
    roots = plan.loop.roots()
    # first turns are compressed by the factor, think times are the plan's at both loads
    assert b[roots[-1]].arrival_s == pytest.approx(a[roots[-1]].arrival_s * low / high)
    assert min(plan.loop.think_s[i] for i in range(len(a)) if i not in roots) > 0
    assert plan.think.source == "fitted" and plan.think.gaps == 6 * 7


def test_think_time_is_trace_gap_minus_service_when_the_trace_has_it() -> None:
    reqs = agent_trace(sessions=2, turns=3)
    for r in reqs:
        r.service_s = 0.01
    plan = closed_loop_plan(reqs, BLOCK)
    assert plan.think.source == "trace"
    groups = session_groups(reqs)
    want = sorted(
        max(b.arrival_s - a.arrival_s - 0.01, 0.0) for g in groups for a, b in itertools.pairwise(g)
    )
    got = sorted(t for i, t in enumerate(plan.loop.think_s) if plan.loop.parents[i])
    assert got == pytest.approx(want)


def test_fanout_siblings_share_the_prefix_and_arrive_together() -> None:
    plan = closed_loop_plan(agent_trace(), BLOCK, sessions=6, fanout=3, fanout_share=1.0)
    reqs = scaled(plan, 1.0)
    out = run_entrant(reqs, "tier_aware", loop=plan.loop)
    groups: dict[tuple[str | None, int | None], list[Request]] = {}
    for r in reqs:
        groups.setdefault((r.session, r.turn), []).append(r)
    fanned = [g for g in groups.values() if len(g) == 3]
    assert len(fanned) == 6 * 7  # every later turn
    for g in fanned:
        assert len({out.arrival[r.index] for r in g}) == 1
        keysets = [r.block_keys for r in g]
        assert keysets[0] != keysets[1] != keysets[2]
        shared = 0
        while all(k[shared] == keysets[0][shared] for k in keysets):
            shared += 1
        assert shared >= 4  # the blocks the turn shares with the previous one


@pytest.mark.parametrize("scale", [1.0, 20.0, 1e4])
def test_the_oracle_never_prefills_more_than_the_floor_without_fanout(scale: float) -> None:
    plan = closed_loop_plan(agent_trace(sessions=8), BLOCK, sessions=24)
    fl = floor(plan.requests, spec().profile)
    reqs = scaled(plan, scale)
    for name in ("oracle:tier_aware", "oracle:least_work", "oracle:spread"):
        out = run_entrant(reqs, name, loop=plan.loop)
        assert sum(out.new_tokens) <= fl.tokens
    # a partitioned cache does prefill more than the floor on the same plan
    rr = run_entrant(reqs, "round_robin", loop=plan.loop)
    assert sum(rr.new_tokens) > fl.tokens


def test_no_policy_beats_the_oracle_or_a_bound_in_a_closed_loop_run() -> None:
    plan = closed_loop_plan(agent_trace(sessions=8), BLOCK, sessions=24, fanout=2)
    fl = floor(plan.requests, spec().profile)
    rows = []
    for scale in (scale_for_load(plan, fl.work_s, x, 2) for x in (0.4, 0.9)):
        reqs = scaled(plan, scale)
        for name in ("tier_aware", "round_robin", "smg_cache_aware:exact", "oracle:tier_aware",
                     "oracle:least_work", "oracle:spread"):  # fmt: skip
            out = run_entrant(reqs, name, loop=plan.loop)
            rows.append(summarize(name, scale, reqs, out, fl.tokens, 2.0, alone_s=fl.work_s))
    rows = with_oracle(rows)
    assert [r.policy for r in rows].count("oracle") == 2
    assert violations(rows) == []


def _row(policy: str, mean: float, alone: float = math.nan) -> Row:
    nan = math.nan
    return Row(policy, 1.0, nan, mean, nan, nan, 0, nan, nan, nan, nan, nan, 0, nan, nan,
               0.5, alone)  # fmt: skip


def test_the_check_fails_a_run_where_a_policy_beats_the_oracle_or_a_bound() -> None:
    rows = with_oracle([_row("oracle:tier_aware", 1.0), _row("oracle:least_work", 1.2)])
    assert violations([*rows, _row("p", 1.1, alone=0.2)]) == []
    beat = violations([*rows, _row("p", 0.9, alone=0.2)])
    assert len(beat) == 1 and "p mean TTFT" in beat[0] and "oracle" in beat[0]
    below = violations([*rows, _row("p", 1.1, alone=1.5)])
    assert len(below) == 1 and "bound:alone" in below[0]
    full = [replace(r, utilization=0.995) for r in rows]
    assert saturated(full) == [1.0] and violations([*full, _row("p", 0.9, 0.2)]) == []
    assert saturated(rows) == []
    srpt = violations([*rows, _row("bound:srpt_merged_2x", 1.05), _row("p", 1.02)])
    assert len(srpt) == 2 and "p mean TTFT" in srpt[0] and "srpt" in srpt[0]
    assert "oracle mean TTFT" in srpt[1]  # the oracle itself is held to the strict bounds


RUNS = sorted(p.with_name("results.csv") for p in RESULTS.glob("*/table.md"))
"""Every `python -m simulations run` output under docs/results (it writes table.md)."""


@pytest.mark.parametrize("path", RUNS, ids=lambda p: p.parent.name)
def test_no_policy_beats_the_oracle_or_a_bound_in_the_results_tables(path: Path) -> None:
    rows = read_rows(path)
    assert any(r.policy == "oracle" for r in rows)
    assert violations(rows) == []


def test_cli_replays_a_session_trace_closed_loop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "agent.jsonl"
    lines = []
    for r in agent_trace(sessions=4, turns=5):
        ids = list(range(len(r.block_keys)))  # ids only need to chain like the keys
        lines.append(
            {
                "timestamp": r.arrival_s * 1000,
                "session_id": r.session,
                "turn": r.turn,
                "input_length": r.prompt_tokens,
                "output_length": r.output_tokens,
                "hash_ids": [hash((r.session, i)) & 0xFFFF_FFFF for i in ids],
            }
        )
    trace.write_text("\n".join(json.dumps(x) for x in lines))
    code = cli.main(
        ["run", "--trace", str(trace), "--policies", "tier_aware,round_robin,oracle",
         "--load", "0.5,0.9", "--sessions", "12", "--fanout", "2", "--out", str(tmp_path / "o"),
         "--quiet", "--no-plot"]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "closed-loop replay: 12 sessions" in printed and "fan-out 2 siblings" in printed
    assert "(load 0.9)" in printed and "bound:srpt_merged_2x" not in printed
    assert "oracle " in printed
    code = cli.main(
        ["run", "--trace", str(trace), "--closed-loop", "off", "--fanout", "2",
         "--out", str(tmp_path / "x"), "--quiet"]
    )  # fmt: skip
    assert code == 2


@pytest.mark.parametrize("name", ["smg_cache_aware:exact", "round_robin", "tier_aware"])
def test_a_policys_decisions_replayed_on_the_shared_cache_are_never_slower(name: str) -> None:
    reqs = scaled(closed_loop_plan(agent_trace(sessions=8), BLOCK, sessions=24), 1e4)
    reqs = finish(sorted(reqs, key=lambda r: r.arrival_s), BLOCK)  # open loop: fixed arrivals
    out = run_entrant(reqs, name)
    again = Simulation(
        reqs, spec(), Replay(name, out.engine), block_tokens=BLOCK, shared_cache=True
    ).run()
    assert again.engine == out.engine
    assert all(b <= a + 1e-9 for a, b in zip(out.ttft, again.ttft, strict=True))
    assert sum(again.new_tokens) <= sum(out.new_tokens)


def test_closed_loop_bad_inputs_are_refused_with_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = tmp_path / "plain.jsonl"  # no sessions: a Mooncake-style trace
    plain.write_text(
        json.dumps({"timestamp": 0, "input_length": 100, "output_length": 1, "hash_ids": [1]})
    )
    base = ["run", "--out", str(tmp_path / "o"), "--quiet", "--no-plot", "--policies", "tier_aware"]
    assert cli.main([*base, "--trace", str(plain), "--closed-loop", "on"]) == 2
    assert "needs a session_id" in capsys.readouterr().err
    assert cli.main([*base, "--trace", str(plain), "--fanout", "2"]) == 2
    assert "--fanout needs closed-loop replay" in capsys.readouterr().err
    reqs = agent_trace(sessions=2, turns=2)
    with pytest.raises(ValueError, match="fanout must be at least 1"):
        closed_loop_plan(reqs, BLOCK, fanout=0)
    with pytest.raises(ValueError, match="fanout_share"):
        closed_loop_plan(reqs, BLOCK, fanout=2, fanout_share=1.5)
    with pytest.raises(ValueError, match="sessions must be at least 1"):
        closed_loop_plan(reqs, BLOCK, sessions=-1)
    assert not (tmp_path / "o" / "results.csv").exists()


def test_the_priority_tables_respect_the_strict_bound() -> None:
    """`benchmarks/priority_sim.py`'s runs (docs/results/priority) mix schedulers, so the
    FCFS oracle bounds none of them; `bound:alone` over the same requests bounds all."""
    with open(RESULTS / "priority" / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows
    low = [r for r in rows if float(r["mean_s"]) < float(r["alone_mean_s"])]
    assert low == []


def test_a_policy_below_every_oracle_routing_is_also_run_on_the_shared_cache() -> None:
    """`checked_rows`: a policy that beats every oracle routing is replayed on the shared
    cache (`oracle:as:`) and, given its maker, run there itself (`oracle:run:`): in closed
    loop a replay's arrivals are not the policy's own. The oracle is the best of them."""
    from ramjet.config import FleetStatsConfig
    from simulations.lineup import ENTRANTS

    plan = closed_loop_plan(agent_trace(sessions=8), BLOCK, sessions=24)
    fl = floor(plan.requests, spec().profile)
    scale = scale_for_load(plan, fl.work_s, 0.8, 2)
    reqs = scaled(plan, scale)
    rows, decisions = [], {}
    for name in ("tier_aware", "oracle:tier_aware"):
        out = run_entrant(reqs, name, loop=plan.loop)
        decisions[name] = out.engine
        rows.append(summarize(name, scale, reqs, out, fl.tokens, 2.0, alone_s=fl.work_s))
    # pretend tier_aware came out below the oracle routing
    rows[0] = replace(rows[0], ttft_mean_s=rows[1].ttft_mean_s / 2)
    ent = ENTRANTS["tier_aware"]
    setup = cli.RunSetup(reqs, spec(), scale, BLOCK, 2, fl, 2.0, 0.8, FleetStatsConfig(), plan.loop)
    added = cli.checked_rows(rows, setup, decisions=decisions)
    assert [r.policy for r in added] == ["oracle:as:tier_aware", "bound:alone"]
    added = cli.checked_rows(
        rows, setup, decisions=decisions,
        policies={"tier_aware": (lambda: ent.make(0), ent.knowledge)},
    )  # fmt: skip
    names = [r.policy for r in added]
    assert names == ["oracle:run:tier_aware", "oracle:as:tier_aware", "bound:alone"]
    # tier_aware run on the shared cache is the oracle routing oracle:tier_aware itself
    run = added[0]
    assert (run.ttft_mean_s, run.ttft_p99_s) == (rows[1].ttft_mean_s, rows[1].ttft_p99_s)
    oracle = next(r for r in with_oracle([*rows, *added]) if r.policy == "oracle")
    assert oracle.ttft_mean_s == min(r.ttft_mean_s for r in [rows[1], *added[:2]])


def test_one_cache_every_runs_each_policy_on_the_shared_cache_whether_or_not_it_won() -> None:
    """`checked_rows(one_cache="every")`: every policy runs on the oracle's one cache in
    every run, not only where it beat the oracle routings, so a routing's one-cache mean
    can be averaged over seeds without selection (benchmarks/fabric_grid.py's oracle);
    "every+replay" replays each one's decisions too. The oracle routings are not re-run."""
    from ramjet.config import FleetStatsConfig
    from simulations.lineup import ENTRANTS

    plan = closed_loop_plan(agent_trace(sessions=8), BLOCK, sessions=24)
    fl = floor(plan.requests, spec().profile)
    scale = scale_for_load(plan, fl.work_s, 0.8, 2)
    reqs = scaled(plan, scale)
    rows, decisions = [], {}
    for name in ("tier_aware", "round_robin", "oracle:tier_aware"):
        out = run_entrant(reqs, name, loop=plan.loop)
        decisions[name] = out.engine
        rows.append(summarize(name, scale, reqs, out, fl.tokens, 2.0, alone_s=fl.work_s))
    # neither policy below the oracle routing: "beaten" adds nothing for them
    rows = [replace(r, ttft_mean_s=9.0) if not r.policy.startswith("oracle") else r for r in rows]
    setup = cli.RunSetup(reqs, spec(), scale, BLOCK, 2, fl, 2.0, 0.8, FleetStatsConfig(), plan.loop)
    makers = {n: (lambda n=n: ENTRANTS[n].make(0), ENTRANTS[n].knowledge) for n in decisions}
    makers.pop("oracle:tier_aware")
    added = cli.checked_rows(rows, setup, decisions=decisions, policies=makers)
    assert [r.policy for r in added] == ["bound:alone"]
    added = cli.checked_rows(rows, setup, decisions=decisions, policies=makers, one_cache="every")
    names = [r.policy for r in added]
    assert names == ["oracle:run:tier_aware", "oracle:run:round_robin", "bound:alone"]
    run = added[0]  # tier_aware run on the shared cache is the oracle routing itself
    assert (run.ttft_mean_s, run.ttft_p99_s) == (rows[2].ttft_mean_s, rows[2].ttft_p99_s)
    added = cli.checked_rows(
        rows, setup, decisions=decisions, policies=makers, one_cache="every+replay"
    )
    assert [r.policy for r in added] == [
        "oracle:run:tier_aware", "oracle:as:tier_aware",
        "oracle:run:round_robin", "oracle:as:round_robin", "bound:alone",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="one_cache must be one of"):
        cli.checked_rows(rows, setup, decisions=decisions, one_cache="all")
