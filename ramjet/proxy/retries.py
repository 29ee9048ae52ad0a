"""What is retried, and how much: retryable statuses, Retry-After, the retry budget.

An attempt answered 429, 502, 503 or 504 (or failed before its first body byte) may be
retried on another engine. Retries are bounded by Envoy's retry budget: concurrent
retries ≤ max(`retry.min_retries`, `retry.budget_ratio` × active requests), so a failing
fleet is not hit with a multiple of its load. A refused connection or a disconnect
(`FREE_RETRIES`) is retried even past the budget (it still counts in it), unless the
budget is zero, which turns retries off.
"""

from __future__ import annotations

RETRY_STATUSES = frozenset({429, 502, 503, 504})
FREE_RETRIES = frozenset({"connect", "disconnect"})
"""Attempt failures retried whatever the budget: the failed engine does none of the
request's work (it refused the connection, or dropped it before answering), so the
retry moves the work instead of adding to it; `retry.max_attempts` still bounds them."""


def parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # HTTP-date form: treat as unspecified


class RetryBudget:
    """Envoy's retry budget: concurrent retries ≤ max(min_retries, ratio × active)."""

    def __init__(self, ratio: float, min_retries: int) -> None:
        self.ratio = ratio
        self.min_retries = min_retries
        self.active = 0
        self.retrying = 0

    @property
    def enabled(self) -> bool:
        """False when the budget is zero (`min_retries` 0 and `budget_ratio` 0): no
        retries at all, not even `FREE_RETRIES`."""
        return self.min_retries > 0 or self.ratio > 0

    def has_room(self) -> bool:
        return self.retrying < max(self.min_retries, self.ratio * self.active)

    def try_acquire(self) -> bool:
        if self.has_room():
            self.retrying += 1
            return True
        return False

    def release(self) -> None:
        self.retrying -= 1
