"""``generate`` from a prefix cache made under ``torch.inference_mode()``: seconds a call, warm.

SmolLM2 compiled with kv4; before each call a prompt's cache is made under ``inference_mode`` (the
prefix-cache recipe), then ``generate`` (which runs under ``no_grad``) continues it. A compiled decode
step's graph that rejected the cache's inference tensors left its structure eager for the process
(docs/design.md, "PackedKV"). The first call compiles; the later ones are the figures.

    python benchmarks/inference_mode_prefix.py [--prefix 300] [--new-tokens 64] [--calls 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvpass import cpu_steps, text_data
from kvpass.bench import dynamic_cache
from kvpass.cache_argument import cache_arg, returned_cache
from kvpass.models_zoo.real_model import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=int, default=300, help="prefix tokens")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--calls", type=int, default=3, help="generate calls, the first compiling")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tokenizer = load_model("smollm2")
    model.compile(backend="kv4")
    ids = tokenizer(text_data.kjv()[: 20 * args.prefix], return_tensors="pt").input_ids
    prefix, turn = ids[:, : args.prefix], ids[:, args.prefix : args.prefix + 4]
    for call in range(args.calls):
        with torch.inference_mode():
            cache = returned_cache(model(input_ids=prefix, **cache_arg(dynamic_cache(model)), use_cache=True))
        start = time.perf_counter()
        model.generate(torch.cat([prefix, turn], 1), **cache_arg(cache), max_new_tokens=args.new_tokens,
                       min_new_tokens=args.new_tokens, do_sample=False)  # fmt: skip
        print(f"call {call}: {time.perf_counter() - start:.1f} s for {args.new_tokens} tokens "
              f"({'compiling' if call == 0 else 'warm'}); decode structures left eager: {len(cpu_steps._refused)}")  # fmt: skip


if __name__ == "__main__":
    main()
