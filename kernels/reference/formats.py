"""The number formats of the CSA2 and Engram references, bit for bit, in plain torch.

Formats (``shared/design/REFERENCE_MODEL.md``):

* **E4M3** (``float8_e4m3fn`` bits, bias 7, max 448, no infinities): encoded by integer
  arithmetic on the fp32 bits, round to nearest with ties to even, saturated at 448. The
  bytes 0x7F/0xFF (NaN in e4m3fn) are never produced.
* **E2M1** (FP4) values ``±{0, .5, 1, 1.5, 2, 3, 4, 6}``, code ``s<<3 | e<<1 | m``. A value is
  rounded to the nearest code by comparing ``|x|`` with the midpoints times the scale; both
  factors have at most 4 significant bits, so each threshold is exact in fp32 and the
  result is the exact round-to-nearest of ``x / scale`` with no division; ties go to the
  even code, anything above ``5 * scale`` saturates to 6. ``x < 0`` sets the sign bit (a
  tiny negative becomes -0). Two codes per byte, element ``2i`` in the low nibble.
* **FP4 main KV**: one E4M3 scale per 16 channels, ``scale = e4m3(max(amax, 6*2^-9) * f32(1/6))``
  (the clamp keeps the scale at least the smallest E4M3 subnormal), no global scale.
* **FP4 index keys/queries**: one power-of-two scale per ``block`` (32) channels,
  ``2^ceil(log2(amax / 6))`` stored as its int8 exponent; amax is clamped to at least
  ``6 * 2^-64`` so a zero block gets exponent -64.
* **FP8 window KV / Engram tables**: E4M3 with a power-of-two scale per 32 values,
  ``2^ceil(log2(max(amax, 1e-4) / 448))`` stored as its int8 exponent.

The ceil(log2(.)) exponents are computed exactly from the fp32 bits (no ``log2``), so the
torch and Triton paths agree bit for bit. Everything is computed in fp32.
"""

from __future__ import annotations

import torch

F32_ONE_SIXTH = torch.tensor(1.0 / 6.0, dtype=torch.float32)  # the fp32 constant both paths use
FP4_SCALE_BLOCK = 16  # channels per E4M3 scale of the main KV
FP4_AMAX_FLOOR = 6.0 * 2.0**-9  # smallest amax whose scale is still a nonzero E4M3
POW2_MIN_EXP = -64  # exponent of an all-zero FP4 pow2 block
FP8_AMAX_FLOOR = 1e-4
E4M3_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# --------------------------------------------------------------------------------------
# bit-level helpers


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2.0**e as fp32, exactly, for integer e in [-126, 127] (built from the exponent bits)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def floor_log2(v: torch.Tensor) -> torch.Tensor:
    """floor(log2(v)) for fp32 v > 0 normal, from the exponent bits (int32)."""
    return ((v.contiguous().view(torch.int32) >> 23) & 0xFF) - 127


def e4m3_encode_abs(v: torch.Tensor) -> torch.Tensor:
    """E4M3 code (int32, sign bit clear) of fp32 ``v >= 0``, RNE, saturated at 448."""
    v = v.clamp(max=E4M3_MAX)
    e = floor_log2(v).clamp(min=-6)  # subnormals share the quantum of exponent -6
    mant = torch.round(v * pow2(3 - e))  # exact scaling; in [0, 16], 16 carries into e
    return 8 * (e + 6) + mant.to(torch.int32)


def e4m3_decode(code: torch.Tensor) -> torch.Tensor:
    """fp32 value of E4M3 bytes (uint8 or int32 code, sign in bit 7)."""
    c = code.to(torch.int32)
    e = (c >> 3) & 15
    m = c & 7
    mag = torch.where(e == 0, m, m + 8).to(torch.float32) * pow2(e.clamp(min=1) - 10)
    return torch.where((c & 0x80) != 0, -mag, mag)


def e2m1_encode(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (int32, 0..15) of fp32 ``x / scale`` (scale broadcastable, > 0)."""
    a = x.abs()
    # midpoints between codes k and k+1; ties go to the even code (">" when k even).
    mag = (
        (a > 0.25 * scale).int()
        + (a >= 0.75 * scale).int()
        + (a > 1.25 * scale).int()
        + (a >= 1.75 * scale).int()
        + (a > 2.5 * scale).int()
        + (a >= 3.5 * scale).int()
        + (a > 5.0 * scale).int()
    )
    return mag | ((x < 0).int() << 3)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """fp32 value of E2M1 codes (int32 0..15)."""
    e = (code >> 1) & 3
    m = (code & 1).to(torch.float32)
    mag = torch.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * pow2(e - 1))
    return torch.where((code & 8) != 0, -mag, mag)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    p = packed.to(torch.int32)
    return torch.stack([p & 15, p >> 4], dim=-1).flatten(-2)


def _ceil_log2_ratio(amax: torch.Tensor, top: float) -> torch.Tensor:
    """ceil(log2(amax / top)) exactly, for ``top = 1.5 * 2^k`` or ``1.75 * 2^k`` and amax normal."""
    k = int(torch.floor(torch.log2(torch.tensor(top))).item())
    frac = top / 2.0**k  # 1.5 (E2M1 max 6) or 1.75 (E4M3 max 448)
    e = floor_log2(amax)
    return torch.where(amax <= frac * pow2(e), e - k, e - k + 1)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    d = x.shape[-1]
    if d % block != 0:
        raise ValueError(f"last dim {d} is not a multiple of the block {block}")
    return x.float().reshape(*x.shape[:-1], d // block, block)


# --------------------------------------------------------------------------------------
# FP4 (global KV, index keys) and FP8 (window KV, Engram tables)


def fp4_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float -> (packed [..., D//2] uint8, scale [..., D//16] uint8 E4M3 bits)."""
    xb = _blocks(x, FP4_SCALE_BLOCK)  # [..., G, 16]
    amax = xb.abs().amax(-1).clamp(min=FP4_AMAX_FLOOR)  # [..., G]
    scode = e4m3_encode_abs(amax * F32_ONE_SIXTH)
    codes = e2m1_encode(xb, e4m3_decode(scode)[..., None]).flatten(-2)
    return _pack_nibbles(codes), scode.to(torch.uint8)


def fp4_dequantize(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """packed [..., D//2] uint8, scale [..., D//16] uint8 -> [..., D] in ``dtype``."""
    vals = e2m1_decode(_unpack_nibbles(packed))  # [..., D]
    vb = vals.reshape(*vals.shape[:-1], -1, FP4_SCALE_BLOCK) * e4m3_decode(scale)[..., None]
    return vb.flatten(-2).to(dtype)


def fp4_pow2_quantize(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (packed [..., D//2] uint8, exp [..., D//block] int8); scale = 2^exp."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1).clamp(min=6.0 * 2.0**POW2_MIN_EXP)
    exp = _ceil_log2_ratio(amax, 6.0)  # [..., G]
    codes = e2m1_encode(xb, pow2(exp)[..., None]).flatten(-2)
    return _pack_nibbles(codes), exp.to(torch.int8)


def fp4_pow2_dequantize(
    packed: torch.Tensor, exp: torch.Tensor, block: int = 32, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """packed [..., D//2] uint8, exp [..., D//block] int8 -> [..., D] in ``dtype``."""
    vals = e2m1_decode(_unpack_nibbles(packed))
    vb = vals.reshape(*vals.shape[:-1], -1, block) * pow2(exp.to(torch.int32))[..., None]
    return vb.flatten(-2).to(dtype)


def fp8_quantize(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (E4M3 bits [..., D] uint8, exp [..., D//block] int8); value = e4m3 * 2^exp."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1).clamp(min=FP8_AMAX_FLOOR)
    exp = _ceil_log2_ratio(amax, E4M3_MAX)  # [..., G]
    y = xb * pow2(-exp)[..., None]  # exact; |y| <= 448
    code = e4m3_encode_abs(y.abs()) | ((y < 0).int() << 7)
    return code.flatten(-2).to(torch.uint8), exp.to(torch.int8)


def fp8_dequantize(
    bits: torch.Tensor, exp: torch.Tensor, block: int = 32, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """bits [..., D] uint8 (E4M3), exp [..., D//block] int8 -> [..., D] in ``dtype``."""
    v = e4m3_decode(bits)
    vb = v.reshape(*v.shape[:-1], -1, block) * pow2(exp.to(torch.int32))[..., None]
    return vb.flatten(-2).to(dtype)


def fp8_qdq(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x [..., D] -> [..., D] (x's dtype): E4M3 quantize-dequantize, pow2 scale per block."""
    bits, exp = fp8_quantize(x, block)
    return fp8_dequantize(bits, exp, block, dtype=x.dtype)
