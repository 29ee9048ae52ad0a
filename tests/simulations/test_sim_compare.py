"""`python -m simulations compare`: tier_aware against the best peer, and the condensed table."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from simulations import __main__ as cli
from simulations.compare import condensed, peer_ratios, read_rows
from simulations.report import write_csv
from simulations.summary import Row


def row(policy: str, mean: float, p99: float, scale: float = 2.0) -> Row:
    nan = math.nan
    return Row(policy, scale, 0.5, mean, nan, p99, 10, 1.01, nan, nan, nan, nan, 0, nan, nan,
               0.6)  # fmt: skip


ROWS = [
    row("tier_aware", 0.8, 2.0),
    row("prefix_affinity", 0.5, 1.0),  # the incumbent is not a peer
    row("smg_cache_aware:exact", 1.0, 3.0),
    row("smg_cache_aware:real", 1.6, 3.5),
    row("session_hash", 1.2, 2.5),
    row("oracle", 0.7, 1.9),
]


def test_peer_ratios_take_the_best_peer_of_each_knowledge_mode() -> None:
    exact, real = peer_ratios(ROWS)
    assert (exact.mode, exact.best_mean, exact.mean_ratio) == (
        "exact",
        "smg_cache_aware:exact",
        0.8,
    )
    assert exact.best_p99 == "session_hash" and exact.p99_ratio == pytest.approx(0.8)
    assert real.best_mean == "session_hash" and real.mean_ratio == pytest.approx(0.8 / 1.2)
    assert exact.oracle_ratio == pytest.approx(0.8 / 0.7)


def test_compare_reads_csvs_and_prints_what_moved(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    write_csv(ROWS, a)
    write_csv([row("tier_aware", 0.9, 2.0), *ROWS[1:]], b)
    assert [repr(r) for r in read_rows(a)] == [repr(r) for r in ROWS]  # NaN-safe
    assert cli.main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "| 60% | exact | 0.800 -> 0.900 |" in out
    assert cli.main(["compare", "--condensed", str(a)]) == 0
    assert "| tier_aware | 0.8 / 2 / 1.010 |" in capsys.readouterr().out
    assert "x2 (load 60%, util 50%)" in condensed(ROWS)
