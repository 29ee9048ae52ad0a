"""benchmarks/bench_all.py (`make bench`): every benchmark in benchmarks/ is in its list
with a quick mode its script accepts, and every one of them prints a `self-check:` line;
the summary reads `figure:` lines as the benchmarks print them."""

from __future__ import annotations

import re
from pathlib import Path

from bench_module import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
NOT_BENCHMARKS = {"bench_all", "loop_trace", "vcpu_pauses"}
"""`loop_trace.py` is the residency benchmarks' loop-turn tracer and `vcpu_pauses.py`
their `--perf` accounting of vCPU pauses: not benchmarks."""


B = load_benchmark("bench_all")


def test_every_benchmark_file_is_in_make_bench() -> None:
    files = {p.stem for p in BENCH.glob("*.py")} - NOT_BENCHMARKS
    listed = [b.name for b in B.BENCHMARKS]
    assert len(listed) == len(set(listed)), "a benchmark is listed twice"
    assert files - set(listed) == set(), "benchmarks that `make bench` never runs"
    assert set(listed) - files == set(), "listed benchmarks with no file"


def test_every_quick_flag_is_one_the_script_takes() -> None:
    for b in B.BENCHMARKS:
        src = (BENCH / f"{b.name}.py").read_text()
        for arg in b.quick:
            if arg.startswith("--"):
                assert f'"{arg}"' in src, f"{b.name}: {arg} is not one of its arguments"
        assert "self-check:" in src, f"{b.name} prints no self-check line"


def test_figure_lines_are_read_as_printed() -> None:
    lines = [
        "figure: prefix keys / parse+key 4 MB = 35.986 ms",
        "figure: fabric grid, TA over the oracle / miniswe 0.4 = 1.002 x",
        "figure: request path CPU / accounting: record + router metrics = 7.31 us",
        "not a figure: x / y = 1 ms",
    ]
    o = B.Outcome(B.BENCHMARKS[0], [], rc=0, lines=lines)
    groups = B.figures([o])
    assert groups == {
        "prefix keys": [("parse+key 4 MB", 35.986, "ms")],
        "fabric grid, TA over the oracle": [("miniswe 0.4", 1.002, "x")],
        "request path CPU": [("accounting: record + router metrics", 7.31, "us")],
    }
    assert re.match(B._FIGURE, "figure: a / b = nan ms") is None


def test_a_run_without_self_check_fails() -> None:
    o = B.Outcome(B.BENCHMARKS[0], [], rc=0, lines=["figure: a / b = 1 ms"])
    assert o.status == "FAIL (no self-check line)"
    o.lines.append("self-check: ok")
    assert o.status == "ok"
    assert B.Outcome(B.BENCHMARKS[0], [], rc=None).status == "TIMEOUT"
