"""What a cache keeps alive after a prefill run in grad mode (a model called without ``torch.no_grad()``).

Compiles SmolLM2 with each backend, runs one prompt under ``no_grad`` to compile, then the same prompt
in grad mode into a fresh cache, drops the output and reads the resident set against its level before
the call (freed memory handed back first, ``kvpass.bench.memory``): what the kept cache holds, its
autograd record included.

    python benchmarks/grad_mode_memory.py --tokens 1024
"""

from __future__ import annotations

import argparse
import gc

import torch

from kvpass import text_data
from kvpass.bench import dynamic_cache, memory
from kvpass.cache_argument import cache_arg
from kvpass.models_zoo.real_model import load_model


def held_mib(backend: str, tokens: int) -> float:
    model, tokenizer = load_model("smollm2")
    ids = tokenizer(text_data.kjv()[: 20 * tokens], return_tensors="pt").input_ids[:, :tokens]
    step = torch.compile(model, backend=backend)
    with torch.no_grad():
        step(input_ids=ids, **cache_arg(dynamic_cache(model)), use_cache=True)
    gc.collect()
    memory.release_free_memory()
    before = memory._status_mib("VmRSS")
    cache = dynamic_cache(model)
    out = step(input_ids=ids, **cache_arg(cache), use_cache=True)
    del out
    gc.collect()
    memory.release_free_memory()
    return memory._status_mib("VmRSS") - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--backend", choices=("kv4", "eager"), default="kv4", help="eager: fp caches")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{args.backend}: {held_mib(args.backend, args.tokens):.0f} MiB held after a {args.tokens}-token grad-mode "
          "prefill, its output dropped, its cache kept")  # fmt: skip


if __name__ == "__main__":
    main()
