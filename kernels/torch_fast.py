"""Fast torch implementations of the reference ops for CPU serving, with the same
signatures and the same results as ``kernels.reference``.

The references are written for bit-exact agreement with the Triton kernels and favour
clarity (integer bit arithmetic, full sorts, gathers). A model serving on two CPU cores
calls the same ops a few hundred times per forward pass; these versions compute the same
values with table lookups, ``topk`` on exact integer ranking keys (score bits, then the
lower position on ties: the reference's tie rule) and, in sparse attention, a banded
window path when every row's window indices are a run of consecutive rows (as a sliding
window always is), which avoids gathering a [T, W, D] tensor.

Equality with the reference is tested in ``tests/engine_stub/test_model_fast_ops.py``:
bit-exact for the formats and the selections, to fp32 rounding for the float math.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from kernels import reference as ref
from kernels.reference.checks import check_index
from kernels.reference.csa2 import check_topk_args, visible_count
from kernels.torch_fast_indexer import candidate_blocks as candidate_blocks
from kernels.torch_fast_indexer import fill_sorted as _fill_sorted
from kernels.torch_fast_indexer import indexer_scores as indexer_scores
from kernels.torch_fast_indexer import indexer_topk as indexer_topk
from kernels.torch_fast_indexer import rank_key as _rank_key

# E2M1 value of each byte's two nibbles: _FP4_PAIR[b] = (value of b & 15, value of b >> 4).
_CODES = torch.arange(16, dtype=torch.int32)
_E2M1 = ref.e2m1_decode(_CODES)
_FP4_PAIR = torch.stack((_E2M1[torch.arange(256) & 15], _E2M1[torch.arange(256) >> 4]), dim=1)
_E4M3 = ref.e4m3_decode(torch.arange(256, dtype=torch.int32))  # fp32 value of each E4M3 byte
_LUTS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_BAND_ROWS = 32  # query rows per band block: keys span rows + window - 1
_FLOOR = -(1 << 62)


def _luts(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    got = _LUTS.get(device)
    if got is None:
        got = (_FP4_PAIR.to(device), _E4M3.to(device))
        _LUTS[device] = got
    return got


def _fp4_values(packed: torch.Tensor) -> torch.Tensor:
    """[..., D//2] uint8 -> [..., D] fp32 E2M1 values: one lookup per byte of both nibbles'
    values as one 8-byte word (half the work of looking up [256, 2] rows)."""
    pair, _ = _luts(packed.device)
    words = pair.view(torch.int64).view(256)
    return torch.take(words, packed.long()).view(torch.float32)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    return ref.pow2(e.to(torch.int32))


# --------------------------------------------------------------------------------------
# formats


fp4_quantize = ref.fp4_quantize
fp4_pow2_quantize = ref.fp4_pow2_quantize


def fp8_quantize(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 with a pow2 scale per block; torch's fp32 -> float8_e4m3fn cast is the same
    round-to-nearest-even as the reference's integer encoder for |y| <= 448."""
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = xb.abs().amax(-1).clamp_(min=ref.FP8_AMAX_FLOOR)
    mant, ex = torch.frexp(amax)  # amax = mant * 2^ex, mant in [0.5, 1)
    # ceil(log2(amax / 448)) with 448 = 1.75 * 2^8: floor_log2(amax) - 8, +1 above 1.75.
    exp = ex - 9 + (mant > 0.875).to(ex.dtype)
    y = torch.ldexp(xb, -exp.unsqueeze(-1).float())
    # + 0.0 turns -0.0 into +0.0: the reference sets the sign only when y < 0.
    bits = (y + 0.0).to(torch.float8_e4m3fn).view(torch.uint8)
    return bits.flatten(-2), exp.to(torch.int8)


def fp4_dequantize(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    vals = _fp4_values(packed)  # [..., D]
    s = scale.view(torch.float8_e4m3fn).float()
    # the block count from the scales, not -1: a view of 0 rows cannot infer it
    out = vals.view(*vals.shape[:-1], s.shape[-1], ref.FP4_SCALE_BLOCK) * s.unsqueeze(-1)
    return out.flatten(-2).to(dtype)


def fp4_pow2_dequantize(
    packed: torch.Tensor, exp: torch.Tensor, block: int = 32, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    vals = _fp4_values(packed)
    out = vals.view(*vals.shape[:-1], exp.shape[-1], block) * _pow2(exp).unsqueeze(-1)
    return out.flatten(-2).to(dtype)


def fp8_dequantize(
    bits: torch.Tensor, exp: torch.Tensor, block: int = 32, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    v = bits.view(torch.float8_e4m3fn).float()
    out = torch.ldexp(v.view(*v.shape[:-1], exp.shape[-1], block), exp.float().unsqueeze(-1))
    return out.flatten(-2).to(dtype)


def fp8_qdq(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    bits, exp = fp8_quantize(x, block)
    return fp8_dequantize(bits, exp, block, dtype=x.dtype)


# --------------------------------------------------------------------------------------
# indexer


def indexer_select(
    q: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    q_pos: torch.Tensor,
    m: int,
    topk: int,
    cand_mask: torch.Tensor,
    block: int,
) -> torch.Tensor:
    """``indexer_topk(indexer_scores(q, w, k, q_pos, m), topk, q_pos, m, cand_mask, block)``
    scoring only the candidate blocks (what a later index layer of the hierarchy needs):
    each row gathers its <= keep candidate blocks' keys instead of scoring all S."""
    t = q.shape[0]
    s = k.shape[0]
    check_topk_args(topk, cand_mask, t, s, block)
    out = torch.full((t, topk), -1, dtype=torch.int32, device=q.device)
    if t == 0 or s == 0:
        return out
    kmax = int(cand_mask.sum(1).max())
    if kmax == 0:
        return out
    present, blk = cand_mask.to(torch.float32).topk(kmax, dim=1)  # [T, kmax]
    pos = (blk[:, :, None] * block + torch.arange(block, device=q.device)).flatten(1)  # [T, C]
    vis = visible_count(q_pos, m, s)
    ok = present.repeat_interleave(block, dim=1).bool() & (pos < vis[:, None])
    keys = k.float()[pos.clamp(max=s - 1)]  # [T, C, Di]
    dots = torch.relu_(torch.bmm(q.float(), keys.transpose(1, 2)))  # [T, H, C]
    sc = torch.bmm(w.float().unsqueeze(1), dots).squeeze(1)  # [T, C]
    key = torch.where(ok, _rank_key(sc, pos), _FLOOR)
    top = key.topk(min(topk, key.shape[1]), dim=1)
    sel = torch.where(top.values != _FLOOR, pos.gather(1, top.indices), s)
    return _fill_sorted(out, sel, s)


# --------------------------------------------------------------------------------------
# sparse attention


class _Memo:
    """One-entry memo per kind, keyed by the identity and version of its input tensors:
    a forward pass hands every layer the same window-index tensor, and reuse layers the
    same global KV and selected positions, so the derived values are computed once."""

    def __init__(self) -> None:
        self._slots: dict[
            str, tuple[tuple[weakref.ref[torch.Tensor], ...], tuple[int, ...], Any]
        ] = {}

    def get(self, kind: str, key: tuple[torch.Tensor, ...], make: Callable[[], Any]) -> Any:
        if any(t.is_inference() for t in key):  # no version counter: never memoize
            return make()
        got = self._slots.get(kind)
        versions = tuple(t._version for t in key)
        if got is not None:
            refs, vers, val = got
            if vers == versions and all(r() is t for r, t in zip(refs, key, strict=True)):
                return val
        val = make()
        self._slots[kind] = (tuple(weakref.ref(t) for t in key), versions, val)
        return val


_MEMO = _Memo()


def _banded(win_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(first, count) per row if every row's valid window indices are one run of
    consecutive rows in increasing order after its -1 entries; else None."""
    valid = win_idx >= 0
    count = valid.sum(1)
    w = win_idx.shape[1]
    if w == 0:
        return None
    # Valid entries must be a suffix, increasing by exactly one.
    if bool((valid[:, :-1] & ~valid[:, 1:]).any()):
        return None
    steps = (win_idx[:, 1:] - win_idx[:, :-1]) != 1
    if bool((steps & valid[:, :-1]).any()):
        return None
    last = win_idx[:, -1].long()
    return last - count + 1, count


def _uniform_band(
    win_idx: torch.Tensor, first: torch.Tensor, count: torch.Tensor
) -> tuple[int, int] | None:
    """(last0, lo) when row t's window is [max(lo, last0 + t - W + 1), last0 + t] (a
    sliding window over consecutive rows: one prefill segment); else None."""
    t, w = win_idx.shape
    last = first + count - 1
    last0 = int(last[0])
    steps = torch.arange(t, device=win_idx.device)
    if not bool((last == last0 + steps).all()):
        return None
    lo = int(first.min())
    if not bool((first == (last - w + 1).clamp(min=lo)).all()):
        return None
    return last0, lo


def _band_mask(
    t: int, w: int, last0: int, lo: int, rows: int, device: torch.device
) -> torch.Tensor:
    """[nb, rows, 1, span] bool: key o of block b is in row r's window (see
    _uniform_attention)."""
    nb = -(-t // rows)
    span = rows + w - 1
    o = torch.arange(span, device=device)
    r = torch.arange(rows, device=device)
    band = (o[None, :] >= r[:, None]) & (o[None, :] < r[:, None] + w)  # [rows, span]
    thr = lo - last0 - torch.arange(nb, device=device) * rows + w - 1  # [nb]
    return (band[None] & (o[None, None, :] >= thr[:, None, None])).unsqueeze(2)


def _uniform_attention(
    qf: torch.Tensor,
    kvw: torch.Tensor,
    w: int,
    last0: int,
    rows: int,
    bias: torch.Tensor,
    sink: torch.Tensor,
    sg: torch.Tensor | None,
    gk: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of all rows of one prefill segment, block by block without a gather.

    Rows are split in blocks of `rows`; block b's keys are the contiguous span of
    rows + w - 1 window rows ending at its last row (an unfold view of the left- and
    right-padded KV); bias [nb, rows, 1, span] is 0 where key o of block b is in row r's
    window, else -inf (_band_bias). Each row's logits [span window | K global | sink] sit side by side
    in one [nb, rows, H, span + K + 1] tensor (-inf outside the row's window and for
    missing global entries), so one fused softmax normalises window, global and sink
    together. qf [T, H, D] (scaled), sg [T, H, K] global logits, gk [T, K, D] -> [T, H, D].
    """
    t, h, d = qf.shape
    nb = bias.shape[0]
    span = rows + w - 1
    kk = 0 if sg is None else sg.shape[-1]
    pad_r = max(0, last0 + nb * rows - kvw.shape[0])
    kvp = torch.cat((kvw.new_zeros(w - 1, d), kvw, kvw.new_zeros(pad_r, d)))
    keys = kvp[last0 : last0 + nb * rows + w - 1].unfold(0, span, rows).transpose(1, 2)
    qp = qf if nb * rows == t else torch.cat((qf, qf.new_zeros(nb * rows - t, h, d)))
    sc = torch.empty(nb, rows, h, span + kk + 1, dtype=torch.float32, device=qf.device)
    sw = torch.bmm(qp.view(nb, rows * h, d), keys.transpose(1, 2))
    # + bias (0 inside the window, -inf outside) in one pass into the slice: masked_fill
    # on the strided slice with a broadcast mask costs four times as much.
    torch.add(sw.view(nb, rows, h, span), bias, out=sc[..., :span])
    flat = sc.view(nb * rows, h, -1)
    if sg is not None:
        flat[:t, :, span:-1] = sg
        flat[t:, :, span:-1] = float("-inf")
    flat[:, :, -1] = sink
    p = torch.softmax(sc, -1)
    o = torch.bmm(p[..., :span].reshape(nb, rows * h, span), keys)
    o = o.view(nb * rows, h, d)[:t]
    if gk is not None:
        o = o + torch.bmm(p.view(nb * rows, h, -1)[:t, :, span:-1], gk)
    return o


def _gather_fp4(packed: torch.Tensor, scale: torch.Tensor, gi: torch.Tensor) -> torch.Tensor:
    check_index(gi, packed.shape[0], "KV index", lowest=-1)
    gsel = gi.clamp(min=0)
    return fp4_dequantize(packed[gsel], scale[gsel])


def _window_plan(win_idx: torch.Tensor) -> tuple[Any, ...] | None:
    """What sparse_attention needs to know about a window index, computed once per tensor:
    None (gather), ("band", first, count) or ("uniform", first, count, last0, bias, rows)."""
    band = _banded(win_idx)
    if band is None:
        return None
    first, count = band
    uni = _uniform_band(win_idx, first, count)
    if uni is None:
        return ("band", first, count)
    t, w = win_idx.shape
    rows = min(_BAND_ROWS, t)
    mask = _band_mask(t, w, uni[0], uni[1], rows, win_idx.device)
    bias = torch.zeros(mask.shape, device=win_idx.device).masked_fill_(~mask, float("-inf"))
    return ("uniform", first, count, uni[0], bias, rows)


def sparse_attention(
    q: torch.Tensor,
    win_kv: torch.Tensor,
    win_idx: torch.Tensor,
    glob_packed: torch.Tensor,
    glob_scale: torch.Tensor,
    glob_idx: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    t, h, d = q.shape
    plan = _MEMO.get("band", (win_idx,), lambda: _window_plan(win_idx))
    if plan is None or win_kv.shape[0] == 0:
        return ref.sparse_attention(
            q, win_kv, win_idx, glob_packed, glob_scale, glob_idx, sink, scale
        )
    first, count = plan[1], plan[2]
    qf = q.float() * scale
    sk = sink.float()[None, :]  # [1, H]
    kvw = win_kv.float()
    # Global part: gather the few selected entries and dequantize them by table lookup.
    gi = glob_idx.long()
    has_glob = gi.shape[1] > 0 and glob_packed.shape[0] > 0
    if has_glob:
        gk = _MEMO.get(
            "glob",
            (glob_idx, glob_packed, glob_scale),
            lambda: _gather_fp4(glob_packed, glob_scale, gi),  # [T, K, D]
        )
        sg = torch.bmm(qf, gk.transpose(1, 2))  # [T, H, K]
        sg.masked_fill_((gi < 0)[:, None, :], float("-inf"))
    if plan[0] == "uniform":
        o = _uniform_attention(
            qf,
            kvw,
            win_idx.shape[1],
            plan[3],
            plan[5],
            plan[4],
            sink.float(),
            sg if has_glob else None,
            gk if has_glob else None,
        )
        return o.to(q.dtype)
    out = torch.empty(t, h, d, dtype=torch.float32, device=q.device)
    wmax = int(count.max()) if t else 0
    blk = _BAND_ROWS
    for a in range(0, t, blk):
        b = min(t, a + blk)
        lo = int(first[a:b].min())
        hi = int((first[a:b] + count[a:b]).max())
        if hi - lo > 2 * (b - a) + 2 * wmax:  # rows from far-apart windows: gather them
            out[a:b] = ref.sparse_attention(
                q[a:b], win_kv, win_idx[a:b], glob_packed, glob_scale, glob_idx[a:b], sink, scale
            )
            continue
        kw = kvw[lo:hi]
        nw = hi - lo
        tb = b - a
        sw = (qf[a:b].reshape(tb * h, d) @ kw.T).view(tb, h, nw)
        j = torch.arange(lo, hi, device=q.device)[None, :]
        f = first[a:b, None]
        outside = (j < f) | (j >= f + count[a:b, None])
        sw.masked_fill_(outside[:, None, :], float("-inf"))
        mx = torch.maximum(sw.amax(-1), sk)  # [tb, H]
        if has_glob:
            sgb = sg[a:b]
            mx = torch.maximum(mx, sgb.amax(-1))
            eg = torch.exp(sgb - mx[..., None])
        ew = torch.exp(sw - mx[..., None])
        denom = ew.sum(-1) + torch.exp(sk - mx)
        if has_glob:
            denom = denom + eg.sum(-1)
        o = (ew.view(tb * h, nw) @ kw).view(tb, h, d)
        if has_glob:
            o = o + torch.bmm(eg, gk[a:b])
        out[a:b] = o / denom[..., None]
    return out.to(q.dtype)


# --------------------------------------------------------------------------------------
# Engram


engram_rows = ref.engram_rows
engram_gate = ref.engram_gate


def engram_gather(table: torch.Tensor, exp: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    r = rows.long()
    check_index(r, table.shape[0], "Engram row")
    return fp8_dequantize(table[r], exp[r]).flatten(1)
