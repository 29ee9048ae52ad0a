"""FP8 (E4M3) kernels with a power-of-two scale per block of 32 values: quantize to bits +
int8 exponents (Engram tables), dequantize, and quantize-dequantize (window KV).

The tensor is viewed as ``[NG, BLOCK]`` groups; a program takes ``BLOCK_G`` groups.
Formats: ``kernels.reference.formats``.
"""

import torch
import triton
import triton.language as tl

from kernels.numerics import ceil_log2_ratio, e4m3_decode, e4m3_encode_abs, pow2
from kernels.reference.formats import FP8_AMAX_FLOOR

__all__ = ["fp8_dequantize", "fp8_qdq", "fp8_quantize"]

BLOCK_G = 32  # groups per program
FP8_FLOOR: tl.constexpr = tl.constexpr(FP8_AMAX_FLOOR)


@triton.jit
def _fp8_quantize_kernel(
    x_ptr,  # [NG * GS] float
    bits_ptr,  # [NG * GS] uint8 E4M3 (MODE 0)
    exp_ptr,  # [NG] int8 (MODE 0)
    out_ptr,  # [NG * GS] x's dtype (MODE 1: quantize-dequantize)
    NG,
    GS: tl.constexpr,
    QDQ: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    g = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)  # [BLOCK_G]
    j = tl.arange(0, GS)
    gmask = g < NG
    mask = gmask[:, None]
    off = g[:, None].to(tl.int64) * GS + j[None, :]  # [BLOCK_G, GS]
    x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), FP8_FLOOR)
    exp = ceil_log2_ratio(amax, 1.75, 8)  # 448 = 1.75 * 2^8
    y = x * pow2(-exp)[:, None]  # exact; |y| <= 448
    code = e4m3_encode_abs(tl.abs(y))
    if QDQ:
        v = e4m3_decode(code) * pow2(exp)[:, None]
        v = tl.where(y < 0, -v, v)
        tl.store(out_ptr + off, v.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        code = code | ((y < 0).to(tl.int32) << 7)
        tl.store(bits_ptr + off, code.to(tl.uint8), mask=mask)
        tl.store(exp_ptr + g, exp.to(tl.int8), mask=gmask)


@triton.jit
def _fp8_dequantize_kernel(
    bits_ptr,  # [NG * GS] uint8
    exp_ptr,  # [NG] int8
    out_ptr,  # [NG * GS] out dtype
    NG,
    GS: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    g = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    j = tl.arange(0, GS)
    gmask = g < NG
    mask = gmask[:, None]
    off = g[:, None].to(tl.int64) * GS + j[None, :]
    c = tl.load(bits_ptr + off, mask=mask, other=0).to(tl.int32)
    s = pow2(tl.load(exp_ptr + g, mask=gmask, other=0).to(tl.int32))
    v = e4m3_decode(c) * s[:, None]
    tl.store(out_ptr + off, v.to(out_ptr.dtype.element_ty), mask=mask)


def _check(d: int, block: int) -> None:
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    if d % block:
        raise ValueError(f"last dim {d} is not a multiple of the block {block}")


def fp8_quantize(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (E4M3 bits [..., D] uint8, exp [..., D//block] int8)."""
    _check(x.shape[-1], block)
    xc = x.contiguous()
    bits = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    exp = torch.empty(*x.shape[:-1], x.shape[-1] // block, dtype=torch.int8, device=x.device)
    ng = xc.numel() // block
    if ng:
        grid = (triton.cdiv(ng, BLOCK_G),)
        _fp8_quantize_kernel[grid](xc, bits, exp, xc, ng, block, False, BLOCK_G)
    return bits, exp


def fp8_dequantize(
    bits: torch.Tensor, exp: torch.Tensor, block: int = 32, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """bits [..., D] uint8, exp [..., D//block] int8 -> [..., D] ``dtype``."""
    _check(bits.shape[-1], block)
    if exp.shape != (*bits.shape[:-1], bits.shape[-1] // block):
        raise ValueError(f"exp {tuple(exp.shape)} does not fit bits {tuple(bits.shape)}")
    out = torch.empty(bits.shape, dtype=dtype, device=bits.device)
    ng = out.numel() // block
    if ng:
        grid = (triton.cdiv(ng, BLOCK_G),)
        _fp8_dequantize_kernel[grid](bits.contiguous(), exp.contiguous(), out, ng, block, BLOCK_G)
    return out


def fp8_qdq(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x [..., D] -> [..., D] (x's dtype): E4M3 quantize-dequantize, pow2 scale per block."""
    _check(x.shape[-1], block)
    xc = x.contiguous()
    out = torch.empty_like(xc)
    ng = xc.numel() // block
    if ng:
        grid = (triton.cdiv(ng, BLOCK_G),)
        _fp8_quantize_kernel[grid](xc, out, out, out, ng, block, True, BLOCK_G)
    return out
