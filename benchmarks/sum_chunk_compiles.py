"""What a CPU decode step's fused attention costs as its cache passes 4,096 keys, where Inductor's
CPU code would sum in chunks instead of plainly: SmolLM2's heads (9 query, 3 KV heads of 64
channels) over a default-packed cache (the layout ``kvpass bench attention`` builds), one fresh cache
per context, in order. For each: the first two calls' wall time (a compile, where one happens), the
graphs Dynamo compiled in them, and the median of 200 calls after.

    python benchmarks/sum_chunk_compiles.py [--contexts 1024,4000,4100,4200,8192] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import torch
from torch._dynamo.utils import counters

from kvpass import arguments, packed
from kvpass.bench.attention import case_inputs

SMOLLM2_HEADS = types.SimpleNamespace(q_heads=9, kv_heads=3, head_dim=64)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=arguments.token_list, default="1024,4000,4100,4200,8192")
    parser.add_argument("--threads", type=arguments.positive_int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("context  first two calls  graphs compiled  median call")
    for ctx in args.contexts:
        torch.manual_seed(0)
        x = case_inputs(1, ctx, SMOLLM2_HEADS, device="cpu")
        q, k_new, v_new = x["q"].float(), x["k_new"].float(), x["v_new"].float()

        def call():
            return packed.attention(q, x["keys"], x["values"], k_new, v_new, None, x["scale"], False)

        graphs = counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        call(), call()
        first = time.perf_counter() - start
        compiled = counters["stats"]["unique_graphs"] - graphs
        times = []
        for _ in range(200):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        print(f"{ctx:>7,}  {first:>13.2f} s  {compiled:>15}  {1e6 * statistics.median(times):>8.0f} us")


if __name__ == "__main__":
    main()
