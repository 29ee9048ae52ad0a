#!/usr/bin/env bash
# One short GPU run for the kernels (issue 8): the kernel tests compiled on the GPU (no
# interpreter), then the full-size benchmark. Run from the repository root:
#
#     bash benchmarks/gpu_check.sh            # logs and JSON under $OUT (or /tmp/kernels_gpu)
#
# Uses the machine's own python3 (torch + triton, nothing to install: the H200 image has
# torch 2.11 and triton 3.6). Budget: tests <= 200 s, benchmark <= 300 s.
set -u -o pipefail
OUT=${OUT:-/tmp/kernels_gpu}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET

nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv \
  | tee "$OUT/gpu.txt"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'cuda', torch.cuda.is_available())" | tee -a "$OUT/gpu.txt"

# -c /dev/null: the project's pytest config names plugins the GPU image may lack
# or that warn there (pytest-asyncio); the kernel tests need none of them.
KERNELS_TEST_DEVICE=cuda timeout 200 $PY -m pytest -q -c /dev/null --rootdir . \
  -p no:cacheprovider -p no:asyncio tests/kernels 2>&1 | tee "$OUT/tests.log"
tests_rc=$?

timeout 300 $PY benchmarks/kernels.py --json "$OUT/kernels.json" 2>&1 | tee "$OUT/bench.log"
bench_rc=$?

echo "gpu_check: tests rc=$tests_rc benchmark rc=$bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
