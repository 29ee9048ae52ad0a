"""The backbone forward pass over a batch of segments (one sequence's new tokens each).

Prefill is one segment of a few hundred tokens; a decode step is B segments of one token;
verification is one segment of 1 + draft tokens. Rows of all segments are concatenated
for every projection; only window assembly, the compressor and the indexer are per
segment. Per layer (REFERENCE_MODEL.md):

1. Engram (layers 1, 14): h += gate * value per residual copy, from rows whose fetch from
   host memory started before layer 0 ran and overlaps the earlier layers
   (`engram_prefetch`); the layer waits only if they are not there yet.
2. Attention on the collapsed residual: query `q = Wq_b RMSNorm(Wq_a x)`, RoPE; window KV
   `RMSNorm(Wkv x)`, RoPE, FP8; full layers compress complete groups of m tokens (gated
   softmax for m = 2) into FP4 global KV + FP4 index keys; full/reindex layers score the
   indexer and pick top-k (layer 20 publishes candidate blocks first; 24-36 pick inside
   them); reuse layers take their sources' KV and positions. Sparse attention with sink,
   inverse RoPE on the output tail, grouped output projection.
3. SwiGLU FFN. Both sublayers read and write the C residual copies (hyper-connections).

The miniature's FFN is dense (the real model's MoE changes nothing that is cached).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels import dispatch as ops

from .config import ModelConfig
from .engram_prefetch import EngramFetch, EngramPrefetcher, EngramStats
from .state import SeqState
from .weights import AttnWeights, BlockWeights, Weights, apply_rope, rmsnorm, rope_rot


@dataclass
class Segment:
    st: SeqState
    ids: torch.Tensor  # [T] int64 (device)
    p0: int  # position of the first row
    frozen_global: bool = False  # replay: read global state, never write it


@dataclass
class ForwardOut:
    logits: torch.Tensor  # [sum T, V] (all rows) or [B, V] (last row per segment)
    hidden: list[torch.Tensor] = field(default_factory=list)  # per segment [2, dim]


class Backbone:
    def __init__(
        self, cfg: ModelConfig, w: Weights, device: torch.device, engram_prefetch: bool = True
    ) -> None:
        self.cfg = cfg
        self.w = w
        self.device = device
        self.compressed = torch.tensor(
            _compressed_table(cfg.vocab), dtype=torch.int64, device=device
        )
        self.engram = EngramPrefetcher(w, self.compressed, device, overlap=engram_prefetch)

    @property
    def engram_stats(self) -> EngramStats:
        return self.engram.stats

    def engram_rows(self, layer: int, segs: list[Segment]) -> torch.Tensor:
        """Rows [N, 24] for all segments' new tokens: a function of token ids only."""
        return self.engram.rows(layer, self.engram.segment_ids(segs)).to(self.device)

    # -- the pass -----------------------------------------------------------------

    def run(self, segs: list[Segment], all_logits: bool = False) -> ForwardOut:
        # Start fetching every Engram layer's rows first; the layers wait only when they
        # need them (finish() in the finally: a pass that raises leaves no job behind).
        engram = self.engram.start(self.engram.segment_ids(segs))
        try:
            return self._run(segs, all_logits, engram)
        finally:
            engram.finish()

    def _run(self, segs: list[Segment], all_logits: bool, engram: EngramFetch) -> ForwardOut:
        c, w = self.cfg, self.w
        dev = self.device
        lens = [int(s.ids.shape[0]) for s in segs]
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        ids = torch.cat([s.ids for s in segs]) if len(segs) > 1 else segs[0].ids
        pos = torch.cat(
            [torch.arange(s.p0, s.p0 + n, device=dev) for s, n in zip(segs, lens, strict=True)]
        )
        rot = rope_rot(pos, c.rope_dim, c.rope_theta)
        win_idx, prev_len = self._window_index(segs, lens)

        # The C residual copies as h [C, N, dim]: collapsing them is one GEMV and mixing
        # them one [C, C] x [C, N*dim] GEMM (as [N, C, dim] both were N tiny GEMMs).
        cm, nrows, dim = c.hc_mult, ids.shape[0], c.dim
        h = w.embed[ids].unsqueeze(0).expand(cm, -1, -1).contiguous()
        ctx = _LayerCtx(pos=pos, rot=rot, win_idx=win_idx, starts=starts)
        hidden_rows: list[torch.Tensor] = []
        last_rows = torch.tensor([s - 1 for s in starts[1:]], device=dev)
        for layer in range(c.n_layers):
            bw = w.blocks[layer]
            if layer in w.engram:
                ew = w.engram[layer]
                emb = engram.get(layer)
                hg = ops.engram_gate(h.transpose(0, 1), emb @ ew.wk, emb @ ew.wv)
                h = hg.transpose(0, 1).contiguous()
            hf = h.view(cm, -1)
            x = rmsnorm((bw.hc_pre[0] @ hf).view(nrows, dim))
            a = self._attention(layer, bw.attn, x, segs, lens, prev_len, ctx)
            h = (bw.hc_res[0] @ hf).view(cm, nrows, dim)
            h.addcmul_(bw.hc_post[0].view(-1, 1, 1), a.unsqueeze(0))
            hf = h.view(cm, -1)
            x = rmsnorm((bw.hc_pre[1] @ hf).view(nrows, dim))
            assert bw.w13 is not None
            g13 = x @ bw.w13
            hid = c.ffn_hidden
            f = (torch.nn.functional.silu(g13[:, :hid]) * g13[:, hid:]) @ bw.w2
            h = (bw.hc_res[1] @ hf).view(cm, nrows, dim)
            h.addcmul_(bw.hc_post[1].view(-1, 1, 1), f.unsqueeze(0))
            if layer >= c.n_layers - 2:
                hidden_rows.append(_collapse(w.final_pre, h[:, last_rows]))
        hfin = rmsnorm(_collapse(w.final_pre, h if all_logits else h[:, last_rows]))
        logits = hfin @ w.head
        hidden = torch.stack(hidden_rows, dim=1)  # [B, 2, dim]
        return ForwardOut(logits=logits, hidden=[hidden[i] for i in range(len(segs))])

    def _window_index(self, segs: list[Segment], lens: list[int]) -> tuple[torch.Tensor, list[int]]:
        """win_idx [N, W] into the per-layer concatenation of (previous window, new rows)
        of every segment; -1 outside the window or before what the state holds."""
        W = self.cfg.window
        out = []
        base = 0
        prev_len = []
        for sg, n in zip(segs, lens, strict=True):
            p = int(sg.st.win[0].shape[0])
            prev_len.append(p)
            local = torch.arange(n, device=self.device).unsqueeze(1) + p  # row index in local array
            j = local - (W - 1) + torch.arange(W, device=self.device).unsqueeze(0)
            idx = torch.where(j >= 0, j + base, torch.full_like(j, -1))
            out.append(idx)
            base += p + n
        return (torch.cat(out) if len(out) > 1 else out[0]).to(torch.int32), prev_len

    def _attention(
        self,
        layer: int,
        aw: AttnWeights,
        x: torch.Tensor,
        segs: list[Segment],
        lens: list[int],
        prev_len: list[int],
        ctx: _LayerCtx,
    ) -> torch.Tensor:
        c = self.cfg
        n = x.shape[0]
        assert aw.w_x is not None and aw.w_qr is not None
        xp = x @ aw.w_x  # [N, q_rank | D | HI? | D? | D?]
        qa, hd = c.q_rank, c.head_dim
        qr = rmsnorm(xp[:, :qa])
        qq = qr @ aw.w_qr  # [N, H*D | HI*Di?]
        q = qq[:, : c.n_heads * hd].reshape(n, c.n_heads, hd)
        qk = apply_rope(torch.cat((q, rmsnorm(xp[:, qa : qa + hd]).unsqueeze(1)), dim=1), ctx.rot)
        q, kv = qk[:, : c.n_heads], qk[:, c.n_heads]
        bits, exp = ops.fp8_quantize(kv, c.fp8_block)
        kv = ops.fp8_dequantize(bits, exp, c.fp8_block)
        parts = []
        for i, sg in enumerate(segs):
            st = sg.st
            s0, s1 = ctx.starts[i], ctx.starts[i + 1]
            new_v, new_e = kv[s0:s1], exp[s0:s1]
            full_v = torch.cat((st.win[layer], new_v)) if prev_len[i] else new_v
            full_e = torch.cat((st.win_exp[layer], new_e)) if prev_len[i] else new_e
            parts.append(full_v)
            keep_v, keep_e = full_v[-c.window :], full_e[-c.window :]
            if full_v.shape[0] > 2 * c.window:  # do not pin a whole chunk's rows
                keep_v, keep_e = keep_v.clone(), keep_e.clone()
            st.win[layer], st.win_exp[layer] = keep_v, keep_e
        win_kv = torch.cat(parts) if len(parts) > 1 else parts[0]

        m = c.ratio(layer)
        role = c.role(layer)
        if m == 0:
            gp = torch.zeros(0, c.head_dim // 2, dtype=torch.uint8, device=self.device)
            gs = torch.zeros(0, c.head_dim // 16, dtype=torch.uint8, device=self.device)
            gi = torch.zeros(n, 0, dtype=torch.int32, device=self.device)
        else:
            src = c.kv_source(layer)
            assert src is not None
            off = qa + hd + c.index_heads  # wc_kv, wc_gate columns of xp (full layers)
            if role == "full":
                for i, sg in enumerate(segs):
                    if not sg.frozen_global:
                        rows = xp[ctx.starts[i] : ctx.starts[i + 1]]
                        self._compress(layer, aw, rows[:, off : off + hd], rows[:, off + hd :], sg)
            if role in ("full", "reindex"):
                wts = xp[:, qa + hd : off]
                qi = qq[:, c.n_heads * hd :]
                ctx.topk[layer] = self._index(layer, qi, wts, segs, src, m, ctx)
            tsrc = c.topk_source(layer)
            assert tsrc is not None
            gi = ctx.topk[tsrc]
            gp, gs = ctx.glob_cat(src, segs)
        o = ops.sparse_attention(q, win_kv, ctx.win_idx, gp, gs, gi, aw.sink, c.head_dim**-0.5)
        o = apply_rope(o, ctx.rot, inverse=True)
        o = torch.bmm(o.reshape(n, c.o_groups, -1).transpose(0, 1), aw.wo_a)  # [G, n, r]
        return o.transpose(0, 1).reshape(n, -1) @ aw.wo_b

    def _compress(
        self, layer: int, aw: AttnWeights, kv: torch.Tensor, sc: torch.Tensor, sg: Segment
    ) -> None:
        """Complete groups of m tokens -> FP4 global KV + FP4 index keys; the rest waits.
        kv = Wkv x and sc = Wgate x [T, head_dim] for this segment's rows."""
        c, st = self.cfg, sg.st
        m = c.ratio(layer)
        assert aw.wc_ik is not None
        pend_kv, pend_sc = st.pending_kv[layer], st.pending_score[layer]
        if m > 1:
            kv = torch.cat((pend_kv, kv))
            sc = torch.cat((pend_sc, sc))
        g = kv.shape[0] // m
        j0 = (sg.p0 - pend_kv.shape[0]) // m
        if m > 1:
            st.pending_kv[layer] = kv[g * m :]
            st.pending_score[layer] = sc[g * m :]
        if g == 0:
            return
        if m > 1:
            kvg = kv[: g * m].view(g, m, -1)
            wgt = torch.softmax(sc[: g * m].view(g, m, -1), dim=1)
            latent = rmsnorm((wgt * kvg).sum(1))
        else:
            latent = rmsnorm(kv)
        gpos = torch.arange(j0, j0 + g, device=self.device) * m
        rot = rope_rot(gpos, c.rope_dim, c.rope_theta)
        ik = apply_rope(rmsnorm(latent @ aw.wc_ik), rot)
        ik_packed, ik_exp = ops.fp4_pow2_quantize(ik, c.index_block)
        ik_deq = ops.fp4_pow2_dequantize(ik_packed, ik_exp, c.index_block)
        kv_packed, kv_scale = ops.fp4_quantize(apply_rope(latent, rot))
        store = st.glob[layer]
        if store.n != j0:
            raise RuntimeError(f"layer {layer}: global store has {store.n} entries, expected {j0}")
        store.append(kv_packed, kv_scale, ik_packed, ik_exp, ik_deq)

    def _index(
        self,
        layer: int,
        qi: torch.Tensor,
        wts: torch.Tensor,
        segs: list[Segment],
        src: int,
        m: int,
        ctx: _LayerCtx,
    ) -> torch.Tensor:
        """Top-k global positions per row [N, topk] int32, offset into ctx.glob_cat(src).
        qi = Wq_I qr [N, HI*Di], wts = Wproj x [N, HI]."""
        c = self.cfg
        n = qi.shape[0]
        qi = apply_rope(qi.reshape(n, c.index_heads, c.index_dim), ctx.rot)
        qp, qe = ops.fp4_pow2_quantize(qi, c.index_block)
        qi = ops.fp4_pow2_dequantize(qp, qe, c.index_block)
        wts = wts * (c.index_dim**-0.5 * c.index_heads**-0.5)
        out = []
        base = 0
        for i, sg in enumerate(segs):
            s0, s1 = ctx.starts[i], ctx.starts[i + 1]
            store = sg.st.glob[src]
            pos = ctx.pos[s0:s1]
            keys = store.ik[: store.n]
            cand = ctx.cand.get(i) if layer > c.candidate_source else None
            if cand is not None:
                # Later index layers pick inside layer 20's candidate blocks: only those
                # blocks are scored.
                idx = ops.indexer_select(
                    qi[s0:s1], wts[s0:s1], keys, pos, m, c.topk, cand, c.cand_block
                )
            else:
                scores = ops.indexer_scores(qi[s0:s1], wts[s0:s1], keys, pos, m)
                if layer == c.candidate_source:
                    ctx.cand[i] = ops.candidate_blocks(scores, c.cand_block, c.cand_keep, pos, m)
                idx = ops.indexer_topk(scores, c.topk, pos, m, None, c.cand_block)
            if base:
                idx = torch.where(idx >= 0, idx + base, idx)
            out.append(idx)
            base += store.n
        return torch.cat(out) if len(out) > 1 else out[0]


@dataclass
class _LayerCtx:
    pos: torch.Tensor
    rot: torch.Tensor  # [N, rope_dim/2] complex
    win_idx: torch.Tensor
    starts: list[int]
    topk: dict[int, torch.Tensor] = field(default_factory=dict)
    cand: dict[int, torch.Tensor] = field(default_factory=dict)
    _glob: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def glob_cat(self, src: int, segs: list[Segment]) -> tuple[torch.Tensor, torch.Tensor]:
        """Global KV of full layer `src` for all segments, concatenated (cached per pass:
        a full layer finishes appending before any layer reads it)."""
        got = self._glob.get(src)
        if got is None:
            stores = [s.st.glob[src] for s in segs]
            if len(stores) == 1:
                got = (stores[0].kv_packed[: stores[0].n], stores[0].kv_scale[: stores[0].n])
            else:
                got = (
                    torch.cat([g.kv_packed[: g.n] for g in stores]),
                    torch.cat([g.kv_scale[: g.n] for g in stores]),
                )
            self._glob[src] = got
        return got


def _collapse(p: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """sum_c p[c] h[c]: p [C], h [C, N, dim] -> [N, dim]."""
    return (p @ h.reshape(h.shape[0], -1)).view(h.shape[1], h.shape[2])


def _compressed_table(vocab: int) -> list[int]:
    from .tokenizer import ByteTokenizer

    return ByteTokenizer(vocab).compressed_ids()


__all__ = ["Backbone", "BlockWeights", "EngramStats", "ForwardOut", "Segment"]
