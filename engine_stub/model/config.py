"""Model configuration and the 40 + 3 layer schedule of DeepSeek-V4.1-Flash.

Per-layer compression ratio m: `[0, 0] + [2] * 18 + [1] * 20 + [0] * 3`: layers 0-1 are
window-only, 2-19 the causal encoder (m = 2), 20-39 the decoder (m = 1), 40-42 the DSpark
draft layers (window-only). CSA2 roles among layers with m > 0:

- full: creates global KV (the gated compressor) and index keys (2, 8, 14, 20);
- reindex: reuses the latest full layer's KV but scores its own top-k (24, 28, 32, 36);
- reuse: takes the latest full layer's KV and the latest full/reindex layer's top-k.

Layer 20 is the candidate source: its indexer publishes the hierarchical block mask that
later index layers pick inside. `ModelConfig.tiny()` is the miniature the engine runs;
`ModelConfig.full()` carries the full-size widths for the memory model only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

Role = Literal["window", "full", "reindex", "reuse"]

N_BACKBONE = 40
N_DRAFT = 3
RATIOS: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20 + (0,) * 3
FULL_LAYERS: tuple[int, ...] = (2, 8, 14, 20)
REINDEX_LAYERS: tuple[int, ...] = (24, 28, 32, 36)
CANDIDATE_SOURCE = 20
ENGRAM_LAYERS: tuple[int, ...] = (1, 14)


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 512
    dim: int = 64
    n_heads: int = 4
    head_dim: int = 32
    rope_dim: int = 8
    q_rank: int = 32
    o_groups: int = 2
    o_rank: int = 32
    ffn_hidden: int = 128
    hc_mult: int = 2  # residual copies (hyper-connections)
    window: int = 128
    fp8_block: int = 32
    index_heads: int = 4
    index_dim: int = 32
    index_block: int = 32  # power-of-two scale block of FP4 index keys
    topk: int = 16
    cand_block: int = 4
    cand_keep: int = 8
    engram_heads: int = 8
    engram_dim: int = 32
    engram_prime_base: int = 1000
    draft_positions: int = 5
    markov_rank: int = 16
    block_tokens: int = 256
    prefill_chunk: int = 512
    rope_theta: float = 10000.0
    ratios: tuple[int, ...] = field(default=RATIOS)
    full_layers: tuple[int, ...] = field(default=FULL_LAYERS)
    reindex_layers: tuple[int, ...] = field(default=REINDEX_LAYERS)
    candidate_source: int = CANDIDATE_SOURCE
    engram_layers: tuple[int, ...] = field(default=ENGRAM_LAYERS)

    def __post_init__(self) -> None:
        if len(self.ratios) != N_BACKBONE + N_DRAFT:
            raise ValueError("ratios must cover 40 backbone + 3 draft layers")
        if self.window < 2:
            raise ValueError("window must be at least 2")
        if self.head_dim % 16 or self.head_dim % self.fp8_block:
            raise ValueError("head_dim must be a multiple of 16 and of fp8_block")
        if self.index_dim % self.index_block or self.index_dim % 2:
            raise ValueError("index_dim must be a multiple of index_block")
        if (self.n_heads * self.head_dim) % self.o_groups:
            raise ValueError("heads x head_dim must split into o_groups")
        if self.engram_dim % 32:
            raise ValueError("engram_dim must be a multiple of 32 (FP8 scale block)")
        for layer in self.full_layers:
            if self.ratios[layer] == 0:
                raise ValueError(f"full layer {layer} has no compression ratio")
        if self.block_tokens % 2:
            raise ValueError("block_tokens must be a multiple of every ratio")

    @staticmethod
    def tiny(window: int = 128, **kw: int) -> ModelConfig:
        """The miniature the engine runs (REFERENCE_MODEL.md, "Miniature (suggested)")."""
        return ModelConfig(window=window, **kw)  # type: ignore[arg-type]

    @staticmethod
    def full() -> ModelConfig:
        """Full-size widths (memory model only; never instantiated as weights)."""
        return ModelConfig(
            vocab=129280,
            dim=5120,
            n_heads=64,
            head_dim=512,
            rope_dim=64,
            q_rank=1280,
            o_groups=8,
            o_rank=1024,
            ffn_hidden=2048,
            hc_mult=4,
            window=128,
            index_heads=32,
            index_dim=128,
            index_block=32,
            topk=512,
            cand_block=8,
            cand_keep=2048,
            engram_heads=8,
            engram_dim=256,
            engram_prime_base=15_950_000,
            markov_rank=256,
        )

    def with_window(self, window: int) -> ModelConfig:
        return replace(self, window=window)

    # -- the schedule -------------------------------------------------------------

    @property
    def n_layers(self) -> int:
        return N_BACKBONE

    def ratio(self, layer: int) -> int:
        return self.ratios[layer]

    def role(self, layer: int) -> Role:
        if self.ratios[layer] == 0:
            return "window"
        if layer in self.full_layers:
            return "full"
        if layer in self.reindex_layers:
            return "reindex"
        return "reuse"

    def kv_source(self, layer: int) -> int | None:
        """The full layer whose global KV `layer` attends to (None: window-only)."""
        if self.ratios[layer] == 0:
            return None
        src = [f for f in self.full_layers if f <= layer]
        if not src:
            raise ValueError(f"layer {layer} has m > 0 but no earlier full layer")
        return src[-1]

    def topk_source(self, layer: int) -> int | None:
        """The full or reindex layer whose selected positions `layer` uses."""
        if self.ratios[layer] == 0:
            return None
        src = [f for f in (*self.full_layers, *self.reindex_layers) if f <= layer]
        return max(src)

    # -- sizes ----------------------------------------------------------------------

    @property
    def kv_entry_bytes(self) -> int:
        """One FP4 global-KV entry: head_dim/2 packed bytes + one E4M3 scale per 16."""
        return self.head_dim // 2 + self.head_dim // 16

    @property
    def index_entry_bytes(self) -> int:
        """One FP4 index key: index_dim/2 packed bytes + one exponent per index_block."""
        return self.index_dim // 2 + self.index_dim // self.index_block

    @property
    def swa_slot_bytes(self) -> int:
        """One FP8 window slot: head_dim bytes + one exponent byte per fp8_block."""
        return self.head_dim + self.head_dim // self.fp8_block

    @property
    def engram_prime_floor(self) -> int:
        """Engram's primes are the consecutive primes above engram_prime_base (each module
        takes the next 3 x engram_heads): the floor `kernels.dispatch.engram_primes`
        counts from."""
        return self.engram_prime_base + 1

    def global_bytes(self, n_tokens: int) -> int:
        """Bytes of global state for `n_tokens` (a multiple of every ratio)."""
        per = self.kv_entry_bytes + self.index_entry_bytes
        return sum(per * (n_tokens // self.ratios[f]) for f in self.full_layers)
