"""benchmarks/vcpu_pauses.py: which sample-less stretches count as the loop thread's
vCPU paused, on synthetic sample streams (perf itself is not needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.vcpu_pauses import absent_in

P = 0.0005  # 2 kHz


def _stream(t0: float, t1: float, skip: tuple[float, float] | None = None) -> list[float]:
    out, t = [], t0
    while t < t1:
        if skip is None or not skip[0] < t < skip[1]:
            out.append(round(t, 6))
        t += P
    return out


def test_a_gap_between_the_threads_own_samples_counts_less_one_period() -> None:
    ts = _stream(10.0, 10.1, skip=(10.04, 10.06))  # 20 ms with nothing on CPU 1
    got = absent_in({1: ts}, {1: set(ts)}, [(10.0, 10.1)], P)
    assert got[0] == pytest.approx(0.020 - P, abs=2 * P)


def test_a_gap_with_another_task_on_either_side_is_not_the_threads() -> None:
    ts = _stream(10.0, 10.1, skip=(10.04, 10.06))
    mine = {t for t in ts if t < 10.03}  # the thread left the CPU before the gap
    assert absent_in({1: ts}, {1: mine}, [(10.0, 10.1)], P) == [0.0]


def test_only_the_part_under_the_window_counts_and_short_gaps_are_sampling() -> None:
    ts = _stream(10.0, 10.1, skip=(10.04, 10.06))
    mine = {1: set(ts)}
    part = absent_in({1: ts}, mine, [(10.05, 10.09)], P)[0]
    assert part == pytest.approx(0.010 - P, abs=2 * P)
    assert absent_in({1: ts}, mine, [(10.07, 10.09)], P) == [0.0]
    even = _stream(10.0, 10.1)  # every period sampled: no pause
    assert absent_in({1: even}, {1: set(even)}, [(10.0, 10.1)], P) == [0.0]
