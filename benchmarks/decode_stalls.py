"""Decode steps slower than the rest: SmolLM2 compiled with kv4, a prompt of ``--context`` KJV tokens,
``--warmup`` untimed decode steps, then ``--steps`` greedy decode steps, each timed, with the heap
trims (glibc's ``malloc_trim``, which a cache storage's regrowth may run first:
``packed._release_freed_heap``) counted and timed, and the graphs Dynamo compiled in it. Medians
hide a step on which every layer's storages regrow at once, or one that compiles; this prints the
median, the slowest step, and every step over 1.5x the median with the trims it ran and its graphs.

    python benchmarks/decode_stalls.py [--context 1000] [--warmup 3] [--steps 300]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from kvpass import packed, text_data
from kvpass.bench import dynamic_cache
from kvpass.cache_argument import cache_arg
from kvpass.models_zoo.real_model import load_model

trims = []  # seconds of each trim


def timed_trim(trim, pad: int) -> int:
    """glibc's ``trim(pad)``, its seconds appended to ``trims``."""
    start = time.perf_counter()
    result = trim(pad)
    trims.append(time.perf_counter() - start)
    return result


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed decode steps first (default 3: the decode graphs compile)")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    trim = packed._malloc_trim()
    if trim is not None:
        packed._malloc_trim = lambda: functools.partial(timed_trim, trim)
    model, tokenizer = load_model("smollm2", torch.float32)
    prompt = tokenizer(text_data.load("kjv"), return_tensors="pt").input_ids[:, : args.context]
    forward = torch.compile(model, backend="kv4")
    cache = dynamic_cache(model)
    token = forward(input_ids=prompt, **cache_arg(cache), use_cache=True).logits[:, -1:].argmax(-1)
    print(f"prefill of {prompt.shape[1]} tokens: {len(trims)} trims, {1e3 * sum(trims):.0f} ms")
    for _ in range(args.warmup):
        token = forward(input_ids=token, **cache_arg(cache), use_cache=True).logits[:, -1:].argmax(-1)
    steps = []
    stats = torch._dynamo.utils.counters["stats"]  # unique_graphs: every graph Dynamo compiled
    for _ in range(args.steps):
        before, graphs_before = len(trims), stats["unique_graphs"]
        start = time.perf_counter()
        token = forward(input_ids=token, **cache_arg(cache), use_cache=True).logits[:, -1:].argmax(-1)
        steps.append((1e3 * (time.perf_counter() - start), trims[before:], stats["unique_graphs"] - graphs_before))
    median = statistics.median(ms for ms, _, _ in steps)
    print(f"{args.steps} decode steps after {prompt.shape[1] + 1 + args.warmup} tokens, {torch.get_num_threads()} "
          f"threads: median {median:.1f} ms, slowest {max(ms for ms, _, _ in steps):.1f} ms, "
          f"{sum(ms for ms, _, _ in steps) / 1e3:.1f} s in all")  # fmt: skip
    for i, (ms, ran, compiled) in enumerate(steps):
        if ms > 1.5 * median:
            print(f"  step {i}: {ms:.1f} ms, {len(ran)} trims taking {1e3 * sum(ran):.0f} ms, "
                  f"{compiled} graphs compiled")


if __name__ == "__main__":
    main()
