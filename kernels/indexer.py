"""CSA2 indexer kernels: ReLU-weighted multi-head scores, candidate blocks, top-k.

* ``indexer_scores``: a program owns a ``[BLOCK_T, BLOCK_S]`` tile of scores and loops
  over heads: ``acc += w[:, h] * relu(q[:, h] @ k^T)`` with ``tl.dot`` (IEEE fp32 for fp32
  inputs; fp16/bf16 inputs use the tensor cores with fp32 accumulation, which is exact
  for FP4-dequantized operands). Positions ``s >= (q_pos+1)//m`` get -inf.
* Selection (``candidate_blocks`` and ``indexer_topk``): one program per query row. The
  k-th largest key is found by bisection over the order-preserving int32 image of the
  fp32 scores (32 counting passes over the row), then one pass keeps the keys above it
  and the lowest-index ties, and compacts them in position order with a prefix sum. This
  reproduces ``kernels.reference`` exactly (ties: lower index) for any row length.
"""

import os

import torch
import triton
import triton.language as tl

from kernels.numerics import device_fn
from kernels.reference.csa2 import check_topk_args

__all__ = ["candidate_blocks", "indexer_scores", "indexer_topk"]

SELECT_BLOCK = 1024  # row chunk per selection pass


@triton.jit
def _scores_kernel(
    q_ptr,  # [T, H, Di]
    w_ptr,  # [T, H]
    k_ptr,  # [S, Di]
    qpos_ptr,  # [T] int64
    out_ptr,  # [T, S] fp32
    T,
    S,
    H,
    DI,
    M,
    BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S]
    d = tl.arange(0, BLOCK_D)
    tmask = t < T
    smask = s < S
    dmask = d < DI
    k = tl.load(
        k_ptr + s[:, None].to(tl.int64) * DI + d[None, :],
        mask=smask[:, None] & dmask[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    acc = tl.zeros((BLOCK_T, BLOCK_S), dtype=tl.float32)
    for h in range(H):
        q = tl.load(
            q_ptr + (t[:, None].to(tl.int64) * H + h) * DI + d[None, :],
            mask=tmask[:, None] & dmask[None, :],
            other=0.0,
        )  # [BLOCK_T, BLOCK_D]
        wh = tl.load(w_ptr + t.to(tl.int64) * H + h, mask=tmask, other=0.0).to(tl.float32)
        if IEEE:  # noqa: SIM108  (constexpr branch)
            dot = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            dot = tl.dot(q, tl.trans(k))
        acc += wh[:, None] * tl.maximum(dot, 0.0)
    vis = (tl.load(qpos_ptr + t, mask=tmask, other=0) + 1) // M  # [BLOCK_T]
    acc = tl.where(s[None, :].to(tl.int64) >= vis[:, None], float("-inf"), acc)
    tl.store(
        out_ptr + t[:, None].to(tl.int64) * S + s[None, :],
        acc,
        mask=tmask[:, None] & smask[None, :],
    )


@triton.jit
def _block_max_kernel(
    scores_ptr,  # [T, S] fp32
    qpos_ptr,  # [T] int64
    out_ptr,  # [T, NB] fp32
    S,
    NB,
    M,
    BLOCK: tl.constexpr,
    BLOCK_NB: tl.constexpr,
):
    t = tl.program_id(0)
    b = tl.program_id(1) * BLOCK_NB + tl.arange(0, BLOCK_NB)  # [BLOCK_NB]
    pos = b[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # [BLOCK_NB, BLOCK]
    vis = tl.minimum((tl.load(qpos_ptr + t) + 1) // M, S)
    x = tl.load(scores_ptr + t.to(tl.int64) * S + pos, mask=pos < vis, other=float("-inf"))
    tl.store(out_ptr + t.to(tl.int64) * NB + b, tl.max(x, axis=1), mask=b < NB)


@device_fn
def _order_key(x):
    """int64 key ordered like fp32 x, -0 folded onto +0."""
    b = x.to(tl.int32, bitcast=True)
    b = tl.where(b == -2147483648, 0, b)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b).to(tl.int64)


@device_fn
def _eligible(
    pos,  # [1, BLOCK_N]
    t,  # [BLOCK_T, 1] int64
    tmask,  # [BLOCK_T, 1]
    limit,  # [BLOCK_T, 1]
    newest,  # [BLOCK_T, 1]
    cand_ptr,
    NBC,
    BLOCK: tl.constexpr,
    MODE_BLOCKS: tl.constexpr,
    HAS_CAND: tl.constexpr,
):
    ok = tmask & (pos < limit)  # [BLOCK_T, BLOCK_N]
    if MODE_BLOCKS:
        ok = ok & (pos != newest)
    if HAS_CAND:
        c = tl.load(cand_ptr + t * NBC + pos // BLOCK, mask=ok, other=0)
        ok = ok & (c != 0)
    return ok


@triton.jit
def _select_kernel(
    key_ptr,  # [T, N] fp32: scores (top-k) or block maxima (candidate blocks)
    qpos_ptr,  # [T] int64
    cand_ptr,  # [T, NBC] uint8 candidate mask (HAS_CAND)
    out_ptr,  # [T, K] int32 positions (top-k) or [T, N] uint8 mask (candidate blocks)
    T,
    N,
    S,
    M,
    K,
    NBC,
    BLOCK: tl.constexpr,
    MODE_BLOCKS: tl.constexpr,
    HAS_CAND: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    tmask = (rows < T)[:, None]  # [BLOCK_T, 1]
    t = rows.to(tl.int64)[:, None]
    qpos = tl.load(qpos_ptr + t, mask=tmask, other=-1)
    vis = tl.minimum((qpos + 1) // M, S)  # [BLOCK_T, 1] int64
    if MODE_BLOCKS:
        limit = (vis + BLOCK - 1) // BLOCK
        newest = tl.where(vis > 0, (vis - 1) // BLOCK, -1)
    else:
        limit = vis
        newest = vis * 0 - 1
    offs = tl.arange(0, BLOCK_N)[None, :]  # [1, BLOCK_N]
    row = key_ptr + t * N
    # how many to pick
    n_elig = tl.zeros((BLOCK_T,), dtype=tl.int32)
    for start in range(0, N, BLOCK_N):
        pos = start + offs
        ok = _eligible(pos, t, tmask, limit, newest, cand_ptr, NBC, BLOCK, MODE_BLOCKS, HAS_CAND)
        n_elig += tl.sum(ok.to(tl.int32), axis=1)
    k = tl.minimum(n_elig, K)
    # bisection: the largest threshold v with count(key >= v) >= k, per row
    lo = tl.zeros((BLOCK_T,), dtype=tl.int64) - 2147483648
    hi = tl.zeros((BLOCK_T,), dtype=tl.int64) + 2147483647
    for _ in range(32):
        mid = (lo + hi + 1) // 2
        cnt = tl.zeros((BLOCK_T,), dtype=tl.int32)
        for start in range(0, N, BLOCK_N):
            pos = start + offs
            ok = _eligible(
                pos, t, tmask, limit, newest, cand_ptr, NBC, BLOCK, MODE_BLOCKS, HAS_CAND
            )
            key = _order_key(tl.load(row + pos, mask=ok, other=0.0))
            cnt += tl.sum((ok & (key >= mid[:, None])).to(tl.int32), axis=1)
        lo = tl.where(cnt >= k, mid, lo)
        hi = tl.where(cnt >= k, hi, mid - 1)
    thr = lo[:, None]
    n_gt = tl.zeros((BLOCK_T,), dtype=tl.int32)
    for start in range(0, N, BLOCK_N):
        pos = start + offs
        ok = _eligible(pos, t, tmask, limit, newest, cand_ptr, NBC, BLOCK, MODE_BLOCKS, HAS_CAND)
        key = _order_key(tl.load(row + pos, mask=ok, other=0.0))
        n_gt += tl.sum((ok & (key > thr)).to(tl.int32), axis=1)
    need = (k - n_gt)[:, None]  # ties at the threshold to take, lowest positions first
    ties_before = tl.zeros((BLOCK_T, 1), dtype=tl.int32)
    taken_before = tl.zeros((BLOCK_T, 1), dtype=tl.int32)
    for start in range(0, N, BLOCK_N):
        pos = start + offs
        ok = _eligible(pos, t, tmask, limit, newest, cand_ptr, NBC, BLOCK, MODE_BLOCKS, HAS_CAND)
        key = _order_key(tl.load(row + pos, mask=ok, other=0.0))
        tie = (ok & (key == thr)).to(tl.int32)
        tie_rank = ties_before + tl.cumsum(tie, axis=1) - tie
        sel = ok & ((key > thr) | ((tie != 0) & (tie_rank < need)))
        ties_before += tl.sum(tie, axis=1)[:, None]
        if MODE_BLOCKS:
            keep = sel | (pos == newest)
            tl.store(out_ptr + t * N + pos, keep.to(tl.uint8), mask=tmask & (pos < N))
        else:
            sel_i = sel.to(tl.int32)
            slot = taken_before + tl.cumsum(sel_i, axis=1) - sel_i
            tl.store(out_ptr + t * K + slot, pos.to(tl.int32), mask=sel)
            taken_before += tl.sum(sel_i, axis=1)[:, None]
    if not MODE_BLOCKS:
        for start in range(0, K, BLOCK_N):
            slot = start + offs
            pad = tmask & (slot >= k[:, None]) & (slot < K)
            tl.store(out_ptr + t * K + slot, slot * 0 - 1, mask=pad)


def _select_rows() -> int:
    """Rows per selection program: many under the interpreter (its cost is per op, not
    per element), one on a GPU (rows are long; one row per program fills the machine)."""
    return 16 if os.environ.get("TRITON_INTERPRET", "0") == "1" else 1


def _check_m(m: int) -> None:
    if m < 1:
        raise ValueError(f"compression ratio m must be >= 1, got {m}")


def indexer_scores(
    q: torch.Tensor,  # [T, H, Di]
    w: torch.Tensor,  # [T, H]
    k: torch.Tensor,  # [S, Di]
    q_pos: torch.Tensor,  # [T] int64
    m: int,
) -> torch.Tensor:
    """-> scores [T, S] fp32 (see ``kernels.reference.indexer_scores``)."""
    _check_m(m)
    t, h, di = q.shape
    s = k.shape[0]
    if w.shape != (t, h) or k.shape[1] != di or q_pos.shape != (t,):
        raise ValueError("indexer_scores: shapes do not agree")
    out = torch.empty(t, s, dtype=torch.float32, device=q.device)
    if t == 0 or s == 0:
        return out
    ieee = q.dtype == torch.float32 or k.dtype == torch.float32
    dt = torch.float32 if ieee else q.dtype
    block_t, block_s = 16, 64
    grid = (triton.cdiv(t, block_t), triton.cdiv(s, block_s))
    _scores_kernel[grid](
        q.to(dt).contiguous(),
        w.float().contiguous(),
        k.to(dt).contiguous(),
        q_pos.long().contiguous(),
        out,
        t,
        s,
        h,
        di,
        m,
        block_t,
        block_s,
        max(16, triton.next_power_of_2(di)),
        ieee,
    )
    return out


def _pow2_block(block: int) -> None:
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")


def candidate_blocks(
    scores: torch.Tensor,  # [T, S] fp32
    block: int,
    keep: int,
    q_pos: torch.Tensor,  # [T] int64
    m: int,
) -> torch.Tensor:
    """-> cand_mask [T, ceil(S/block)] bool (see ``kernels.reference.candidate_blocks``)."""
    _check_m(m)
    _pow2_block(block)
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    t, s = scores.shape
    nb = triton.cdiv(s, block)
    mask = torch.zeros(t, nb, dtype=torch.uint8, device=scores.device)
    if t == 0 or nb == 0:
        return mask.bool()
    sc = scores.float().contiguous()
    qp = q_pos.long().contiguous()
    bmax = torch.empty(t, nb, dtype=torch.float32, device=scores.device)
    block_nb = max(1, min(256, triton.next_power_of_2(nb)))
    _block_max_kernel[(t, triton.cdiv(nb, block_nb))](sc, qp, bmax, s, nb, m, block, block_nb)
    chunk = min(SELECT_BLOCK, triton.next_power_of_2(nb))
    bt = _select_rows()
    _select_kernel[(triton.cdiv(t, bt),)](
        bmax, qp, mask, mask, t, nb, s, m, keep - 1, 1, block, True, False, bt, chunk
    )
    return mask.bool()


def indexer_topk(
    scores: torch.Tensor,  # [T, S] fp32
    topk: int,
    q_pos: torch.Tensor,  # [T] int64
    m: int,
    cand_mask: torch.Tensor | None = None,  # [T, NB] bool
    block: int = 8,
) -> torch.Tensor:
    """-> idx [T, topk] int32 (see ``kernels.reference.indexer_topk``)."""
    _check_m(m)
    t, s = scores.shape
    check_topk_args(topk, cand_mask, t, s, block)
    out = torch.empty(t, topk, dtype=torch.int32, device=scores.device)
    if t == 0:
        return out
    cand = cand_mask.to(torch.uint8).contiguous() if cand_mask is not None else out
    nbc = cand_mask.shape[1] if cand_mask is not None else 1
    chunk = min(SELECT_BLOCK, triton.next_power_of_2(max(s, topk, 1)))
    bt = _select_rows()
    _select_kernel[(triton.cdiv(t, bt),)](
        scores.float().contiguous(),
        q_pos.long().contiguous(),
        cand,
        out,
        t,
        s,
        s,
        m,
        topk,
        nbc,
        max(block, 1),
        False,
        cand_mask is not None,
        bt,
        chunk,
    )
    return out
