"""FP4 (E2M1) quantize / dequantize kernels: global KV (E4M3 scale per 16 channels) and
index keys/queries (power-of-two scale per 32 channels).

The tensor is viewed as groups of ``GS`` contiguous channels (one scale each). A program
takes ``BLOCK_G`` groups; it loads the even and the odd channels of each group as two
``[BLOCK_G, GS/2]`` tiles, which are exactly the low and high nibbles of the packed bytes,
so packing needs no shuffle. Formats: ``kernels.reference.formats``.
"""

import torch
import triton
import triton.language as tl

from kernels.numerics import (
    ceil_log2_ratio,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode_abs,
    pow2,
)
from kernels.reference.formats import FP4_AMAX_FLOOR, FP4_SCALE_BLOCK, POW2_MIN_EXP

__all__ = [
    "fp4_dequantize",
    "fp4_pow2_dequantize",
    "fp4_pow2_quantize",
    "fp4_quantize",
]

BLOCK_G = 64  # groups per program


@triton.jit
def _fp4_quantize_kernel(
    x_ptr,  # [NG * GS] float, groups of GS channels
    packed_ptr,  # [NG * GS/2] uint8
    scale_ptr,  # [NG] uint8 (E4M3) or int8 (pow2 exponent)
    NG,
    GS: tl.constexpr,
    POW2: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    HALF: tl.constexpr = GS // 2
    g = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)  # [BLOCK_G]
    j = tl.arange(0, HALF)  # [HALF]
    gmask = g < NG
    mask = gmask[:, None]
    base = g[:, None].to(tl.int64) * GS + 2 * j[None, :]  # [BLOCK_G, HALF]
    xe = tl.load(x_ptr + base, mask=mask, other=0.0).to(tl.float32)
    xo = tl.load(x_ptr + base + 1, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.maximum(tl.abs(xe), tl.abs(xo)), axis=1), AMAX_FLOOR)
    if POW2:
        exp = ceil_log2_ratio(amax, 1.5, 2)  # 6 = 1.5 * 2^2
        s = pow2(exp)
        tl.store(scale_ptr + g, exp.to(tl.int8), mask=gmask)
    else:
        code = e4m3_encode_abs(amax * 0.16666667163372040)  # f32(1/6)
        s = e4m3_decode(code)
        tl.store(scale_ptr + g, code.to(tl.uint8), mask=gmask)
    lo = e2m1_encode(xe, s[:, None])
    hi = e2m1_encode(xo, s[:, None])
    out = g[:, None].to(tl.int64) * HALF + j[None, :]
    tl.store(packed_ptr + out, (lo | (hi << 4)).to(tl.uint8), mask=mask)


@triton.jit
def _fp4_dequantize_kernel(
    packed_ptr,  # [NG * GS/2] uint8
    scale_ptr,  # [NG] uint8 (E4M3) or int8 (pow2 exponent)
    out_ptr,  # [NG * GS] out dtype
    NG,
    GS: tl.constexpr,
    POW2: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    HALF: tl.constexpr = GS // 2
    g = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    j = tl.arange(0, HALF)
    gmask = g < NG
    mask = gmask[:, None]
    p = tl.load(packed_ptr + g[:, None].to(tl.int64) * HALF + j[None, :], mask=mask, other=0)
    p = p.to(tl.int32)
    if POW2:
        s = pow2(tl.load(scale_ptr + g, mask=gmask, other=0).to(tl.int32))
    else:
        s = e4m3_decode(tl.load(scale_ptr + g, mask=gmask, other=0).to(tl.int32))
    lo = e2m1_decode(p & 15) * s[:, None]
    hi = e2m1_decode(p >> 4) * s[:, None]
    base = g[:, None].to(tl.int64) * GS + 2 * j[None, :]
    tl.store(out_ptr + base, lo.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + base + 1, hi.to(out_ptr.dtype.element_ty), mask=mask)


def _check_block(d: int, block: int) -> None:
    if block < 2 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 2, got {block}")
    if d % block:
        raise ValueError(f"last dim {d} is not a multiple of the block {block}")


def _quantize(x: torch.Tensor, block: int, pow2_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[-1]
    _check_block(d, block)
    lead = x.shape[:-1]
    xc = x.contiguous()
    ng = xc.numel() // block
    packed = torch.empty(*lead, d // 2, dtype=torch.uint8, device=x.device)
    sdtype = torch.int8 if pow2_scale else torch.uint8
    scale = torch.empty(*lead, d // block, dtype=sdtype, device=x.device)
    if ng:
        floor = 6.0 * 2.0**POW2_MIN_EXP if pow2_scale else FP4_AMAX_FLOOR
        grid = (triton.cdiv(ng, BLOCK_G),)
        _fp4_quantize_kernel[grid](xc, packed, scale, ng, block, pow2_scale, floor, BLOCK_G)
    return packed, scale


def _dequantize(
    packed: torch.Tensor, scale: torch.Tensor, block: int, pow2_scale: bool, dtype: torch.dtype
) -> torch.Tensor:
    d = packed.shape[-1] * 2
    _check_block(d, block)
    if scale.shape != (*packed.shape[:-1], d // block):
        raise ValueError(f"scale {tuple(scale.shape)} does not fit packed {tuple(packed.shape)}")
    out = torch.empty(*packed.shape[:-1], d, dtype=dtype, device=packed.device)
    ng = out.numel() // block
    if ng:
        grid = (triton.cdiv(ng, BLOCK_G),)
        _fp4_dequantize_kernel[grid](
            packed.contiguous(), scale.contiguous(), out, ng, block, pow2_scale, BLOCK_G
        )
    return out


def fp4_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (packed [..., D//2] uint8, scale [..., D//16] uint8 E4M3)."""
    return _quantize(x, FP4_SCALE_BLOCK, False)


def fp4_dequantize(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """packed [..., D//2] uint8, scale [..., D//16] uint8 -> [..., D] ``dtype``."""
    return _dequantize(packed, scale, FP4_SCALE_BLOCK, False, dtype)


def fp4_pow2_quantize(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (packed [..., D//2] uint8, exp [..., D//block] int8)."""
    return _quantize(x, block, True)


def fp4_pow2_dequantize(
    packed: torch.Tensor, exp: torch.Tensor, block: int = 32, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """packed [..., D//2] uint8, exp [..., D//block] int8 -> [..., D] ``dtype``."""
    return _dequantize(packed, exp, block, True, dtype)
