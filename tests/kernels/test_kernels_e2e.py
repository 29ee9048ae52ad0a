"""End to end: a short greedy request through the reference model (``engine_stub.model``)
with every op on the Triton path (interpreter) gives the same tokens as the torch path.

While the Triton run goes, every op in ``kernels.reference`` raises, so a call that
silently took the torch path would fail the test."""

from __future__ import annotations

import pytest
import torch

from engine_stub.model import MiniV4, ModelConfig
from kernels import dispatch as K
from kernels import reference as R

OPS = [
    "fp4_quantize",
    "fp4_dequantize",
    "fp4_pow2_quantize",
    "fp4_pow2_dequantize",
    "fp8_quantize",
    "fp8_dequantize",
    "fp8_qdq",
    "indexer_scores",
    "candidate_blocks",
    "indexer_topk",
    "sparse_attention",
    "engram_rows",
    "engram_gather",
    "engram_gate",
]


def _greedy(model: MiniV4, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Prefill, then one decode step: two greedy tokens (two forward passes, since each
    interpreted forward pass costs seconds)."""
    st = model.new_state()
    first = int(torch.argmax(model.prefill(st, prompt)))
    logits = model.decode_batch([st], [first])[0]
    return [first, int(torch.argmax(logits))], logits


def test_triton_path_gives_the_torch_path_tokens(
    monkeypatch: pytest.MonkeyPatch, device: torch.device
) -> None:
    import engine_stub.model.ops as ops

    # window 8 and 12 prompt tokens: window expiry, m=2 groups, top-k (16) > visible. The
    # weights (Engram tables included) are built before the ops are rerouted below.
    model = MiniV4(ModelConfig.tiny(window=8), seed=0, device=device)
    # The model binds its ops in engine_stub.model.ops (CPU tensors may take a fast torch
    # twin there): route every op through kernels.dispatch for both runs, counting calls.
    called: dict[str, set[str]] = {"torch": set(), "triton": set()}

    def through_dispatch(name: str) -> object:
        real = getattr(K, name)

        def wrapper(*args: object, **kwargs: object) -> object:
            called[K.active_backend()].add(name)
            return real(*args, **kwargs)

        return wrapper

    for name in OPS:
        monkeypatch.setattr(ops, name, through_dispatch(name))

    def select_through_dispatch(
        q: torch.Tensor,
        w: torch.Tensor,
        k: torch.Tensor,
        q_pos: torch.Tensor,
        m: int,
        topk: int,
        cand_mask: torch.Tensor,
        block: int,
    ) -> torch.Tensor:
        # the composed op, by its definition: top-k of the scores inside the candidates
        scores = ops.indexer_scores(q, w, k, q_pos, m)
        return ops.indexer_topk(scores, topk, q_pos, m, cand_mask, block)  # type: ignore[no-any-return]

    monkeypatch.setattr(ops, "indexer_select", select_through_dispatch, raising=False)
    # an op added to the model's table later must be routed here too: none of the ops
    # module's own public functions may be left in place
    left = {
        n
        for n in dir(ops)
        if not n.startswith("_") and getattr(getattr(ops, n), "__module__", "") == ops.__name__
    }
    assert not left, f"ops not routed through the dispatcher: {left}"
    prompt = list(b"kernels, go!")
    with K.use_backend("torch"):
        want, want_logits = _greedy(model, prompt)

    def refuse(*args: object, **kwargs: object) -> object:
        raise AssertionError("an op took the torch reference during the Triton run")

    for name in OPS:
        monkeypatch.setattr(R, name, refuse)
    with K.use_backend("triton"):
        got, got_logits = _greedy(model, prompt)
    assert got == want
    assert (got_logits - want_logits).abs().max() <= 1e-3 * want_logits.abs().max()  # fp32
    used = {
        "fp8_quantize",
        "fp8_dequantize",
        "fp4_quantize",
        "fp4_pow2_quantize",
        "indexer_scores",
        "indexer_topk",
        "candidate_blocks",
        "sparse_attention",
        "engram_rows",
        "engram_gather",
        "engram_gate",
    }
    assert used <= called["triton"], f"ops never reached: {used - called['triton']}"
    assert called["torch"] == called["triton"]
