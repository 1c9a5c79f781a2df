"""What the CPU reference attention's block length costs a decode step: one query token over a
default-packed cache (``PackedKV.from_float``), with blocks bounded in elements
(``reference.BLOCK_ELEMENTS``, the default) against every block ``MIN_BLOCK_TOKENS`` long
(``BLOCK_ELEMENTS = 0``, as before the twenty-sixth run), alternating between the two in one
process; each figure is the fastest of 4 medians of 15 calls. Then what a site that hands a bool
mask pays for filled pads (``PackedKV.filled_pads``, unpadded rows: every such site carries them):
the same step with and without them, and ``reference.mask_with_filled_pads`` alone.

    python benchmarks/attention_blocks.py
"""

from __future__ import annotations

import torch
from rounding_costs import median_ms  # this folder's, as the script runs from it

from kvpass import packed, reference
from kvpass.config import KVConfig

# (batch, query heads, KV heads, head_dim): SmolLM2-135M's, Gemma 3 270M's, the decode bench model's
# (Llama-3-8B's heads) at batch 1 and 4.
SHAPES = {
    "SmolLM2": (1, 9, 3, 64),
    "Gemma 3": (1, 4, 1, 256),
    "bench model": (1, 32, 8, 128),
    "bench model b4": (4, 32, 8, 128),
}
CONTEXTS = (512, 2048, 8192)


@torch.no_grad()
def main() -> None:
    torch.manual_seed(0)
    config = KVConfig()
    budget = reference.BLOCK_ELEMENTS
    print(f"kvpass from {reference.__file__}")
    print(f"{'shape':<15} {'context':>7} {'block':>5} {'256-token ms':>12} {'now ms':>7} {'speed-up':>8}")
    for name, (B, Hq, Hkv, D) in SHAPES.items():
        for context in CONTEXTS:
            keys = packed.PackedKV.from_float(torch.randn(B, Hkv, context, D), config.k, torch.randn(B, Hq, context, D))
            values = packed.PackedKV.from_float(torch.randn(B, Hkv, context, D), config.v)
            q, k_new, v_new = torch.randn(B, Hq, 1, D), torch.randn(B, Hkv, 1, D), torch.randn(B, Hkv, 1, D)
            best = {0: float("inf"), budget: float("inf")}
            for _ in range(4):
                for elements in best:
                    reference.BLOCK_ELEMENTS = elements
                    ms = median_ms(lambda: packed.attention(q, keys, values, k_new, v_new, None, None, False), 15)
                    best[elements] = min(best[elements], ms)
            reference.BLOCK_ELEMENTS = budget
            block = reference._block_tokens(config.k, config.v, B * Hkv * D)
            print(f"{name:<15} {context:>7} {block:>5} {best[0]:>12.2f} {best[budget]:>7.2f} {best[0] / best[budget]:>7.2f}x")

    print(f"\n{'shape':<15} {'context':>7} {'no fill ms':>10} {'filled ms':>9} {'gather ms':>9}")
    for name, (B, Hq, Hkv, D) in {**SHAPES, "Gemma 3 b4": (4, 4, 1, 256)}.items():
        if "bench" in name:
            continue
        for context in (512, 4096):
            x, v, q = torch.randn(B, Hkv, context, D), torch.randn(B, Hkv, context, D), torch.randn(B, Hq, context, D)
            no_pads = torch.zeros(B, dtype=torch.long)
            caches = {
                fills: (packed.PackedKV.from_float(x, config.k, q, no_pads, fills),
                        packed.PackedKV.from_float(v, config.v, None, no_pads, fills))
                for fills in (False, True)
            }  # fmt: skip
            mask = torch.ones(B, 1, 1, context + 1, dtype=torch.bool)
            query, k_new, v_new = torch.randn(B, Hq, 1, D), torch.randn(B, Hkv, 1, D), torch.randn(B, Hkv, 1, D)
            best = {key: float("inf") for key in (False, True, "gather")}
            filled = caches[True][0].filled_pads
            for _ in range(4):
                for fills, (keys, values) in caches.items():
                    ms = median_ms(lambda: packed.attention(query, keys, values, k_new, v_new, mask), 15)
                    best[fills] = min(best[fills], ms)
                ms = median_ms(lambda: reference.mask_with_filled_pads(mask, filled, 1, context + 1, False), 15)
                best["gather"] = min(best["gather"], ms)
            print(f"{name:<15} {context:>7} {best[False]:>10.2f} {best[True]:>9.2f} {best['gather']:>9.3f}")


if __name__ == "__main__":
    main()
