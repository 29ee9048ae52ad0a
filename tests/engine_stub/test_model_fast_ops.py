"""kernels.torch_fast (the model's CPU ops) against kernels.reference: bit-exact formats and
selections (ties included), fp32-rounding equality for scores and attention."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kernels import reference as R
from kernels import torch_fast as F


@pytest.mark.parametrize("scale", [1e-6, 1e-3, 1.0, 100.0, 1e4])
def test_formats_bit_exact(scale: float) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 64, generator=g) * scale
    x[0, :32] = 0
    x[1, :5] = 448 * 2.0**-3
    x[2, :32] = -0.0
    a, b = R.fp8_quantize(x), F.fp8_quantize(x)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(R.fp8_dequantize(*a), F.fp8_dequantize(*a))
    p, s = R.fp4_quantize(x)
    assert torch.equal(R.fp4_dequantize(p, s), F.fp4_dequantize(p, s))
    p, e = R.fp4_pow2_quantize(x)
    assert torch.equal(R.fp4_pow2_dequantize(p, e), F.fp4_pow2_dequantize(p, e))


def test_fp8_exponent_boundaries_bit_exact() -> None:
    x = torch.tensor([[448 * 2.0**k * (1 + j / 64) for j in range(32)] for k in range(-20, 20)])
    a, b = R.fp8_quantize(x), F.fp8_quantize(x)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_indexer_selection_matches_reference_with_ties() -> None:
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        t = int(torch.randint(1, 40, (1,), generator=g))
        s = int(torch.randint(1, 300, (1,), generator=g))
        m = int(torch.randint(1, 3, (1,), generator=g))
        q = torch.randn(t, 4, 32, generator=g)
        w = torch.randn(t, 4, generator=g)
        k = torch.randn(s, 32, generator=g)
        if trial % 3 == 0:  # many exact-zero scores (ties)
            k[: s // 2] = -k[: s // 2].abs()
            q = q.abs()
        if trial % 5 == 0:  # integer-valued: equal nonzero scores
            q, k, w = torch.round(q), torch.round(k), torch.round(w)
        pos = torch.randint(0, s * m, (t,), generator=g)
        a, b = R.indexer_scores(q, w, k, pos, m), F.indexer_scores(q, w, k, pos, m)
        assert torch.equal(torch.isinf(a), torch.isinf(b))
        assert torch.allclose(a[torch.isfinite(a)], b[torch.isfinite(b)], atol=1e-4)
        cand = R.candidate_blocks(a, 4, 3, pos, m)
        assert torch.equal(cand, F.candidate_blocks(a, 4, 3, pos, m))
        for cm in (None, cand):
            assert torch.equal(
                R.indexer_topk(a, 16, pos, m, cm, 4), F.indexer_topk(a, 16, pos, m, cm, 4)
            )


@pytest.mark.parametrize(
    ("t", "p", "w"), [(256, 128, 128), (100, 0, 16), (1, 5, 16), (37, 16, 16), (300, 3, 128)]
)
def test_sparse_attention_banded_equals_gathered(t: int, p: int, w: int) -> None:
    g = torch.Generator().manual_seed(t + p + w)
    d, h, k = 32, 4, 16
    kv = torch.randn(p + t, d, generator=g)
    q = torch.randn(t, h, d, generator=g)
    j = torch.arange(t)[:, None] + p - (w - 1) + torch.arange(w)[None]
    idx = torch.where(j >= 0, j, -1).int()
    gp, gs = R.fp4_quantize(torch.randn(50, d, generator=g))
    gi = torch.randint(-1, 50, (t, k), generator=g).int()
    sink = torch.randn(h, generator=g)
    for args in ((gp, gs, gi), (gp[:0], gs[:0], gi[:, :0])):
        a = R.sparse_attention(q, kv, idx, *args, sink, 0.17)
        b = F.sparse_attention(q, kv, idx, *args, sink, 0.17)
        assert (a - b).abs().max().item() < 1e-5


def test_sparse_attention_scattered_windows_fall_back_to_gather() -> None:
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(40, 32, generator=g)
    q = torch.randn(3, 4, 32, generator=g)
    idx = torch.tensor([[-1, 0, 1, 2], [10, 11, 12, 13], [5, -1, 7, 30]], dtype=torch.int32)
    gp, gs = R.fp4_quantize(torch.randn(8, 32, generator=g))
    gi = torch.tensor([[0, -1], [1, 2], [-1, -1]], dtype=torch.int32)
    sink = torch.randn(4, generator=g)
    a = R.sparse_attention(q, kv, idx, gp, gs, gi, sink, 0.2)
    b = F.sparse_attention(q, kv, idx, gp, gs, gi, sink, 0.2)
    assert (a - b).abs().max().item() < 1e-5


def test_indexer_select_equals_scores_then_topk_in_candidates() -> None:
    g = torch.Generator().manual_seed(7)
    for trial in range(20):
        t = int(torch.randint(1, 30, (1,), generator=g))
        s = int(torch.randint(1, 200, (1,), generator=g))
        m = 1 + trial % 2
        # Integer-valued inputs: every score is exact, so the selections must be identical.
        q = torch.randint(-3, 4, (t, 4, 32), generator=g).float()
        w = torch.randint(-2, 3, (t, 4), generator=g).float()
        k = torch.randint(-3, 4, (s, 32), generator=g).float()
        pos = torch.randint(0, s * m, (t,), generator=g)
        scores = R.indexer_scores(q, w, k, pos, m)
        cand = R.candidate_blocks(scores, 4, 3, pos, m)
        want = R.indexer_topk(scores, 16, pos, m, cand, 4)
        assert torch.equal(F.indexer_select(q, w, k, pos, m, 16, cand, 4), want), trial
        assert torch.equal(R.indexer_select(q, w, k, pos, m, 16, cand, 4), want), trial


def test_memo_works_through_the_dispatcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model reaches torch_fast through kernels.dispatch (CPU default) and the same
    tensors arrive: the window plan is derived once per forward pass, and each index
    layer's selected global KV is gathered once, not once per layer reusing it."""
    from engine_stub.model import MiniV4, ModelConfig

    cfg = ModelConfig.tiny(window=8)
    model = MiniV4(cfg, seed=0)
    calls = {"plan": 0, "glob": 0}

    def counted(key: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any) -> Any:
            calls[key] += 1
            return real(*args)

        return wrapper

    monkeypatch.setattr(F, "_window_plan", counted("plan", F._window_plan))
    monkeypatch.setattr(F, "_gather_fp4", counted("glob", F._gather_fp4))
    st = model.new_state()
    model.prefill(st, list(b"the memo: one plan per pass, one gather per index layer"))
    model.decode_batch([st], [int(st.last_logits.argmax())])  # type: ignore[union-attr]
    index_layers = len(cfg.full_layers) + len(cfg.reindex_layers)
    assert calls == {"plan": 2, "glob": 2 * index_layers}


def test_long_row_topk_and_candidates_match_reference() -> None:
    """Rows long enough for the two-level top-k (block maxima first): exact, including
    rows of ties (all-zero scores), rows that see only a few entries, and integer scores."""
    g = torch.Generator().manual_seed(11)
    for trial in range(6):
        t, s, m = 24, 2400 + 700 * trial, 1 + trial % 2
        q = torch.randn(t, 4, 32, generator=g)
        w = torch.randn(t, 4, generator=g)
        k = torch.randn(s, 32, generator=g)
        w[:4] = -w[:4].abs()  # every score <= 0: ties at 0 decide the selection
        if trial % 2:
            q, k, w = torch.round(q), torch.round(k), torch.round(w)
        pos = torch.randint(s * m // 2, s * m, (t,), generator=g)
        pos[4:8] = torch.tensor([0, 3, 20, 40])  # few visible entries
        a, b = R.indexer_scores(q, w, k, pos, m), F.indexer_scores(q, w, k, pos, m)
        assert torch.equal(torch.isinf(a), torch.isinf(b))
        assert torch.allclose(a[torch.isfinite(a)], b[torch.isfinite(b)], atol=1e-4)
        for sc in (a, b):
            for topk in (16, 1):
                want = R.indexer_topk(sc, topk, pos, m, None, 4)
                assert torch.equal(F.indexer_topk(sc, topk, pos, m, None, 4), want), trial
            assert torch.equal(
                R.candidate_blocks(sc, 4, 8, pos, m), F.candidate_blocks(sc, 4, 8, pos, m)
            )
