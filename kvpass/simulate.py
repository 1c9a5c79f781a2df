"""An eager, model-agnostic twin of the kv4 backend, for references and scheme studies.

``SimulatedKVCache`` is an HF cache whose attention sees exactly what the kv4 backend's
attention sees: every past token as :func:`kvpass.reference.quantize_dequantize` gives it
back, the new tokens exact. It keeps fp copies and re-quantizes the whole past each step
(groups stay aligned from token 0, so this equals quantizing each token once), which is
slow and simple: what a reference should be.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvpass.config import QuantSpec
from kvpass.reference import quantize_dequantize


class SimulatedKVLayer(DynamicLayer):
    def __init__(self, k_spec: QuantSpec, v_spec: QuantSpec):
        super().__init__()
        self.k_spec, self.v_spec = k_spec, v_spec

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        past_k, past_v = self.keys, self.values
        self.keys = torch.cat([past_k, key_states], dim=-2)
        self.values = torch.cat([past_v, value_states], dim=-2)
        if past_k.dim() != 4:  # the empty 1-D tensor of a fresh layer
            return key_states, value_states
        return (
            torch.cat([quantize_dequantize(past_k, self.k_spec), key_states], dim=-2),
            torch.cat([quantize_dequantize(past_v, self.v_spec), value_states], dim=-2),
        )


class SimulatedKVCache(Cache):
    def __init__(self, num_layers: int, k_spec: QuantSpec, v_spec: QuantSpec):
        super().__init__(layers=[SimulatedKVLayer(k_spec, v_spec) for _ in range(num_layers)])
