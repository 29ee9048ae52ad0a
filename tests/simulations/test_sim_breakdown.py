"""`breakdown`: wait against service, moved later turns, the per-engine wait gap."""

from __future__ import annotations

import math

import pytest

from simulations.breakdown import breakdown
from simulations.sessions import ClosedLoop
from simulations.simulator import Outcome


def outcome() -> Outcome:
    # session 0: requests 0 -> 1 -> 2 (2 moves to engine 1); session 1: request 3 alone
    return Outcome(
        engine=[0, 0, 1, 1],
        arrival=[0.0, 1.0, 2.0, 3.0],
        ttft=[0.5, 0.3, 0.9, 0.2],
        wait=[0.4, 0.2, 0.1, 0.1],
        new_tokens=[100, 50, 700, 80],
        window=(0.5, 3.0),
    )


LOOP = ClosedLoop(parents=[0, 1, 1, 0], children=[[1], [2], [], []], think_s=[0.0] * 4)


def test_breakdown_splits_ttft_and_counts_moves_inside_the_window() -> None:
    b = breakdown(outcome(), LOOP, bin_s=10.0)
    assert b.requests == 3  # request 0 was sent before the window
    assert b.ttft_mean_s == pytest.approx((0.3 + 0.9 + 0.2) / 3)
    assert b.wait_mean_s == pytest.approx((0.2 + 0.1 + 0.1) / 3)
    assert b.service_mean_s == pytest.approx((0.1 + 0.8 + 0.1) / 3)
    assert (b.later_turns, b.moved) == (2, 1)
    assert b.moved_new_tokens_mean == 700
    assert b.moved_wait_mean_s == pytest.approx(0.1)
    # one 10 s bin: engine 0 waits 0.2, engine 1 (0.1 + 0.1) / 2
    assert b.wait_gap_s == pytest.approx(0.1)
    assert "moved 1 of 2 later turns" in b.line()


def test_open_loop_has_no_later_turns_and_single_engine_bins_no_gap() -> None:
    b = breakdown(outcome(), None, bin_s=1.0)
    assert (b.later_turns, b.moved) == (0, 0)
    assert math.isnan(b.moved_wait_mean_s)
    assert math.isnan(b.wait_gap_s)  # every 1 s bin holds one engine only
    with pytest.raises(ValueError):
        breakdown(outcome(), None, bin_s=0.0)
