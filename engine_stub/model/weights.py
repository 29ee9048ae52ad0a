"""Random weights from a seed (nothing is downloaded), and the small shared math helpers.

Initialization keeps activations near unit scale through 40 layers: projections are
N(0, 1/fan_in), residual writes are scaled down by the depth, hyper-connection mixing
matrices are doubly stochastic (Sinkhorn-normalized), and Engram tables are FP8-quantized
at creation like the real tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import dispatch as ops
from kernels.dispatch import engram_hash_params, engram_table_rows

from .config import ModelConfig


def rmsnorm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim (no weight: random weights would only
    rescale)."""
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=eps)


def rope_rot(pos: torch.Tensor, rope_dim: int, theta: float) -> torch.Tensor:
    """Unit complex rotations [N, rope_dim/2] for integer positions [N]."""
    inv = theta ** (
        -torch.arange(0, rope_dim, 2, device=pos.device, dtype=torch.float32) / rope_dim
    )
    ang = pos.float().unsqueeze(-1) * inv
    return torch.polar(torch.ones_like(ang), ang)


def apply_rope(x: torch.Tensor, rot: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate interleaved pairs of the last rope_dim dims of x [N, ..., D] by the position
    angle (by minus it when inverse: the output tail). rot [N, r/2] complex broadcasts over
    the middle dims."""
    half = rot.shape[-1]
    r = 2 * half
    rot = rot.view((rot.shape[0],) + (1,) * (x.dim() - 2) + (half,))
    if inverse:
        rot = rot.conj()
    tail = torch.view_as_complex(x[..., -r:].reshape(*x.shape[:-1], half, 2).contiguous())
    out = x.clone()
    out[..., -r:] = torch.view_as_real(tail * rot).flatten(-2)
    return out


def _sinkhorn(m: torch.Tensor, iters: int = 20) -> torch.Tensor:
    p = m.exp()
    for _ in range(iters):
        p = p / p.sum(1, keepdim=True)
        p = p / p.sum(0, keepdim=True)
    return p


@dataclass
class AttnWeights:
    wq_a: torch.Tensor  # [dim, q_rank]
    wq_b: torch.Tensor  # [q_rank, H*D]
    wkv: torch.Tensor  # [dim, D]
    sink: torch.Tensor  # [H]
    wo_a: torch.Tensor  # [G, H*D/G, o_rank]
    wo_b: torch.Tensor  # [G*o_rank, dim]
    # compressor (full layers)
    wc_kv: torch.Tensor | None
    wc_gate: torch.Tensor | None
    wc_ik: torch.Tensor | None  # [D, Di] index-key projection of the latent
    # indexer query (full and reindex layers)
    wi_q: torch.Tensor | None  # [q_rank, HI*Di]
    wi_w: torch.Tensor | None  # [dim, HI]
    # Fused copies (one matmul per input): x @ [wq_a | wkv | wi_w? | wc_kv? | wc_gate?],
    # qr @ [wq_b | wi_q?]. Filled by fuse().
    w_x: torch.Tensor | None = None
    w_qr: torch.Tensor | None = None

    def fuse(self) -> None:
        xs = [self.wq_a, self.wkv]
        xs += [t for t in (self.wi_w, self.wc_kv, self.wc_gate) if t is not None]
        self.w_x = torch.cat(xs, dim=1).contiguous()
        qs = [self.wq_b] + ([self.wi_q] if self.wi_q is not None else [])
        self.w_qr = torch.cat(qs, dim=1).contiguous()


@dataclass
class BlockWeights:
    attn: AttnWeights
    w1: torch.Tensor  # [dim, hidden]
    w3: torch.Tensor
    w2: torch.Tensor  # [hidden, dim]
    hc_pre: torch.Tensor  # [2, C]: collapse weights (attention, ffn)
    hc_post: torch.Tensor  # [2, C]: write weights
    hc_res: torch.Tensor  # [2, C, C]: doubly stochastic mixing
    w13: torch.Tensor | None = None  # [dim, 2*hidden]: [w1 | w3] fused


@dataclass
class EngramWeights:
    table: torch.Tensor  # [R, Dh] u8 (E4M3 bits), host memory (pinned on CUDA)
    exp: torch.Tensor  # [R, Dh/32] i8, host memory
    mult: torch.Tensor  # [4] i64, odd
    primes: torch.Tensor  # [3, heads] i64
    offsets: torch.Tensor  # [3, heads] i64
    wk: torch.Tensor  # [24*Dh, dim]
    wv: torch.Tensor


@dataclass
class DraftWeights:
    w_in: torch.Tensor  # [3*dim, dim]: last two backbone hiddens + next-token embedding
    slot: torch.Tensor  # [P, dim]
    markov_u: torch.Tensor  # [V, r]
    markov_v: torch.Tensor  # [r, V]
    conf_w: torch.Tensor  # [dim]
    conf_b: float


class Weights:
    def __init__(self, cfg: ModelConfig, seed: int, device: torch.device) -> None:
        g = torch.Generator().manual_seed(seed)
        self.cfg = cfg
        dev = device

        def rnd(*shape: int, std: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * std).to(dev)

        def proj(fan_in: int, fan_out: int, gain: float = 1.0) -> torch.Tensor:
            return rnd(fan_in, fan_out, std=gain / fan_in**0.5)

        c = cfg
        hd_all = c.n_heads * c.head_dim
        depth_gain = (2.0 * (c.n_layers + 3)) ** -0.5
        self.embed = rnd(c.vocab, c.dim)
        self.head = proj(c.dim, c.vocab)
        self.final_pre = torch.softmax(rnd(c.hc_mult, std=0.1), 0)
        self.blocks: list[BlockWeights] = []
        for layer in range(c.n_layers + 3):
            role = c.role(layer)
            full = role == "full"
            scored = role in ("full", "reindex")
            attn = AttnWeights(
                wq_a=proj(c.dim, c.q_rank),
                wq_b=proj(c.q_rank, hd_all),
                wkv=proj(c.dim, c.head_dim),
                sink=rnd(c.n_heads),
                wo_a=rnd(
                    c.o_groups, hd_all // c.o_groups, c.o_rank, std=(hd_all // c.o_groups) ** -0.5
                ),
                wo_b=proj(c.o_groups * c.o_rank, c.dim, depth_gain),
                wc_kv=proj(c.dim, c.head_dim) if full else None,
                wc_gate=proj(c.dim, c.head_dim) if full else None,
                wc_ik=proj(c.head_dim, c.index_dim) if full else None,
                wi_q=proj(c.q_rank, c.index_heads * c.index_dim) if scored else None,
                wi_w=proj(c.dim, c.index_heads) if scored else None,
            )
            cm = c.hc_mult
            self.blocks.append(
                BlockWeights(
                    attn=attn,
                    w1=proj(c.dim, c.ffn_hidden),
                    w3=proj(c.dim, c.ffn_hidden),
                    w2=proj(c.ffn_hidden, c.dim, depth_gain),
                    hc_pre=torch.softmax(rnd(2, cm, std=0.5), -1),
                    hc_post=1.0 + rnd(2, cm, std=0.1),
                    hc_res=torch.stack(
                        [
                            _sinkhorn(4.0 * torch.eye(cm, device=dev) + rnd(cm, cm, std=0.5))
                            for _ in range(2)
                        ]
                    ),
                )
            )
        for bw in self.blocks:
            bw.attn.fuse()
            bw.w13 = torch.cat((bw.w1, bw.w3), dim=1).contiguous()
        self.engram: dict[int, EngramWeights] = {}
        for i, layer in enumerate(c.engram_layers):
            mult, primes, offsets = engram_hash_params(
                seed, c.engram_prime_floor, c.engram_heads, module=i
            )
            vals = rnd(engram_table_rows(primes), c.engram_dim)
            table, exp = ops.fp8_quantize(vals, 32)
            # The tables live in host memory (pinned on CUDA, so the prefetch's copies are
            # asynchronous): rows are fetched ahead of their layer (engram_prefetch.py).
            table, exp = table.cpu(), exp.cpu()
            if dev.type == "cuda":
                table, exp = table.pin_memory(), exp.pin_memory()
            width = 3 * c.engram_heads * c.engram_dim
            self.engram[layer] = EngramWeights(
                table=table,
                exp=exp,
                mult=mult.to(dev),
                primes=primes.to(dev),
                offsets=offsets.to(dev),
                wk=proj(width, c.dim),
                wv=proj(width, c.dim, depth_gain),
            )
        self.draft = DraftWeights(
            w_in=proj(3 * c.dim, c.dim),
            slot=rnd(c.draft_positions, c.dim, std=0.5),
            markov_u=rnd(c.vocab, c.markov_rank, std=0.5),
            markov_v=proj(c.markov_rank, c.vocab),
            conf_w=rnd(c.dim, std=c.dim**-0.5),
            conf_b=1.0,
        )
