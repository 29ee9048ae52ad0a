"""Fast CPU indexer ops (``indexer_scores``, ``candidate_blocks``, ``indexer_topk``) with the
reference's results; ``kernels.torch_fast`` re-exports them.

Scores: ``score[t, s] = sum_h w[t,h] relu(q[t,h] . k[s])`` is one GEMM of the [T*H, Di]
queries against the keys, then relu and a weighted sum over heads. Done over the whole
row it writes, rereads and rewrites a [T, H, S] fp32 intermediate (64 MB at T=512, S=8k),
so it runs memory-bound; here the keys go in column tiles whose [T*H, tile] products stay
in cache. Every score is computed by the same GEMM, relu and head sum as before: the same
bits.

Top-k over long rows: the best ``topk + 1`` values of a row lie in the ``topk + 1`` blocks
(of ``_TOPK_BLOCK`` columns) with the largest maxima, unless a value there ties with or
falls below a maximum of an unpicked block. So each row ranks its block maxima, takes
``topk`` over those blocks' columns only, and checks the strict inequality; the rows that
fail it (few: rows that see few entries, exact ties) take the full-row path. The
selected set is therefore exactly the full-row ``topk``'s, ties included.
"""

from __future__ import annotations

import torch

from kernels.reference.csa2 import check_topk_args, order_key, visible_count

_POS_BITS = 26  # positions below 2^26 fit beside the 32-bit score key in an int64
_FLOOR = -(1 << 62)
_SCORE_TILE = 1024  # key columns per GEMM tile: [T*H, tile] fp32 stays in cache
_TOPK_BLOCK = 32  # columns per block of the two-level top-k
_NEG_INF = float("-inf")


def _mask_invisible(scores: torch.Tensor, q_pos: torch.Tensor, m: int) -> torch.Tensor:
    """-inf where s >= (q_pos + 1) // m, touching only the columns some row cannot see."""
    t, s = scores.shape
    if t == 0 or s == 0:
        return scores
    vis = visible_count(q_pos, m, s)
    v0 = int(vis.min())
    if v0 < s:
        cols = torch.arange(v0, s, device=scores.device)[None, :]
        scores[:, v0:].masked_fill_(cols >= vis[:, None], _NEG_INF)
    return scores


def indexer_scores(
    q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, m: int
) -> torch.Tensor:
    t, h, di = q.shape
    s = k.shape[0]
    scores = torch.empty(t, s, dtype=torch.float32, device=q.device)
    qf = q.reshape(t * h, di).float()
    kt = k.float().T
    wu = w.float().unsqueeze(1)  # [T, 1, H]
    for a in range(0, s, _SCORE_TILE):
        b = min(s, a + _SCORE_TILE)
        dots = torch.relu_(qf @ kt[:, a:b]).view(t, h, b - a)
        scores[:, a:b] = torch.bmm(wu, dots).squeeze(1)
    return _mask_invisible(scores, q_pos, m)


def rank_key(x: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
    """int64 key: score order first, then the lower position on ties (the reference's
    rule); ``pos`` (x's shape, < 2^26) defaults to the column index."""
    if pos is None:
        n = x.shape[-1]
        if n >= 1 << _POS_BITS:
            raise ValueError("too many positions for the ranking key")
        pos = torch.arange(n, device=x.device)
    return (order_key(x) << _POS_BITS) | ((1 << _POS_BITS) - 1 - pos)


def fill_sorted(out: torch.Tensor, sel: torch.Tensor, s: int) -> torch.Tensor:
    """out[:, :width] = the selected positions ascending, ``s`` (nothing) becoming -1."""
    sel = sel.sort(dim=1).values
    out[:, : sel.shape[1]] = torch.where(sel == s, -1, sel).to(torch.int32)
    return out


def _block_maxima(scores: torch.Tensor, block: int, vis: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(bmax [T, ceil(S/block)] of the visible scores, v0 = the fewest visible): full
    blocks before v0 straight from ``scores``, the rest from a masked copy."""
    t, s = scores.shape
    nb = -(-s // block)
    v0 = int(vis.min()) if t else s
    f0 = min(v0, s) // block  # blocks wholly visible to every row
    bmax = torch.empty(t, nb, dtype=torch.float32, device=scores.device)
    if f0:
        bmax[:, :f0] = scores[:, : f0 * block].view(t, f0, block).amax(-1)
    if f0 < nb:
        tail = torch.full((t, (nb - f0) * block), _NEG_INF, device=scores.device)
        tail[:, : s - f0 * block] = scores[:, f0 * block :]
        cols = torch.arange(f0 * block, nb * block, device=scores.device)[None, :]
        tail.masked_fill_(cols >= vis[:, None], _NEG_INF)
        bmax[:, f0:] = tail.view(t, nb - f0, block).amax(-1)
    return bmax, v0


def candidate_blocks(
    scores: torch.Tensor, block: int, keep: int, q_pos: torch.Tensor, m: int
) -> torch.Tensor:
    if block < 1 or keep < 1:
        raise ValueError(f"block and keep must be >= 1, got {block}, {keep}")
    s = scores.shape[1]
    nb = -(-s // block)
    vis = visible_count(q_pos, m, s)
    bmax, _ = _block_maxima(scores.float(), block, vis)
    bidx = torch.arange(nb, device=scores.device)[None, :]
    newest = (vis - 1).div(block, rounding_mode="floor")[:, None]  # -1 when nothing visible
    forced = (bidx == newest) & (vis[:, None] > 0)
    eligible = (bidx < -(-vis[:, None] // block)) & ~forced
    out = forced.clone()
    k = min(keep - 1, nb)
    if k <= 0:
        return out
    # Float topk of the eligible maxima, one extra value to see a tie at the boundary;
    # rows with such a tie or fewer than k finite eligible maxima (where -inf cannot tell
    # eligible from not) are ranked again with exact keys (ties: lower block index).
    vals, idx = bmax.masked_fill(~eligible, _NEG_INF).topk(min(k + 1, nb), dim=1)
    redo = ~torch.isfinite(vals[:, k - 1])
    if vals.shape[1] > k:
        redo |= vals[:, k] == vals[:, k - 1]
    out.scatter_(1, idx[:, :k], True)
    rows = redo.nonzero().squeeze(1)
    if rows.numel():
        key = torch.where(eligible[rows], rank_key(bmax[rows]), _FLOOR)
        top = key.topk(k, dim=1)
        fix = forced[rows].clone()
        fix.scatter_(1, top.indices, top.values != _FLOOR)
        out[rows] = fix
    return out | forced


def _masked(
    scores: torch.Tensor, q_pos: torch.Tensor, m: int, cand_mask: torch.Tensor | None, block: int
) -> torch.Tensor:
    """A float copy of scores with -inf where not visible or outside the candidate mask."""
    t, s = scores.shape
    sc = _mask_invisible(scores.float().clone(), q_pos, m)
    if cand_mask is not None:
        nb = cand_mask.shape[1]
        full = s // block
        off = ~cand_mask.bool()
        if full:
            sc[:, : full * block].view(t, full, block).masked_fill_(off[:, :full, None], _NEG_INF)
        if full < nb:
            sc[:, full * block :].masked_fill_(off[:, full:], _NEG_INF)
    return sc


def _topk_rows(sc: torch.Tensor, width: int) -> torch.Tensor:
    """Selected positions [R, width] (``s`` = nothing) of the masked rows ``sc``: float
    ``topk``; rows whose k-th value ties with an unselected entry are redone with exact
    ranking keys (lower position wins)."""
    t, s = sc.shape
    vals, idx = sc.topk(min(width + 1, s), dim=1)
    if vals.shape[1] > width:
        tie = torch.isfinite(vals[:, width]) & (vals[:, width] == vals[:, width - 1])
        vals, idx = vals[:, :width], idx[:, :width]
    else:
        tie = torch.zeros(t, dtype=torch.bool, device=sc.device)
    sel = torch.where(torch.isfinite(vals), idx, s)
    if bool(tie.any()):
        rows = tie.nonzero().squeeze(1)
        key = torch.where(torch.isfinite(sc[rows]), rank_key(sc[rows]), _FLOOR)
        ridx = key.topk(width, dim=1).indices
        ok = torch.isfinite(sc[rows].gather(1, ridx))
        sel[rows] = torch.where(ok, ridx, s)
    return sel


def _topk_two_level(
    scores: torch.Tensor, width: int, q_pos: torch.Tensor, m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sel [T, width] for the rows it could decide, redo [R] rows it could not)."""
    s = scores.shape[1]
    blk = _TOPK_BLOCK
    vis = visible_count(q_pos, m, s)
    bmax, _ = _block_maxima(scores, blk, vis)
    c = width + 1
    bv, bi = bmax.topk(c + 1, dim=1)  # the picked blocks, then the best unpicked maximum
    outside = bv[:, c]
    cols = (bi[:, :c, None] * blk + torch.arange(blk, device=scores.device)).flatten(1)
    inside = cols < vis[:, None]  # also drops the padding past S in the last block
    vals = scores.gather(1, cols.clamp(max=s - 1)).masked_fill_(~inside, _NEG_INF)
    top, j = vals.topk(c, dim=1)
    # Decided: the (width+1)-th best value beats everything in the unpicked blocks, so
    # these are the row's best width+1 values; then the full-row rule applies unchanged.
    sel = cols.gather(1, j[:, :width])
    # Every entry >= the width-th best candidate is a candidate when that value beats the
    # unpicked blocks; a tie at the boundary is then ranked exactly among the candidates.
    ok = top[:, width - 1] > outside
    tie = ok & (top[:, width] == top[:, width - 1])
    rows = tie.nonzero().squeeze(1)
    if rows.numel():
        key = torch.where(inside[rows], rank_key(vals[rows], cols[rows]), _FLOOR)
        sel[rows] = cols[rows].gather(1, key.topk(width, dim=1).indices)
    return sel, (~ok).nonzero().squeeze(1)


def indexer_topk(
    scores: torch.Tensor,
    topk: int,
    q_pos: torch.Tensor,
    m: int,
    cand_mask: torch.Tensor | None = None,
    block: int = 8,
) -> torch.Tensor:
    t, s = scores.shape
    check_topk_args(topk, cand_mask, t, s, block)
    out = torch.full((t, topk), -1, dtype=torch.int32, device=scores.device)
    if s == 0 or t == 0:
        return out
    width = min(topk, s)
    if cand_mask is None and s >= 4 * (width + 2) * _TOPK_BLOCK:
        sel, redo = _topk_two_level(scores.float(), width, q_pos, m)
        if redo.numel():  # exact keys over the whole row (rows of ties, few visible)
            sc = _masked(scores[redo], q_pos[redo], m, None, block)
            key = torch.where(torch.isfinite(sc), rank_key(sc), _FLOOR)
            top = key.topk(width, dim=1)
            sel[redo] = torch.where(top.values != _FLOOR, top.indices, s)
        return fill_sorted(out, sel, s)
    sc = _masked(scores, q_pos, m, cand_mask, block)
    return fill_sorted(out, _topk_rows(sc, width), s)
