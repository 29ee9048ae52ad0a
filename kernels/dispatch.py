"""The one entry point for every kernel op: the engine (``engine_stub.model``) calls the
ops only through this module.

Backends:

* ``"triton"``: the Triton kernels (compiled on CUDA, or the interpreter on CPU).
* ``"torch_fast"``: ``kernels.torch_fast``, the same results as the reference computed
  faster on CPU (what the engine serves with on CPU).
* ``"reference"``: ``kernels.reference``, plain torch, the ground truth (tests, baselines).

Choice, per call (``"auto"``): Triton when any tensor argument is on CUDA, or when the
environment has ``TRITON_INTERPRET=1`` (then the Triton interpreter runs the kernels on
CPU); ``torch_fast`` otherwise. ``use_backend(name)`` overrides the choice for calls in
this thread inside a ``with`` block (tests compare paths this way). ``TRITON_INTERPRET``
is the only environment variable read, at each call.

Triton decides when it is first imported whether ``@triton.jit`` compiles or interprets
(its own ``tl`` library is decorated then), and reads ``TRITON_INTERPRET`` again at each
launch. So this module imports triton lazily, on the first Triton call, and a CPU call
after triton was imported in compiled mode raises a clear error instead of crashing
inside Triton. ``tests/kernels/conftest.py`` shows the one safe way to interpret in a
process that also runs torch-path tests.

Signatures and formats: see ``kernels.reference`` (identical arguments and results).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch

from kernels import reference, torch_fast
from kernels.reference.engram import engram_hash_params, engram_primes, engram_table_rows

__all__ = [
    "BACKENDS",
    "active_backend",
    "candidate_blocks",
    "engram_gate",
    "engram_gather",
    "engram_hash_params",
    "engram_primes",
    "engram_rows",
    "engram_table_rows",
    "forced_backend",
    "fp4_dequantize",
    "fp4_pow2_dequantize",
    "fp4_pow2_quantize",
    "fp4_quantize",
    "fp8_dequantize",
    "fp8_qdq",
    "fp8_quantize",
    "indexer_scores",
    "indexer_select",
    "indexer_topk",
    "load_kernels",
    "sparse_attention",
    "triton_interpreted",
    "use_backend",
]

BACKENDS = ("auto", "triton", "torch_fast", "reference")
_TORCH_BACKENDS: dict[str, ModuleType] = {"torch_fast": torch_fast, "reference": reference}
KERNEL_MODULES = (  # dependencies first: a reload must rebind the helpers
    "kernels.numerics",
    "kernels.fp4",
    "kernels.fp8",
    "kernels.indexer",
    "kernels.sparse_attention",
    "kernels.engram",
)
_state = threading.local()


def _override() -> str:
    return getattr(_state, "backend", "auto")


@contextlib.contextmanager
def use_backend(backend: str) -> Iterator[None]:
    """Force a backend of ``BACKENDS`` (``"auto"``: the default choice) for calls in this
    thread."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    previous = _override()
    _state.backend = backend
    try:
        yield
    finally:
        _state.backend = previous


def forced_backend() -> str:
    """The backend ``use_backend`` forces in this thread (``"auto"`` when none): a worker
    thread that runs ops for this one re-enters ``use_backend(forced_backend())`` so it
    picks the same kernels."""
    return _override()


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def active_backend(*tensors: torch.Tensor | None) -> str:
    """ "triton", "torch_fast" or "reference" for a call with these tensor arguments."""
    forced = _override()
    if forced != "auto":
        return forced
    on_cuda = any(t is not None and t.is_cuda for t in tensors)
    return "triton" if on_cuda or _interpret_env() else "torch_fast"


def triton_interpreted() -> bool:
    """Whether the imported Triton runs in interpreter mode (fixed when triton is first
    imported: its own ``tl`` library functions are decorated then)."""
    triton = sys.modules.get("triton")
    if triton is None:
        return _interpret_env()
    from triton.language import standard

    return type(standard.cdiv).__name__ == "InterpretedFunction"


def load_kernels(names: tuple[str, ...] = KERNEL_MODULES) -> dict[str, ModuleType]:
    """Import the Triton kernel modules (compiled or interpreted, as Triton was imported)."""
    return {name: importlib.import_module(name) for name in names}


def _kernel(module: str, name: str, tensors: tuple[torch.Tensor | None, ...]) -> Callable[..., Any]:
    on_cuda = any(t is not None and t.is_cuda for t in tensors)
    if not on_cuda and not triton_interpreted():
        raise RuntimeError(
            "Triton kernels on CPU tensors need the Triton interpreter, and triton was "
            "imported in compiled mode: set TRITON_INTERPRET=1 before anything imports triton"
        )
    mod = load_kernels((module,))[module]
    fn: Callable[..., Any] = getattr(mod, name)
    return fn


def _route(module: str, name: str, *tensors: torch.Tensor | None) -> Callable[..., Any]:
    backend = active_backend(*tensors)
    if backend == "triton":
        return _kernel(module, name, tensors)
    fn: Callable[..., Any] = getattr(_TORCH_BACKENDS[backend], name)
    return fn


# --------------------------------------------------------------------------------------
# FP4 / FP8 formats


def fp4_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (packed [..., D//2] uint8, scale [..., D//16] uint8 E4M3)."""
    return _route("kernels.fp4", "fp4_quantize", x)(x)  # type: ignore[no-any-return]


def fp4_dequantize(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """packed [..., D//2] uint8, scale [..., D//16] uint8 -> [..., D] ``dtype``."""
    return _route("kernels.fp4", "fp4_dequantize", packed)(packed, scale, dtype)  # type: ignore[no-any-return]


def fp4_pow2_quantize(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (packed [..., D//2] uint8, exp [..., D//block] int8)."""
    return _route("kernels.fp4", "fp4_pow2_quantize", x)(x, block)  # type: ignore[no-any-return]


def fp4_pow2_dequantize(
    packed: torch.Tensor, exp: torch.Tensor, block: int = 32, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """packed [..., D//2] uint8, exp [..., D//block] int8 -> [..., D] ``dtype``."""
    fn = _route("kernels.fp4", "fp4_pow2_dequantize", packed)
    return fn(packed, exp, block, dtype)  # type: ignore[no-any-return]


def fp8_quantize(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (E4M3 bits [..., D] uint8, exp [..., D//block] int8)."""
    return _route("kernels.fp8", "fp8_quantize", x)(x, block)  # type: ignore[no-any-return]


def fp8_dequantize(
    bits: torch.Tensor, exp: torch.Tensor, block: int = 32, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """bits [..., D] uint8, exp [..., D//block] int8 -> [..., D] ``dtype``."""
    return _route("kernels.fp8", "fp8_dequantize", bits)(bits, exp, block, dtype)  # type: ignore[no-any-return]


def fp8_qdq(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x [..., D] -> [..., D] (x's dtype), E4M3 quantize-dequantize with pow2 block scales."""
    return _route("kernels.fp8", "fp8_qdq", x)(x, block)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------------
# CSA2 indexer


def indexer_scores(
    q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, m: int
) -> torch.Tensor:
    """q [T, H, Di], w [T, H], k [S, Di], q_pos [T] int64 -> scores [T, S] fp32."""
    return _route("kernels.indexer", "indexer_scores", q, k)(q, w, k, q_pos, m)  # type: ignore[no-any-return]


def candidate_blocks(
    scores: torch.Tensor, block: int, keep: int, q_pos: torch.Tensor, m: int
) -> torch.Tensor:
    """scores [T, S] fp32, q_pos [T] -> cand_mask [T, ceil(S/block)] bool."""
    fn = _route("kernels.indexer", "candidate_blocks", scores)
    return fn(scores, block, keep, q_pos, m)  # type: ignore[no-any-return]


def indexer_topk(
    scores: torch.Tensor,
    topk: int,
    q_pos: torch.Tensor,
    m: int,
    cand_mask: torch.Tensor | None = None,
    block: int = 8,
) -> torch.Tensor:
    """scores [T, S] fp32, q_pos [T], cand_mask [T, NB] bool | None -> idx [T, topk] int32."""
    fn = _route("kernels.indexer", "indexer_topk", scores)
    return fn(scores, topk, q_pos, m, cand_mask, block)  # type: ignore[no-any-return]


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
    """Top-k inside the candidate blocks (later index layers of the hierarchy), by
    definition ``indexer_topk(indexer_scores(q, w, k, q_pos, m), topk, q_pos, m, cand_mask,
    block)``: composed from the two kernels on the Triton path; torch_fast scores only the
    candidate blocks. -> idx [T, topk] int32."""
    backend = active_backend(q, k)
    if backend == "triton":
        scores = indexer_scores(q, w, k, q_pos, m)
        return indexer_topk(scores, topk, q_pos, m, cand_mask, block)
    fn: Callable[..., torch.Tensor] = _TORCH_BACKENDS[backend].indexer_select
    return fn(q, w, k, q_pos, m, topk, cand_mask, block)


# --------------------------------------------------------------------------------------
# sparse attention


def sparse_attention(
    q: torch.Tensor,
    win_kv: torch.Tensor,
    win_idx: torch.Tensor,
    glob_packed: torch.Tensor,
    glob_scale: torch.Tensor,
    glob_idx: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [T, H, D], win_kv [Nw, D], win_idx [T, W] int32, glob_packed [Ng, D//2] uint8,
    glob_scale [Ng, D//16] uint8, glob_idx [T, K] int32, sink [H] -> [T, H, D]."""
    fn = _route("kernels.sparse_attention", "sparse_attention", q)
    return fn(q, win_kv, win_idx, glob_packed, glob_scale, glob_idx, sink, scale)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------------
# Engram


def engram_rows(
    ids: torch.Tensor, mult: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """ids [T+3] int64, mult [4], primes [3, 8], offsets [3, 8] -> rows [T, 24] int64."""
    return _route("kernels.engram", "engram_rows", ids)(ids, mult, primes, offsets)  # type: ignore[no-any-return]


def engram_gather(table: torch.Tensor, exp: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """table [R, Dh] uint8, exp [R, Dh//32] int8, rows [T, 24] -> [T, 24*Dh] fp32."""
    return _route("kernels.engram", "engram_gather", table, rows)(table, exp, rows)  # type: ignore[no-any-return]


def engram_gate(h: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """h [T, C, dim], key [T, dim], value [T, dim] -> [T, C, dim]."""
    return _route("kernels.engram", "engram_gate", h)(h, key, value)  # type: ignore[no-any-return]
