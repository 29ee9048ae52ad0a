"""Triton device functions for the E4M3 and E2M1 number formats.

Bit-exact twins of the helpers in ``kernels.reference.formats`` (see its docstring for the
formats): exponents come from the fp32 bits, scaling is by exact powers of two, and
E2M1 rounding compares against exact midpoint thresholds, so no result depends on how
a backend rounds a division or a ``log2``.
"""

import os
from collections.abc import Callable
from typing import Any, TypeVar

import triton
import triton.language as tl

F = TypeVar("F", bound=Callable[..., Any])


def device_fn(fn: F) -> F:
    """``@triton.jit`` for a helper called from kernels. Under the interpreter the plain
    function is returned instead: the interpreter re-patches ``triton.language`` on every
    device-function call (milliseconds each, and helpers run inside loops), while a plain
    function runs the same code inside the calling kernel's already-patched scope. The
    compiled path is unchanged. (Triton, too, decides interpret-or-compile at decoration.)"""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return fn
    return triton.jit(fn)  # type: ignore[no-any-return]


@device_fn
def pow2(e):
    """2.0**e as fp32 for int32 e in [-126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@device_fn
def floor_log2(v):
    """floor(log2(v)) for fp32 v > 0 (int32); -127 for 0."""
    return ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@device_fn
def round_half_even(y):
    """Round fp32 y >= 0 to the nearest integer, ties to even, exactly."""
    r = tl.floor(y)
    frac = y - r  # exact
    odd = (r.to(tl.int32) & 1) == 1
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return tl.where(up, r + 1.0, r)


@device_fn
def e4m3_encode_abs(v):
    """E4M3 code (int32, sign clear) of fp32 v >= 0: RNE, saturated at 448."""
    v = tl.minimum(v, 448.0)
    e = tl.maximum(floor_log2(v), -6)
    mant = round_half_even(v * pow2(3 - e))
    return 8 * (e + 6) + mant.to(tl.int32)


@device_fn
def e4m3_decode(c):
    """fp32 value of E4M3 codes (int32, sign in bit 7)."""
    e = (c >> 3) & 15
    m = c & 7
    mag = tl.where(e == 0, m, m + 8).to(tl.float32) * pow2(tl.maximum(e, 1) - 10)
    return tl.where((c & 0x80) != 0, -mag, mag)


@device_fn
def e2m1_encode(x, scale):
    """E2M1 codes (int32 0..15) of x / scale, round to nearest, ties to even, saturated."""
    a = tl.abs(x)
    mag = (
        (a > 0.25 * scale).to(tl.int32)
        + (a >= 0.75 * scale).to(tl.int32)
        + (a > 1.25 * scale).to(tl.int32)
        + (a >= 1.75 * scale).to(tl.int32)
        + (a > 2.5 * scale).to(tl.int32)
        + (a >= 3.5 * scale).to(tl.int32)
        + (a > 5.0 * scale).to(tl.int32)
    )
    return mag | ((x < 0).to(tl.int32) << 3)


@device_fn
def e2m1_decode(c):
    """fp32 value of E2M1 codes (int32 0..15)."""
    e = (c >> 1) & 3
    m = (c & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * pow2(e - 1))
    return tl.where((c & 8) != 0, -mag, mag)


@device_fn
def ceil_log2_ratio(amax, FRAC: tl.constexpr, K: tl.constexpr):
    """ceil(log2(amax / (FRAC * 2^K))) exactly, FRAC in [1, 2), amax normal fp32 (int32)."""
    e = floor_log2(amax)
    return tl.where(amax <= FRAC * pow2(e), e - K, e - K + 1)
