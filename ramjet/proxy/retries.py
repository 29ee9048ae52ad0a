"""What is retried, and how much: retryable statuses, Retry-After, the retry budget.

An attempt answered 429, 502, 503 or 504 (or failed before its first body byte) may be
retried on another engine. Retries are bounded by Envoy's retry budget: concurrent
retries ≤ max(`retry.min_retries`, `retry.budget_ratio` × active requests), so a failing
fleet is not hit with a multiple of its load.
"""

from __future__ import annotations

RETRY_STATUSES = frozenset({429, 502, 503, 504})


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

    def has_room(self) -> bool:
        return self.retrying < max(self.min_retries, self.ratio * self.active)

    def try_acquire(self) -> bool:
        if self.has_room():
            self.retrying += 1
            return True
        return False

    def release(self) -> None:
        self.retrying -= 1
