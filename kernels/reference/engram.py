"""Engram in plain torch: hashed n-gram rows, the FP8 table gather, the gate, and the hash
parameters (multipliers, primes, row offsets). Formats: ``kernels.reference.formats``."""

from __future__ import annotations

import random

import torch

from kernels.reference.checks import check_index
from kernels.reference.formats import fp8_dequantize

ENGRAM_ORDERS = 3  # 2-, 3- and 4-grams
ENGRAM_HEADS = 8
ENGRAM_CONTEXT = 3  # left-context ids in front of the sequence passed to engram_rows


# --------------------------------------------------------------------------------------
# Engram: hashed n-gram rows, FP8 table gather, gate


def engram_rows(
    ids: torch.Tensor,  # [T+3] int64: 3 left-context ids (pad before the start), then tokens
    mult: torch.Tensor,  # [4] int64 odd multipliers
    primes: torch.Tensor,  # [3, 8] int64 (n-gram order 2..4, head)
    offsets: torch.Tensor,  # [3, 8] int64 row offsets
) -> torch.Tensor:
    """rows [T, 24] int64, column ``(n-2)*8 + h``.

    Integer semantics: products and XORs wrap in two's-complement int64;
    ``row = mix_n mod prime + offset`` with the non-negative (floor) remainder.
    """
    ids = ids.long()
    t = ids.shape[0] - ENGRAM_CONTEXT
    if t < 0:
        raise ValueError("ids must hold the 3 left-context ids")
    mult, primes, offsets = mult.long(), primes.long(), offsets.long()
    tok = [ids[ENGRAM_CONTEXT - j : ENGRAM_CONTEXT - j + t] for j in range(4)]  # tok[t-j]
    mix = tok[0] * mult[0]
    cols = []
    for n in range(ENGRAM_ORDERS):
        mix = mix ^ (tok[n + 1] * mult[n + 1])
        cols.append(torch.remainder(mix[:, None], primes[n][None, :]) + offsets[n][None, :])
    return torch.cat(cols, 1)


def engram_gather(
    table: torch.Tensor,  # [R, Dh] uint8 E4M3 bits
    exp: torch.Tensor,  # [R, Dh//32] int8
    rows: torch.Tensor,  # [T, 24] int64
) -> torch.Tensor:
    """-> [T, 24*Dh] fp32: the dequantized rows, concatenated in column order."""
    r = rows.long()
    check_index(r, table.shape[0], "Engram row")
    return fp8_dequantize(table[r], exp[r]).flatten(1)


def rms_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, fp32, no weight."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def engram_gate(
    h: torch.Tensor,  # [T, C, dim] residual copies
    key: torch.Tensor,  # [T, dim]
    value: torch.Tensor,  # [T, dim]
    eps: float = 1e-6,
) -> torch.Tensor:
    """h + gate * value per copy, gate = sigmoid(sign(d) * sqrt(max(|d|, 1e-6))) with
    d = <rms_normalize(h), rms_normalize(key)> * dim^-0.5. -> [T, C, dim] in h's dtype."""
    dim = h.shape[-1]
    d = (rms_normalize(h, eps) * rms_normalize(key, eps)[:, None, :]).sum(-1) * dim**-0.5
    gate = torch.sigmoid(torch.sign(d) * torch.sqrt(d.abs().clamp(min=1e-6)))  # [T, C]
    return (h.float() + gate[..., None] * value.float()[:, None, :]).to(h.dtype)


# --------------------------------------------------------------------------------------
# Engram hash parameters


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (exact for n < 3.3e24)."""
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


def engram_primes(prime_floor: int, heads: int = ENGRAM_HEADS, module: int = 0) -> torch.Tensor:
    """[3, heads] int64, (order, head) order: Engram module ``module``'s primes, the
    ``3*heads`` consecutive primes that follow the ``module * 3*heads`` first primes
    ``>= prime_floor``. Distinct within and across modules, and a function of these numbers
    alone, so the table size is known from a config without any weights."""
    if prime_floor < 2 or heads < 1 or module < 0:
        raise ValueError(
            f"need prime_floor >= 2, heads >= 1, module >= 0; got {prime_floor}, {heads}, {module}"
        )
    per = ENGRAM_ORDERS * heads
    found: list[int] = []
    skip, n = module * per, prime_floor
    while len(found) < per:
        if is_prime(n):
            if skip:
                skip -= 1
            else:
                found.append(n)
        n += 1
    return torch.tensor(found, dtype=torch.int64).view(ENGRAM_ORDERS, heads)


def engram_hash_params(
    seed: int, prime_floor: int = 1000, heads: int = ENGRAM_HEADS, module: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (mult [4] int64 odd, primes [3, heads] int64 distinct, offsets [3, heads] int64).

    Multipliers are odd 63-bit values from ``random.Random(seed)`` (module ``i`` takes
    draws ``4i .. 4i+3``; products wrap in int64). Primes: ``engram_primes(prime_floor,
    heads, module)``, independent of the seed; offsets are their exclusive cumulative sum,
    so the module's table has ``engram_table_rows(primes)`` rows.
    """
    primes = engram_primes(prime_floor, heads, module)
    rng = random.Random(seed)
    draws = [rng.getrandbits(62) | 1 for _ in range(4 * (module + 1))]
    flat = primes.flatten()
    offsets = torch.cumsum(flat, 0) - flat
    return torch.tensor(draws[-4:], dtype=torch.int64), primes, offsets.view_as(primes)


def engram_table_rows(primes: torch.Tensor) -> int:
    """Rows of the concatenated Engram table for these primes."""
    return int(primes.sum().item())
