"""CSA2 indexer: scores (tolerance per dtype), candidate blocks and top-k (exact), with the
boundaries: nothing visible, exactly one compressed group, top-k larger than what is
visible, ties, and a candidate mask narrower than top-k."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kernels import reference as R

TritonCall = Callable[..., Any]  # the conftest fixture: one op on the Triton path

SCORE_TOL = {torch.float32: 1e-5, torch.float16: 1e-3}  # relative to the row's |score| max


def _inputs(t: int, h: int, di: int, s: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, di, generator=g)
    w = torch.randn(t, h, generator=g)
    k = torch.randn(s, di, generator=g)
    return q, w, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("t", "h", "di", "s", "m"), [(7, 3, 24, 21, 2), (17, 4, 32, 70, 1)])
def test_scores_match_reference(
    t: int, h: int, di: int, s: int, m: int, dtype: torch.dtype, triton_call: TritonCall
) -> None:
    q, w, k = _inputs(t, h, di, s, seed=t * s)
    # index queries and keys are FP4 (pow2 scales): exact in fp16
    q = R.fp4_pow2_dequantize(*R.fp4_pow2_quantize(q)).to(dtype) if di % 32 == 0 else q.to(dtype)
    k = k.to(dtype)
    q_pos = torch.randint(0, 2 * s * m, (t,), generator=torch.Generator().manual_seed(3))
    q_pos[0] = 0  # (0 + 1) // m visible: nothing for m = 2, one group for m = 1
    want = R.indexer_scores(q, w, k, q_pos, m)
    got = triton_call("indexer_scores", q, w, k, q_pos, m)
    assert torch.equal(want.isneginf(), got.isneginf())
    fin = want.isfinite()
    scale = want.masked_fill(~fin, 0).abs().amax().clamp(min=1.0)
    assert ((want[fin] - got[fin]).abs() / scale).max() <= SCORE_TOL[dtype]


def _tied_scores(t: int, s: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 5, (t, s), generator=g).float()  # many exact ties
    x[0, ::3] = -0.0  # -0 and +0 are one value
    return x


@pytest.mark.parametrize(("block", "keep"), [(4, 1), (4, 3), (8, 2)])
def test_candidate_blocks_exact(block: int, keep: int, triton_call: TritonCall) -> None:
    t, s, m = 20, 37, 2
    scores = _tied_scores(t, s, seed=block * 10 + keep)
    q_pos = torch.tensor([0, 1, 2, 3, 7, 8, 9, 15, 16, 31, 40, 63, 64, 65, 73, 74, 75, 100, 5, 6])
    want = R.candidate_blocks(scores, block, keep, q_pos, m)
    assert torch.equal(triton_call("candidate_blocks", scores, block, keep, q_pos, m), want)
    vis = R.visible_count(q_pos, m, s)
    assert not want[vis == 0].any()  # nothing visible -> empty mask
    for i in torch.nonzero(vis > 0).flatten().tolist():  # newest visible block forced in
        assert want[i, (vis[i] - 1) // block]
        assert int(want[i].sum()) == min(keep, -(-int(vis[i]) // block))


def test_candidate_blocks_hand_example(triton_call: TritonCall) -> None:
    # 10 positions, blocks of 4: maxima [5, 9, 1(newest, partial)]; keep 2 -> newest + block 1
    scores = torch.tensor([[5.0, 0, 0, 0, 1, 9, 0, 0, 1, 0]])
    mask = R.candidate_blocks(scores, 4, 2, torch.tensor([9]), 1)
    assert mask.tolist() == [[False, True, True]]
    assert torch.equal(triton_call("candidate_blocks", scores, 4, 2, torch.tensor([9]), 1), mask)


@pytest.mark.parametrize("topk", [1, 3, 8, 50])
@pytest.mark.parametrize("with_mask", [False, True])
def test_topk_exact(topk: int, with_mask: bool, triton_call: TritonCall) -> None:
    t, s, m, block = 20, 37, 2, 4
    scores = _tied_scores(t, s, seed=topk)
    q_pos = torch.tensor([0, 1, 2, 3, 7, 8, 9, 15, 16, 31, 40, 63, 64, 65, 73, 74, 75, 100, 5, 6])
    cand = R.candidate_blocks(scores, block, 2, q_pos, m) if with_mask else None
    want = R.indexer_topk(scores, topk, q_pos, m, cand, block)
    assert torch.equal(triton_call("indexer_topk", scores, topk, q_pos, m, cand, block), want)
    vis = R.visible_count(q_pos, m, s)
    for i in range(t):
        got = [p for p in want[i].tolist() if p >= 0]
        assert got == sorted(got) and all(p < vis[i] for p in got)
        assert want[i, len(got) :].eq(-1).all()
        if not with_mask:  # top-k larger than visible -> everything visible, then -1
            assert len(got) == min(topk, int(vis[i]))


def test_topk_hand_example_ties_lower_position_first(triton_call: TritonCall) -> None:
    scores = torch.tensor([[3.0, 7.0, 3.0, 9.0, 3.0, float("-inf")]])
    q_pos = torch.tensor([4])  # m = 1: positions 0..4 visible
    want = [[0, 1, 3]]  # 9 (pos 3), 7 (pos 1), then the tied 3s: the lowest position, 0
    got = R.indexer_topk(scores, 3, q_pos, 1)
    assert got.tolist() == want
    assert torch.equal(triton_call("indexer_topk", scores, 3, q_pos, 1), got)
    assert R.indexer_topk(scores, 7, q_pos, 1).tolist() == [[0, 1, 2, 3, 4, -1, -1]]


def test_one_compressed_group_and_nothing_visible(triton_call: TritonCall) -> None:
    scores = torch.tensor([[2.0, 1.0], [2.0, 1.0], [2.0, 1.0]])
    q_pos = torch.tensor([0, 1, 2])  # m = 2: 0, 1, 1 groups visible
    want = [[-1, -1], [0, -1], [0, -1]]
    assert R.indexer_topk(scores, 2, q_pos, 2).tolist() == want
    assert triton_call("indexer_topk", scores, 2, q_pos, 2).tolist() == want


def test_indexer_errors(triton_call: TritonCall) -> None:
    with pytest.raises(ValueError, match="m must be >= 1"):
        triton_call("indexer_topk", torch.zeros(1, 4), 2, torch.zeros(1, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="does not fit"):
        R.indexer_topk(torch.zeros(1, 9), 2, torch.zeros(1, dtype=torch.long), 1,
                       torch.ones(1, 2, dtype=torch.bool), 4)  # fmt: skip
