"""The ops the model calls. Tensors on CUDA go through `kernels.dispatch` (the Triton
kernels); CPU tensors use `kernels.torch_fast` (the reference semantics, fast enough to
serve on two cores). `ENGINE_MODEL_OPS=dispatch` sends CPU calls through the dispatcher
too (the torch references, or the Triton interpreter under TRITON_INTERPRET=1). An op the
dispatcher does not export yet falls back to `kernels.reference`. The model never carries
its own copy of an op."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from kernels import reference as _reference
from kernels import torch_fast as _fast

try:
    _dispatch: ModuleType | None = importlib.import_module("kernels.dispatch")
except ImportError:  # the dispatcher is optional for the CPU path
    _dispatch = None

_FORCE_DISPATCH = os.environ.get("ENGINE_MODEL_OPS", "") == "dispatch"


def _bind(name: str) -> Callable[..., Any]:
    slow: Callable[..., Any] = getattr(_dispatch, name, None) or getattr(_reference, name)
    fast: Callable[..., Any] = getattr(_fast, name, None) or slow
    if _FORCE_DISPATCH:
        return slow

    def op(*args: Any, **kwargs: Any) -> Any:
        first = args[0]
        if isinstance(first, torch.Tensor) and first.is_cuda:
            return slow(*args, **kwargs)
        return fast(*args, **kwargs)

    op.__name__ = name
    op.__doc__ = getattr(slow, "__doc__", None)
    return op


fp4_quantize = _bind("fp4_quantize")
fp4_dequantize = _bind("fp4_dequantize")
fp4_pow2_quantize = _bind("fp4_pow2_quantize")
fp4_pow2_dequantize = _bind("fp4_pow2_dequantize")
fp8_quantize = _bind("fp8_quantize")
fp8_dequantize = _bind("fp8_dequantize")
fp8_qdq = _bind("fp8_qdq")
indexer_scores = _bind("indexer_scores")
indexer_topk = _bind("indexer_topk")
candidate_blocks = _bind("candidate_blocks")
sparse_attention = _bind("sparse_attention")
engram_rows = _bind("engram_rows")
engram_gather = _bind("engram_gather")
engram_gate = _bind("engram_gate")


def _select_composed(
    q: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    q_pos: torch.Tensor,
    m: int,
    topk: int,
    cand_mask: torch.Tensor,
    block: int,
) -> torch.Tensor:
    scores = indexer_scores(q, w, k, q_pos, m)
    return indexer_topk(scores, topk, q_pos, m, cand_mask, block)  # type: ignore[no-any-return]


def indexer_select(
    q: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    q_pos: torch.Tensor,
    m: int,
    topk: int,
    cand_mask: torch.Tensor,
    block: int,
) -> torch.Tensor:
    """Top-k inside the candidate blocks (later index layers of the hierarchy): by
    definition `indexer_topk(indexer_scores(...), ..., cand_mask, block)`; on CPU the fast
    version scores only the candidate blocks."""
    if q.is_cuda or _FORCE_DISPATCH:
        return _select_composed(q, w, k, q_pos, m, topk, cand_mask, block)
    return _fast.indexer_select(q, w, k, q_pos, m, topk, cand_mask, block)  # type: ignore[no-any-return]
