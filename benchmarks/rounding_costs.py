"""What query rounding costs on CPU, in isolation, for three GQA shapes, one thread: one decode
step's K append (the shares, ``reference.rounding_coefficients``, and the rounded quantize against
rounding to nearest; minimum over repeated batches of calls), and a prompt's first K append as the
default stores it (``PackedKV.from_float``: rounded against the prompt's queries, and with
``query_rounded=0`` to nearest; median of repeated calls).

    OMP_NUM_THREADS=1 python benchmarks/rounding_costs.py

Run with ``PYTHONPATH`` pointing at another checkout to time its reference the same way.
"""

from __future__ import annotations

import time

import torch

import kvpass
from kvpass import reference
from kvpass.packed import PackedKV

# (query heads, KV heads, head_dim): the decode bench model's, SmolLM2-135M's, Gemma 3 270M's.
SHAPES = {"bench model": (16, 8, 128), "SmolLM2": (9, 3, 64), "Gemma 3": (4, 1, 256)}


def fastest_us(fn, calls: int = 50, repeats: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return 1e6 * best


def median_ms(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def prompt_costs(gen: torch.Generator, prompt_tokens=(64, 512, 2048)) -> None:
    default = kvpass.kv4().config.k
    nearest = kvpass.kv4(k_query_rounded=0).config.k
    print(f"\nprompt append, default K ({default.tag}) against query_rounded=0")
    print(f"{'shape':12} {'tokens':>6} {'rounded ms':>11} {'nearest ms':>11} {'us/token':>9}")
    for name, (query_heads, kv_heads, head_dim) in SHAPES.items():
        for tokens in prompt_tokens:
            query = torch.randn(1, query_heads, tokens, head_dim, generator=gen)
            key = torch.randn(1, kv_heads, tokens, head_dim, generator=gen)
            rounded, to_nearest = (median_ms(lambda: PackedKV.from_float(key, spec, query)) for spec in (default, nearest))
            print(f"{name:12} {tokens:6} {rounded:11.1f} {to_nearest:11.1f} {1e3 * (rounded - to_nearest) / tokens:9.1f}")


def main() -> None:
    torch.set_num_threads(1)
    spec = kvpass.kv4(k_query_rounded=True).config.k
    gen = torch.Generator().manual_seed(0)
    print(f"kvpass from {kvpass.__file__}")
    print(f"{'shape':12} {'shares us':>10} {'rounded us':>11} {'nearest us':>11}")
    for name, (query_heads, kv_heads, head_dim) in SHAPES.items():
        query = torch.randn(1, query_heads, 1, head_dim, generator=gen)
        key = reference.rotate(torch.randn(1, kv_heads, 1, head_dim, generator=gen))
        shares = reference.rounding_coefficients(query, kv_heads, None, spec)
        print(f"{name:12} {fastest_us(lambda: reference.rounding_coefficients(query, kv_heads, None, spec)):10.0f} "
              f"{fastest_us(lambda: reference.quantize(key, spec, shares)):11.0f} "
              f"{fastest_us(lambda: reference.quantize(key, spec)):11.0f}")  # fmt: skip
    prompt_costs(gen)


if __name__ == "__main__":
    main()
