"""HF static caches whose attention layers are int4 from the first allocation.

A static layer allocates its buffers at their final size on its first ``update``. When that
forward is compiled (``model.compile(backend="kv4")`` and ``cache_implementation="static"``),
the allocation is in the graph and the kv4 pass allocates int4 buffers itself. When it runs
eagerly, before any graph exists, the buffers are fp unless the layer is one of these:

``StaticKVCache`` allocates :class:`~kvpass.packed.PackedKV` buffers instead; the layer's
``index_copy_`` then quantizes new tokens into their slots in place (``kv4::write_``), and
the kv4 pass turns the attention over the buffer into ``kv4::attention``.

    cache = kvpass.StaticKVCache(model.config, max_cache_len=4096)
    model.compile(backend="kv4")
    model.generate(ids, cache=cache, max_new_tokens=256)  # older transformers: past_key_values=cache

``generate``'s own compile route (``compile_config``) runs the prefill eagerly, in a plain
``StaticCache`` built inside ``generate`` (no hook takes a cache class).
:func:`int4_static_caches` opts one model in: before each eager forward it gives a fresh
static cache int4 layers, so that route is int4 too:

    kvpass.static.int4_static_caches(model)
    model.generate(ids, cache_implementation="static", compile_config=CompileConfig(backend="kv4"))

Sliding-window layers are int4 as well: once full, their update rolls the buffer and writes
the last slot, which PackedKV does in int4, in place (per-token rows move whole).
"""

from __future__ import annotations

import weakref

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import StaticCache, StaticLayer, StaticSlidingWindowLayer
from transformers.utils import is_torchdynamo_compiling

from kvpass.config import KVConfig, QuantSpec, check_spec, is_count
from kvpass.packed import PackedKV


class _PackedBuffers:
    """``StaticLayer.lazy_initialization`` with PackedKV buffers in place of fp zeros."""

    def __init__(self, *args, k_spec: QuantSpec, v_spec: QuantSpec, **kwargs):
        super().__init__(*args, **kwargs)
        self.k_spec, self.v_spec = k_spec, v_spec

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        shape = (self.batch_size, self.num_heads, self.max_cache_len)
        k_spec, v_spec = self.k_spec.for_head_dim(self.k_head_dim), self.v_spec.for_head_dim(self.v_head_dim)
        self.keys = PackedKV.zeros((*shape, self.k_head_dim), key_states.dtype, self.device, k_spec)
        self.values = PackedKV.zeros((*shape, self.v_head_dim), value_states.dtype, self.device, v_spec)
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not is_torchdynamo_compiling():
            # Fixed addresses, as HF marks its own buffers, so CUDA graphs replay without copying
            # them in. AOTAutograd reads the mark on the PackedKV, not on its inner tensors.
            for tensor in (self.keys, self.values, self.cumulative_length):
                torch._dynamo.mark_static_address(tensor)
        self.is_initialized = True


class PackedStaticLayer(_PackedBuffers, StaticLayer):
    pass


class PackedStaticSlidingWindowLayer(_PackedBuffers, StaticSlidingWindowLayer):
    """Once full, its update rolls the buffer and writes the last slot: PackedKV does both in int4."""


def _packed_twin(layer: StaticLayer, k_spec: QuantSpec, v_spec: QuantSpec) -> StaticLayer:
    if type(layer) is StaticSlidingWindowLayer:
        # max_cache_len is already min(window, max_cache_len); croppability was decided from both
        packed = PackedStaticSlidingWindowLayer(layer.max_cache_len, layer.max_cache_len, k_spec=k_spec, v_spec=v_spec)
        packed._is_croppable = layer.is_croppable
        return packed
    return PackedStaticLayer(layer.max_cache_len, k_spec=k_spec, v_spec=v_spec)


def _int4_layers(cache: StaticCache, k_spec: QuantSpec, v_spec: QuantSpec) -> None:
    """Give ``cache``'s attention layers that hold no token yet int4 buffers, in place."""
    layers = []
    for layer in cache.layers:
        if type(layer) in (StaticLayer, StaticSlidingWindowLayer) and (
            not layer.is_initialized or int(layer.cumulative_length) == 0
        ):
            packed = _packed_twin(layer, k_spec, v_spec)
            if layer.is_initialized:
                # Allocated ahead of its first forward (early_initialization): same shapes, int4.
                packed.lazy_initialization(layer.keys[:, :, :0], layer.values[:, :, :0])
            layer = packed
        layers.append(layer)
    cache.layers = layers


def _specs(k_spec: QuantSpec | None, v_spec: QuantSpec | None) -> tuple[QuantSpec, QuantSpec]:
    for name, spec in (("k_spec", k_spec), ("v_spec", v_spec)):
        if spec is not None:
            check_spec(spec, name)
    default = KVConfig()
    return tuple(s.for_slots for s in (k_spec or default.k, v_spec or default.v))


class StaticKVCache(StaticCache):
    """``StaticCache(config, max_cache_len)`` with int4 attention layers, full and sliding-window (the default specs)."""

    def __init__(self, config, max_cache_len: int, k_spec: QuantSpec | None = None, v_spec: QuantSpec | None = None,
                 **kwargs):  # fmt: skip
        if not isinstance(config, PretrainedConfig):
            raise TypeError(f"config must be a transformers PretrainedConfig (model.config), got {config!r}")
        if not is_count(max_cache_len) or max_cache_len < 1:
            raise ValueError(f"max_cache_len must be an int >= 1 (the tokens the cache holds), got {max_cache_len!r}")
        super().__init__(config=config, max_cache_len=max_cache_len, **kwargs)
        _int4_layers(self, *_specs(k_spec, v_spec))


def int4_static_caches(model: torch.nn.Module, k_spec: QuantSpec | None = None, v_spec: QuantSpec | None = None):
    """Opt ``model`` in: a ``StaticCache`` passed to its forward gets int4 layers first.

    A forward pre-hook (remove it with the returned handle's ``remove()``). It acts on eager
    calls only, where ``generate`` runs the prefill that allocates the buffers; a compiled
    forward traces it as a no-op, so it adds no guard and no graph break (a cache first
    filled by a compiled forward is allocated int4 by the kv4 pass itself).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (the model whose generate is called), got {model!r}")
    specs = _specs(k_spec, v_spec)
    seen = weakref.WeakSet()  # each cache once, at its first forward: later steps pay nothing

    def hook(module, args, kwargs):
        if torch.compiler.is_compiling():
            return None
        for value in (*args, *kwargs.values()):
            if isinstance(value, StaticCache) and value not in seen:
                seen.add(value)
                _int4_layers(value, *specs)
        return None

    return model.register_forward_pre_hook(hook, with_kwargs=True)
