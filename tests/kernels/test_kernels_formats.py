"""FP4 / FP8 formats: hand-computed codes (ties, saturation, subnormals), agreement with
torch's own float8_e4m3fn cast, and the Triton kernels bit-exact against the reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kernels import reference as R

TritonCall = Callable[..., Any]  # the conftest fixture: one op on the Triton path


def test_e4m3_encode_matches_torch_cast_including_ties_and_subnormals() -> None:
    g = torch.Generator().manual_seed(1)
    v = torch.cat(
        [
            torch.rand(20000, generator=g) * 448,
            torch.rand(2000, generator=g) * 2**-5,  # subnormal range
            # exact ties between neighbours: 1 + 1/16 (between 1 and 1.125), 2^-9 * 1.5
            torch.tensor([0.0, 2**-9, 2**-10, 1.0625, 1.1875, 3 * 2**-10, 448.0, 240.0]),
        ]
    )
    want = v.to(torch.float8_e4m3fn).view(torch.uint8).int()
    assert torch.equal(R.e4m3_encode_abs(v), want)
    assert R.e4m3_encode_abs(torch.tensor([1000.0])).item() == 0x7E  # saturates at 448


def test_e2m1_hand_values_ties_to_even_and_saturation() -> None:
    x = torch.tensor(
        # exact midpoints: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4
        [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, -0.25, -0.75, -5.0, -9.0, 0.26, 0.0]
    )
    codes = R.e2m1_encode(x, torch.tensor(1.0))
    assert codes.tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 7, 8, 10, 14, 15, 1, 0]
    assert R.e2m1_decode(codes).tolist() == [
        0, 1, 1, 2, 2, 4, 4, 6, 6, -0.0, -1, -4, -6, 0.5, 0
    ]  # fmt: skip


def test_fp4_quantize_hand_computed_block() -> None:
    # amax 12 -> scale e4m3(12/6) = 2.0 (code 0x40); values / 2 -> E2M1.
    x = torch.tensor([[12.0, -12.0, 1.0, 0.5, 3.0, 5.0, 7.0, -2.5] + [0.0] * 8])
    packed, scale = R.fp4_quantize(x)
    assert scale.tolist() == [[0x40]]
    # x/2 = 6, -6, .5 (code 1), .25 (tie -> 0), 1.5 (3), 2.5 (tie -> 2: code 4), 3.5 (tie -> 4:
    # code 6), -1.25 (tie -> -1: code 10)
    assert packed[0, :4].tolist() == [
        0x7 | 0xF << 4,
        0x1 | 0x0 << 4,
        0x3 | 0x4 << 4,
        0x6 | 0xA << 4,
    ]
    assert R.fp4_dequantize(packed, scale)[0, :8].tolist() == [12, -12, 1, 0, 3, 4, 8, -2]
    # a zero block gets the smallest scale (amax floor 6*2^-9 -> 2^-9, code 1), values 0
    p0, s0 = R.fp4_quantize(torch.zeros(1, 16))
    assert s0.tolist() == [[1]] and p0.abs().sum().item() == 0


def test_fp4_scale_rounds_to_nearest_e4m3_and_saturates_elements() -> None:
    # amax 6.5 -> 6.5/6 = 1.0833 -> e4m3 1.125 (RNE) ; amax 6.3 -> 1.05 -> 1.0, so
    # 6.3 / 1.0 = 6.3 saturates to 6.
    x = torch.zeros(2, 16)
    x[0, 0], x[1, 0] = 6.5, 6.3
    packed, scale = R.fp4_quantize(x)
    assert R.e4m3_decode(scale).flatten().tolist() == [1.125, 1.0]
    assert R.fp4_dequantize(packed, scale)[:, 0].tolist() == [6.75, 6.0]


def test_fp4_pow2_and_fp8_hand_computed_exponents() -> None:
    x = torch.zeros(3, 32)
    x[0, 0], x[1, 0], x[2, 0] = 6.0, 6.01, 3.0  # ceil(log2(amax/6)) = 0, 1, -1
    _, exp = R.fp4_pow2_quantize(x)
    assert exp.flatten().tolist() == [0, 1, -1]
    assert R.fp4_pow2_quantize(torch.zeros(1, 32))[1].item() == R.POW2_MIN_EXP
    y = torch.zeros(3, 32)
    y[0, 0], y[1, 0], y[2, 0] = 448.0, 449.0, 0.0  # exponent 0, 1, ceil(log2(1e-4/448)) = -22
    bits, e8 = R.fp8_quantize(y)
    assert e8.flatten().tolist() == [0, 1, -22]
    assert bits[0, 0].item() == 0x7E and bits[1, 0].item() == R.e4m3_encode_abs(torch.tensor(224.5))
    assert R.fp8_qdq(y)[:, 0].tolist() == [448.0, 448.0, 0.0]  # 449/2=224.5 -> 224 (RNE)


def test_fp8_qdq_matches_torch_float8_per_block() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 64, generator=g) * torch.logspace(-6, 4, 64)
    bits, exp = R.fp8_quantize(x)
    scaled = x.view(9, 2, 32) * R.pow2(-exp.int())[..., None]
    assert torch.equal(bits, scaled.to(torch.float8_e4m3fn).view(torch.uint8).view(9, 64))


def _odd_inputs(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.logspace(-5, 3, shape[-1])
    flat = x.view(-1, shape[-1])
    flat[0, :16] = 0.0  # zero block
    flat[-1, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 9.0] * 2)  # ties
    flat[-1, 16:32] = -flat[-1, :16] * 2.0**-7
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(3, 5, 64), (1, 32), (7, 96)])
def test_fp4_triton_bit_exact(
    shape: tuple[int, ...], dtype: torch.dtype, triton_call: TritonCall
) -> None:
    x = _odd_inputs(shape, seed=len(shape) * 100 + shape[-1]).to(dtype)
    packed, scale = R.fp4_quantize(x)
    tp, ts = triton_call("fp4_quantize", x)
    assert torch.equal(packed, tp) and torch.equal(scale, ts)
    assert torch.equal(
        triton_call("fp4_dequantize", packed, scale), R.fp4_dequantize(packed, scale)
    )
    deq16 = triton_call("fp4_dequantize", packed, scale, torch.float16)
    assert deq16.dtype == torch.float16
    assert torch.equal(deq16, R.fp4_dequantize(packed, scale, torch.float16))
    pp, pe = R.fp4_pow2_quantize(x)
    tpp, tpe = triton_call("fp4_pow2_quantize", x)
    assert torch.equal(pp, tpp) and torch.equal(pe, tpe)
    assert torch.equal(triton_call("fp4_pow2_dequantize", pp, pe), R.fp4_pow2_dequantize(pp, pe))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_triton_bit_exact(dtype: torch.dtype, triton_call: TritonCall) -> None:
    x = _odd_inputs((5, 3, 96), seed=7).to(dtype)
    bits, exp = R.fp8_quantize(x)
    tb, te = triton_call("fp8_quantize", x)
    assert torch.equal(bits, tb) and torch.equal(exp, te)
    assert torch.equal(triton_call("fp8_dequantize", bits, exp), R.fp8_dequantize(bits, exp))
    q = triton_call("fp8_qdq", x)
    assert q.dtype == dtype and torch.equal(q, R.fp8_qdq(x))


def test_format_errors_are_clear(triton_call: TritonCall) -> None:
    with pytest.raises(ValueError, match="multiple of the block"):
        R.fp4_quantize(torch.zeros(2, 24))
    with pytest.raises(ValueError, match="multiple of the block"):
        triton_call("fp8_qdq", torch.zeros(2, 40))
    with pytest.raises(ValueError, match="does not fit"):
        triton_call("fp4_dequantize", torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 3))
