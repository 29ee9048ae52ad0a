"""Byte formats of a sequence's state.

Global blob for tokens [start, end) (block-aligned): for each full layer in order
(2, 8, 14, 20), the entries e in [start/m, end/m) as four contiguous arrays:
kv_packed [e, head_dim/2] | kv_scale [e, head_dim/16] (E4M3) | ik_packed [e, index_dim/2] |
ik_exp [e, index_dim/index_block] (int8). No header: its length is exactly
`cfg.global_bytes(end - start)` (890 bytes per token at full size).

Tail blob (everything past the last complete block): a header, then the SWA rings (per
backbone layer, `window` slots of FP8 bits [W, head_dim] then exponents [W, head_dim/32],
slot = position % window), the global entries past the aligned prefix and the partial
compressor groups (raw fp32 kv and gate scores) per full layer, the known trailing token
ids, and the last logits and hidden rows (what the next step and the draft start from).
Everything is bit-exact: a restored state continues identically.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from kernels import dispatch as ops

from .config import ModelConfig
from .state import SeqState

_TAIL_MAGIC = b"MV4T"
_TAIL_HEAD = struct.Struct("<4sHqqIIIIBB")  # magic, ver, n, n_aligned, W, P, n_tok, V, has_l, has_h


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().numpy().tobytes()


class _Reader:
    def __init__(self, data: bytes, device: torch.device) -> None:
        self.buf = memoryview(data)
        self.off = 0
        self.device = device

    def take(self, n: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        size = torch.tensor([], dtype=dtype).element_size()
        nbytes = n * size
        if self.off + nbytes > len(self.buf):
            raise ValueError("state blob is truncated")
        arr = np.frombuffer(self.buf[self.off : self.off + nbytes], dtype=_NP[dtype]).copy()
        self.off += nbytes
        return torch.from_numpy(arr).view(shape).to(self.device)

    def u32(self) -> int:
        (v,) = struct.unpack_from("<I", self.buf, self.off)
        self.off += 4
        return int(v)

    def done(self) -> None:
        if self.off != len(self.buf):
            raise ValueError("state blob has trailing bytes")


_NP = {
    torch.uint8: np.uint8,
    torch.int8: np.int8,
    torch.float32: np.float32,
    torch.int32: np.int32,
}


def export_global(cfg: ModelConfig, st: SeqState, start: int, end: int) -> bytes:
    bt = cfg.block_tokens
    if start % bt or end % bt or not 0 <= start < end:
        raise ValueError(f"[{start}, {end}) is not a non-empty range of {bt}-token blocks")
    if end > st.n_tokens:
        raise ValueError(f"end {end} is past the {st.n_tokens} processed tokens")
    out = []
    for f in cfg.full_layers:
        m = cfg.ratio(f)
        g = st.glob[f]
        e0, e1 = start // m, end // m
        if e1 > g.n or e0 < 0:
            raise ValueError(f"layer {f} holds entries [0, {g.n}), not [{e0}, {e1})")
        for arr in (g.kv_packed, g.kv_scale, g.ik_packed, g.ik_exp):
            out.append(_bytes(arr[e0:e1].view(torch.uint8)))
    blob = b"".join(out)
    assert len(blob) == cfg.global_bytes(end - start)
    return blob


def _read_entries(
    cfg: ModelConfig, r: _Reader, e: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    hd, di = cfg.head_dim, cfg.index_dim
    kp = r.take(e * hd // 2, torch.uint8, (e, hd // 2))
    ks = r.take(e * hd // 16, torch.uint8, (e, hd // 16))
    ip = r.take(e * di // 2, torch.uint8, (e, di // 2))
    ie = r.take(e * di // cfg.index_block, torch.int8, (e, di // cfg.index_block))
    return kp, ks, ip, ie


def state_from_global(
    cfg: ModelConfig,
    device: torch.device,
    blobs: list[bytes],
    n_tokens: int,
    tokens: list[int] | None = None,
) -> SeqState:
    """Global state of a block-aligned prefix from consecutive blobs starting at token 0.
    The windows are empty: replay (or import_tail) rebuilds them."""
    bt = cfg.block_tokens
    if n_tokens % bt or n_tokens < 0:
        raise ValueError(f"n_tokens {n_tokens} is not a multiple of {bt}")
    per_block = cfg.global_bytes(bt)
    total = sum(len(b) for b in blobs)
    if total != cfg.global_bytes(n_tokens):
        raise ValueError(
            f"blobs hold {total} bytes, {n_tokens} tokens need {cfg.global_bytes(n_tokens)}"
        )
    st = SeqState.empty(cfg, device)
    for blob in blobs:
        if len(blob) % per_block:
            raise ValueError("a blob does not cover whole blocks")
        ntok = len(blob) // per_block * bt
        r = _Reader(blob, device)
        for f in cfg.full_layers:
            kp, ks, ip, ie = _read_entries(cfg, r, ntok // cfg.ratio(f))
            ik = ops.fp4_pow2_dequantize(ip, ie, cfg.index_block)
            st.glob[f].append(kp, ks, ip, ie, ik)
        r.done()
    st.n_tokens = n_tokens
    if tokens is not None:
        if len(tokens) > n_tokens:
            raise ValueError("more tokens than n_tokens")
        st.tokens = list(tokens)
    return st


def export_tail(cfg: ModelConfig, st: SeqState) -> bytes:
    n = st.n_tokens
    W = cfg.window
    aligned = n // cfg.block_tokens * cfg.block_tokens
    P = int(st.win[0].shape[0])
    n_tok = min(len(st.tokens), 3 + n - aligned)
    has_l = st.last_logits is not None
    has_h = st.last_hidden is not None
    parts = [_TAIL_HEAD.pack(_TAIL_MAGIC, 1, n, aligned, W, P, n_tok, cfg.vocab, has_l, has_h)]
    slots = torch.arange(n - P, n, device=st.device) % W
    for layer in range(cfg.n_layers):
        vals, exp = st.win[layer], st.win_exp[layer]
        bits = torch.zeros(W, cfg.head_dim, dtype=torch.uint8, device=st.device)
        exps = torch.zeros(W, cfg.head_dim // cfg.fp8_block, dtype=torch.int8, device=st.device)
        if P:
            scaled = vals.view(P, -1, cfg.fp8_block) * torch.exp2(-exp.float()).unsqueeze(-1)
            bits[slots] = scaled.reshape(P, -1).to(torch.float8_e4m3fn).view(torch.uint8)
            exps[slots] = exp
        parts += [_bytes(bits), _bytes(exps.view(torch.uint8))]
    for f in cfg.full_layers:
        g = st.glob[f]
        e0 = aligned // cfg.ratio(f)
        parts.append(struct.pack("<I", g.n - e0))
        for arr in (g.kv_packed, g.kv_scale, g.ik_packed, g.ik_exp):
            parts.append(_bytes(arr[e0 : g.n].view(torch.uint8)))
        pk, ps = st.pending_kv[f], st.pending_score[f]
        parts.append(struct.pack("<I", int(pk.shape[0])))
        parts += [_bytes(pk.float()), _bytes(ps.float())]
    if n_tok:
        parts.append(_bytes(torch.tensor(st.tokens[-n_tok:], dtype=torch.int32)))
    if has_l:
        assert st.last_logits is not None
        parts.append(_bytes(st.last_logits.float()))
    if has_h:
        assert st.last_hidden is not None
        parts.append(_bytes(st.last_hidden.float()))
    return b"".join(parts)


def import_tail(cfg: ModelConfig, st: SeqState, tail: bytes) -> None:
    """Bring a state restored at the tail's aligned prefix up to the tail's n_tokens."""
    if len(tail) < _TAIL_HEAD.size:
        raise ValueError("tail blob is truncated")
    magic, ver, n, aligned, W, P, n_tok, V, has_l, has_h = _TAIL_HEAD.unpack_from(tail)
    if magic != _TAIL_MAGIC or ver != 1:
        raise ValueError("not a tail blob")
    if cfg.window != W or cfg.vocab != V:
        raise ValueError("tail blob is from another configuration")
    if st.n_tokens != aligned:
        raise ValueError(f"state holds {st.n_tokens} tokens; the tail continues from {aligned}")
    for f in cfg.full_layers:
        if st.glob[f].n != aligned // cfg.ratio(f):
            raise ValueError("state's global entries do not match its token count")
    dev = st.device
    r = _Reader(tail, dev)
    r.off = _TAIL_HEAD.size
    hd, eb = cfg.head_dim, cfg.head_dim // cfg.fp8_block
    slots = torch.arange(n - P, n, device=dev) % W
    wins, exps = [], []
    for _ in range(cfg.n_layers):
        bits = r.take(W * hd, torch.uint8, (W, hd))
        ex = r.take(W * eb, torch.int8, (W, eb))
        wins.append(ops.fp8_dequantize(bits[slots], ex[slots], cfg.fp8_block))
        exps.append(ex[slots].clone())
    entries = []
    for f in cfg.full_layers:
        e = r.u32()
        kp, ks, ip, ie = _read_entries(cfg, r, e)
        p = r.u32()
        pk = r.take(p * hd, torch.float32, (p, hd))
        ps = r.take(p * hd, torch.float32, (p, hd))
        entries.append((f, kp, ks, ip, ie, pk, ps))
    toks = r.take(n_tok, torch.int32, (n_tok,)).tolist() if n_tok else []
    logits = r.take(V, torch.float32, (V,)) if has_l else None
    hidden = r.take(2 * cfg.dim, torch.float32, (2, cfg.dim)) if has_h else None
    r.done()
    # Parsed completely: now change the state.
    st.win, st.win_exp = wins, exps
    for f, kp, ks, ip, ie, pk, ps in entries:
        st.glob[f].append(kp, ks, ip, ie, ops.fp4_pow2_dequantize(ip, ie, cfg.index_block))
        st.pending_kv[f], st.pending_score[f] = pk, ps
    new = n - aligned
    if st.tokens and len(toks) >= new:
        st.tokens = st.tokens + toks[len(toks) - new :]
    else:
        st.tokens = toks
    st.n_tokens = n
    st.last_logits, st.last_hidden = logits, hidden
