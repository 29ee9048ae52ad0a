"""DSpark speculative drafting: 3 window-only draft layers (40-42) predict a block of up
to 5 positions in one pass.

Input to slot i: `W_in [h_38; h_39; E(g0)] + slot_i`, where h_38, h_39 are the last two
backbone layers' collapsed hidden states at the last position and g0 = argmax of the
backbone's last logits (the token greedy decoding emits next, certain). The slots attend
to each other causally (their window is the draft block itself, so draft layers keep no
state between steps and add no SWA bytes). Slot i's logits are refined by a low-rank
Markov (bigram) head on the previous draft token (g0 for slot 0) and slot i predicts the
token after it; a confidence head gives sigmoid(w·h_i + b) per slot. Prefix survival is
the cumulative product of the confidences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import dispatch as ops

from .config import ModelConfig
from .weights import Weights, apply_rope, rmsnorm, rope_rot


@dataclass
class Draft:
    tokens: torch.Tensor  # [n] int64: guesses for the n tokens after g0
    confidences: torch.Tensor  # [n] fp32 in (0, 1)
    first: int  # g0, the certain next token the draft follows

    @property
    def survival(self) -> torch.Tensor:
        return torch.cumprod(self.confidences, 0)


def draft_block(cfg: ModelConfig, w: Weights, hidden: torch.Tensor, g0: int, n: int) -> Draft:
    """hidden [2, dim]; n <= cfg.draft_positions."""
    if not 0 <= n <= cfg.draft_positions:
        raise ValueError(f"draft length must be in [0, {cfg.draft_positions}]")
    dev = hidden.device
    dw = w.draft
    p = cfg.draft_positions
    base = torch.cat((hidden.reshape(-1), w.embed[g0])) @ dw.w_in  # [dim]
    x = base.unsqueeze(0) + dw.slot  # [P, dim]
    pos = torch.arange(p, device=dev)
    rot = rope_rot(pos, cfg.rope_dim, cfg.rope_theta)
    j = pos.unsqueeze(1) - torch.arange(p - 1, -1, -1, device=dev).unsqueeze(0)
    win_idx = torch.where(j >= 0, j, torch.full_like(j, -1)).to(torch.int32)
    empty_p = torch.zeros(0, cfg.head_dim // 2, dtype=torch.uint8, device=dev)
    empty_s = torch.zeros(0, cfg.head_dim // 16, dtype=torch.uint8, device=dev)
    empty_i = torch.zeros(p, 0, dtype=torch.int32, device=dev)
    for layer in range(cfg.n_layers, cfg.n_layers + 3):
        bw = w.blocks[layer]
        aw = bw.attn
        xn = rmsnorm(x)
        qr = rmsnorm(xn @ aw.wq_a)
        q = apply_rope((qr @ aw.wq_b).view(p, cfg.n_heads, cfg.head_dim), rot)
        kv = ops.fp8_qdq(apply_rope(rmsnorm(xn @ aw.wkv), rot), cfg.fp8_block)
        o = ops.sparse_attention(
            q, kv, win_idx, empty_p, empty_s, empty_i, aw.sink, cfg.head_dim**-0.5
        )
        o = apply_rope(o, rot, inverse=True)
        o = (
            torch.einsum("ngk,gkr->ngr", o.reshape(p, cfg.o_groups, -1), aw.wo_a).reshape(p, -1)
            @ aw.wo_b
        )
        x = x + o
        xn = rmsnorm(x)
        x = x + (torch.nn.functional.silu(xn @ bw.w1) * (xn @ bw.w3)) @ bw.w2
    hfin = rmsnorm(x)
    logits = hfin @ w.head  # [P, V]
    conf = torch.sigmoid(hfin @ dw.conf_w + dw.conf_b)
    toks: list[int] = []
    prev = g0
    for i in range(n):
        li = logits[i] + dw.markov_u[prev] @ dw.markov_v
        prev = int(li.argmax())
        toks.append(prev)
    return Draft(
        tokens=torch.tensor(toks, dtype=torch.int64),
        confidences=conf[:n].float().cpu(),
        first=g0,
    )
