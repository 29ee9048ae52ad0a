"""`tune_gc` freezes the start-up heap and raises the young threshold (restored after)."""

from __future__ import annotations

import gc

from ramjet.runtime.gc import tune_gc


def test_tune_gc_freezes_and_raises_gen0() -> None:
    before = gc.get_threshold()
    try:
        tune_gc(12_345)
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (12_345, before[1], before[2])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
