"""The ops the model calls, bound once from `kernels.dispatch` (Triton where it runs,
torch references otherwise), falling back to `kernels.reference` for any op the dispatcher
does not export yet. The model never carries its own copy of an op."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from kernels import reference as _reference

try:
    _dispatch: ModuleType | None = importlib.import_module("kernels.dispatch")
except ImportError:
    _dispatch = None


def _bind(name: str) -> Any:
    if _dispatch is not None and hasattr(_dispatch, name):
        return getattr(_dispatch, name)
    return getattr(_reference, name)


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
