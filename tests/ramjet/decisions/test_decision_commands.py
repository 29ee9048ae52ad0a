"""`ramjet report` and `ramjet explain` over a decision log written by the real writer."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_accounting import record

from ramjet.cli import main
from ramjet.decisions.log import DecisionLog, decision_entry, parse_realized
from ramjet.decisions.summary import percentile, summarize
from ramjet.policy.base import Decision


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
