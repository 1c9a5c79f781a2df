"""The name a Hugging Face forward takes its KV cache by and returns it under, and the cache's layers
that hold K and V.

transformers 5 renamed the forward argument and the output field ``past_key_values`` to ``cache``.
In 5.24 (the release the tests pin) the old name still works, with a warning for each spelling,
and its forwards say they drop it in 5.40. kvpass's commands and benchmarks use the name the
installed release knows: no warnings on 5.24, and still the old name on releases from before the rename.
"""

from __future__ import annotations

import functools


@functools.cache
def cache_name() -> str:
    """``"cache"``, or ``"past_key_values"`` on a transformers release from before the rename."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def cache_arg(cache) -> dict:
    """``cache`` as a forward's (or ``generate``'s) keyword argument: ``model(ids, **cache_arg(cache))``."""
    return {cache_name(): cache}


def returned_cache(out):
    """The KV cache a forward's or ``generate``'s output holds."""
    return getattr(out, cache_name())


def kv_layers(cache) -> list:
    """``cache``'s layers that hold K and V: not a hybrid model's convolution or linear-attention layers
    (``LinearAttentionLayer``: a fixed-size state, no ``keys``), nor a layer nothing has written yet
    (one that reads another layer's K and V)."""
    import torch

    return [layer for layer in cache.layers if isinstance(getattr(layer, "keys", None), torch.Tensor)]
