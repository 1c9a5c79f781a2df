"""An eager, model-agnostic twin of the kv4 backend, for references and scheme studies.

``SimulatedKVCache`` is an HF ``DynamicCache`` whose attention layers hand attention
exactly what the kv4 backend's attention reads: every past token as
:func:`kvpass.reference.quantize_dequantize` gives it back, the new tokens exact. It keeps
fp copies and re-quantizes the whole past each step (groups stay aligned from token 0,
so this equals quantizing each token once), which is slow and simple: what a reference
should be. Layer types (full, sliding-window, recurrent) come from the model config as in
``DynamicCache``; only attention layers are simulated.

``FpTokens`` says which tokens stay unquantized: by default the specs' window, as kv4 keeps
it; also schemes kv4 does not have, such as the first ``sinks`` tokens of K and V alike, kept
fp wherever a sliding window has moved them (see :meth:`FpTokens.quantized`). A spec's own
``sinks`` and ``center`` are simulated as kv4 stores them: sinks at the start of the sequence
until a sliding window evicts them, the offset fixed by a layer's first update.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from kvpass.config import WINDOW_BLOCK, QuantSpec
from kvpass.reference import bits_per_value, center_offset, quantize_dequantize


@dataclasses.dataclass(frozen=True)
class FpTokens:
    """Which stored tokens stay unquantized: the first ``sinks`` (attention sinks) and a
    recent window of ``window`` to ``window + flush - 1`` tokens.

    Tokens leave the window ``flush`` at a time: a cache holding ``S`` tokens quantizes
    tokens ``[sinks, sinks + n)`` with ``n`` the largest multiple of ``flush`` that leaves at
    least ``window`` tokens after them. So the quantized span only grows, in whole blocks,
    and each token is quantized once, as a real cache would.
    """

    sinks: int = 0
    window: int = 0
    flush: int = 1

    def __post_init__(self):
        if self.sinks < 0 or self.window < 0 or self.flush < 1:
            raise ValueError(f"need sinks >= 0, window >= 0, flush >= 1, got {self}")

    def quantized(self, stored: int) -> tuple[int, int]:
        """``[start, stop)``: the quantized tokens of a cache holding ``stored`` tokens."""
        start = min(self.sinks, stored)
        free = stored - start - self.window
        return start, start + (free // self.flush * self.flush if free > 0 else 0)

    def fp16_ratio(self, stored: int, k_spec: QuantSpec, v_spec: QuantSpec, heads: int, head_dim: int) -> float:
        """Bytes of a ``stored``-token cache of ``heads`` KV heads of ``head_dim`` channels built from
        one prompt (fp tokens in fp16, refined tokens' second code plane, the sinks, offset and query
        scales a spec takes from it included) over an all-fp16 cache."""
        start, stop = self.quantized(stored)
        total = 0
        for spec in (k_spec.for_head_dim(head_dim), v_spec.for_head_dim(head_dim)):
            taken, has_offset = spec.prefix(stored)
            sinks = min(taken, stop)
            n_quant = stop - max(start, sinks)
            total += (stored - n_quant) * 2 * head_dim + 2 * head_dim * (has_offset + spec.takes_query_scales(stored))
            refined = spec.refined_tokens(n_quant + sinks, head_dim, sinks, has_offset)
            total += (n_quant + refined) * head_dim * bits_per_value(spec, heads, head_dim) / 8
        return total / (stored * 4 * head_dim)


def _simulated_update(base_update, k_spec, v_spec, fp_tokens, state, key_states, value_states, *args, **kwargs):
    """The layer's own update (its bookkeeping, eviction included), quantized past on read.
    ``state`` (a dict per layer) counts the tokens seen and holds the sinks and offset each spec took."""
    if value_states is key_states:  # one tensor read as both K and V: kv4 stores it with K's spec
        v_spec = k_spec
    k_spec, v_spec = (
        None if spec is None else spec.for_head_dim(x.shape[-1])
        for x, spec in ((key_states, k_spec), (value_states, v_spec))
    )
    if not state:  # the first update fixes the specs' sinks and offsets, as kv4's first append does
        prefixes = []
        for x, spec in ((key_states, k_spec), (value_states, v_spec)):
            sinks, takes_offset = (0, False) if spec is None else spec.prefix(x.shape[2])
            prefixes.append((sinks, center_offset(x, spec) if takes_offset else None))
        state.update(seen=0, prefixes=prefixes)
    state["seen"] += key_states.shape[2]
    full_k, full_v = base_update(key_states, value_states, *args, **kwargs)
    past = full_k.shape[2] - key_states.shape[2]
    evicted = state["seen"] - full_k.shape[2]  # tokens a sliding window dropped from the front
    # The past as the cache stored it after the previous step; the new tokens are exact.
    start, stop = fp_tokens.quantized(past)

    def read(full, spec, prefix):
        sinks, offset = prefix
        held = max(min(sinks - evicted, past), 0)  # the spec's sinks, while the layer holds them
        first = max(start, held)
        if spec is None or stop <= first:
            return full
        # The spec's sinks as kv4 stores them (16 bits), then its quantized tokens.
        stored = quantize_dequantize(full[:, :, first - held : stop], spec, offset, sinks=held)
        return torch.cat([full[:, :, : first - held], stored, full[:, :, stop:]], 2)

    k_prefix, v_prefix = state["prefixes"]
    return read(full_k, k_spec, k_prefix), read(full_v, v_spec, v_prefix)


class SimulatedKVCache(DynamicCache):
    """``k_spec``/``v_spec``: how K/V are stored (None: exact); ``layers``: the indices of the cache
    layers simulated (default: every attention layer), the others exact."""

    def __init__(
        self, config, k_spec: QuantSpec | None, v_spec: QuantSpec | None, fp_tokens: FpTokens | None = None,
        layers: Collection[int] | None = None,
    ):  # fmt: skip
        if k_spec is not None and k_spec.query_scaled:
            raise ValueError(
                f"K spec {k_spec.tag}: query scales come from the queries, which a cache never sees; "
                "SimulatedKVCache cannot simulate them (the kv4 backend stores them)"
            )
        super().__init__(config=config)
        if fp_tokens is None:  # what kv4 itself keeps fp: the specs' window
            windows = {spec.window for spec in (k_spec, v_spec) if spec is not None}
            if len(windows) > 1:
                raise ValueError(f"K and V windows differ ({k_spec.window}, {v_spec.window}); pass fp_tokens")
            window = windows.pop() if windows else 0
            fp_tokens = FpTokens(window=window, flush=WINDOW_BLOCK) if window else FpTokens()
        for index, layer in enumerate(self.layers):
            if isinstance(layer, DynamicLayer) and (layers is None or index in layers):
                layer.update = functools.partial(_simulated_update, layer.update, k_spec, v_spec, fp_tokens, {})


def _rounded_update(base_update, dtype, key_states, value_states, *args, **kwargs):
    """The layer's own update on K and V cast to ``dtype``; read back in the model's dtype."""
    full_k, full_v = base_update(key_states.to(dtype), value_states.to(dtype), *args, **kwargs)
    return full_k.to(key_states.dtype), full_v.to(value_states.dtype)


class RoundedKVCache(DynamicCache):
    """An unquantized cache holding K and V in ``dtype`` (float16, bfloat16) for a model run in a
    wider one: what 16-bit storage alone costs, the floor under a quantized cache's comparison with
    the model's own. New tokens are read as stored, as a 16-bit model's cache would hand them over."""

    def __init__(self, config, dtype: torch.dtype):
        super().__init__(config=config)
        for layer in self.layers:
            if isinstance(layer, DynamicLayer):
                layer.update = functools.partial(_rounded_update, layer.update, dtype)
