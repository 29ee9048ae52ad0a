"""End to end: a short greedy request through the reference model (``engine_stub.model``)
with every op on the Triton path (interpreter) gives the same tokens as the torch paths
(the reference, the ground truth, and torch_fast, what the engine serves with on CPU).

The model calls its ops only through ``kernels.dispatch``: while the Triton run goes,
every op of ``kernels.reference`` and ``kernels.torch_fast`` raises, so a call that
bypassed the dispatcher (or silently took a torch path) would fail the test; while the
reference run goes, torch_fast's ops raise."""

from __future__ import annotations

import pytest
import torch

from engine_stub.model import MiniV4, ModelConfig
from kernels import dispatch as K
from kernels import reference as R
from kernels import torch_fast as F

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
    "indexer_select",
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


def _refuse(monkeypatch: pytest.MonkeyPatch, *modules: object) -> None:
    def refuse(*args: object, **kwargs: object) -> object:
        raise AssertionError("an op bypassed the dispatcher's chosen backend")

    for mod in modules:
        for name in OPS:
            monkeypatch.setattr(mod, name, refuse)


def test_triton_path_gives_the_torch_path_tokens(
    monkeypatch: pytest.MonkeyPatch, device: torch.device
) -> None:
    # window 8 and 12 prompt tokens: window expiry, m=2 groups, top-k (16) > visible.
    with K.use_backend("reference"):
        model = MiniV4(ModelConfig.tiny(window=8), seed=0, device=device)
    called: dict[str, set[str]] = {b: set() for b in K.BACKENDS}

    def counting(name: str) -> object:
        real = getattr(K, name)

        def wrapper(*args: object, **kwargs: object) -> object:
            called[K.active_backend()].add(name)
            return real(*args, **kwargs)

        return wrapper

    for name in OPS:
        monkeypatch.setattr(K, name, counting(name))
    prompt = list(b"kernels, go!")
    with K.use_backend("torch_fast"):
        fast, fast_logits = _greedy(model, prompt)
    with monkeypatch.context() as mp:
        _refuse(mp, F)
        with K.use_backend("reference"):
            want, want_logits = _greedy(model, prompt)
        _refuse(mp, R)
        with K.use_backend("triton"):
            got, got_logits = _greedy(model, prompt)
    assert got == want == fast
    assert (got_logits - want_logits).abs().max() <= 1e-3 * want_logits.abs().max()  # fp32
    assert (fast_logits - want_logits).abs().max() <= 1e-3 * want_logits.abs().max()
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
    assert called["reference"] == called["triton"] == called["torch_fast"]
