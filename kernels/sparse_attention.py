"""Sparse MQA with a per-head sink over gathered window rows and FP4 global rows.

A program owns one query row ``t`` and ``BLOCK_H`` heads (all heads share the one KV
head, so a KV tile loaded once serves them all). It streams ``BLOCK_N`` entries at a
time, first the window rows (``win_kv``, already FP8-qdq floats), then the selected
global rows, which it dequantizes from FP4 in registers: the packed bytes of a row are
exactly its even (low nibble) and odd (high nibble) channels, so the head dim is kept as
two halves, ``q_even . k_even + q_odd . k_odd``, and the output is stored the same way.

Online softmax whose running max and denominator start at the sink (``m = sink_h``,
``l = exp(sink_h - m) = 1``): the sink enters the denominator only, and a row with no
valid entry ends with ``acc = 0``, i.e. outputs 0. Index -1 = empty (masked to -inf).
fp32 inputs use IEEE fp32 dots; fp16/bf16 inputs use tensor-core dots in that dtype with
fp32 accumulation (FP4 and FP8-qdq values are exact in both).
"""

import torch
import triton
import triton.language as tl

from kernels.numerics import device_fn, e2m1_decode, e4m3_decode

__all__ = ["sparse_attention"]


@device_fn
def _attend(q_e, q_o, k_e, k_o, valid, m_i, l_i, acc_e, acc_o, scale, IEEE: tl.constexpr):
    """One online-softmax step over a [BLOCK_N] tile of KV (k_e/k_o: [BLOCK_N, HALF])."""
    if IEEE:
        s = tl.dot(q_e, tl.trans(k_e), input_precision="ieee")
        s += tl.dot(q_o, tl.trans(k_o), input_precision="ieee")
    else:
        s = tl.dot(q_e, tl.trans(k_e)) + tl.dot(q_o, tl.trans(k_o))
    s = tl.where(valid[None, :], s * scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc_e = acc_e * alpha[:, None] + tl.dot(p, k_e, input_precision="ieee")
        acc_o = acc_o * alpha[:, None] + tl.dot(p, k_o, input_precision="ieee")
    else:
        pk = p.to(k_e.dtype)
        acc_e = acc_e * alpha[:, None] + tl.dot(pk, k_e)
        acc_o = acc_o * alpha[:, None] + tl.dot(pk, k_o)
    return m_new, l_i, acc_e, acc_o


@triton.jit
def _sparse_attention_kernel(
    q_ptr,  # [T, H, D]
    win_ptr,  # [Nw, D] float
    widx_ptr,  # [T, W] int32
    gp_ptr,  # [Ng, D//2] uint8
    gs_ptr,  # [Ng, D//16] uint8
    gidx_ptr,  # [T, K] int32
    sink_ptr,  # [H] fp32
    out_ptr,  # [T, H, D]
    H,
    D,
    W,
    K,
    scale,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HALF: tl.constexpr,  # power of two >= D // 2
    IEEE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    j = tl.arange(0, HALF)  # [HALF] channel pair: channels 2j and 2j+1
    hmask = h < H
    jmask = j < D // 2
    qmask = hmask[:, None] & jmask[None, :]
    q_off = (t * H + h[:, None]) * D + 2 * j[None, :]  # [BLOCK_H, HALF]
    q_e = tl.load(q_ptr + q_off, mask=qmask, other=0.0)
    q_o = tl.load(q_ptr + q_off + 1, mask=qmask, other=0.0)
    m_i = tl.load(sink_ptr + h, mask=hmask, other=0.0).to(tl.float32)  # [BLOCK_H]
    l_i = tl.full((BLOCK_H,), 1.0, tl.float32)
    acc_e = tl.zeros((BLOCK_H, HALF), dtype=tl.float32)
    acc_o = tl.zeros((BLOCK_H, HALF), dtype=tl.float32)
    offs = tl.arange(0, BLOCK_N)
    # window rows
    for n0 in range(0, W, BLOCK_N):
        n = n0 + offs
        idx = tl.load(widx_ptr + t * W + n, mask=n < W, other=-1)
        valid = idx >= 0
        kmask = valid[:, None] & jmask[None, :]
        row = tl.where(valid, idx, 0).to(tl.int64)[:, None] * D + 2 * j[None, :]
        k_e = tl.load(win_ptr + row, mask=kmask, other=0.0).to(q_e.dtype)
        k_o = tl.load(win_ptr + row + 1, mask=kmask, other=0.0).to(q_e.dtype)
        m_i, l_i, acc_e, acc_o = _attend(
            q_e, q_o, k_e, k_o, valid, m_i, l_i, acc_e, acc_o, scale, IEEE
        )
    # selected global rows, FP4 dequantized here
    for n0 in range(0, K, BLOCK_N):
        n = n0 + offs
        idx = tl.load(gidx_ptr + t * K + n, mask=n < K, other=-1)
        valid = idx >= 0
        kmask = valid[:, None] & jmask[None, :]
        row = tl.where(valid, idx, 0).to(tl.int64)[:, None]
        packed = tl.load(gp_ptr + row * (D // 2) + j[None, :], mask=kmask, other=0).to(tl.int32)
        sc = e4m3_decode(
            tl.load(gs_ptr + row * (D // 16) + j[None, :] // 8, mask=kmask, other=0).to(tl.int32)
        )  # channels 2j, 2j+1 share the scale of group 2j // 16 = j // 8
        k_e = (e2m1_decode(packed & 15) * sc).to(q_e.dtype)
        k_o = (e2m1_decode(packed >> 4) * sc).to(q_e.dtype)
        m_i, l_i, acc_e, acc_o = _attend(
            q_e, q_o, k_e, k_o, valid, m_i, l_i, acc_e, acc_o, scale, IEEE
        )
    o_e = acc_e / l_i[:, None]
    o_o = acc_o / l_i[:, None]
    tl.store(out_ptr + q_off, o_e.to(out_ptr.dtype.element_ty), mask=qmask)
    tl.store(out_ptr + q_off + 1, o_o.to(out_ptr.dtype.element_ty), mask=qmask)


def sparse_attention(
    q: torch.Tensor,  # [T, H, D]
    win_kv: torch.Tensor,  # [Nw, D] float
    win_idx: torch.Tensor,  # [T, W] int32
    glob_packed: torch.Tensor,  # [Ng, D//2] uint8
    glob_scale: torch.Tensor,  # [Ng, D//16] uint8
    glob_idx: torch.Tensor,  # [T, K] int32
    sink: torch.Tensor,  # [H] fp32
    scale: float,
) -> torch.Tensor:
    """-> [T, H, D] in q's dtype (see ``kernels.reference.sparse_attention``)."""
    t, h, d = q.shape
    if d % 16:
        raise ValueError(f"head dim {d} must be a multiple of 16")
    w, k = win_idx.shape[1], glob_idx.shape[1]
    if win_idx.shape[0] != t or glob_idx.shape[0] != t or sink.shape != (h,):
        raise ValueError("sparse_attention: shapes do not agree")
    if win_kv.shape[1] != d or glob_packed.shape[1] != d // 2 or glob_scale.shape[1] != d // 16:
        raise ValueError("sparse_attention: KV widths do not match the head dim")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if t == 0 or h == 0:
        return out
    ieee = q.dtype == torch.float32
    win = win_kv.contiguous() if win_kv.shape[0] else q.new_zeros(1, d)
    gp = (
        glob_packed.contiguous()
        if glob_packed.shape[0]
        else q.new_zeros(1, d // 2, dtype=torch.uint8)
    )
    gs = (
        glob_scale.contiguous()
        if glob_scale.shape[0]
        else q.new_zeros(1, d // 16, dtype=torch.uint8)
    )
    half = max(16, triton.next_power_of_2(d // 2))
    block_h = 16 if half >= 128 else max(16, min(64, triton.next_power_of_2(h)))
    block_n = 16 if half >= 128 else 64  # D=512: 16 rows keep it in 255 registers
    grid = (t, triton.cdiv(h, block_h))
    _sparse_attention_kernel[grid](
        q.contiguous(),
        win,
        win_idx.to(torch.int32).contiguous(),
        gp,
        gs,
        glob_idx.to(torch.int32).contiguous(),
        sink.float().contiguous(),
        out,
        h,
        d,
        w,
        k,
        float(scale),
        block_h,
        block_n,
        half,
        ieee,
        num_warps=4 if half <= 128 else 8,
    )
    return out
