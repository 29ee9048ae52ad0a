"""Compile every Triton kernel for Hopper (sm_90) without a GPU and print its registers,
stack (spills) and shared memory, read from the cubin with Triton's bundled cuobjdump.

    .venv/bin/python benchmarks/kernels_compile.py      # about a minute on 2 cores

`make bench` runs it as is (it has no longer mode). Self-check, or the run fails: every
kernel compiles for sm_90.

Catches compile errors and register spills before a GPU is lent. The constexpr values
mirror the launches in ``kernels/*.py`` at full-size shapes (head_dim 512, index 32x128,
Engram dim 5120); keep them in step when a launch changes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import engram, fp4, fp8, indexer
from kernels import sparse_attention as sa

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def p(t: str) -> str:
    return "*" + t


def compile_one(name: str, fn: Any, sig: dict[str, str], const: dict[str, Any], warps: int) -> bool:
    full = {a: ("constexpr" if a in const else sig[a]) for a in fn.arg_names}
    consts = {(fn.arg_names.index(a),): v for a, v in const.items()}
    try:
        k = triton.compile(
            ASTSource(fn, full, constexprs=consts), target=TARGET, options={"num_warps": warps}
        )
    except Exception as e:
        print(f"FAIL {name}: {str(e)[-2000:]}")
        return False
    usage = "?"
    if CUOBJDUMP.exists():
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(k.asm["cubin"])
        out = subprocess.run(
            [str(CUOBJDUMP), "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
        os.unlink(f.name)
        usage = " ".join(s.strip() for s in out.splitlines() if "REG:" in s)[:26]
    print(f"ok   {name:<34} warps {warps}  {usage}")
    return True


def main() -> int:
    print(f"triton {triton.__version__}, target sm_90")
    i32, i64, f32 = "i32", "i64", "fp32"
    jobs: list[tuple[str, Any, dict[str, str], dict[str, Any], int]] = []
    for pow2, gs, st in ((False, 16, "u8"), (True, 32, "i8")):
        sig = dict(x_ptr=p("bf16"), packed_ptr=p("u8"), scale_ptr=p(st), NG=i32)
        floor = 6 * 2.0**-64 if pow2 else 6 * 2.0**-9
        const = dict(GS=gs, POW2=pow2, AMAX_FLOOR=floor, BLOCK_G=fp4.BLOCK_G)
        jobs.append((f"fp4 quantize pow2={pow2}", fp4._fp4_quantize_kernel, sig, const, 4))
        sig = dict(packed_ptr=p("u8"), scale_ptr=p(st), out_ptr=p("bf16"), NG=i32)
        const = dict(GS=gs, POW2=pow2, BLOCK_G=fp4.BLOCK_G)
        jobs.append((f"fp4 dequantize pow2={pow2}", fp4._fp4_dequantize_kernel, sig, const, 4))
    for qdq in (False, True):
        sig = dict(x_ptr=p("bf16"), bits_ptr=p("u8"), exp_ptr=p("i8"), out_ptr=p("bf16"), NG=i32)
        const = dict(GS=32, QDQ=qdq, BLOCK_G=fp8.BLOCK_G)
        jobs.append((f"fp8 quantize qdq={qdq}", fp8._fp8_quantize_kernel, sig, const, 4))
    sig = dict(bits_ptr=p("u8"), exp_ptr=p("i8"), out_ptr=p("bf16"), NG=i32)
    jobs.append(("fp8 dequantize", fp8._fp8_dequantize_kernel, sig, dict(GS=32, BLOCK_G=32), 4))
    for dt, ieee in (("bf16", False), ("fp32", True)):
        sig = dict(q_ptr=p(dt), w_ptr=p(f32), k_ptr=p(dt), qpos_ptr=p(i64), out_ptr=p(f32))
        sig |= dict(T=i32, S=i32, H=i32, DI=i32, M=i32)
        const = dict(BLOCK_T=16, BLOCK_S=64, BLOCK_D=128, IEEE=ieee)
        jobs.append((f"indexer scores {dt}", indexer._scores_kernel, sig, const, 4))
    sig = dict(scores_ptr=p(f32), qpos_ptr=p(i64), out_ptr=p(f32), S=i32, NB=i32, M=i32)
    jobs.append(("block max", indexer._block_max_kernel, sig, dict(BLOCK=8, BLOCK_NB=256), 4))
    for blocks, cand in ((True, False), (False, True), (False, False)):
        sig = dict(key_ptr=p(f32), qpos_ptr=p(i64), cand_ptr=p("u8"))
        sig |= dict(out_ptr=p("u8" if blocks else "i32"), T=i32, N=i32, S=i32, M=i32, K=i32)
        sig |= dict(NBC=i32)
        const = dict(BLOCK=8, MODE_BLOCKS=blocks, HAS_CAND=cand, BLOCK_T=1, BLOCK_N=1024)
        jobs.append((f"select blocks={blocks} cand={cand}", indexer._select_kernel, sig, const, 4))
    for dt, ieee in (("bf16", False), ("fp32", True)):
        sig = dict(q_ptr=p(dt), win_ptr=p(dt), widx_ptr=p(i32), gp_ptr=p("u8"), gs_ptr=p("u8"))
        sig |= dict(gidx_ptr=p(i32), sink_ptr=p(f32), out_ptr=p(dt), H=i32, D=i32, W=i32)
        sig |= dict(K=i32, scale=f32)
        const = dict(BLOCK_H=16, BLOCK_N=16, HALF=256, IEEE=ieee)
        jobs.append((f"sparse attention D=512 {dt}", sa._sparse_attention_kernel, sig, const, 8))
    sig = dict(ids_ptr=p(i64), mult_ptr=p(i64), primes_ptr=p(i64), offsets_ptr=p(i64))
    sig |= dict(out_ptr=p(i64), T=i32, NH=i32)
    jobs.append(("engram rows", engram._rows_kernel, sig, dict(BLOCK_T=128, BLOCK_H=8), 4))
    sig = dict(table_ptr=p("u8"), exp_ptr=p("i8"), rows_ptr=p(i64), out_ptr=p(f32), NR=i32)
    sig |= dict(DH=i32)
    jobs.append(("engram gather", engram._gather_kernel, sig, dict(BLOCK_R=32, BLOCK_D=256), 8))
    sig = dict(h_ptr=p("bf16"), key_ptr=p("bf16"), value_ptr=p("bf16"), out_ptr=p("bf16"))
    sig |= dict(C=i32, DIM=i32, eps=f32, inv_sqrt_dim=f32)
    jobs.append(("engram gate dim=5120", engram._gate_kernel, sig, dict(BLOCK_D=8192), 8))
    ok = [compile_one(*job) for job in jobs]
    print(f"{sum(ok)}/{len(ok)} kernels compiled")
    if not all(ok):
        return 1
    print(f"self-check: every kernel ({len(ok)}) compiled for sm_90 with Triton's own compiler")
    print(f"kernels compile result: {len(ok)}/{len(ok)} kernels compiled for sm_90")
    return 0


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: this compiles the kernels")
    raise SystemExit(main())
