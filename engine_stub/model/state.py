"""Per-sequence state, split exactly as the serving layer stores it.

- Global state (per full layer): FP4 compressed KV entries and FP4 index keys, append-only,
  one entry per complete group of m tokens (`GlobalStore`), plus the partial compressor
  group waiting for its last tokens (`pending_kv`, `pending_score`, raw fp32).
- SWA state (per backbone layer): the last `window` FP8 window-KV entries, kept in
  position order as dequantized values plus their power-of-two exponents (the bytes are
  recovered exactly from the two).

The forward pass never mutates a window tensor in place and only appends past a store's
count, so a `Snapshot` (references and counts) rolls a state back exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import ModelConfig


class GlobalStore:
    """Append-only global entries of one full layer, with amortized capacity growth.

    kv_packed [n, head_dim/2] u8, kv_scale [n, head_dim/16] u8 (E4M3 bits),
    ik_packed [n, index_dim/2] u8, ik_exp [n, index_dim/index_block] i8, and ik (the
    dequantized index keys, fp32, derived: the indexer scores against it).
    """

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.n = 0
        self._alloc(64)

    def _alloc(self, cap: int) -> None:
        c, d = self.cfg, self.device
        self.kv_packed = torch.zeros(cap, c.head_dim // 2, dtype=torch.uint8, device=d)
        self.kv_scale = torch.zeros(cap, c.head_dim // 16, dtype=torch.uint8, device=d)
        self.ik_packed = torch.zeros(cap, c.index_dim // 2, dtype=torch.uint8, device=d)
        self.ik_exp = torch.zeros(cap, c.index_dim // c.index_block, dtype=torch.int8, device=d)
        self.ik = torch.zeros(cap, c.index_dim, dtype=torch.float32, device=d)

    @property
    def capacity(self) -> int:
        return int(self.kv_packed.shape[0])

    def _grow(self, need: int) -> None:
        if need <= self.capacity:
            return
        old = (self.kv_packed, self.kv_scale, self.ik_packed, self.ik_exp, self.ik)
        cap = self.capacity
        while cap < need:
            cap *= 2
        self._alloc(cap)
        for dst, src in zip(
            (self.kv_packed, self.kv_scale, self.ik_packed, self.ik_exp, self.ik), old, strict=True
        ):
            dst[: self.n] = src[: self.n]

    def append(
        self,
        kv_packed: torch.Tensor,
        kv_scale: torch.Tensor,
        ik_packed: torch.Tensor,
        ik_exp: torch.Tensor,
        ik: torch.Tensor,
    ) -> None:
        g = int(kv_packed.shape[0])
        if g == 0:
            return
        self._grow(self.n + g)
        s = slice(self.n, self.n + g)
        self.kv_packed[s] = kv_packed
        self.kv_scale[s] = kv_scale
        self.ik_packed[s] = ik_packed
        self.ik_exp[s] = ik_exp
        self.ik[s] = ik
        self.n += g

    def clone(self) -> GlobalStore:
        out = GlobalStore.__new__(GlobalStore)
        out.cfg, out.device, out.n = self.cfg, self.device, self.n
        out.kv_packed = self.kv_packed.clone()
        out.kv_scale = self.kv_scale.clone()
        out.ik_packed = self.ik_packed.clone()
        out.ik_exp = self.ik_exp.clone()
        out.ik = self.ik.clone()
        return out


@dataclass
class SeqState:
    """One sequence. `tokens` is the known suffix of the processed tokens (all of them for a
    state built by prefill; a state restored from global state knows only what it was
    given); `n_tokens` is authoritative."""

    cfg: ModelConfig
    device: torch.device
    n_tokens: int = 0
    tokens: list[int] = field(default_factory=list)
    win: list[torch.Tensor] = field(default_factory=list)  # per layer [P, head_dim] fp32
    win_exp: list[torch.Tensor] = field(default_factory=list)  # per layer [P, hd/32] i8
    glob: dict[int, GlobalStore] = field(default_factory=dict)
    pending_kv: dict[int, torch.Tensor] = field(default_factory=dict)  # [p, head_dim]
    pending_score: dict[int, torch.Tensor] = field(default_factory=dict)
    last_logits: torch.Tensor | None = None  # [V] logits after the last token
    last_hidden: torch.Tensor | None = None  # [2, dim]: last two backbone layers, last row

    @staticmethod
    def empty(cfg: ModelConfig, device: torch.device) -> SeqState:
        st = SeqState(cfg=cfg, device=device)
        hd, eb = cfg.head_dim, cfg.head_dim // cfg.fp8_block
        for _ in range(cfg.n_layers):
            st.win.append(torch.zeros(0, hd, device=device))
            st.win_exp.append(torch.zeros(0, eb, dtype=torch.int8, device=device))
        for f in cfg.full_layers:
            st.glob[f] = GlobalStore(cfg, device)
            st.pending_kv[f] = torch.zeros(0, hd, device=device)
            st.pending_score[f] = torch.zeros(0, hd, device=device)
        return st

    @property
    def has_swa(self) -> bool:
        """Whether the window rings hold the last min(n, window) positions."""
        return all(int(w.shape[0]) == min(self.n_tokens, self.cfg.window) for w in self.win)

    def snapshot(self) -> Snapshot:
        return Snapshot(
            n_tokens=self.n_tokens,
            n_known=len(self.tokens),
            win=list(self.win),
            win_exp=list(self.win_exp),
            glob_n={f: g.n for f, g in self.glob.items()},
            pending_kv=dict(self.pending_kv),
            pending_score=dict(self.pending_score),
            last_logits=self.last_logits,
            last_hidden=self.last_hidden,
        )

    def restore(self, snap: Snapshot) -> None:
        self.n_tokens = snap.n_tokens
        del self.tokens[snap.n_known :]
        self.win = list(snap.win)
        self.win_exp = list(snap.win_exp)
        for f, n in snap.glob_n.items():
            self.glob[f].n = n
        self.pending_kv = dict(snap.pending_kv)
        self.pending_score = dict(snap.pending_score)
        self.last_logits = snap.last_logits
        self.last_hidden = snap.last_hidden

    def clone(self) -> SeqState:
        st = SeqState(
            cfg=self.cfg,
            device=self.device,
            n_tokens=self.n_tokens,
            tokens=list(self.tokens),
            win=list(self.win),
            win_exp=list(self.win_exp),
            glob={f: g.clone() for f, g in self.glob.items()},
            pending_kv=dict(self.pending_kv),
            pending_score=dict(self.pending_score),
            last_logits=self.last_logits,
            last_hidden=self.last_hidden,
        )
        return st


@dataclass
class Snapshot:
    n_tokens: int
    n_known: int
    win: list[torch.Tensor]
    win_exp: list[torch.Tensor]
    glob_n: dict[int, int]
    pending_kv: dict[int, torch.Tensor]
    pending_score: dict[int, torch.Tensor]
    last_logits: torch.Tensor | None
    last_hidden: torch.Tensor | None
