"""The memory model, from the config alone.

- Global KV per token: every full layer stores, per complete group of m tokens, one FP4
  KV entry (head_dim/2 + head_dim/16 bytes) and one FP4 index key (index_dim/2 +
  index_dim/index_block bytes). Full size: (288 + 68) x (3 x 0.5 + 1) = 890 bytes/token.
- SWA per sequence: window slots x (head_dim FP8 bytes + head_dim/32 exponents) x 40
  backbone layers (the draft layers keep no window). Full size: 128 x 528 x 40.
- Engram: per module, (sum of its 24 primes) rows x engram_dim FP8 values (+ one
  exponent byte per 32 values).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kernels.dispatch import engram_primes, engram_table_rows

from .config import ModelConfig


@dataclass(frozen=True)
class MemoryModel:
    global_kv_bytes_per_token: float
    global_kv_bytes_per_block: int
    swa_slot_bytes: int
    swa_bytes_per_sequence: int
    swa_layers: int
    window: int
    engram_params: int
    engram_table_bytes: int
    engram_modules: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def memory_model(cfg: ModelConfig) -> MemoryModel:
    per_entry = cfg.kv_entry_bytes + cfg.index_entry_bytes
    per_token = sum(per_entry / cfg.ratio(f) for f in cfg.full_layers)
    rows = sum(
        engram_table_rows(engram_primes(cfg.engram_prime_floor, cfg.engram_heads, module))
        for module in range(len(cfg.engram_layers))
    )
    params = rows * cfg.engram_dim
    return MemoryModel(
        global_kv_bytes_per_token=per_token,
        global_kv_bytes_per_block=cfg.global_bytes(cfg.block_tokens),
        swa_slot_bytes=cfg.swa_slot_bytes,
        swa_bytes_per_sequence=cfg.window * cfg.swa_slot_bytes * cfg.n_layers,
        swa_layers=cfg.n_layers,
        window=cfg.window,
        engram_params=params,
        engram_table_bytes=params + params // 32,
        engram_modules=len(cfg.engram_layers),
    )


def print_memory(config: str, window: int = 128, as_json: bool = False) -> int:
    """`python -m engine_stub memory --config full|tiny`."""
    import json

    cfg = ModelConfig.full() if config == "full" else ModelConfig.tiny(window=window)
    mm = memory_model(cfg)
    if as_json:
        print(json.dumps(mm.as_dict()))
        return 0
    print(f"config: {config}")
    print(f"global_kv_bytes_per_token: {mm.global_kv_bytes_per_token:g}")
    print(f"global_kv_bytes_per_block: {mm.global_kv_bytes_per_block}")
    print(
        f"swa_bytes_per_sequence: {mm.swa_bytes_per_sequence} "
        f"({mm.window} x {mm.swa_slot_bytes} x {mm.swa_layers})"
    )
    print(
        f"engram_params: {mm.engram_params} "
        f"({mm.engram_params / 1e9:.1f}B in {mm.engram_modules} modules)"
    )
    print(f"engram_table_bytes: {mm.engram_table_bytes}")
    return 0
