"""Which decode steps compile, how long each takes, and how many symbols its graph takes: a tiny
Llama (random weights; 4 query and 2 KV heads of 64, hidden 128: ``tests/helpers.kv_heavy_llama``)
compiled with kv4, a random prompt of ``--prompt`` tokens, then ``--steps`` greedy decode steps. A small model's compiles show what a step's trace costs per layer
in seconds, where SmolLM2's take tens (``benchmarks/decode_stalls.py``).

    python benchmarks/decode_compiles.py [--layers 8] [--prompt 600] [--steps 8] [--no-cpu-steps]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvpass import cpu_steps
from kvpass.backend import kv4_backend
from kvpass.bench import build_model, dynamic_cache
from kvpass.cache_argument import cache_arg


def input_symbols(example_inputs) -> int:
    """Distinct free symbols in a graph's inputs: sizes, strides, storage offsets and integers."""
    symbols = set()
    for x in example_inputs:
        values = (*x.shape, *x.stride(), x.storage_offset()) if isinstance(x, torch.Tensor) else (x,)
        symbols |= {s for v in values if isinstance(v, torch.SymInt) for s in v.node.expr.free_symbols}
    return len(symbols)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=600)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--no-cpu-steps", action="store_true", help="the kv4 ops' eager reference: the trace alone")
    args = parser.parse_args()
    cpu_steps.enabled = cpu_steps.enabled and not args.no_cpu_steps
    torch.manual_seed(0)
    model = build_model(torch.float32, layers=args.layers, hidden=128, heads=4, kv_heads=2, head_dim=64, vocab=256,
                        positions=2048)  # fmt: skip
    graphs = []

    def counting(gm, example_inputs, **options):
        graphs.append(input_symbols(example_inputs))
        return kv4_backend(gm, example_inputs, **options)

    forward = torch.compile(model, backend=counting)
    cache = dynamic_cache(model)
    token = forward(input_ids=torch.randint(0, model.config.vocab_size, (1, args.prompt)), **cache_arg(cache),
                    use_cache=True).logits[:, -1:].argmax(-1)  # fmt: skip
    total = time.perf_counter()
    for step in range(args.steps):
        before, start = len(graphs), time.perf_counter()
        token = forward(input_ids=token, **cache_arg(cache), use_cache=True).logits[:, -1:].argmax(-1)
        if len(graphs) > before:
            print(f"step {step}: {time.perf_counter() - start:.1f} s, graphs taking {graphs[before:]} symbols")
    print(f"{args.steps} decode steps after {args.prompt} tokens, {args.layers} layers: "
          f"{time.perf_counter() - total:.1f} s in all, {len(graphs) - 1} decode graphs")


if __name__ == "__main__":
    main()
