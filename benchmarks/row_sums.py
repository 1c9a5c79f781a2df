"""The fused CPU decode attention over an MLA latent (one KV head of 512 channels, as kv4 attends over it
after absorbing the projections) with its query heads summed in groups of at most
``kvpass.cpu_steps.ROW_SUMS``, set per process since it decides the graph compiled: 8, 16 (the default)
and every head in one group.

For each count of query heads a KV head, each setting runs in a subprocess of its own, with an empty
Inductor cache (a directory of its own): the first 3 calls (compiling), then the median of 30, and the
largest difference from the reference attention.

    python benchmarks/row_sums.py [--heads 16 32 64 71 128] [--context 4096]
"""

from __future__ import annotations

import argparse
import statistics
import os
import subprocess
import sys
import tempfile
import time

import torch

from kvpass import arguments


def measure(heads: int, row_sums: int, context: int) -> str:
    from kvpass import cpu_steps, packed
    from kvpass.config import KVConfig
    from kvpass.packed import PackedKV

    cpu_steps.ROW_SUMS = row_sums
    spec = KVConfig().v.for_head_dim(512)  # a latent is stored with V's spec
    g = torch.Generator().manual_seed(0)
    latent = PackedKV.from_float(torch.randn(1, 1, context, 512, generator=g), spec)
    latent = latent.append(torch.randn(1, 1, 1, 512, generator=g))
    q = torch.randn(1, heads, 1, 512, generator=g) * 0.05
    new = torch.randn(1, 1, 1, 512, generator=g)
    mask = torch.randn(1, heads, 1, latent.shape[2] + 1, generator=g)  # the rotary part of the scores

    def call():
        return packed.attention(q, latent, latent, new, new, mask, 0.1)

    start = time.perf_counter()
    for _ in range(3):  # a structure's first call runs eagerly, its second compiles
        out = call()
    first = time.perf_counter() - start
    times = []
    for _ in range(30):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    with cpu_steps.reference_attention():
        err = (out - call()).abs().max().item()
    return f"| {heads} | {row_sums} | {first:.1f} | {statistics.median(times) * 1e3:.2f} | {err:.1e} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=arguments.positive_int, nargs="+", default=[16, 32, 64, 71, 128])
    parser.add_argument("--context", type=arguments.tokens, default=4096)
    parser.add_argument("--threads", type=arguments.positive_int, default=2)
    parser.add_argument("--one", type=arguments.positive_int, nargs=2, help=argparse.SUPPRESS)  # a worker's
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        print(measure(*args.one, args.context))
        return
    print("| query heads a KV head | ROW_SUMS | first 3 calls s | ms a call | max diff vs reference |")
    print("|---|---|---|---|---|")
    for heads in args.heads:
        for row_sums in sorted({8, 16, heads}):
            worker = [sys.executable, __file__, "--one", str(heads), str(row_sums), "--context", str(args.context),
                      "--threads", str(args.threads)]  # fmt: skip
            with tempfile.TemporaryDirectory() as cache:  # compiled cold, as a fresh machine would
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
                out = subprocess.run(worker, capture_output=True, text=True, env=env)
            print(out.stdout.strip() or f"| {heads} | {row_sums} | failed: {out.stderr.strip().splitlines()[-1]} |",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
