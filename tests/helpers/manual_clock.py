"""`ManualClock`: a clock a test sets by hand, for code that takes `clock=` (a callable
returning seconds). Set or advance `t`; nothing moves it otherwise.

Tests import this module by path (test dirs carry no `__init__.py`):

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
    from manual_clock import ManualClock
"""

from __future__ import annotations


class ManualClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
