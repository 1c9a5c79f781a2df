#!/usr/bin/env bash
# One call on a lent GPU: the Triton kernels compiled natively against the reference on random
# and odd shapes (benchmarks/gpu_check.py), then the decode-attention kernel timed against fp16
# flash SDPA (kvpass bench attention), then whole decode steps of the benchmark model on the GPU
# (kvpass bench decode --device cuda). Each part has its own time limit and runs even if one
# before it failed; logs and JSON go to $OUT (else benchmarks/). Installs kvpass without network
# if it is not importable. Extra arguments go to kvpass bench attention.
# First runs (docs/gpu-check.md, H200, 2026-12-04): gpu_check.py took 219 s, most of it compiling;
# kvpass bench attention (then over 3 contexts) did not finish in 110 s, so the limits below
# leave it more. The three limits sum to 570 s: one call under the device's 600.
set -uo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1
out="${OUT:-benchmarks}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import kvpass" 2>/dev/null ||
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3
python3 -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__,
'triton', triton.__version__, 'transformers', transformers.__version__)"
failed=()

# One kernel config per shape class: the checks cover many shape classes, and autotuning
# each would compile every config for every one of them.
KVPASS_AUTOTUNE=0 timeout "${GPU_CHECK_S:-270}" python3 benchmarks/gpu_check.py 2>&1 | tee "$out/gpu_check.log" ||
    failed+=(gpu_check)
timeout "${BENCH_ATTENTION_S:-180}" python3 -m kvpass.cli bench attention --batch 1 8 --context 4096 32768 \
    --output "$out/bench_attention.json" "$@" 2>&1 | tee "$out/bench_attention.log" || failed+=(bench_attention)
timeout "${BENCH_DECODE_S:-120}" python3 -m kvpass.cli bench decode --device cuda --dtype float16 --methods fp,kv4 \
    --contexts 4096,32768 --batch 8 --warmup 4 --steps 30 --json "$out/bench_decode_cuda.json" 2>&1 |
    tee "$out/bench_decode_cuda.log" || failed+=(bench_decode)
echo "gpu_check.sh: ${failed[*]:-all parts passed}"
[ ${#failed[@]} -eq 0 ]
