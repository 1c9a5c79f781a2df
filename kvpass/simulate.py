"""An eager, model-agnostic twin of the kv4 backend, for references and scheme studies.

``SimulatedKVCache`` is an HF ``DynamicCache`` whose attention layers hand attention
exactly what the kv4 backend's attention reads: every past token as
:func:`kvpass.reference.quantize_dequantize` gives it back, the new tokens exact. It keeps
fp copies and re-quantizes the whole past each step (groups stay aligned from token 0,
so this equals quantizing each token once), which is slow and simple: what a reference
should be. Layer types (full, sliding-window, recurrent) come from the model config as in
``DynamicCache``; only attention layers are simulated.
"""

from __future__ import annotations

import functools

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from kvpass.config import QuantSpec
from kvpass.reference import quantize_dequantize


def _simulated_update(base_update, k_spec: QuantSpec, v_spec: QuantSpec, key_states, value_states, *args, **kwargs):
    """The layer's own update (its bookkeeping, eviction included), quantized past on read."""
    full_k, full_v = base_update(key_states, value_states, *args, **kwargs)
    past = full_k.shape[2] - key_states.shape[2]
    if past == 0:
        return full_k, full_v
    return (
        torch.cat([quantize_dequantize(full_k[:, :, :past], k_spec), full_k[:, :, past:]], dim=2),
        torch.cat([quantize_dequantize(full_v[:, :, :past], v_spec), full_v[:, :, past:]], dim=2),
    )


class SimulatedKVCache(DynamicCache):
    def __init__(self, config, k_spec: QuantSpec, v_spec: QuantSpec):
        super().__init__(config=config)
        for layer in self.layers:
            if isinstance(layer, DynamicLayer):
                layer.update = functools.partial(_simulated_update, layer.update, k_spec, v_spec)
