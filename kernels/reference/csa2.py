"""CSA2 in plain torch: the FP4 indexer, hierarchical top-k, and sparse attention with a
per-head sink. Formats: ``kernels.reference.formats``."""

from __future__ import annotations

import torch

from kernels.reference.checks import check_index
from kernels.reference.formats import fp4_dequantize

# --------------------------------------------------------------------------------------
# CSA2 indexer and hierarchical top-k


def check_topk_args(topk: int, cand_mask: torch.Tensor | None, t: int, s: int, block: int) -> None:
    """ValueError unless topk >= 1 and cand_mask (if given) is [T, ceil(S/block)]."""
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    if cand_mask is not None and cand_mask.shape != (t, -(-s // block)):
        raise ValueError(f"cand_mask {tuple(cand_mask.shape)} does not fit S={s}, block={block}")


def visible_count(q_pos: torch.Tensor, m: int, s: int) -> torch.Tensor:
    """Compressed entries visible to each query: min((q_pos + 1) // m, S), int64 [T]."""
    if m < 1:
        raise ValueError(f"compression ratio m must be >= 1, got {m}")
    return ((q_pos.long() + 1) // m).clamp(min=0, max=s)


def indexer_scores(
    q: torch.Tensor,  # [T, H, Di] index queries (dequantized)
    w: torch.Tensor,  # [T, H] head weights
    k: torch.Tensor,  # [S, Di] index keys (dequantized)
    q_pos: torch.Tensor,  # [T] int64 absolute query positions
    m: int,
) -> torch.Tensor:
    """score[t, s] = sum_h w[t,h] * relu(q[t,h] . k[s]); -inf where s >= (q_pos+1)//m. [T, S] fp32."""
    t, h, _ = q.shape
    s = k.shape[0]
    scores = torch.empty(t, s, dtype=torch.float32, device=q.device)
    chunk = max(1, (1 << 24) // max(1, h * s))  # bound the [chunk, H, S] intermediate
    kf = k.float()
    for a in range(0, t, chunk):
        dots = torch.einsum("thd,sd->ths", q[a : a + chunk].float(), kf).relu()
        scores[a : a + chunk] = (dots * w[a : a + chunk].float()[:, :, None]).sum(1)
    vis = visible_count(q_pos, m, k.shape[0])
    hidden = torch.arange(k.shape[0], device=k.device)[None, :] >= vis[:, None]
    return scores.masked_fill(hidden, float("-inf"))


def order_key(x: torch.Tensor) -> torch.Tensor:
    """int64 key ordered like fp32 ``x`` (-0 folded onto +0), for exact, tie-stable ranking."""
    b = x.float().contiguous().view(torch.int32)
    b = torch.where(b == -(2**31), torch.zeros_like(b), b)  # -0.0 -> +0.0
    return torch.where(b < 0, b ^ 0x7FFFFFFF, b).long()


def _top_positions(key: torch.Tensor, eligible: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Bool [T, N]: the n[t] eligible entries with the largest key (ties: lower index)."""
    k = torch.where(eligible, key, torch.full_like(key, -(2**62)))
    order = torch.sort(k, dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(k.shape[1], device=k.device).expand_as(order))
    return eligible & (rank < n[:, None])


def block_maxima(
    scores: torch.Tensor, block: int, keep: int, q_pos: torch.Tensor, m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What candidate_blocks ranks, for scores [T, S]: (bmax [T, NB] fp32, each block's max
    visible score; forced [T, NB] bool, the newest visible block; eligible [T, NB] bool, the
    other blocks holding a visible position), NB = ceil(S/block)."""
    if block < 1 or keep < 1:
        raise ValueError(f"block and keep must be >= 1, got {block}, {keep}")
    t, s = scores.shape
    nb = -(-s // block)
    vis = visible_count(q_pos, m, s)
    pos = torch.arange(nb * block, device=scores.device)
    padded = torch.full((t, nb * block), float("-inf"), device=scores.device)
    padded[:, :s] = scores.float()
    padded.masked_fill_(pos[None, :] >= vis[:, None], float("-inf"))
    bmax = padded.view(t, nb, block).amax(-1)
    bidx = torch.arange(nb, device=scores.device)[None, :]
    newest = (vis - 1).div(block, rounding_mode="floor")[:, None]  # -1 when nothing visible
    forced = (bidx == newest) & (vis[:, None] > 0)
    eligible = (bidx < -(-vis[:, None] // block)) & ~forced
    return bmax, forced, eligible


def candidate_blocks(
    scores: torch.Tensor,  # [T, S] fp32, -inf where hidden
    block: int,
    keep: int,
    q_pos: torch.Tensor,  # [T] int64
    m: int,
) -> torch.Tensor:
    """cand_mask [T, NB] bool, NB = ceil(S/block): the newest visible block plus the best
    ``keep - 1`` other visible blocks by their max score (ties: lower block index)."""
    bmax, forced, eligible = block_maxima(scores, block, keep, q_pos, m)
    keep_other = torch.full((scores.shape[0],), keep - 1, device=scores.device)
    picked = _top_positions(order_key(bmax), eligible, keep_other)
    return forced | picked


def indexer_topk(
    scores: torch.Tensor,  # [T, S] fp32
    topk: int,
    q_pos: torch.Tensor,  # [T] int64
    m: int,
    cand_mask: torch.Tensor | None = None,  # [T, NB] bool
    block: int = 8,
) -> torch.Tensor:
    """idx [T, topk] int32: the best min(topk, eligible) visible positions (inside the
    candidate mask if given; ties: lower position), ascending, then -1 padding."""
    t, s = scores.shape
    check_topk_args(topk, cand_mask, t, s, block)
    vis = visible_count(q_pos, m, s)
    pos = torch.arange(s, device=scores.device)
    eligible = pos[None, :] < vis[:, None]
    if cand_mask is not None:
        eligible = eligible & cand_mask[:, pos // block].bool()
    n = eligible.sum(1).clamp(max=topk)
    chosen = _top_positions(order_key(scores), eligible, n)
    # ascending positions first, padding last: sort by (not chosen, position)
    order = torch.sort(torch.where(chosen, pos[None, :], pos[None, :] + s), dim=1).indices
    out = torch.full((t, topk), -1, dtype=torch.int32, device=scores.device)
    width = min(topk, s)
    sel = order[:, :width].to(torch.int32)
    out[:, :width] = torch.where(
        torch.arange(width, device=scores.device)[None] < n[:, None], sel, -1
    )
    return out


def indexer_select(
    q: torch.Tensor,  # [T, H, Di]
    w: torch.Tensor,  # [T, H]
    k: torch.Tensor,  # [S, Di]
    q_pos: torch.Tensor,  # [T] int64
    m: int,
    topk: int,
    cand_mask: torch.Tensor,  # [T, ceil(S/block)] bool
    block: int,
) -> torch.Tensor:
    """Top-k inside the candidate blocks (later index layers of the hierarchy), by
    definition the top-k of the scores under the mask. -> idx [T, topk] int32."""
    scores = indexer_scores(q, w, k, q_pos, m)
    return indexer_topk(scores, topk, q_pos, m, cand_mask, block)


# --------------------------------------------------------------------------------------
# sparse attention with a per-head sink


def _gather_kv(
    win_kv: torch.Tensor,
    win_idx: torch.Tensor,
    glob_packed: torch.Tensor,
    glob_scale: torch.Tensor,
    glob_idx: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (kv [T, W+K, D] fp32, valid [T, W+K] bool)."""
    parts, valid = [], []
    for idx, rows in ((win_idx, win_kv.shape[0]), (glob_idx, glob_packed.shape[0])):
        idx = idx.long()
        check_index(idx, rows, "KV index", lowest=-1)
        valid.append(idx >= 0)
    wi, gi = win_idx.long().clamp(min=0), glob_idx.long().clamp(min=0)
    d = win_kv.shape[1]
    if win_kv.shape[0] > 0:
        parts.append(win_kv[wi].float())
    else:
        parts.append(torch.zeros(*wi.shape, d, device=win_kv.device))
    if glob_packed.shape[0] > 0:
        parts.append(fp4_dequantize(glob_packed[gi], glob_scale[gi]))
    else:
        parts.append(torch.zeros(*gi.shape, d, device=win_kv.device))
    return torch.cat(parts, 1), torch.cat(valid, 1)


def sparse_attention(
    q: torch.Tensor,  # [T, H, D]
    win_kv: torch.Tensor,  # [Nw, D] float (FP8-qdq window KV)
    win_idx: torch.Tensor,  # [T, W] int32 rows of win_kv, -1 = empty
    glob_packed: torch.Tensor,  # [Ng, D//2] uint8 FP4 global KV
    glob_scale: torch.Tensor,  # [Ng, D//16] uint8 E4M3 scales
    glob_idx: torch.Tensor,  # [T, K] int32 rows of the global KV, -1 = empty
    sink: torch.Tensor,  # [H] fp32
    scale: float,
) -> torch.Tensor:
    """MQA over window + selected global entries (one KV head as K and V), sink in the
    denominator only; a row with no valid entry is 0. -> [T, H, D] in q's dtype."""
    t, h, d = q.shape
    out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    n = win_idx.shape[1] + glob_idx.shape[1]
    chunk = max(1, (1 << 24) // max(1, n * d))  # bound the gathered [chunk, N, D] tensor
    sk = sink.float()[None, :]  # [1, H]
    for a in range(0, t, chunk):
        b = min(t, a + chunk)
        kv, valid = _gather_kv(win_kv, win_idx[a:b], glob_packed, glob_scale, glob_idx[a:b])
        s = torch.einsum("thd,tnd->thn", q[a:b].float(), kv) * scale
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        mx = torch.maximum(s.amax(-1), sk)  # [t, H], finite thanks to the sink
        e = torch.exp(s - mx[..., None])
        denom = e.sum(-1) + torch.exp(sk - mx)
        out[a:b] = torch.einsum("thn,tnd->thd", e / denom[..., None], kv).to(q.dtype)
    return out
