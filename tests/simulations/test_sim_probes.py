"""`simulations.probes`: the first-turn placement probes of docs/results.md's ablation."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
from policy_fakes import engine, request

from ramjet.policy.base import FleetStats
from simulations import __main__ as cli
from simulations import probes
from simulations.probes import BusyPeriod, Placement, future_work, probe
from simulations.workload import Request

TRACE = (
    Path(__file__).resolve().parents[3] / "shared/data/traces/agent/miniswe_interleaved_b64.jsonl"
)


def _first(p: Placement, session: str, now: float, **queued: int) -> str:
    views = [engine(name, queued=queued.get(name, 0)) for name in ("e0", "e1")]
    return p.pick(request(1024, session=session), views, FleetStats(now_s=now)).engine


def test_count_probe_sends_a_new_session_away_from_the_engine_with_more_sessions() -> None:
    p = Placement("place:count:1", "count", 1.0)
    # three sessions start on e0 (its queue is empty, e1's is long), one on e1
    assert [_first(p, s, 0.1 * i, e1=50_000) for i, s in enumerate("abc")] == ["e0"] * 3
    assert _first(p, "d", 0.3, e0=50_000) == "e1"
    # equal queues: a new session goes where fewer sessions live, whichever the tie cursor
    assert _first(p, "e", 0.4) == "e1"
    assert _first(p, "f", 0.5) == "e1"
    # without the count term tier_aware alone would alternate on the tie
    plain = Placement("place:count:0", "count", 0.0)
    assert {_first(plain, s, 0.1 * i) for i, s in enumerate("xy")} == {"e0", "e1"}


def test_sessions_idle_for_three_cycles_stop_counting() -> None:
    p = Placement("place:count:1", "count", 1.0)
    for i, s in enumerate("abc"):
        assert _first(p, s, 0.01 * i, e1=50_000) == "e0"
    # long after: a, b, c ended (first guess of a cycle is 2 s, 3 cycles = 6 s)
    assert _first(p, "d", 100.0, e0=10_000) == "e1"
    assert set(p.seen) == {"d"}


def test_later_turns_are_left_to_tier_aware() -> None:
    p = Placement("place:count:1", "count", 1.0)
    assert _first(p, "a", 0.0, e1=50_000) == "e0"
    # the session's second turn holds its prefix on e0: it stays although e0 is busier
    views = [engine("e0", hbm=1024, queued=500), engine("e1")]
    assert p.pick(request(1100, session="a"), views, FleetStats(now_s=2.0)).engine == "e0"
    assert p.seen["a"].turns == 2
    assert p.seen["a"].cycle_s == pytest.approx(2.0)


def test_future_work_is_per_session_in_turn_order() -> None:
    reqs = [
        Request(0, 0.0, 10, 1, [], [], session="s", turn=1),
        Request(1, 0.0, 10, 1, [], [], session="t", turn=0),
        Request(2, 0.0, 10, 1, [], [], session="s", turn=0),
        Request(3, 0.0, 10, 1, [], []),
    ]
    assert future_work(reqs, [1.0, 2.0, 3.0, 4.0]) == {"s": [3.0, 1.0], "t": [2.0]}


@pytest.mark.parametrize("spec", ["place:count", "place:size:1", "place:rate:x", "first:random"])
def test_unknown_probes_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="unknown probe"):
        probe(spec)


def test_the_clairvoyant_probe_needs_future_work() -> None:
    with pytest.raises(ValueError, match="future work"):
        Placement("p", "future", 1.0)


def test_cli_refuses_bad_input_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert probes.main(["--trace", "no-such-file", "--probe", "place:size:1"]) == 2
    assert "unknown probe" in capsys.readouterr().err
    assert probes.main(["--trace", "no-such-file", "--probe", "ext:busy"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert probes.main(["--trace", "x", "--policies", "tier_aware,tier_aware"]) == 2
    assert "named twice" in capsys.readouterr().err


def test_busy_period_externality_is_delta_times_arrivals_until_the_backlog_clears() -> None:
    p = probe("ext:busy")(0, {})
    assert isinstance(p, BusyPeriod)
    fleet = FleetStats(now_s=1.0, arrival_rate_per_s=20.0, mean_wait_s=0.2)
    views = [engine("e0", hbm=4096, queued=4096), engine("e1", queued=1024)]
    d = p.pick(request(8192, session="a"), views, fleet)
    prof = p.params.default_profile
    fixed = prof.prefill_overhead_s + prof.decode_step_s
    for e in ("e0", "e1"):
        c = d.components[e]
        # nothing sent yet: rho 0, so the backlog clears in wait + work + fixed
        want = c["delta_s"] * 20.0 / 2 * (c["wait_s"] + c["work_s"] + fixed)
        assert c["externality_s"] == pytest.approx(want)
    assert d.components["e1"]["externality_s"] > 0  # e1 recomputes the prefix e0 holds
    sent = d.components[d.engine]["work_s"] + fixed
    assert p.rho == {d.engine: pytest.approx(sent / p.tau_s)}
    # ten seconds later (one time constant) the engine time sent there has decayed by e
    p.estimates(request(8192, session="a"), views, FleetStats(now_s=11.0))
    assert p.rho[d.engine] == pytest.approx(sent / p.tau_s / math.e)


def test_probe_runs_match_simulations_run_seed_by_seed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The probe driver builds each run as `simulations run` does: same figures per seed."""
    common = ["--trace", str(TRACE), "--policies", "tier_aware,session_hash", "--sessions", "12"]
    assert probes.main([*common, "--load", "0.6", "--seeds", "0,1"]) == 0
    printed = capsys.readouterr().out
    means = []
    for seed in (0, 1):
        out = tmp_path / f"s{seed}"
        argv = ["run", *common, "--load", "0.6", "--seed", str(seed), "--out", str(out)]
        assert cli.main([*argv, "--quiet", "--no-plot"]) == 0
        with (out / "results.csv").open() as f:
            row = next(r for r in csv.DictReader(f) if r["policy"] == "tier_aware")
        mean = float(row["ttft_mean_s"])
        assert f"seed {seed} tier_aware" in printed
        assert f"mean {mean:.4f}" in printed.split(f"seed {seed} tier_aware", 1)[1][:40]
        means.append(mean)
    summary = printed.split("mean over seeds", 1)[1]
    line = next(x for x in summary.splitlines() if x.startswith("tier_aware "))
    assert f"mean {sum(means) / 2:.4f}" in line
    assert line.endswith("1.000x tier_aware")


def test_social_externality_prices_own_work_by_the_engines_own_arrivals() -> None:
    """`ext:social:W`: (Δ + W·(work + fixed)) · λ_e · backlog / (1 − ρ_e), with λ_e the
    requests this policy sent to e per second (EWMA), not the fleet's λ split evenly."""
    p = probe("ext:social:0.5")(0, {})
    assert isinstance(p, BusyPeriod) and p.own == 0.5
    fleet = FleetStats(now_s=1.0, arrival_rate_per_s=20.0, mean_wait_s=0.2)
    views = [engine("e0", hbm=4096, queued=4096), engine("e1", queued=1024)]
    # nothing sent yet: no engine has arrivals, so nothing is delayed and the pick is selfish
    d = p.pick(request(8192, session="a"), views, fleet)
    assert all(c["externality_s"] == 0.0 for c in d.components.values())
    assert p.lam == {d.engine: pytest.approx(1.0 / p.tau_s)}
    prof = p.params.default_profile
    fixed = prof.prefill_overhead_s + prof.decode_step_s
    lam, rho = dict(p.lam), dict(p.rho)  # as the next pick (same instant: no decay) reads them
    d = p.pick(request(8192, session="b"), views, FleetStats(now_s=1.0))
    for e, c in d.components.items():
        backlog = c["wait_s"] + c["work_s"] + fixed
        priced = c["delta_s"] + 0.5 * (c["work_s"] + fixed)
        want = priced * lam.get(e, 0.0) * backlog / (1 - rho.get(e, 0.0))
        assert c["externality_s"] == pytest.approx(want)
    assert max(c["externality_s"] for c in d.components.values()) > 0
    with pytest.raises(ValueError, match="unknown probe"):
        probe("ext:social:x")


def test_cross_replays_and_the_goal_table(capsys: pytest.CaptureFixture[str]) -> None:
    """`--cross`: a policy's decisions on one shared cache prefill the floor (no fan-out),
    an oracle routing's decisions on the partitioned caches pay for their moves. `--goal`
    divides the seeds' means as printed."""
    argv = ["--trace", str(TRACE), "--sessions", "12", "--load", "0.6", "--seeds", "0,1"]
    argv += ["--policies", "tier_aware,session_hash,round_robin,oracle:tier_aware"]
    assert probes.main([*argv, "--cross", "--goal", "tier_aware"]) == 0
    out = capsys.readouterr().out
    summary = out.split("mean over seeds", 1)[1]

    def fig(name: str) -> tuple[float, float, float]:
        line = next(x for x in summary.splitlines() if x.startswith(name + " "))
        parts = line.split()
        return float(parts[2]), float(parts[4]), float(parts[6])

    assert fig("oracle:as:tier_aware")[2] == pytest.approx(1.0, abs=1e-3)
    assert fig("oracle:as:session_hash")[2] == pytest.approx(1.0, abs=1e-3)
    assert fig("partitioned:as:oracle:tier_aware")[2] > fig("oracle:tier_aware")[2] + 0.01
    goal = next(x for x in out.splitlines() if x.startswith("| 60% | exact |"))
    cells = [c.strip() for c in goal.strip("|").split("|")]
    mine, peers = fig("tier_aware"), {n: fig(n) for n in ("session_hash", "round_robin")}
    best = min(peers, key=lambda n: peers[n][0])
    assert cells[2] == best
    assert float(cells[3]) == pytest.approx(mine[0] / peers[best][0], abs=2e-3)
    assert float(cells[6]) == pytest.approx(mine[2], abs=2e-3)
    assert probes.main([*argv, "--goal", "nobody"]) == 2
    assert "not in the lineup" in capsys.readouterr().err
