"""`ramjet report` and `ramjet explain` over a decision log written by the real writer."""

from __future__ import annotations

from pathlib import Path

import pytest
from policy_fakes import engine, request
from test_accounting import record

from ramjet.cli import main
from ramjet.decisions.log import DecisionLog, decision_entry, parse_realized
from ramjet.decisions.summary import batched_with_later, percentile, summarize
from ramjet.policy.base import Decision, FleetStats, KeyedQueue
from ramjet.policy.priority_key import hint_key_s
from ramjet.policy.profile import CurvePoint, EngineProfile
from ramjet.policy.tier_aware import TierAware, TierAwareParams
from ramjet.types import EngineId


def write_log(path: Path, n: int = 10) -> None:
    lg = DecisionLog(path)
    for i in range(n):
        r = record(inc="e0", cand="e1" if i % 2 else "e0", ttft=0.2 + 0.01 * i)
        object.__setattr__(r, "request_id", f"r{i}")
        object.__setattr__(r, "time_unix", 1_700_000_000.0 + 1800.0 * i)  # 5 hours
        if i == 3:
            notes = (
                "default_profile:e0",
                "degraded:e1",
                "estimate_profile:e0",
                "estimate_profile:e1",
                "externality_off",
            )
            cand = r.candidate
            assert cand is not None
            object.__setattr__(
                r, "candidate", Decision(cand.engine, cand.policy, cand.components, notes)
            )
        lg.submit(r, parse_realized(r.response_tail))
    lg.close()


def test_report_prints_hours_and_writes_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "d.jsonl"
    write_log(log)
    png = tmp_path / "ttft.png"
    assert main(["report", str(log), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["hour", "requests", "agree_%"]
    assert sum(1 for line in lines if line.startswith("2023-11-1")) == 5
    all_row = next(line for line in lines if line.startswith("all")).split()
    assert all_row[1] == "10" and float(all_row[2]) == 50.0  # half the picks agree
    assert png.stat().st_size > 1000 and "10 points" in out


def test_report_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path / "missing.jsonl")]) == 2
    empty = tmp_path / "e.jsonl"
    empty.write_text("not json\n")
    assert main(["report", str(empty), "--no-plot"]) == 1


def test_explain_by_id_and_last(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "d.jsonl"
    write_log(log)
    assert main(["explain", str(log), "r3"]) == 0
    out = capsys.readouterr().out
    assert "request r3" in out and "mode observe" in out
    assert "e1 *" in out  # least cost marked (e1 predicted cheaper)
    assert "e0: has reported no profile" in out and "e1: view degraded" in out
    assert "externality term is zero" in out
    for e in ("e0", "e1"):  # both priced with the hard-coded estimate, each said so
        assert f"{e}: priced with the built-in DeepSeek-V4.1-Flash TP4 ESTIMATE" in out
    assert "TTFT predicted - realized = +0.17 s" in out  # 0.4 - 0.23 on e0
    assert "hbm_tokens 700" in out
    assert main(["explain", str(log), "--last", "2"]) == 0
    out = capsys.readouterr().out
    assert "request r8" in out and "request r9" in out and "request r7" not in out
    assert main(["explain", str(log), "nope"]) == 1
    assert main(["explain", str(log)]) == 2
    assert main(["explain", str(log), "r1", "--last", "1"]) == 2


def test_summary_percentiles_and_gain() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    e = decision_entry(record(inc="e0", cand="e1"), None)
    groups = summarize([e, e])
    assert groups[-1].label == "all" and groups[-1].gains == pytest.approx([0.3, 0.3])


def test_explain_shows_the_jump_charge_for_keyed_engines_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a serves by the priority key and holds three waiting prompts with higher keys than
    # the turn's (charged: the turn would overtake them); b is in no keyed pool
    profile = EngineProfile(
        prefill_curve=[CurvePoint(context_tokens=0, seconds_per_token=1e-4)],
        replay_floor_s=0.02,
        global_kv_bytes_per_token=1000,
    )
    views = [engine("a", hbm=2048, queued=9_000, profile=profile), engine("b", profile=profile)]
    theirs = hint_key_s(0.3, 0.05, 99.9, 20.0)
    queue = KeyedQueue(0.05, 20.0, True, ((theirs, 3_000, False),) * 3, True)
    policy = TierAware(TierAwareParams(default_profile=profile))
    picked = policy.pick(
        request(4096), views, FleetStats(now_s=100.0, keyed={EngineId("a"): queue})
    )
    jump = picked.components[EngineId("a")]["jump_s"]
    assert jump > 0 and "jump_s" not in picked.components[EngineId("b")]
    log = tmp_path / "d.jsonl"
    lg = DecisionLog(log)
    r = record(inc="a", cand="a", engine="a")
    object.__setattr__(r, "request_id", "rj")
    object.__setattr__(r, "candidate", picked)
    lg.submit(r, parse_realized(r.response_tail))
    lg.close()
    assert main(["explain", str(log), "rj"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:1] == ["engine"])
    cols = lines[head].split()
    assert cols[cols.index("extern_s") + 1] == "jump_s"  # beside the externality it is in
    rows = {line.split()[0]: line.split() for line in lines[head + 2 : head + 4]}
    assert set(rows) == {"a", "b"}
    a_cells = [c for c in rows["a"] if c != "*"]
    b_cells = [c for c in rows["b"] if c != "*"]
    at = cols.index("jump_s")
    assert float(a_cells[at]) == pytest.approx(jump, rel=1e-3)
    assert float(a_cells[cols.index("extern_s")]) >= float(a_cells[at])  # part of it
    assert b_cells[at] == "-"  # no keyed pool: no jump charge, shown absent


def test_a_request_is_batched_only_with_a_later_arrival_in_its_own_engine_step() -> None:
    flags = batched_with_later(
        [
            ("a", 0.000, 0.200),  # first tokens at 0.200: r1 arrived after it, same step
            ("a", 0.010, 0.1905),  # the later arrival itself: nothing came after it
            ("b", 0.020, 0.180),  # same instant, other engine: not a batchmate of r0
            ("a", 0.300, 0.200),  # alone
            ("a", 0.310, 0.196),  # 6 ms after r3's first token: the next step
            (None, 0.0, 0.2),  # no engine answered
        ]
    )
    assert flags == [True, False, False, False, False, False]


def test_report_splits_the_error_by_later_batchmates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "d.jsonl"
    lg = DecisionLog(log)
    for i, (sent, ttft) in enumerate([(0.0, 0.30), (0.02, 0.28), (1.0, 0.2), (2.0, 0.2)]):
        r = record(inc="e0", cand="e0", ttft=ttft)
        object.__setattr__(r, "request_id", f"r{i}")
        object.__setattr__(r, "time_unix", 1_700_000_000.0 + sent)
        lg.submit(r, parse_realized(r.response_tail))
    lg.close()
    assert main(["report", str(log), "--no-plot", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    rows = {}
    for label in ("alone or last in its step", "batched with a later arrival"):
        line = next(x for x in out.splitlines() if x.startswith(label))
        rows[label] = line[len(label) :].split()[:2]  # count, share
    assert rows["alone or last in its step"] == ["3", "0.75"]
    assert rows["batched with a later arrival"] == ["1", "0.25"]
