"""Engram: hashed rows bit-exact against a Python big-integer oracle (int64 wraparound,
floor remainder), the FP8 gather exact, the gate within fp32/fp16 tolerance, and the
hash parameters (odd multipliers, distinct primes, cumulative offsets)."""

from __future__ import annotations

from collections.abc import Callable
from math import isqrt
from typing import Any

import pytest
import torch

from kernels import reference as R

TritonCall = Callable[..., Any]  # the conftest fixture: one op on the Triton path

# |got - want| <= atol + rtol * |want|; fp16: the output rounding (2^-10 relative) may
# differ by an ulp when the GPU fuses multiply-adds.
GATE_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 2e-3)}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    atol, rtol = GATE_TOL[dtype]
    return bool(((got.float() - want.float()).abs() <= atol + rtol * want.float().abs()).all())


def _wrap64(v: int) -> int:
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def _oracle(ids: list[int], mult: list[int], primes: list[list[int]], offsets: list[list[int]]) -> list[list[int]]:  # fmt: skip
    rows = []
    for t in range(len(ids) - 3):
        tok = [ids[t + 3 - j] for j in range(4)]
        mix = _wrap64(tok[0] * mult[0])
        row = []
        for n in range(3):
            mix = _wrap64(mix ^ _wrap64(tok[n + 1] * mult[n + 1]))
            row += [mix % p + o for p, o in zip(primes[n], offsets[n], strict=True)]  # floor mod
        rows.append(row)
    return rows


def test_hash_params() -> None:
    mult, primes, offsets = R.engram_hash_params(seed=5, prime_floor=1000)
    assert mult.shape == (4,) and bool((mult % 2 == 1).all())
    flat = primes.flatten().tolist()
    assert len(set(flat)) == 24 and all(R.is_prime(p) and p >= 1000 for p in flat)
    assert offsets.flatten().tolist() == [sum(flat[:i]) for i in range(24)]
    assert R.engram_table_rows(primes) == sum(flat)
    other = R.engram_hash_params(seed=6)
    assert not torch.equal(other[0], mult)
    # the primes (so the table size) depend on the floor and heads only, not on the seed
    assert torch.equal(other[1], primes) and torch.equal(other[2], offsets)


def test_hash_primes_consecutive_across_modules() -> None:
    """Module i's primes are the 24 primes following module i-1's: no prime is skipped or
    repeated, and a trial-division count agrees with the Miller-Rabin test."""
    floor = 1000
    first, second = (R.engram_primes(floor, 8, module=i).flatten().tolist() for i in (0, 1))
    top = second[-1]
    every = [n for n in range(floor, top + 1) if all(n % f for f in range(2, isqrt(n) + 1))]
    assert first + second == every
    assert R.engram_hash_params(3, floor, 8, module=1)[1].flatten().tolist() == second
    m0, m1 = R.engram_hash_params(3, floor, 8)[0], R.engram_hash_params(3, floor, 8, module=1)[0]
    assert not torch.equal(m0, m1) and bool((m1 % 2 == 1).all())
    with pytest.raises(ValueError, match="prime_floor"):
        R.engram_primes(1)


@pytest.mark.parametrize("t", [1, 37])
def test_rows_exact_with_wraparound(t: int, triton_call: TritonCall) -> None:
    mult, primes, offsets = R.engram_hash_params(seed=t)
    g = torch.Generator().manual_seed(t)
    ids = torch.randint(0, 130_000, (t + 3,), generator=g)
    ids[:3] = 0  # pad ids before the start
    want = _oracle(ids.tolist(), mult.tolist(), primes.tolist(), offsets.tolist())
    assert R.engram_rows(ids, mult, primes, offsets).tolist() == want
    assert triton_call("engram_rows", ids, mult, primes, offsets).tolist() == want
    # the multipliers are 62-bit: products really wrap
    assert any(abs(int(i) * int(mult[0])) >= 1 << 63 for i in ids[3:])


def test_gather_exact(triton_call: TritonCall) -> None:
    g = torch.Generator().manual_seed(9)
    table, exp = R.fp8_quantize(torch.randn(300, 64, generator=g) * 10)
    rows = torch.randint(0, 300, (5, 24), generator=g)
    want = R.engram_gather(table, exp, rows)
    assert torch.equal(want[:, 64:128], R.fp8_dequantize(table, exp)[rows[:, 1]])
    assert torch.equal(triton_call("engram_gather", table, exp, rows), want)
    with pytest.raises(IndexError):
        triton_call("engram_gather", table, exp, rows + 300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gate(dtype: torch.dtype, triton_call: TritonCall) -> None:
    g = torch.Generator().manual_seed(11)
    h = torch.randn(6, 3, 40, generator=g)
    key, value = torch.randn(6, 40, generator=g), torch.randn(6, 40, generator=g)
    h[0, 0] = -key[0]  # strongly negative dot
    h[1, 1] = 0.0  # zero copy: dot 0 -> gate sigmoid(0) = 0.5
    want = R.engram_gate(h.to(dtype), key.to(dtype), value.to(dtype))
    assert torch.allclose(want[1, 1].float(), 0.5 * value[1].to(dtype).float(), atol=1e-3)
    got = triton_call("engram_gate", h.to(dtype), key.to(dtype), value.to(dtype))
    assert got.dtype == dtype
    assert _close(got, want, dtype)


def test_gate_non_contiguous_residual(triton_call: TritonCall) -> None:
    g = torch.Generator().manual_seed(12)
    h = torch.randn(2, 5, 32, generator=g).transpose(0, 1)  # [T=5, C=2, dim] as a view
    key, value = torch.randn(5, 32, generator=g), torch.randn(5, 32, generator=g)
    got = triton_call("engram_gate", h, key, value)
    assert _close(got, R.engram_gate(h, key, value), torch.float32)
