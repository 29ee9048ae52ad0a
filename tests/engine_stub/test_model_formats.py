"""FP4 / FP8 formats as the model uses them (through kernels.dispatch, on CPU the torch_fast backend), against
hand-computed values: ties to the even code, saturation, packing order, pow2 scales."""

from __future__ import annotations

import torch

from kernels import dispatch as ops

NAN_FREE = torch.float32


def _fp4(values: list[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.tensor([values], dtype=torch.float32)
    packed, scale = ops.fp4_quantize(x)
    return packed, scale, ops.fp4_dequantize(packed, scale)


def test_fp4_ties_go_to_the_even_code() -> None:
    # amax 6 -> scale E4M3(1.0) = 1: values are their own E2M1 inputs.
    vals = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.75, 0.3, 0, 0, 0, 0, 0, 0]
    packed, scale, deq = _fp4(vals)
    assert scale.tolist() == [[0x38]]  # E4M3 1.0
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, 0.5, 0, 0, 0, 0, 0, 0]
    assert deq.tolist() == [want]
    # codes: 0.25->0, 0.75->2, 1.25->2, 1.75->4, 2.5->4, 3.5->6, 5->6, 6->7, -0.75->0xA, .3->1
    codes = [0, 2, 2, 4, 4, 6, 6, 7, 0xA, 1, 0, 0, 0, 0, 0, 0]
    assert packed.tolist() == [[codes[2 * i] | codes[2 * i + 1] << 4 for i in range(8)]]


def test_fp4_saturates_when_the_scale_rounds_down() -> None:
    # amax 6.3: 6.3/6 = 1.05 rounds to the E4M3 scale 1.0, so 6.3 saturates to 6.
    packed, scale, deq = _fp4([6.3, -6.3, 3.0] + [0.0] * 13)
    assert scale.tolist() == [[0x38]]
    assert deq[0, :3].tolist() == [6.0, -6.0, 3.0]
    assert packed[0, 0].item() == (0x7 | 0xF << 4)


def test_fp4_small_blocks_clamp_the_scale() -> None:
    # amax below 6 * 2^-9: the scale stays the smallest E4M3 subnormal 2^-9.
    _, scale, deq = _fp4([1e-6] + [0.0] * 15)
    assert scale.tolist() == [[0x01]]
    assert deq.abs().max().item() == 0.0


def test_fp4_pow2_index_keys() -> None:
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 2] = 6.0, 1.5, -2.5
    packed, exp = ops.fp4_pow2_quantize(x, 32)
    assert exp.tolist() == [[0]]  # 2^ceil(log2(6/6))
    assert ops.fp4_pow2_dequantize(packed, exp, 32)[0, :3].tolist() == [6.0, 1.5, -2.0]
    x[0, 0] = 6.1  # just above 6: the scale doubles
    packed, exp = ops.fp4_pow2_quantize(x, 32)
    assert exp.tolist() == [[1]]
    assert ops.fp4_pow2_dequantize(packed, exp, 32)[0, :3].tolist() == [6.0, 2.0, -2.0]


def test_fp8_window_values() -> None:
    x = torch.zeros(2, 32)
    x[0, 0], x[0, 1], x[0, 2], x[0, 3] = 300.0, 1.0, 1.0625, -448.0
    x[1, 0] = 449.0  # just above 448: exponent 1
    bits, exp = ops.fp8_quantize(x, 32)
    assert exp.tolist() == [[0], [1]]
    assert bits[0, :4].tolist() == [0x79, 0x38, 0x38, 0xFE]  # 288 (300 rounded), 1, tie->1, -448
    deq = ops.fp8_dequantize(bits, exp, 32)
    assert deq[0, :4].tolist() == [288.0, 1.0, 1.0, -448.0]
    assert deq[1, 0].item() == 448.0  # 449/2 = 224.5 -> 224, times 2
    assert torch.equal(ops.fp8_qdq(x, 32), deq)
    # An all-zero block takes the floor amax 1e-4: exponent ceil(log2(1e-4/448)) = -22.
    _, e0 = ops.fp8_quantize(torch.zeros(1, 32), 32)
    assert e0.tolist() == [[-22]]
