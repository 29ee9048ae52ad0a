"""Capacity planner: what fits on one engine, and what is left for global KV and SWA state.

The arithmetic of the target deployment (DeepSeek-V4.1-Flash, one copy per TP4 engine
of RTX PRO 6000 Blackwell Server Edition); every figure is a parameter, its default and
source are in `docs/simulation.md`:

    usable           = gpus · usable_per_gpu                 4 · 95.59 GiB = 382.37 GiB
    checkpoint miss  = checkpoint − usable                   475.25 − 382.37 = 92.88 GiB
    Engram FP8→FP4   = engram_params · (1 − 0.5) bytes        196e9 · 0.5 B = 98 GB (decimal)
    KV budget        = usable − loaded weights − gpus · runtime reserve
    KV tokens        = KV budget / bytes per token (890)     ; in 1M-token sequences
    SWA sessions     = swa_share · host memory / SWA bytes per sequence (128·528·40 B)

`python -m simulations plan` prints it for loaded weights across the 300-320 GiB range.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

GIB = 1024**3
GB = 1000**3

USABLE_MIB_PER_GPU = 97_887
"""RTX PRO 6000 Blackwell Server Edition as the driver reports it (≈ 95.59 GiB)."""


@dataclass(frozen=True)
class Deployment:
    gpus: int = 4
    usable_gib_per_gpu: float = USABLE_MIB_PER_GPU / 1024
    checkpoint_gib: float = 475.25
    engram_params: float = 196e9
    loaded_weights_gib: float = 310.0
    reserve_gib_per_gpu: float = 3.0
    """Activations, CUDA graphs, NCCL buffers, running sequences' SWA: an estimate."""
    kv_bytes_per_token: float = 890.0
    swa_bytes_per_sequence: float = 128 * 528 * 40
    host_gib: float = 1024.0
    """Host memory per engine (half of a 2 TiB 8-GPU server): an estimate."""
    swa_share_of_host: float = 0.10
    host_kv_share_of_host: float = 0.50
    ssd_tb: float = 7.68
    """NVMe for the SSD tier per engine: an estimate."""

    @property
    def usable_gib(self) -> float:
        return self.gpus * self.usable_gib_per_gpu

    @property
    def checkpoint_miss_gib(self) -> float:
        return self.checkpoint_gib - self.usable_gib

    @property
    def engram_fp4_saving_bytes(self) -> float:
        # E4M3 → E2M1 halves the value bytes; the power-of-two scale per 32 is kept
        return self.engram_params * 0.5

    @property
    def kv_budget_gib(self) -> float:
        return self.usable_gib - self.loaded_weights_gib - self.gpus * self.reserve_gib_per_gpu

    @property
    def hbm_kv_tokens(self) -> int:
        return max(0, int(self.kv_budget_gib * GIB / self.kv_bytes_per_token))

    @property
    def host_kv_tokens(self) -> int:
        return int(self.host_kv_share_of_host * self.host_gib * GIB / self.kv_bytes_per_token)

    @property
    def ssd_kv_tokens(self) -> int:
        return int(self.ssd_tb * 1e12 / self.kv_bytes_per_token)

    @property
    def swa_pool_bytes(self) -> float:
        return self.swa_share_of_host * self.host_gib * GIB

    @property
    def swa_sessions(self) -> int:
        if self.swa_bytes_per_sequence <= 0:
            return 0
        return int(self.swa_pool_bytes // self.swa_bytes_per_sequence)


def report(d: Deployment, weights_range: tuple[float, ...] = (300.0, 310.0, 320.0)) -> str:
    lines = [
        f"GPUs per engine                 {d.gpus} x {d.usable_gib_per_gpu:.2f} GiB usable",
        f"usable together                 {d.usable_gib:.2f} GiB",
        f"full checkpoint                 {d.checkpoint_gib:.2f} GiB  -> misses by {d.checkpoint_miss_gib:.2f} GiB",
        f"Engram FP8 -> FP4 saves         {d.engram_fp4_saving_bytes / GB:.1f} GB "
        f"({d.engram_fp4_saving_bytes / GIB:.2f} GiB) of {d.engram_params / 1e9:.0f}B params",
        f"checkpoint after Engram FP4     {d.checkpoint_gib - d.engram_fp4_saving_bytes / GIB:.2f} GiB",
        f"runtime reserve                 {d.gpus} x {d.reserve_gib_per_gpu:.1f} GiB (estimate)",
        f"global KV                       {d.kv_bytes_per_token:.0f} B/token",
        "",
        "loaded weights  KV budget   KV tokens (HBM)   1M-token sequences",
    ]
    for w in weights_range:
        x = Deployment(**{**d.__dict__, "loaded_weights_gib": w})
        lines.append(
            f"{w:10.1f} GiB  {x.kv_budget_gib:7.2f} GiB  {x.hbm_kv_tokens:15,d}   {x.hbm_kv_tokens // 1_000_000:6d}"
        )
    lines += [
        "",
        f"host memory                     {d.host_gib:.0f} GiB (estimate)",
        f"host KV tier                    {d.host_kv_share_of_host:.0%} -> {d.host_kv_tokens:,d} tokens",
        f"SSD KV tier                     {d.ssd_tb:.2f} TB -> {d.ssd_kv_tokens:,d} tokens",
        f"SWA pool                        {d.swa_share_of_host:.0%} of host = {d.swa_pool_bytes / GIB:.1f} GiB, "
        f"{d.swa_bytes_per_sequence:,.0f} B/sequence -> {d.swa_sessions:,d} sessions",
    ]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Deployment()
    p.add_argument("--gpus", type=int, default=d.gpus)
    p.add_argument("--usable-gib-per-gpu", type=float, default=d.usable_gib_per_gpu)
    p.add_argument("--checkpoint-gib", type=float, default=d.checkpoint_gib)
    p.add_argument("--engram-params", type=float, default=d.engram_params)
    p.add_argument("--weights-gib", type=float, nargs="+", default=[300.0, 310.0, 320.0])
    p.add_argument("--reserve-gib-per-gpu", type=float, default=d.reserve_gib_per_gpu)
    p.add_argument("--kv-bytes-per-token", type=float, default=d.kv_bytes_per_token)
    p.add_argument("--host-gib", type=float, default=d.host_gib)
    p.add_argument("--ssd-tb", type=float, default=d.ssd_tb)


def from_args(a: argparse.Namespace) -> Deployment:
    return Deployment(
        gpus=a.gpus,
        usable_gib_per_gpu=a.usable_gib_per_gpu,
        checkpoint_gib=a.checkpoint_gib,
        engram_params=a.engram_params,
        reserve_gib_per_gpu=a.reserve_gib_per_gpu,
        kv_bytes_per_token=a.kv_bytes_per_token,
        host_gib=a.host_gib,
        ssd_tb=a.ssd_tb,
    )


def main(a: argparse.Namespace) -> int:
    d = from_args(a)
    for name, v in (("--gpus", d.gpus), ("--usable-gib-per-gpu", d.usable_gib_per_gpu)):
        if v <= 0:
            raise SystemExit(f"{name} must be positive")
    print(report(d, tuple(a.weights_gib)))
    return 0
