"""Sparse attention with a sink: Triton vs reference, prefill and decode shapes, fp32 and
fp16, sequence shorter than the window (-1 padding), all -1 rows, no global KV."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kernels import reference as R

TritonCall = Callable[..., Any]  # the conftest fixture: one op on the Triton path

# |got - want| <= atol + rtol * |want|. fp32: summation order only. fp16: both sides round
# the output to fp16 (1 ulp = 2^-10 relative) and the kernel rounds p to fp16 for the PV dot.
TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (1e-3, 4e-3)}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    atol, rtol = TOL[dtype]
    return bool(((got.float() - want.float()).abs() <= atol + rtol * want.float().abs()).all())


def _case(
    t: int, h: int, d: int, nw: int, w: int, ng: int, k: int, seed: int
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g)
    win_kv = R.fp8_qdq(torch.randn(nw, d, generator=g)) if d % 32 == 0 else torch.randn(nw, d)
    win_idx = torch.randint(-1, max(nw, 1), (t, w), generator=g).int() if nw else -torch.ones(t, w)
    packed, scale = R.fp4_quantize(torch.randn(ng, d, generator=g))
    glob_idx = torch.randint(-1, max(ng, 1), (t, k), generator=g).int() if ng else -torch.ones(t, k)
    sink = torch.randn(h, generator=g)
    return q, win_kv, win_idx.int(), packed, scale, glob_idx.int(), sink


def _check(
    args: tuple[torch.Tensor, ...], dtype: torch.dtype, triton_call: TritonCall
) -> torch.Tensor:
    q, win_kv, win_idx, packed, scale, glob_idx, sink = args
    q, win_kv = q.to(dtype), win_kv.to(dtype)
    sm = q.shape[-1] ** -0.5
    want = R.sparse_attention(q, win_kv, win_idx, packed, scale, glob_idx, sink, sm)
    got = triton_call("sparse_attention", q, win_kv, win_idx, packed, scale, glob_idx, sink, sm)
    assert got.dtype == dtype and got.shape == q.shape
    assert _close(got, want, dtype)
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_shape_with_empty_rows(dtype: torch.dtype, triton_call: TritonCall) -> None:
    args = _case(t=9, h=5, d=32, nw=11, w=8, ng=13, k=6, seed=1)
    args[2][0] = -1
    args[5][0] = -1  # row 0: nothing valid -> exactly 0
    args[5][1] = -1  # row 1: window only
    got = _check(args, dtype, triton_call)
    assert got[0].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_batch_shape(dtype: torch.dtype, triton_call: TritonCall) -> None:
    # one query per sequence: each row gathers its own window and selected rows
    _check(_case(t=3, h=20, d=64, nw=40, w=70, ng=50, k=20, seed=2), dtype, triton_call)


def test_sequence_shorter_than_window(triton_call: TritonCall) -> None:
    t, w = 4, 8
    args = list(_case(t=t, h=4, d=32, nw=t, w=w, ng=3, k=2, seed=3))
    # query i sees window rows 0..i only; the rest of its window slots are empty
    args[2] = torch.tensor([[j if j <= i else -1 for j in range(w)] for i in range(t)]).int()
    args[5] = -torch.ones(t, 2, dtype=torch.int32)
    _check(tuple(args), torch.float32, triton_call)


def test_no_global_kv_and_odd_head_dim(triton_call: TritonCall) -> None:
    _check(_case(t=3, h=3, d=48, nw=4, w=5, ng=0, k=0, seed=4), torch.float32, triton_call)


def test_sink_only_in_denominator(triton_call: TritonCall) -> None:
    # one valid entry with score 0 and sink 0: p = 1 / (1 + 1) -> output = v / 2
    q = torch.zeros(1, 1, 16)
    v = torch.arange(16, dtype=torch.float32)[None]
    empty_p, empty_s = torch.zeros(0, 8, dtype=torch.uint8), torch.zeros(0, 1, dtype=torch.uint8)
    idx = torch.tensor([[0, -1]], dtype=torch.int32)
    gidx = torch.zeros(1, 0, dtype=torch.int32)
    args = (q, v, idx, empty_p, empty_s, gidx, torch.zeros(1), 0.25)
    want = v[0] / 2
    assert torch.allclose(R.sparse_attention(*args)[0, 0], want)
    assert torch.allclose(triton_call("sparse_attention", *args)[0, 0], want)


def test_out_of_range_index_is_an_error() -> None:
    q, win_kv, win_idx, packed, scale, glob_idx, sink = _case(2, 2, 32, 3, 2, 3, 2, seed=5)
    win_idx[0, 0] = 3
    with pytest.raises(IndexError):
        R.sparse_attention(q, win_kv, win_idx, packed, scale, glob_idx, sink, 1.0)


def test_non_contiguous_query(triton_call: TritonCall) -> None:
    q, win_kv, win_idx, packed, scale, glob_idx, sink = _case(4, 3, 32, 5, 4, 6, 3, seed=6)
    qt = q.transpose(0, 1).contiguous().transpose(0, 1)  # same values, [H, T, D] memory
    want = R.sparse_attention(q, win_kv, win_idx, packed, scale, glob_idx, sink, 0.2)
    got = triton_call("sparse_attention", qt, win_kv, win_idx, packed, scale, glob_idx, sink, 0.2)
    assert got.is_contiguous() and _close(got, want, torch.float32)
