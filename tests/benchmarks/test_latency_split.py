"""benchmarks/latency_split.py: every marker line it instruments exists exactly once in
today's source (a moved line must fail here, not silently measure something else), the
instrumented copy still compiles, and a perf-script timeline is split into steps."""

from __future__ import annotations

import py_compile
import shutil
from pathlib import Path

import pytest
from bench_module import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


L = load_benchmark("latency_split")


def test_every_marker_lands_once_and_the_copy_compiles(tmp_path: Path) -> None:
    files = {f for f, _line, _mark, _after in L.MARKS}
    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / f, tmp_path / f)
    L.instrument(tmp_path)
    placed = []
    for f in files:
        py_compile.compile(str(tmp_path / f), doraise=True)
        text = (tmp_path / f).read_text()
        placed += [int(x) for x in __import__("re").findall(r"umask\((\d+)\)", text)]
    assert sorted(placed) == sorted(m for _f, _l, m, _a in L.MARKS)
    # every stage the report names is bounded by markers that exist (or the syscalls)
    names = {f"m{m}" for _f, _l, m, _a in L.MARKS} | {"read", "write"}
    assert all(a in names and b in names for _side, a, b, _what in L.STAGES)


def test_a_moved_line_fails_the_run(tmp_path: Path) -> None:
    f, line, _mark, _after = L.MARKS[0]
    (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / f).write_text((ROOT / f).read_text().replace(line, line + "  # moved"))
    for g in {g for g, *_ in L.MARKS} - {f}:
        (tmp_path / g).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / g, tmp_path / g)
    with pytest.raises(SystemExit, match="0 lines are"):
        L.instrument(tmp_path)


def test_the_timeline_is_split_per_step_on_the_loop_thread() -> None:
    rows = []
    t = 100.0
    for _ in range(8):  # the loop thread: read, marker 32, write, 10 us apart
        for nr, arg in ((0, 0xF), (95, 32), (1, 0x10)):
            rows.append(f" 7 {t:.6f}: raw_syscalls:sys_enter: NR {nr} ({arg:x}, 0, 0)")
            t += 10e-6
    rows.append(f" 8 {t:.6f}: raw_syscalls:sys_enter: NR 0 (3, 0, 0)")  # another thread
    evs = L.events("\n".join(rows))
    assert [e for _t, e in evs[:3]] == ["read", "m32", "write"] and len(evs) == 24
    steps = L.split(evs)
    assert steps[("read", "m32")] and all(abs(x - 10.0) < 0.01 for x in steps[("read", "m32")])
