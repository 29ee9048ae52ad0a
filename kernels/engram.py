"""Engram kernels: n-gram hash rows, FP8 table gather with dequantization, and the gate.

* ``engram_rows``: ``mix_2 = tok[t]*m0 ^ tok[t-1]*m1``, ``mix_n = mix_{n-1} ^ tok[t-n+1]*m_{n-1}``
  in wrapping two's-complement int64; ``row = (mix_n mod p) + offset`` with the
  non-negative remainder (Triton's ``%`` truncates, so a negative remainder gets ``+p``).
* ``engram_gather``: one program per position gathers its 24 rows (``[rows, Dh]`` tile),
  decodes E4M3 and applies the power-of-two exponent of each 32-value block.
* ``engram_gate``: one program per position; per residual copy c,
  ``d = <rms(h_c), rms(key)> * dim^-0.5``, ``gate = sigmoid(sign(d) sqrt(max(|d|, 1e-6)))``,
  ``h_c + gate * value``.
"""

import torch
import triton
import triton.language as tl

from kernels.numerics import e4m3_decode, pow2
from kernels.reference.checks import check_index
from kernels.reference.engram import ENGRAM_CONTEXT, ENGRAM_ORDERS

__all__ = ["engram_gate", "engram_gather", "engram_rows"]


@triton.jit
def _rows_kernel(
    ids_ptr,  # [T+3] int64
    mult_ptr,  # [4] int64
    primes_ptr,  # [3, NH] int64
    offsets_ptr,  # [3, NH] int64
    out_ptr,  # [T, 3*NH] int64
    T,
    NH,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    hh = tl.arange(0, BLOCK_H)
    tmask = t < T
    hmask = hh < NH
    mult = tl.load(mult_ptr + tl.arange(0, 4))  # [4]
    mix = tl.zeros((BLOCK_T,), dtype=tl.int64)
    for j in tl.static_range(4):
        tok = tl.load(ids_ptr + t + (3 - j), mask=tmask, other=0)  # tok[t - j]
        mj = tl.sum(tl.where(tl.arange(0, 4) == j, mult, 0), axis=0)
        mix = mix ^ (tok * mj)  # wraps in int64
        if j >= 1:
            n = j - 1  # n-gram order n + 2
            p = tl.load(primes_ptr + n * NH + hh, mask=hmask, other=1)
            off = tl.load(offsets_ptr + n * NH + hh, mask=hmask, other=0)
            r = mix[:, None] % p[None, :]
            r = tl.where(r < 0, r + p[None, :], r)
            tl.store(
                out_ptr + t[:, None].to(tl.int64) * (3 * NH) + n * NH + hh[None, :],
                r + off[None, :],
                mask=tmask[:, None] & hmask[None, :],
            )


@triton.jit
def _gather_kernel(
    table_ptr,  # [R, Dh] uint8 E4M3
    exp_ptr,  # [R, Dh//32] int8
    rows_ptr,  # [T, NR] int64
    out_ptr,  # [T, NR*Dh] fp32
    NR,
    DH,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    rmask = r < NR
    mask = rmask[:, None] & (d < DH)[None, :]
    row = tl.load(rows_ptr + t * NR + r, mask=rmask, other=0)  # [BLOCK_R] int64
    c = tl.load(table_ptr + row[:, None] * DH + d[None, :], mask=mask, other=0).to(tl.int32)
    e = tl.load(exp_ptr + row[:, None] * (DH // 32) + d[None, :] // 32, mask=mask, other=0)
    v = e4m3_decode(c) * pow2(e.to(tl.int32))
    tl.store(out_ptr + t * NR * DH + r[:, None] * DH + d[None, :], v, mask=mask)


@triton.jit
def _gate_kernel(
    h_ptr,  # [T, C, dim]
    key_ptr,  # [T, dim]
    value_ptr,  # [T, dim]
    out_ptr,  # [T, C, dim]
    C,
    DIM,
    eps,
    inv_sqrt_dim,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < DIM
    key = tl.load(key_ptr + t * DIM + d, mask=dmask, other=0.0).to(tl.float32)
    val = tl.load(value_ptr + t * DIM + d, mask=dmask, other=0.0).to(tl.float32)
    kn = key * tl.rsqrt(tl.sum(key * key, axis=0) / DIM + eps)
    for c in range(C):
        off = (t * C + c) * DIM + d
        h = tl.load(h_ptr + off, mask=dmask, other=0.0).to(tl.float32)
        hn = h * tl.rsqrt(tl.sum(h * h, axis=0) / DIM + eps)
        dot = tl.sum(hn * kn, axis=0) * inv_sqrt_dim
        mag = tl.sqrt(tl.maximum(tl.abs(dot), 1e-6))
        z = tl.where(dot > 0, mag, tl.where(dot < 0, -mag, 0.0))
        gate = 1.0 / (1.0 + tl.exp(-z))
        tl.store(out_ptr + off, (h + gate * val).to(out_ptr.dtype.element_ty), mask=dmask)


def engram_rows(
    ids: torch.Tensor,  # [T+3] int64
    mult: torch.Tensor,  # [4] int64
    primes: torch.Tensor,  # [3, NH] int64
    offsets: torch.Tensor,  # [3, NH] int64
) -> torch.Tensor:
    """-> rows [T, 3*NH] int64 (see ``kernels.reference.engram_rows``)."""
    t = ids.shape[0] - ENGRAM_CONTEXT
    if t < 0:
        raise ValueError("ids must hold the 3 left-context ids")
    nh = primes.shape[1]
    if mult.shape != (4,) or primes.shape != (ENGRAM_ORDERS, nh) or offsets.shape != primes.shape:
        raise ValueError("engram_rows: mult [4], primes and offsets [3, heads]")
    if bool((primes <= 0).any()):
        raise ValueError("engram_rows: primes must be positive")
    out = torch.empty(t, ENGRAM_ORDERS * nh, dtype=torch.int64, device=ids.device)
    if t == 0:
        return out
    block_t = 128
    _rows_kernel[(triton.cdiv(t, block_t),)](
        ids.long().contiguous(),
        mult.long().contiguous(),
        primes.long().contiguous(),
        offsets.long().contiguous(),
        out,
        t,
        nh,
        block_t,
        triton.next_power_of_2(nh),
    )
    return out


def engram_gather(
    table: torch.Tensor,  # [R, Dh] uint8
    exp: torch.Tensor,  # [R, Dh//32] int8
    rows: torch.Tensor,  # [T, NR] int64
) -> torch.Tensor:
    """-> [T, NR*Dh] fp32 (see ``kernels.reference.engram_gather``)."""
    r, dh = table.shape
    if dh % 32 or exp.shape != (r, dh // 32):
        raise ValueError("engram_gather: table [R, Dh] with Dh % 32 == 0, exp [R, Dh//32]")
    t, nr = rows.shape
    out = torch.empty(t, nr * dh, dtype=torch.float32, device=table.device)
    if t == 0 or nr == 0:
        return out
    rl = rows.long().contiguous()
    check_index(rl, r, "Engram row")
    _gather_kernel[(t,)](
        table.contiguous(),
        exp.contiguous(),
        rl,
        out,
        nr,
        dh,
        triton.next_power_of_2(nr),
        triton.next_power_of_2(dh),
        num_warps=8 if nr * dh >= 4096 else 4,
    )
    return out


def engram_gate(
    h: torch.Tensor,  # [T, C, dim]
    key: torch.Tensor,  # [T, dim]
    value: torch.Tensor,  # [T, dim]
    eps: float = 1e-6,
) -> torch.Tensor:
    """-> [T, C, dim] in h's dtype (see ``kernels.reference.engram_gate``)."""
    t, c, dim = h.shape
    if key.shape != (t, dim) or value.shape != (t, dim):
        raise ValueError("engram_gate: h [T, C, dim], key and value [T, dim]")
    out = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    if t == 0 or c == 0:
        return out
    block_d = triton.next_power_of_2(dim)
    _gate_kernel[(t,)](
        h.contiguous(),
        key.contiguous(),
        value.contiguous(),
        out,
        c,
        dim,
        eps,
        dim**-0.5,
        block_d,
        num_warps=4 if block_d <= 1024 else 8,
    )
    return out
