"""Kernel benchmark: each Triton kernel at full-size shapes against its torch reference,
in the same run, as achieved memory bandwidth and share of the device's peak.

    python benchmarks/kernels.py [--json PATH] [--only NAME[,NAME]]

Shapes (REFERENCE_MODEL.md, full size): decode attention = batch 64, 64 heads, head_dim
512, 128 window + 512 selected entries per sequence; prefill = 8k tokens (attention,
indexer at m=2 and m=1, formats); Engram = 8k positions x 24 rows. Bytes are the fewest
a kernel must move (each input read once, each output written once; gathered rows
counted once per row that is gathered). GB/s = those bytes over the median time
measured with CUDA events (warm-up first; inputs rotated across several copies when
one copy would sit in L2). Compute-heavy ops also print TFLOP/s. Each row checks the
Triton result against the reference (exact ops: "exact"; others: max abs error).

Without a GPU the script still runs: tiny shapes, torch reference only (the Triton
interpreter is a correctness tool, not a performance path), and it says so. `--quick`
(make bench) on a machine without a GPU also runs every Triton kernel once through the
interpreter (`TRITON_INTERPRET=1`, set here before Triton is imported) and checks it
against the reference at those tiny shapes; its timings are the reference's on the CPU
and say nothing of the kernels: those need a GPU. With a GPU, `--quick` is the full run.
Ends with `self-check:` (every case's Triton result matches the reference, where one
ran) and, on a GPU, one `figure:` line per case.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

if "--quick" in sys.argv[1:] and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import dispatch as K
from kernels import reference as R

# Peak HBM bandwidth, bytes/s, by device-name substring (datasheet figures; first match).
PEAK_BANDWIDTH = [
    ("GH200", 4.0e12),  # before "H200", which it contains
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("H800", 3.35e12),
    ("B200", 8.0e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB", 1.935e12),
    ("A100", 1.555e12),
    ("L40S", 0.864e12),
    ("L4", 0.3e12),
    ("A10", 0.6e12),
    ("RTX 4090", 1.008e12),
    ("V100", 0.9e12),
]
L2_ROTATE_BYTES = 512 << 20  # rotate input copies until a pass touches this much


def device_peak(name: str) -> float | None:
    for key, peak in PEAK_BANDWIDTH:
        if key in name:
            return peak
    return None


def nbytes(*xs: Any) -> int:
    return sum(x.numel() * x.element_size() for x in xs if isinstance(x, torch.Tensor))


@dataclass
class Case:
    name: str
    shape: str
    op: str
    make: Callable[[], tuple[Any, ...]]  # builds one input set
    bytes_of: Callable[[tuple[Any, ...], Any], int]
    flops: float = 0.0
    exact: bool = True
    ref_reps: int = 5
    results: dict[str, Any] = field(default_factory=dict)


def _sorted_subset(g: torch.Generator, hi: int, k: int, dev: torch.device) -> torch.Tensor:
    """k distinct ascending indices in [0, hi), -1 padded when hi < k. [k] int32"""
    n = min(k, hi)
    idx = torch.randperm(hi, generator=g)[:n].sort().values
    out = torch.full((k,), -1, dtype=torch.int32)
    out[:n] = idx.int()
    return out.to(dev)


def build_cases(dev: torch.device, full: bool) -> list[Case]:
    g = torch.Generator().manual_seed(0)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32

    def rnd(*shape: int, dtype: torch.dtype = dt) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dev, dtype)

    # sizes: full, or tiny on CPU
    T = 8192 if full else 64  # prefill tokens / Engram positions
    B, H, D, W, KSEL = (64, 64, 512, 128, 512) if full else (4, 4, 64, 16, 16)
    IH, ID = (32, 128) if full else (4, 32)
    DIM, HC = (5120, 4) if full else (64, 2)
    DH, PRIME = (256, 1 << 17) if full else (32, 1000)
    cases: list[Case] = []

    def fp4q() -> tuple[Any, ...]:
        return (rnd(T, D),)

    cases.append(
        Case("fp4_quantize", f"[{T},{D}]", "fp4_quantize", fp4q, lambda a, o: nbytes(a[0], *o))
    )

    def fp4dq() -> tuple[Any, ...]:
        return (*R.fp4_quantize(rnd(T, D, dtype=torch.float32)), dt)

    cases.append(
        Case(
            "fp4_dequantize",
            f"[{T},{D}]",
            "fp4_dequantize",
            fp4dq,
            lambda a, o: nbytes(a[0], a[1], o),
        )
    )

    def fp4p2() -> tuple[Any, ...]:
        return (rnd(T, IH * ID), 32)

    cases.append(
        Case(
            "fp4_pow2_quantize",
            f"[{T},{IH}x{ID}] idx q",
            "fp4_pow2_quantize",
            fp4p2,
            lambda a, o: nbytes(a[0], *o),
        )
    )

    def fp8() -> tuple[Any, ...]:
        return (rnd(T, D), 32)

    cases.append(Case("fp8_qdq", f"[{T},{D}]", "fp8_qdq", fp8, lambda a, o: nbytes(a[0], o)))

    def fp4_vals(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, generator=g)
        v = R.fp4_pow2_dequantize(*R.fp4_pow2_quantize(x.view(-1, shape[-1])))
        return v.view(*shape).to(dev, dt)  # FP4 values: exact in bf16

    for m in (2, 1):
        s = T // m

        def scores_in(s: int = s, m: int = m) -> tuple[Any, ...]:
            q_pos = torch.arange(T, device=dev)
            return (fp4_vals(T, IH, ID), rnd(T, IH, dtype=torch.float32), fp4_vals(s, ID), q_pos, m)

        cases.append(
            Case(
                f"indexer_scores m={m}",
                f"T={T} S={s} {IH}x{ID}",
                "indexer_scores",
                scores_in,
                lambda a, o: nbytes(*a[:4], o),
                flops=2.0 * T * s * IH * ID,
                exact=False,
                ref_reps=2,
            )
        )
    s1 = T
    blk, keep, topk = (8, 2048, 512) if full else (4, 8, 16)
    base_scores = R.indexer_scores(
        fp4_vals(T, IH, ID).float(),
        rnd(T, IH, dtype=torch.float32).float(),
        fp4_vals(s1, ID).float(),
        torch.arange(T, device=dev),
        1,
    )

    def cand_in() -> tuple[Any, ...]:
        return (base_scores, blk, keep, torch.arange(T, device=dev), 1)

    cases.append(
        Case(
            "candidate_blocks",
            f"[{T},{s1}] blk {blk} keep {keep}",
            "candidate_blocks",
            cand_in,
            lambda a, o: nbytes(a[0], a[3], o),
            ref_reps=3,
        )
    )
    cand = R.candidate_blocks(
        base_scores, blk, max(1, s1 // blk // 4), torch.arange(T, device=dev), 1
    )

    def topk_in() -> tuple[Any, ...]:
        return (base_scores, topk, torch.arange(T, device=dev), 1, cand, blk)

    cases.append(
        Case(
            "indexer_topk",
            f"[{T},{s1}] k={topk} in 1/4 blocks",
            "indexer_topk",
            topk_in,
            lambda a, o: nbytes(a[0], a[2], a[4], o),
            ref_reps=3,
        )
    )

    # sparse attention, decode: B sequences, each its own window and global rows
    ng_per = 4096 if full else 64
    sink = rnd(H, dtype=torch.float32)

    def decode_in() -> tuple[Any, ...]:
        win = R.fp8_qdq(torch.randn(B * W, D, generator=g)).to(dev, dt)
        win_idx = (torch.arange(B)[:, None] * W + torch.arange(W)[None]).int().to(dev)
        gp, gs = R.fp4_quantize(torch.randn(B * ng_per, D, generator=g))
        glob_idx = torch.stack(
            [_sorted_subset(g, ng_per, KSEL, torch.device("cpu")) + b * ng_per for b in range(B)]
        ).to(dev)
        return (rnd(B, H, D), win, win_idx, gp.to(dev), gs.to(dev), glob_idx, sink, D**-0.5)

    def attn_bytes(a: tuple[Any, ...], o: Any) -> int:
        q, win, win_idx, glob_idx = a[0], a[1], a[2], a[5]
        row_w = D * win.element_size()
        # unique window rows (prefill windows overlap) and gathered global rows
        uniq_w = int(torch.unique(win_idx[win_idx >= 0]).numel())
        uniq_g = int(torch.unique(glob_idx[glob_idx >= 0]).numel())
        return nbytes(q, o, win_idx, glob_idx) + int(uniq_w * row_w) + uniq_g * (D // 2 + D // 16)

    entries = W + KSEL
    cases.append(
        Case(
            "sparse_attention decode",
            f"B={B} H={H} D={D} {W}+{KSEL}",
            "sparse_attention",
            decode_in,
            attn_bytes,
            flops=4.0 * B * H * entries * D,
            exact=False,
        )
    )

    def prefill_in() -> tuple[Any, ...]:
        t = torch.arange(T)
        win_pos = t[:, None] - torch.arange(W - 1, -1, -1)[None]  # t-127 .. t
        win_idx = torch.where(win_pos >= 0, win_pos, -1).int().to(dev)
        win = R.fp8_qdq(torch.randn(T, D, generator=g)).to(dev, dt)
        gp, gs = R.fp4_quantize(torch.randn(T, D, generator=g))  # m = 1: one entry per token
        sel = torch.stack([_sorted_subset(g, i + 1, KSEL, torch.device("cpu")) for i in range(T)])
        return (rnd(T, H, D), win, win_idx, gp.to(dev), gs.to(dev), sel.to(dev), sink, D**-0.5)

    cases.append(
        Case(
            "sparse_attention prefill",
            f"T={T} H={H} D={D} {W}+{KSEL}",
            "sparse_attention",
            prefill_in,
            attn_bytes,
            flops=4.0 * T * H * entries * D,
            exact=False,
            ref_reps=1,
        )
    )

    # Engram
    mult, primes, offsets = R.engram_hash_params(seed=1, prime_floor=PRIME)
    mult, primes, offsets = mult.to(dev), primes.to(dev), offsets.to(dev)
    rows_total = R.engram_table_rows(primes)

    def rows_in() -> tuple[Any, ...]:
        ids = torch.randint(0, 129280 if full else 512, (T + 3,), generator=g).to(dev)
        return (ids, mult, primes, offsets)

    cases.append(
        Case("engram_rows", f"T={T} x 24", "engram_rows", rows_in, lambda a, o: nbytes(a[0], o))
    )
    # random E4M3 bytes (no NaN codes 0x7F/0xFF) and exponents, made on the device
    table = torch.randint(0, 0x7F, (rows_total, DH), device=dev, dtype=torch.uint8)
    table |= torch.randint(0, 2, (rows_total, DH), device=dev, dtype=torch.uint8) << 7
    texp = torch.randint(-8, 8, (rows_total, DH // 32), device=dev, dtype=torch.int8)

    def gather_in() -> tuple[Any, ...]:
        rows = R.engram_rows(rows_in()[0], mult, primes, offsets)
        return (table, texp, rows)

    cases.append(
        Case(
            "engram_gather",
            f"T={T} x 24 x {DH} (table {rows_total} rows)",
            "engram_gather",
            gather_in,
            lambda a, o: nbytes(a[2], o) + a[2].numel() * (DH + DH // 32),
        )
    )

    def gate_in() -> tuple[Any, ...]:
        return (rnd(T, HC, DIM), rnd(T, DIM), rnd(T, DIM))

    cases.append(
        Case(
            "engram_gate",
            f"T={T} C={HC} dim={DIM}",
            "engram_gate",
            gate_in,
            lambda a, o: nbytes(*a, o),
            exact=False,
        )
    )
    return cases


def _time_cuda(fn: Callable[[int], Any], reps: int) -> float:
    times = []
    for i in range(reps):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) / 1e3)
    return statistics.median(times)


def _time_cpu(fn: Callable[[int], Any], reps: int) -> float:
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _compare(a: Any, b: Any, exact: bool) -> str:
    xs = a if isinstance(a, tuple) else (a,)
    ys = b if isinstance(b, tuple) else (b,)
    if exact:
        return "exact" if all(torch.equal(x, y) for x, y in zip(xs, ys, strict=True)) else "DIFF"
    err = 0.0
    for x, y in zip(xs, ys, strict=True):
        fin = torch.isfinite(y)
        if not torch.equal(fin, torch.isfinite(x)):
            return "DIFF(inf)"
        err = max(err, float((x.float() - y.float())[fin].abs().max()) if fin.any() else 0.0)
    return f"{err:.1e}"


def run_case(case: Case, cuda: bool, interpret: bool = False) -> None:
    first = case.make()
    sets = [first]
    per = nbytes(*first)
    while cuda and len(sets) < 16 and per * len(sets) < L2_ROTATE_BYTES:
        sets.append(case.make())
    timer = _time_cuda if cuda else _time_cpu
    paths = ["triton", "torch"] if cuda else ["torch"]  # "torch": the reference backend
    outs: dict[str, Any] = {}
    for path in paths:
        ref_path = path == "torch"

        def call(i: int, path: str = path) -> Any:
            with K.use_backend("reference" if path == "torch" else path):
                return getattr(K, case.op)(*sets[i % len(sets)])

        outs[path] = call(0)  # warm-up (compiles Triton)
        call(1)
        if cuda:
            torch.cuda.synchronize()
        est = timer(call, 1)
        budget = 2.0 if ref_path else 1.0
        reps = max(1, min(case.ref_reps if ref_path else 50, int(budget / max(est, 1e-6))))
        sec = timer(call, max(reps, 1 if ref_path else 5))
        moved = case.bytes_of(first, outs[path])
        case.results[path] = {
            "seconds": sec,
            "bytes": moved,
            "gbps": moved / sec / 1e9,
            "tflops": case.flops / sec / 1e12 if case.flops else None,
        }
    if interpret:  # the Triton kernel once, through the interpreter: checked, not timed
        with K.use_backend("triton"):
            outs["triton"] = getattr(K, case.op)(*first)
    if cuda or interpret:
        case.results["check"] = _compare(outs["triton"], outs["torch"], case.exact)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write all figures here")
    ap.add_argument("--only", help="comma-separated case names (prefix match)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="make bench: without a GPU, also check each Triton kernel in the interpreter",
    )
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = device_peak(name) if cuda else None
    import triton

    interpret = args.quick and not cuda
    if interpret and not K.triton_interpreted():
        print("self-check: FAILED: triton was imported before TRITON_INTERPRET=1 could be set")
        return 1
    print(f"device: {name}  torch {torch.__version__}  triton {triton.__version__}")
    if cuda:
        shown = f"{peak / 1e12:.2f} TB/s (datasheet)" if peak else "unknown (add to PEAK_BANDWIDTH)"
        print(f"peak memory bandwidth: {shown}")
    else:
        print("NO CUDA DEVICE: tiny shapes, torch reference only; the Triton kernels are not")
        print("timed (the interpreter is a correctness tool). Figures below are not full size.")
        if interpret:
            print("--quick: each Triton kernel runs once in the interpreter and is checked")
            print("against the reference; kernel timings need a GPU.")
    with torch.inference_mode():
        cases = build_cases(dev, full=cuda)
        if args.only:
            keys = args.only.split(",")
            cases = [c for c in cases if any(c.name.startswith(k) for k in keys)]
        rows = []
        for case in cases:
            run_case(case, cuda, interpret)
            rows.append(case)
            _print_row(case, peak)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": name,
                    "peak_bytes_per_s": peak,
                    "torch": torch.__version__,
                    "triton": triton.__version__,
                    "cases": [{"name": c.name, "shape": c.shape, **c.results} for c in rows],
                },
                indent=1,
            )
        )
    return verdict(rows, cuda, peak)


CHECK_TOL = 1e-2
"""Largest absolute difference from the reference accepted for an inexact op at the
benchmark's shapes (the tests hold each op to its own, tighter, tolerance)."""


def verdict(rows: list[Case], cuda: bool, peak: float | None) -> int:
    """`figure:` lines and the `self-check:` line; 1 when a Triton result is off."""
    for c in rows if cuda else []:  # CPU timings of tiny shapes are no kernel's figure
        r = c.results.get("triton")
        if r is None:
            continue
        if peak:
            print(
                f"figure: kernels, share of peak bandwidth / {c.name} = {100 * r['gbps'] * 1e9 / peak:.1f} %"
            )
        else:
            print(f"figure: kernels, Triton / {c.name} = {r['seconds'] * 1e3:.3f} ms")
    checks = {c.name: c.results.get("check") for c in rows}
    if all(v is None for v in checks.values()):
        print(
            f"self-check: {len(rows)} reference ops ran; no Triton kernel ran (no GPU, no --quick)"
        )
        return 0
    bad = [f"{n}: {v}" for n, v in checks.items() if not _check_ok(v)]
    if bad:
        print(f"self-check: FAILED: Triton against the reference: {'; '.join(bad)}")
        return 1
    where = "on the GPU" if cuda else "in the interpreter (tiny shapes; timings need a GPU)"
    print(
        f"self-check: all {len(rows)} Triton kernels match the reference {where} "
        f"(exact ops exactly, others within {CHECK_TOL:g})"
    )
    return 0


def _check_ok(v: object) -> bool:
    if v == "exact":
        return True
    try:
        return float(str(v)) <= CHECK_TOL
    except ValueError:
        return False


def _fmt(r: dict[str, Any] | None, peak: float | None) -> str:
    if r is None:
        return f"{'-':>9} {'-':>8} {'-':>6} {'-':>7}"
    share = f"{100 * r['gbps'] * 1e9 / peak:5.1f}%" if peak else "    - "
    tf = f"{r['tflops']:7.1f}" if r["tflops"] is not None else f"{'':>7}"
    return f"{r['seconds'] * 1e3:9.3f} {r['gbps']:8.1f} {share} {tf}"


def _print_row(c: Case, peak: float | None) -> None:
    if not getattr(_print_row, "done", False):
        hdr = f"{'ms':>9} {'GB/s':>8} {'peak':>6} {'TFLOP/s':>7}"
        print(f"\n{'op':<26} {'shape':<38} | triton: {hdr} | torch: {hdr} | speedup check")
        _print_row.done = True  # type: ignore[attr-defined]
    tri, ref = c.results.get("triton"), c.results.get("torch")
    speed = f"{ref['seconds'] / tri['seconds']:7.1f}x" if tri and ref else f"{'-':>8}"
    print(
        f"{c.name:<26} {c.shape:<38} | triton: {_fmt(tri, peak)} | torch: {_fmt(ref, peak)}"
        f" | {speed} {c.results.get('check', '-')}",
        flush=True,
    )


if __name__ == "__main__":
    raise SystemExit(main())
