#!/usr/bin/env bash
# GPU checks of the Triton kernels: native (not interpreted) kernels against the reference
# on random and odd shapes, an uncompiled SDPA over int4 caches (the fused kernel torch picks must
# not fall back), static-cache decode under CUDA graphs (mode="reduce-overhead"),
# then the decode benchmark, whose table prints last. Installs nothing; expects
# `pip install -e .` done. About 3-6 minutes on an H200 (not yet run), most of it compilation.
set -euo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET

# One kernel config per shape class: the checks cover many shape classes, and autotuning
# each would compile every config for every one of them.
KVPASS_AUTOTUNE=0 python benchmarks/gpu_check.py

mkdir -p "${OUT:-benchmarks}"
kvpass bench attention --output "${OUT:-benchmarks}/bench_attention.md" "$@"
