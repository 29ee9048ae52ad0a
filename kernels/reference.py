"""Plain torch references for every CSA2 and Engram op; the Triton kernels must match them.

Formats (``shared/design/REFERENCE_MODEL.md``), defined here bit for bit:

* **E4M3** (``float8_e4m3fn`` bits, bias 7, max 448, no infinities): encoded by integer
  arithmetic on the fp32 bits, round to nearest with ties to even, saturated at 448. The
  bytes 0x7F/0xFF (NaN in e4m3fn) are never produced.
* **E2M1** (FP4) values ``±{0, .5, 1, 1.5, 2, 3, 4, 6}``, code ``s<<3 | e<<1 | m``. A value is
  rounded to the nearest code by comparing ``|x|`` with the midpoints times the scale; both
  factors have at most 4 significant bits, so each threshold is exact in fp32 and the
  result is the exact round-to-nearest of ``x / scale`` with no division; ties go to the
  even code, anything above ``5 * scale`` saturates to 6. ``x < 0`` sets the sign bit (a
  tiny negative becomes -0). Two codes per byte, element ``2i`` in the low nibble.
* **FP4 main KV**: one E4M3 scale per 16 channels, ``scale = e4m3(max(amax, 6*2^-9) * f32(1/6))``
  (the clamp keeps the scale at least the smallest E4M3 subnormal), no global scale.
* **FP4 index keys/queries**: one power-of-two scale per ``block`` (32) channels,
  ``2^ceil(log2(amax / 6))`` stored as its int8 exponent; amax is clamped to at least
  ``6 * 2^-64`` so a zero block gets exponent -64.
* **FP8 window KV / Engram tables**: E4M3 with a power-of-two scale per 32 values,
  ``2^ceil(log2(max(amax, 1e-4) / 448))`` stored as its int8 exponent.

The ceil(log2(.)) exponents are computed exactly from the fp32 bits (no ``log2``), so the
torch and Triton paths agree bit for bit. Everything is computed in fp32.
"""

from __future__ import annotations

import random

import torch

F32_ONE_SIXTH = torch.tensor(1.0 / 6.0, dtype=torch.float32)  # the fp32 constant both paths use
FP4_SCALE_BLOCK = 16  # channels per E4M3 scale of the main KV
FP4_AMAX_FLOOR = 6.0 * 2.0**-9  # smallest amax whose scale is still a nonzero E4M3
POW2_MIN_EXP = -64  # exponent of an all-zero FP4 pow2 block
FP8_AMAX_FLOOR = 1e-4
E4M3_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
ENGRAM_ORDERS = 3  # 2-, 3- and 4-grams
ENGRAM_HEADS = 8
ENGRAM_CONTEXT = 3  # left-context ids in front of the sequence passed to engram_rows


# --------------------------------------------------------------------------------------
# bit-level helpers


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2.0**e as fp32, exactly, for integer e in [-126, 127] (built from the exponent bits)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def floor_log2(v: torch.Tensor) -> torch.Tensor:
    """floor(log2(v)) for fp32 v > 0 normal, from the exponent bits (int32)."""
    return ((v.contiguous().view(torch.int32) >> 23) & 0xFF) - 127


def e4m3_encode_abs(v: torch.Tensor) -> torch.Tensor:
    """E4M3 code (int32, sign bit clear) of fp32 ``v >= 0``, RNE, saturated at 448."""
    v = v.clamp(max=E4M3_MAX)
    e = floor_log2(v).clamp(min=-6)  # subnormals share the quantum of exponent -6
    mant = torch.round(v * pow2(3 - e))  # exact scaling; in [0, 16], 16 carries into e
    return 8 * (e + 6) + mant.to(torch.int32)


def e4m3_decode(code: torch.Tensor) -> torch.Tensor:
    """fp32 value of E4M3 bytes (uint8 or int32 code, sign in bit 7)."""
    c = code.to(torch.int32)
    e = (c >> 3) & 15
    m = c & 7
    mag = torch.where(e == 0, m, m + 8).to(torch.float32) * pow2(e.clamp(min=1) - 10)
    return torch.where((c & 0x80) != 0, -mag, mag)


def e2m1_encode(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (int32, 0..15) of fp32 ``x / scale`` (scale broadcastable, > 0)."""
    a = x.abs()
    # midpoints between codes k and k+1; ties go to the even code (">" when k even).
    mag = (
        (a > 0.25 * scale).int()
        + (a >= 0.75 * scale).int()
        + (a > 1.25 * scale).int()
        + (a >= 1.75 * scale).int()
        + (a > 2.5 * scale).int()
        + (a >= 3.5 * scale).int()
        + (a > 5.0 * scale).int()
    )
    return mag | ((x < 0).int() << 3)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """fp32 value of E2M1 codes (int32 0..15)."""
    e = (code >> 1) & 3
    m = (code & 1).to(torch.float32)
    mag = torch.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * pow2(e - 1))
    return torch.where((code & 8) != 0, -mag, mag)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    p = packed.to(torch.int32)
    return torch.stack([p & 15, p >> 4], dim=-1).flatten(-2)


def _ceil_log2_ratio(amax: torch.Tensor, top: float) -> torch.Tensor:
    """ceil(log2(amax / top)) exactly, for ``top = 1.5 * 2^k`` or ``1.75 * 2^k`` and amax normal."""
    k = int(torch.floor(torch.log2(torch.tensor(top))).item())
    frac = top / 2.0**k  # 1.5 (E2M1 max 6) or 1.75 (E4M3 max 448)
    e = floor_log2(amax)
    return torch.where(amax <= frac * pow2(e), e - k, e - k + 1)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    d = x.shape[-1]
    if d % block != 0:
        raise ValueError(f"last dim {d} is not a multiple of the block {block}")
    return x.float().reshape(*x.shape[:-1], d // block, block)


# --------------------------------------------------------------------------------------
# FP4 (global KV, index keys) and FP8 (window KV, Engram tables)


def fp4_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float -> (packed [..., D//2] uint8, scale [..., D//16] uint8 E4M3 bits)."""
    xb = _blocks(x, FP4_SCALE_BLOCK)  # [..., G, 16]
    amax = xb.abs().amax(-1).clamp(min=FP4_AMAX_FLOOR)  # [..., G]
    scode = e4m3_encode_abs(amax * F32_ONE_SIXTH)
    codes = e2m1_encode(xb, e4m3_decode(scode)[..., None]).flatten(-2)
    return _pack_nibbles(codes), scode.to(torch.uint8)


def fp4_dequantize(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """packed [..., D//2] uint8, scale [..., D//16] uint8 -> [..., D] in ``dtype``."""
    vals = e2m1_decode(_unpack_nibbles(packed))  # [..., D]
    vb = vals.reshape(*vals.shape[:-1], -1, FP4_SCALE_BLOCK) * e4m3_decode(scale)[..., None]
    return vb.flatten(-2).to(dtype)


def fp4_pow2_quantize(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (packed [..., D//2] uint8, exp [..., D//block] int8); scale = 2^exp."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1).clamp(min=6.0 * 2.0**POW2_MIN_EXP)
    exp = _ceil_log2_ratio(amax, 6.0)  # [..., G]
    codes = e2m1_encode(xb, pow2(exp)[..., None]).flatten(-2)
    return _pack_nibbles(codes), exp.to(torch.int8)


def fp4_pow2_dequantize(
    packed: torch.Tensor, exp: torch.Tensor, block: int = 32, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """packed [..., D//2] uint8, exp [..., D//block] int8 -> [..., D] in ``dtype``."""
    vals = e2m1_decode(_unpack_nibbles(packed))
    vb = vals.reshape(*vals.shape[:-1], -1, block) * pow2(exp.to(torch.int32))[..., None]
    return vb.flatten(-2).to(dtype)


def fp8_quantize(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (E4M3 bits [..., D] uint8, exp [..., D//block] int8); value = e4m3 * 2^exp."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1).clamp(min=FP8_AMAX_FLOOR)
    exp = _ceil_log2_ratio(amax, E4M3_MAX)  # [..., G]
    y = xb * pow2(-exp)[..., None]  # exact; |y| <= 448
    code = e4m3_encode_abs(y.abs()) | ((y < 0).int() << 7)
    return code.flatten(-2).to(torch.uint8), exp.to(torch.int8)


def fp8_dequantize(
    bits: torch.Tensor, exp: torch.Tensor, block: int = 32, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """bits [..., D] uint8 (E4M3), exp [..., D//block] int8 -> [..., D] in ``dtype``."""
    v = e4m3_decode(bits)
    vb = v.reshape(*v.shape[:-1], -1, block) * pow2(exp.to(torch.int32))[..., None]
    return vb.flatten(-2).to(dtype)


def fp8_qdq(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x [..., D] -> [..., D] (x's dtype): E4M3 quantize-dequantize, pow2 scale per block."""
    bits, exp = fp8_quantize(x, block)
    return fp8_dequantize(bits, exp, block, dtype=x.dtype)


# --------------------------------------------------------------------------------------
# CSA2 indexer and hierarchical top-k


def check_index(idx: torch.Tensor, rows: int, what: str, lowest: int = 0) -> None:
    """IndexError unless every entry of ``idx`` is in ``[lowest, rows)`` (-1: empty slot)."""
    if bool(((idx < lowest) | (idx >= rows)).any()):
        raise IndexError(f"{what} out of range [{lowest}, {rows})")


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
