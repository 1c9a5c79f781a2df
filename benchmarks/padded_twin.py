"""A left-padded batch through kv4 against the eager twin, per model type: is every padded row's cache
read as the twin reads it?

    python benchmarks/padded_twin.py llama gemma3_text qwen3_next

Each type's tiny config (``kvpass coverage``'s: 2 layers, head_dim 32 where the config has one) runs a
batch of two 70-token prompts, the second left-padded by 20, through a kv4-compiled model and through
the eager model over :class:`kvpass.simulate.SimulatedKVCache` (positions and masks as ``generate``
places them), then one decode step; prints the largest logit difference and each packed K cache's
``filled_pads`` (a row's pads and the copies of its first tokens still held; ``[]``: not filled, an
attention form whose mask is additive; 0 copies: a sliding window already evicted them).
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache

import kvpass
from kvpass.cache_argument import cache_arg
from kvpass.coverage import PROMPT_TOKENS, TWIN_TOLERANCE, causal_lm, tiny_config
from kvpass.packed import PackedKV
from kvpass.simulate import SimulatedKVCache, observed_queries

PADS = 20


@torch.no_grad()
def padded_step_error(model_type: str) -> tuple[float, list]:
    """``(max |kv4 - twin|, filled_pads of each packed K cache)`` of a padded batch's first decode step."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = causal_lm(tiny_config(model_type)).eval()
    vocab = min(model.config.get_text_config(decoder=True).vocab_size or 256, 256)
    ids = torch.randint(3, vocab, (2, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :PADS], ids[1, :PADS] = 0, 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    prompt = dict(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    step = dict(input_ids=torch.randint(3, vocab, (2, 1), generator=torch.Generator().manual_seed(1)),
                attention_mask=torch.cat([mask, torch.ones_like(mask[:, :1])], 1),
                position_ids=positions[:, -1:] + 1, use_cache=True)  # fmt: skip
    compiled, cache = torch.compile(model, backend="kv4"), DynamicCache(config=model.config)
    compiled(**prompt, **cache_arg(cache))
    got = compiled(**step, **cache_arg(cache)).logits
    config = kvpass.kv4().config
    twin = SimulatedKVCache(model.config, config.k, config.v)
    with observed_queries():
        model(**prompt, **cache_arg(twin))
        expected = model(**step, **cache_arg(twin)).logits
    keys = [getattr(layer, "keys", None) for layer in cache.layers]
    filled = [k.filled_pads.tolist() for k in keys if isinstance(k, PackedKV)]
    return float((got - expected).abs().max()), filled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("types", nargs="+", help="transformers model types (kvpass coverage's names)")
    args = parser.parse_args()
    print(f"| model type | max logit difference (within {TWIN_TOLERANCE:g}?) | K's filled_pads per packed layer |")
    print("|---|---|---|")
    for model_type in args.types:
        try:
            error, filled = padded_step_error(model_type)
            print(f"| {model_type} | {error:.1e} ({'yes' if error <= TWIN_TOLERANCE else 'NO'}) | {filled} |", flush=True)
        except Exception as err:  # noqa: BLE001 - one type's failure is its row
            print(f"| {model_type} | not checked: {type(err).__name__}: {str(err)[:120]} | |", flush=True)


if __name__ == "__main__":
    main()
