"""Engram's primes: a distinct prime per (engram layer, n-gram size, head), never repeated,
taken in order as consecutive primes above `engram_prime_base`."""

from __future__ import annotations

from .config import ModelConfig


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = pow(x, 2, n)
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(cfg: ModelConfig) -> list[list[int]]:
    """Per engram layer, 3 * heads primes ordered (n-gram size 2..4, head)."""
    per = 3 * cfg.engram_heads
    out: list[list[int]] = []
    n = cfg.engram_prime_base
    for _ in cfg.engram_layers:
        layer: list[int] = []
        while len(layer) < per:
            n += 1
            if is_prime(n):
                layer.append(n)
        out.append(layer)
    return out
