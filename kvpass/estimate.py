"""KV-cache size estimates at fp16, fp8, int8 and kv4 for a model's attention layout.

The cache holds, per sequence, per layer with attention, ``kv_heads * (k_head_dim +
v_head_dim)`` elements per token. What varies between models is how many layers hold a
growing cache (hybrid models keep only a fixed-size recurrent/convolution state in the
others), how many tokens a sliding-window layer keeps, and how many KV heads there are
(GQA/MQA). What some caches hold beside K/V (DeepSeek-V4's compressors, sparse-attention
indexers' keys) kvpass leaves as the model writes it, costed alike in every format. Sizes come
from a Hugging Face config (a local directory or config.json, a ``kvpass.models_zoo`` name, a
``PretrainedConfig``, or a model ``kvpass eval`` loads: ``smollm2``, a ``.gguf`` file or a hub id
the local Hugging Face cache holds) or from explicit ``(layers, kv_heads, head_dim)``.

kv4 is costed as the backend's default stores it (other ``kvpass.kv4`` settings through
``kv4_settings``, ``--kv4-setting NAME=VALUE``; unquantized tokens in 16 bits, as a 16-bit model
holds them): 4-bit codes plus, per group, a 16-bit
scale (and a 16-bit zero point when asymmetric); groups still under 16 values (one KV head of 8
channels) keep 8-bit scales. A per-token group spans
``gcd(group, head_dim)`` channels of one token (64 at head_dim 128); with ``k_scheme="channel"`` a K group spans ``k_group`` tokens of one
channel, and the residual of a K group not full yet (under ``k_group`` tokens per layer) is
left out, as it is negligible at the context lengths where the cache matters. The newest
``min(refine, tokens // 8)`` tokens of each layer also hold a second plane of codes and
scales (``QuantSpec.refine``, 64 by default), costed like the first. K's first 4 tokens stay
fp16 and an fp16 offset row is kept per KV head (``QuantSpec.sinks``, ``QuantSpec.center``),
paid for by 15 fewer refined K tokens, and an fp16 row of query scales (``QuantSpec.query_scaled``);
contexts are costed as one prompt (sinks, offset and query scales come from prompts of 64 tokens or
more; a prompt of 6 to 63 keeps one sink, paid for by one refined token at head_dim 32, free from
64). Heads under 32 channels store neither plane nor sinks. fp8 and int8 are costed without scales.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Sequence

from kvpass.config import (
    MIN_EXTRAS_HEAD_DIM, PREFIX_MIN_TOKENS, REFINE_SHARE, SHORT_PREFIX_MIN_TOKENS, SHORT_PREFIX_SINKS, KVConfig,
    QuantSpec,
)  # fmt: skip
from kvpass import arguments, reference
from kvpass.backend import check_settings, kv4
from kvpass.tables import index_ranges

logger = logging.getLogger("kvpass")

FORMATS = ("fp16", "fp8", "int8", "kv4")
_FIXED_BITS = {"fp16": 16, "fp8": 8, "int8": 8}
# Follow the backend's defaults so the table describes what `kv4()` actually stores.
_DEFAULT = KVConfig()
K_GROUP = _DEFAULT.k.group
V_GROUP = _DEFAULT.v.group

# kvpass.kv4 arguments the estimate takes through its own options, or that change no byte.
_OWN_KV4_OPTIONS = ("k_group", "v_group", "k_layer_bits", "inner", "debug", "debug_dir")

DEFAULT_CONTEXTS = (4096, 32768, 131072)
DEFAULT_BATCHES = (1,)

# Layer types as transformers' configs spell them (`layer_types`, or Jamba/Bamba-style
# `layers_block_type`). Anything that is neither attention kind keeps a fixed-size state.
# A DSA layer ("indexed_attention") holds every token's K/V, as a full one does, beside its indexer's keys.
_FULL_TYPES = {"full_attention", "attention", "global", "global_attention", "hybrid", "indexed_attention"}
_SLIDING_TYPES = {"sliding_attention", "sliding", "local", "local_attention", "hybrid_sliding"}
_CHUNKED_TYPES = {"chunked_attention"}
_STATE_TYPES = {"linear_attention", "conv", "mamba", "mamba2", "ssm", "recurrent", "rwkv"}
_NO_CACHE_TYPES = {"moe", "mlp", "dummy"}
# Models with no attention layer whose configs name no layer types (xLSTM's num_heads are its cells').
_ATTENTION_FREE_TYPES = {"mamba", "falcon_mamba", "rwkv", "xlstm"}
# The kinds of layer (`KVSizes.kinds`) that hold a KV cache of their own.
_KV_KINDS = ("full", "sliding")
# DeepSeek-V4's layers (transformers' DeepseekV4HCACache, DeepseekV4CSACache): a sliding window of K and V
# as one tensor of one head, beside a compressor's state (`Compressor`).
_COMPRESSED_TYPES = {"heavily_compressed_attention", "compressed_sparse_attention"}
# The cache layer's dicts of compressor state, `Compressor.bytes` of them.
DEEPSEEK_V4_STATE = ("compressed_kv", "buffer_kv", "buffer_gate", "overlap_kv", "overlap_gate")
# What transformers' DynamicIndexedLayer holds beside K/V: a sparse-attention indexer's keys, and the
# positions Qwen4-Exp's indexers read (on its first indexed layer only).
INDEXER_STATE = ("indexer_keys", "indexer_position_ids")


@dataclasses.dataclass(frozen=True)
class Compressor:
    """A DeepSeek-V4 layer's compressor, which kvpass leaves in the model's 16 bits: one entry of ``dim``
    channels for every ``rate`` tokens, and the tokens of a window not yet closed (their K/V and gate). An
    ``overlapping`` one (CSA's) projects two series of ``dim`` channels each and keeps the last closed
    window's first series (K/V and gate) for the next."""

    rate: int
    dim: int
    overlapping: bool = False

    def bytes(self, context: int) -> int:
        """Bytes one sequence of ``context`` tokens leaves it holding."""
        width = 2 * self.dim if self.overlapping else self.dim
        kept = 2 * self.rate * self.dim if self.overlapping and context >= self.rate else 0
        return 2 * (context // self.rate * self.dim + 2 * (context % self.rate) * width + kept)


@dataclasses.dataclass(frozen=True)
class KVSizes:
    """The shape of a model's KV cache.

    ``layers`` counts every layer that holds a KV cache; ``sliding_layers`` of them keep at
    most ``window - 1`` tokens between steps (``window``: one for all, or each sliding layer's in
    order where they differ, as NeoMME's do). ``kinds`` lists every decoder layer's kind,
    ``"full"``, ``"sliding"``, ``"state"`` (a fixed-size recurrent state) or ``"shared"`` (it reads an
    earlier layer's K/V and holds none), by the index the backend's ``k_layer_bits`` names it with;
    left empty, the full layers come first. ``latent``: the K and V slots hold an MLA model's latent
    and rotary key, which kv4 stores with V's settings both.
    ``sliding_shape``: ``(KV heads, K head dim, V head dim)`` of the sliding layers where they differ
    from the full layers' (Gemma 4, Inkling, MiMo-V2-Flash). ``one_tensor``: K and V are one tensor,
    stored once with K's settings (DeepSeek-V4's); ``compressors``: every layer's compressor state, which
    the cache holds in 16 bits in every format (DeepSeek-V4's). ``indexer_bytes``: what one token adds to
    the sparse-attention indexers' caches of all layers (DeepSeek-V3.2's DSA and its kin), which kvpass
    leaves as the model writes them, in every format. ``empty_v_layers``: layers (by index, as ``kinds``)
    whose V slot holds nothing, an MLA layer without RoPE caching no rotary key (Mistral Large 4's
    ``no_rope_layers``). ``notes`` explain how the figures were derived.
    """

    layers: int
    kv_heads: int
    k_head_dim: int
    v_head_dim: int
    sliding_layers: int = 0
    window: int | tuple[int, ...] | None = None
    name: str = "explicit sizes"
    notes: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()
    latent: bool = False
    sliding_shape: tuple[int, int, int] | None = None
    one_tensor: bool = False
    compressors: tuple[Compressor, ...] = ()
    indexer_bytes: int = 0
    empty_v_layers: tuple[int, ...] = ()

    def __post_init__(self):
        for field in ("layers", "kv_heads", "k_head_dim", "v_head_dim"):
            if not (field == "v_head_dim" and self.latent and self.v_head_dim == 0):  # NoPE MLA: no rotary key
                _check_positive_int(field, getattr(self, field))
        for value in self.sliding_shape or ():
            _check_positive_int("sliding_shape", value)
        if not isinstance(self.sliding_layers, int) or not 0 <= self.sliding_layers <= self.layers:
            raise ValueError(
                f"sliding_layers must be an int in [0, layers={self.layers}], "
                f"got {self.sliding_layers!r}"
            )
        for window in self._windows():
            _check_positive_int("window", window)
        full, sliding = self.kinds.count("full"), self.kinds.count("sliding")
        if self.kinds and (full + sliding, sliding) != (self.layers, self.sliding_layers):
            raise ValueError(
                f"kinds {self.kinds!r} do not hold {self.layers} KV layers, {self.sliding_layers} sliding"
            )

    def shape(self, kind: str) -> tuple[int, int, int]:
        """``(KV heads, K head dim, V head dim)`` of a layer of this kind."""
        if kind == "sliding" and self.sliding_shape:
            return self.sliding_shape
        return self.kv_heads, self.k_head_dim, self.v_head_dim

    def layer_kinds(self) -> tuple[str, ...]:
        """Every decoder layer's kind (:attr:`kinds`, or the full layers then the sliding ones)."""
        return self.kinds or ("full",) * (self.layers - self.sliding_layers) + ("sliding",) * self.sliding_layers

    def layer_shapes(self) -> list[tuple[int, int, int]]:
        """``(KV heads, K head dim, V head dim)`` of each KV layer, in order."""
        shapes = []
        for i, kind in enumerate(self.layer_kinds()):
            if kind in _KV_KINDS:
                heads, k_dim, v_dim = self.shape(kind)
                shapes.append((heads, k_dim, 0 if i in self.empty_v_layers else v_dim))
        return shapes

    def _windows(self) -> tuple:
        """Each sliding layer's window, in order."""
        if isinstance(self.window, tuple):
            if len(self.window) != self.sliding_layers:
                raise ValueError(f"window lists {len(self.window)} windows for {self.sliding_layers} sliding layers")
            return self.window
        return (self.window,) * self.sliding_layers

    def held(self, context: int) -> list[int]:
        """Tokens each KV layer holds after a sequence of ``context``, in order: transformers'
        ``DynamicSlidingWindowLayer`` keeps the newest ``window - 1`` between steps (the next
        token makes ``window``)."""
        windows = iter(self._windows())
        return [context if kind == "full" else min(context, next(windows) - 1)
                for kind in self.layer_kinds() if kind in _KV_KINDS]  # fmt: skip


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {list(FORMATS)}, got {fmt!r}")


def element_bits(
    fmt: str, sizes: KVSizes, k_group: int = K_GROUP, v_group: int = V_GROUP, kv4_settings: dict | None = None
) -> tuple[float, float]:
    """Bits per stored K element and per V element in ``fmt``, scale overhead included."""
    _check_format(fmt)
    if fmt != "kv4":
        return float(_FIXED_BITS[fmt]), float(_FIXED_BITS[fmt])
    return _spec_bits(sizes.shape("full"), *_kv4_specs(sizes, k_group, v_group, kv4_settings))


def _spec_bits(shape: tuple[int, int, int], k_spec: QuantSpec, v_spec: QuantSpec) -> tuple[float, float]:
    heads, k_dim, v_dim = shape
    return tuple(reference.bits_per_value(spec, heads, dim) for spec, dim in ((k_spec, k_dim), (v_spec, v_dim)))


def _kv4_specs(
    sizes: KVSizes, k_group: int, v_group: int, kv4_settings: dict | None = None, kind: str = "full"
) -> tuple[QuantSpec, QuantSpec]:
    """The K and V specs of ``kvpass.kv4(k_group=..., v_group=..., **kv4_settings)`` (the defaults
    with these groups when there are no other settings), as kv4 stores a ``kind`` layer's heads."""
    _check_positive_int("k_group", k_group)
    _check_positive_int("v_group", v_group)
    if kv4_settings:  # the backend's own defaults and checks
        check_settings(kv4_settings, "the estimate", taken=_OWN_KV4_OPTIONS)
        config = kv4(k_group=k_group, v_group=v_group, **kv4_settings).config
        k_spec, v_spec = config.k, config.v
    else:
        k_spec, v_spec = (dataclasses.replace(_DEFAULT.k, group=k_group), dataclasses.replace(_DEFAULT.v, group=v_group))
    if sizes.latent:  # the pass stores a latent cache with V's settings (kvpass/passes.py)
        k_spec = v_spec
    if sizes.one_tensor:  # read as V too, so as stored: the pass gives it no query scales
        k_spec = dataclasses.replace(k_spec, query_scaled=False)
    _, k_dim, v_dim = sizes.shape(kind)
    return k_spec.for_head_dim(k_dim), v_spec.for_head_dim(v_dim)


def _layer_token_bytes(shape: tuple[int, int, int], k_bits: float, v_bits: float, one_tensor: bool = False) -> float:
    heads, k_dim, v_dim = shape
    return heads * (k_dim * k_bits + (0 if one_tensor else v_dim * v_bits)) / 8


def _kv4_layer_specs(
    sizes: KVSizes, k_group: int, v_group: int, k_layer_bits: dict[int, int] | None, kv4_settings: dict | None = None
) -> list[tuple[str, QuantSpec, QuantSpec]]:
    """``(kind, K spec, V spec)`` of every KV layer as kv4 stores it, K's bits overridden in the
    layers ``k_layer_bits`` names (as ``kvpass.kv4(k_layer_bits=...)`` does)."""
    kinds = sizes.layer_kinds()
    specs = {kind: _kv4_specs(sizes, k_group, v_group, kv4_settings, kind) for kind in set(kinds) & set(_KV_KINDS)}
    bits_by_layer = dict(k_layer_bits or {})
    if bits_by_layer and sizes.latent:
        raise ValueError(f"k_layer_bits: {sizes.name} caches an MLA latent, which kv4 stores with V's settings in "
                         "every layer; K's bits per layer do not apply")  # fmt: skip
    for layer, bits in bits_by_layer.items():
        if type(layer) is not int or not 0 <= layer < len(kinds) or kinds[layer] not in _KV_KINDS:
            kv_layers = [i for i, kind in enumerate(kinds) if kind in _KV_KINDS]
            raise ValueError(f"k_layer_bits: {layer!r} is not the index of a KV layer of {sizes.name}; "
                             f"those are {index_ranges(kv_layers)}")  # fmt: skip
        try:
            bits_by_layer[layer] = dataclasses.replace(specs[kinds[layer]][0], bits=bits)
        except ValueError as why:
            raise ValueError(f"k_layer_bits[{layer}]: {why}") from None
    return [(kind, bits_by_layer.get(i, specs[kind][0]), specs[kind][1])
            for i, kind in enumerate(kinds) if kind in _KV_KINDS]  # fmt: skip


def _kv4_spec_bytes(spec: QuantSpec, heads: int, dim: int, context: int, held: int) -> float:
    """Bytes one layer's K or V stores under ``spec`` for one sequence holding ``held`` of a
    prompt's ``context`` tokens: a code and scale per value, the second code plane of the newest
    tokens, and the fp16 sinks (beyond the codes they stand for), offset and query scales the prompt
    fixes, the sinks evicted where a sliding window holds fewer than ``context``; a prompt shorter than
    a ``defer_prefix`` spec waits for, 16 bits a value."""
    bits = reference.bits_per_value(spec, heads, dim)
    fp16_bits = _FIXED_BITS["fp16"]
    if spec.waits(context):  # every token 16-bit, and the queries' fp64 energy
        return heads * (held * dim * fp16_bits + 64 * dim * spec.gathers_queries) / 8
    taken, has_offset = spec.prefix(context)
    sinks = taken if held == context else 0
    refined = spec.refined_tokens(held, dim, sinks, has_offset)
    rows_bits = fp16_bits * dim * (has_offset + spec.takes_query_scales(context))  # offset, query scales
    return heads * ((held + refined) * dim * bits + sinks * dim * (fp16_bits - bits) + rows_bits) / 8


def kv_bytes_per_token(
    source: Any,
    fmt: str = "fp16",
    k_group: int = K_GROUP,
    v_group: int = V_GROUP,
    k_layer_bits: dict[int, int] | None = None,
    kv4_settings: dict | None = None,
) -> float:
    """Bytes one more token adds to one sequence's cache, over all KV layers.

    This is the cost while the context fits in every sliding window; past it, sliding
    layers stop growing (see :func:`kv_cache_bytes`). ``source`` is anything
    :func:`kv_sizes` accepts; ``k_layer_bits`` and ``kv4_settings`` (other keyword arguments
    of ``kvpass.kv4``) are kv4's, as ``kvpass.kv4`` takes them.
    """
    sizes = kv_sizes(source)
    _check_kv4_only(fmt, k_layer_bits, kv4_settings)
    # The compressors' 16-bit entry every rate tokens, and the indexers' keys, in every format.
    unquantized = sum(2 * c.dim / c.rate for c in sizes.compressors) + sizes.indexer_bytes
    if fmt != "kv4":
        bits = element_bits(fmt, sizes)
        return unquantized + sum(_layer_token_bytes(shape, *bits, sizes.one_tensor) for shape in sizes.layer_shapes())
    return unquantized + sum(
        _layer_token_bytes(shape, *_spec_bits(shape, k_spec, v_spec), sizes.one_tensor)
        for (_, k_spec, v_spec), shape in zip(_kv4_layer_specs(sizes, k_group, v_group, k_layer_bits, kv4_settings),
                                              sizes.layer_shapes())  # fmt: skip
    )


def _check_kv4_only(fmt: str, k_layer_bits: dict[int, int] | None, kv4_settings: dict | None = None) -> None:
    _check_format(fmt)
    for name, value in (("k_layer_bits", k_layer_bits), ("kv4_settings", kv4_settings)):
        if value and fmt != "kv4":
            raise ValueError(f"{name} applies to kv4 only, not to {fmt!r}")


def kv_cache_bytes(
    source: Any,
    fmt: str,
    context: int,
    batch: int = 1,
    k_group: int = K_GROUP,
    v_group: int = V_GROUP,
    k_layer_bits: dict[int, int] | None = None,
    kv4_settings: dict | None = None,
) -> float:
    """Bytes of the whole cache for ``batch`` sequences of ``context`` tokens each (kv4 with
    ``k_layer_bits`` and ``kv4_settings`` as ``kvpass.kv4`` takes them)."""
    _check_positive_int("context", context)
    _check_positive_int("batch", batch)
    _check_kv4_only(fmt, k_layer_bits, kv4_settings)
    sizes = kv_sizes(source)
    held = sizes.held(context)
    unquantized = batch * (sum(c.bytes(context) for c in sizes.compressors) + context * sizes.indexer_bytes)
    if fmt != "kv4":
        bits = element_bits(fmt, sizes)
        return unquantized + batch * sum(tokens * _layer_token_bytes(shape, *bits, sizes.one_tensor)
                                         for shape, tokens in zip(sizes.layer_shapes(), held))  # fmt: skip
    slots = 1 if sizes.one_tensor else 2  # K's alone where K and V are one tensor
    specs = _kv4_layer_specs(sizes, k_group, v_group, k_layer_bits, kv4_settings)
    return unquantized + batch * sum(
        _kv4_spec_bytes(spec, shape[0], dim, context, tokens)
        for (_, k_spec, v_spec), shape, tokens in zip(specs, sizes.layer_shapes(), held)
        for spec, dim in list(zip((k_spec, v_spec), shape[1:]))[:slots]
    )


def unquantized_state_bytes(cache: Any) -> int:
    """Bytes a transformers cache holds beside its K/V that the estimate costs alike in every format:
    DeepSeek-V4's compressors' state (:data:`DEEPSEEK_V4_STATE`) and the sparse-attention indexers' keys
    and positions (:data:`INDEXER_STATE`)."""
    tensors = [t for layer in cache.layers for name in DEEPSEEK_V4_STATE for t in getattr(layer, name, {}).values()]
    tensors += [getattr(layer, name, None) for layer in cache.layers for name in INDEXER_STATE]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# ----------------------------------------------------------------------------- sources


def kv_sizes(source: Any) -> KVSizes:
    """Cache shape of ``source``.

    Accepted: a :class:`KVSizes`; a ``(layers, kv_heads, head_dim)`` tuple; a
    ``PretrainedConfig``; a path to a directory holding config.json or to a config file;
    a ``kvpass.models_zoo`` name; ``"smollm2"`` or a ``.gguf`` file (their configs, no weights); a hub
    id (``"org/name"``) the local Hugging Face cache holds (never downloaded).
    """
    if isinstance(source, KVSizes):
        return source
    if isinstance(source, (tuple, list)):
        if len(source) != 3:
            raise ValueError(f"explicit sizes must be (layers, kv_heads, head_dim), got {source!r}")
        layers, kv_heads, head_dim = source
        return KVSizes(layers=layers, kv_heads=kv_heads, k_head_dim=head_dim, v_head_dim=head_dim)
    if isinstance(source, (str, os.PathLike)):
        return _sizes_from_name_or_path(source)
    if hasattr(source, "to_dict") and hasattr(source, "model_type"):
        return sizes_from_config(source)
    raise ValueError(
        f"cannot estimate a KV cache for {source!r}; accepted: a config directory or config.json path, "
        "a models_zoo name, 'smollm2', a .gguf file or a locally cached hub id, a PretrainedConfig, or "
        "(layers, kv_heads, head_dim)"
    )


def _sizes_from_name_or_path(source: str | os.PathLike) -> KVSizes:
    # Imported here: models_zoo pulls in torch and transformers, which explicit sizes never need.
    from kvpass.models_zoo import ZOO
    from kvpass.models_zoo.real_model import cached_hub_snapshot

    path = Path(source).expanduser()
    if not path.exists() and str(source) not in ZOO:
        path = cached_hub_snapshot(str(source)) or path  # read as the directory it is
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"directory {str(source)!r} has no config.json")
    if str(source) == "smollm2" or (path.suffix == ".gguf" and path.is_file()):
        # The models kvpass eval and bench decode --model take by name or file, as they load them.
        from kvpass.models_zoo.real_model import load_config

        return sizes_from_config(load_config(str(source)), name=str(source))
    if path.is_file():
        return sizes_from_config(_load_config_file(path), name=str(source))
    if str(source) in ZOO:
        return sizes_from_config(ZOO[str(source)](), name=f"models_zoo:{source}")
    raise ValueError(
        f"{str(source)!r} is neither an existing config directory/file, a .gguf file, 'smollm2', a "
        f"models_zoo name nor a hub id in the local Hugging Face cache; models_zoo names: {sorted(ZOO)}"
    )


def _load_config_file(path: Path) -> Any:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {str(path)!r} as a JSON config: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{str(path)!r} holds a JSON {type(data).__name__}, not a config object")
    from transformers import CONFIG_MAPPING

    model_type = data.get("model_type")
    if model_type in CONFIG_MAPPING:
        # The config class fills in defaults the file omits (head_dim, layer_types, ...), and reads the floats
        # save_pretrained writes as objects (Mamba-2's time_step_limit [0.0, {"__float__": "Infinity"}]).
        try:
            return CONFIG_MAPPING[model_type].from_json_file(path)
        except Exception as err:  # the config class's own checks: strict dataclass fields, ValueErrors
            raise ValueError(f"transformers' {model_type} config refuses {str(path)!r}: {err}") from err
    # A model type this transformers does not know: read the file's own fields.
    logger.info(
        "model_type %r unknown to transformers; reading %s field by field", model_type, path
    )
    text = data.get("text_config") or data
    return SimpleNamespace(**text)


def _get(cfg: Any, *names: str) -> Any:
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    return None


def _require(cfg: Any, what: str, *names: str) -> int:
    value = _get(cfg, *names)
    if value is None:
        raise ValueError(f"config has no {what} (looked for {', '.join(names)})")
    _check_positive_int(names[0], value)
    return value


def sizes_from_config(cfg: Any, name: str | None = None) -> KVSizes:
    """Cache shape of a transformers config (or an object with the same attribute names)."""
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config(decoder=True)
    name = name or getattr(cfg, "model_type", None) or "config"
    notes: list[str] = []
    if getattr(cfg, "model_type", None) in _ATTENTION_FREE_TYPES:
        raise ValueError(f"config has no layer that holds a KV cache ({cfg.model_type}: a recurrent model, "
                         "a fixed-size state per layer); nothing to estimate")  # fmt: skip
    layers = _require(cfg, "layer count", "num_hidden_layers", "n_layer", "num_layers", "n_layers")
    query_heads = sorted(set(_global_or_per_layer(cfg, _query_heads)))
    heads = "/".join(map(str, query_heads))
    latent = any(rank is not None for rank in _global_or_per_layer(cfg, lambda c: _get(c, "kv_lora_rank")))

    kinds, window = _layer_layout(cfg, layers, notes)
    indexer_bytes = _indexer_token_bytes(cfg, notes)
    shapes = _shapes_by_kind(cfg, kinds, _latent_shape if latent else _attention_shape)
    kv_heads, k_dim, v_dim = shapes.get("full", shapes.get("sliding"))
    sliding_shape, compressors, empty_v = None, (), ()
    if shapes.get("sliding", (kv_heads, k_dim, v_dim)) != (kv_heads, k_dim, v_dim):
        sliding_shape = shapes["sliding"]
        notes.append("sliding layers: {}, K dim {}, V dim {}".format(_plural(sliding_shape[0], "KV head"),
                                                                     *sliding_shape[1:]))
    if latent:
        # transformers' MLA models cache the compressed latent and the shared rotary key,
        # one of each per layer, in the K and V slots of a single "head".
        rotary = f"the {v_dim}-dim rotary key (V slot)" if v_dim else "no rotary key (V's slot is empty)"
        notes.insert(0, f"MLA: the cache holds the {k_dim}-dim latent (K slot) and {rotary} once per layer, not per "
                        f"head ({heads} query heads); kv4 stores both with V's settings")  # fmt: skip
        rotates = _get(cfg, "no_rope_layers")  # 1 where a layer uses RoPE (SmolLM3's convention)
        if v_dim and rotates:
            empty_v = tuple(i for i, (kind, rope) in enumerate(zip(kinds, rotates)) if kind in _KV_KINDS and not rope)
            if empty_v:
                notes.append(f"MLA layers without RoPE ({index_ranges(list(empty_v))}) cache no rotary key")
    else:
        compressors = _compressors(cfg, k_dim)
        if compressors:
            kv_heads = 1  # one K=V head, whatever num_key_value_heads says (DeepSeek-V4's modeling code)
            rates = _get(cfg, "compress_rates")
            counts = ", ".join(f"every {rates[kind]} tokens in {_plural(n, kind + ' layer')}"
                               for kind, n in collections.Counter(_get(cfg, "layer_types")).items())  # fmt: skip
            notes.append(f"DeepSeek-V4: each layer's sliding window holds K and V as one tensor of 1 head (kv4: K's "
                         f"settings); its compressor's entries ({counts}; with an indexer's in CSA layers) stay in "
                         "16 bits in every format, as kvpass leaves them")  # fmt: skip
        if kv_heads == 1 and query_heads[0] > 1:
            notes.append(f"MQA: 1 KV head shared by {heads} query heads")
        elif kv_heads < query_heads[0]:
            notes.append(f"GQA: {kv_heads} KV heads for {heads} query heads")
    return KVSizes(
        layers=sum(kind in _KV_KINDS for kind in kinds),
        kv_heads=kv_heads,
        k_head_dim=k_dim,
        v_head_dim=v_dim,
        sliding_layers=kinds.count("sliding"),
        window=window,
        name=name,
        notes=tuple(notes),
        kinds=kinds,
        latent=latent,
        sliding_shape=sliding_shape,
        one_tensor=bool(compressors),
        compressors=compressors,
        indexer_bytes=indexer_bytes,
        empty_v_layers=empty_v,
    )


def _global_or_per_layer(cfg: Any, read: Callable[[Any], Any]) -> list:
    """``[read(cfg)]``, or ``read`` of every layer's config where the config declares what it reads per
    layer (``per_layer_config``: transformers raises ``AmbiguousGlobalPerLayerAttributeError`` for the
    global value; Gemma 4's head_dim, Dots3's head counts and MLA ranks)."""
    per_layer = getattr(cfg, "per_layer_config", None)
    try:
        return [read(cfg)]
    except Exception as err:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError, by name
        if type(err).__name__ != "AmbiguousGlobalPerLayerAttributeError" or per_layer is None:
            raise
        return [read(layer) for layer in per_layer]


def _shapes_by_kind(
    cfg: Any, kinds: tuple[str, ...], read: Callable[[Any], tuple[int, int, int]]
) -> dict[str, tuple[int, int, int]]:
    """``{kind: (KV heads, K head dim, V head dim)}`` of the attention layers, each ``read`` from the
    config or from its layers' (:func:`_global_or_per_layer`); sliding layers may have their own
    ``swa_*`` sizes (Inkling)."""
    found = _global_or_per_layer(cfg, read)
    shapes: dict[str, set] = {}
    for kind, shape in zip(kinds, found * len(kinds) if len(found) == 1 else found):
        shapes.setdefault(kind, set()).add(shape)
    shapes = {kind: found for kind, found in shapes.items() if kind in _KV_KINDS}
    mixed = {kind: sorted(found) for kind, found in shapes.items() if len(found) > 1}
    if mixed:
        raise ValueError(f"layers of one kind have different head sizes in this config, {mixed}; give explicit sizes")
    by_kind = {kind: found.pop() for kind, found in shapes.items()}
    if "sliding" in by_kind and getattr(cfg, "model_type", None) == "mimo_v2_flash":
        # Its modeling code, not its config, doubles the sliding layers' KV heads.
        kv_heads, k_dim, v_dim = by_kind["sliding"]
        by_kind["sliding"] = (2 * kv_heads, k_dim, v_dim)
    if "sliding" in by_kind and _get(cfg, "swa_num_key_value_heads", "swa_head_dim") is not None:
        kv_heads, k_dim, v_dim = by_kind["sliding"]
        k_dim = _get(cfg, "swa_head_dim") or k_dim
        kv_heads = _get(cfg, "swa_num_key_value_heads") or kv_heads
        by_kind["sliding"] = (kv_heads, k_dim, _get(cfg, "swa_v_head_dim") or k_dim)
    return by_kind


def _query_heads(cfg: Any) -> int:
    return _require(cfg, "attention head count", "num_attention_heads", "n_head", "num_heads")


def _latent_shape(cfg: Any) -> tuple[int, int, int]:
    """An MLA layer's cache as kvpass holds it: one "head" of the latent (K slot) and of the rotary key (V
    slot), which GLM-5-next's layers without RoPE leave empty."""
    rotary = _get(cfg, "qk_rope_head_dim")
    if rotary != 0:
        rotary = _require(cfg, "MLA rotary key dim", "qk_rope_head_dim")
    return 1, _require(cfg, "MLA latent rank", "kv_lora_rank"), rotary


def _attention_shape(cfg: Any) -> tuple[int, int, int]:
    """``(KV heads, K head dim, V head dim)`` of a config's attention, or of one layer's."""
    heads = _query_heads(cfg)
    kv_heads = _kv_heads(cfg, heads)
    head_dim = _get(cfg, "head_dim")
    if head_dim is None:
        hidden = _require(cfg, "hidden size", "hidden_size", "n_embd", "d_model")
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} is not divisible by {heads} heads; set head_dim")
        head_dim = hidden // heads
    _check_positive_int("head_dim", head_dim)
    v_dim = _get(cfg, "v_head_dim") or head_dim  # MiMo-V2-Flash: K 192, V 128
    _check_positive_int("v_head_dim", v_dim)
    return kv_heads, head_dim, v_dim


def _kv_heads(cfg: Any, heads: int) -> int:
    # Falcon-7B and GPT-BigCode say multi_query=True while num_kv_heads still reads the
    # query head count; only Falcon's new decoder architecture honours num_kv_heads.
    if getattr(cfg, "multi_query", False) and not getattr(cfg, "new_decoder_architecture", False):
        return 1
    kv_heads = _get(
        cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"
    )
    if kv_heads is None:
        return heads
    _check_positive_int("num_key_value_heads", kv_heads)
    if heads % kv_heads:
        raise ValueError(f"num_key_value_heads {kv_heads} does not divide {heads} attention heads")
    return kv_heads


def _layer_layout(cfg: Any, layers: int, notes: list[str]) -> tuple[tuple[str, ...], int | tuple[int, ...] | None]:
    """(each layer's kind, as :attr:`KVSizes.kinds` spells it; the window, or each sliding layer's) from
    the config's per-layer types."""
    types = _get(cfg, "layer_types", "layers_block_type")
    windows = _global_or_per_layer(cfg, lambda c: _get(c, "sliding_window"))  # NeoMME's differ by layer
    per_layer_windows = windows if len(windows) > 1 else None
    window = max(filter(None, windows), default=None)
    if getattr(cfg, "use_sliding_window", True) is False:
        # Qwen2-style configs carry a sliding_window value that is switched off.
        window = None
    if types is None:
        # Same inference as transformers' DynamicCache for configs without layer_types.
        chunk = _get(cfg, "attention_chunk_size")
        types = [
            "sliding_attention" if window else "chunked_attention" if chunk else "full_attention"
        ] * layers
    types = [str(t) for t in types]
    if len(types) != layers:
        raise ValueError(f"config lists {len(types)} layer types for {layers} layers: {types!r}")

    kinds = []
    state: dict[str, int] = {}  # layer type -> count, of those without a KV cache
    unknown: collections.Counter[str] = collections.Counter()
    for kind in types:
        if kind in _SLIDING_TYPES or kind in _COMPRESSED_TYPES:
            kinds.append("sliding")
        elif kind in _CHUNKED_TYPES:
            kinds.append("sliding")
            window = _require(cfg, "attention chunk size", "attention_chunk_size")
        elif kind in _STATE_TYPES or kind in _NO_CACHE_TYPES:
            kinds.append("state")
            state[kind] = state.get(kind, 0) + 1
        else:
            if kind not in _FULL_TYPES:
                unknown[kind] += 1
            kinds.append("full")
    if unknown:
        counted = ", ".join(f"{kind!r} ({_plural(n, 'layer')})" for kind, n in unknown.items())
        notes.append(f"unknown layer types counted as full attention: {counted}")
    kinds += _loop_cache_layers(cfg, kinds, notes)
    sliding = kinds.count("sliding")
    if sliding and not window:
        notes.append(
            f"{sliding} sliding layers have no sliding_window in the config; counted as full"
        )
        kinds, sliding = ["full" if kind == "sliding" else kind for kind in kinds], 0
    shared = _kv_shared_layers(cfg, layers)
    if shared:
        kinds = ["shared" if i in shared else kind for i, kind in enumerate(kinds)]
        sliding = kinds.count("sliding")
        notes.append(f"KV sharing: layers {index_ranges(shared)} read earlier layers' caches and hold none of their "
                     "own")
    full = kinds.count("full")
    if full + sliding == 0:
        why = "every layer reads K/V another model shares" if shared else f"layer types: {sorted(set(types))}"
        raise ValueError(f"config has no layer that holds a KV cache ({why}); nothing to estimate")
    if state:
        # A MoE or MLP block listed as a layer (Nemotron-H) holds nothing; a recurrent one a state.
        held = ", ".join(f"{n} {k}" for k, n in state.items() if k not in _NO_CACHE_TYPES)
        none = ", ".join(f"{n} {k}" for k, n in state.items() if k in _NO_CACHE_TYPES)
        others = " or ".join(([f"keep a fixed-size state that is not counted ({held})"] if held else [])
                             + ([f"hold nothing ({none})"] if none else []))  # fmt: skip
        notes.append(f"hybrid: {full + sliding} of {layers} layers hold a KV cache; the others {others}")
    if sliding and per_layer_windows:
        by_window = collections.Counter(w for w, kind in zip(per_layer_windows, kinds) if kind == "sliding")
        window = tuple(w for w, kind in zip(per_layer_windows, kinds) if kind == "sliding")
        if len(by_window) == 1:
            window = window[0]
        else:
            sizes = ", ".join(f"{w} in {_plural(n, 'layer')}" for w, n in sorted(by_window.items()))
            notes.append(f"sliding windows {sizes} of {full + sliding} KV layers: each stops growing at its window "
                         "less one token (the next token's)")  # fmt: skip
    if sliding and not isinstance(window, tuple):
        notes.append(
            f"sliding window {window} on {sliding} of {full + sliding} KV layers: "
            f"they stop growing at {window - 1} tokens (the window less the next token)"
        )
    return tuple(kinds), (window if sliding else None)


def _loop_cache_layers(cfg: Any, kinds: list[str], notes: list[str]) -> list[str]:
    """The cache layers a looped section adds: Dory runs its recurrent layers ``n_recurrent_loops`` times,
    and in its ``per_loop`` mode each loop after the first writes copies of their caches, appended after
    the model's layers (``"last_loop"`` keeps one cache a layer)."""
    loops = _get(cfg, "n_recurrent_loops")
    if not loops or loops < 2 or _get(cfg, "recurrent_kv_cache_mode") != "per_loop":
        return []
    start = _get(cfg, "n_input_layers") or 0
    looped = kinds[start : start + _require(cfg, "recurrent layer count", "n_recurrent_layers")]
    notes.append(f"recurrent loops: layers {index_ranges(list(range(start, start + len(looped))))} run {loops} times, "
                 f"each loop with caches of its own: {len(looped) * (loops - 1)} more cache layers")  # fmt: skip
    return looped * (loops - 1)


def _compressors(cfg: Any, head_dim: int) -> tuple[Compressor, ...]:
    """Every DeepSeek-V4 layer's compressor (none for other configs): an HCA layer's entry of ``head_dim``
    channels, a CSA layer's overlapping one and its indexer's, of ``index_head_dim``."""
    rates = _get(cfg, "compress_rates") or {}
    found: list[Compressor] = []
    for kind in _get(cfg, "layer_types") or ():
        if kind == "heavily_compressed_attention":
            found.append(Compressor(rates[kind], head_dim))
        elif kind == "compressed_sparse_attention":
            index_dim = _require(cfg, "indexer head dim", "index_head_dim")
            found += [Compressor(rates[kind], head_dim, True), Compressor(rates[kind], index_dim, True)]
    return tuple(found)


def _indexer_token_bytes(cfg: Any, notes: list[str]) -> int:
    """Bytes one token adds to the caches of the sparse-attention indexers (transformers'
    ``DynamicIndexedLayer``): each ``indexed_attention`` layer that runs its own indexer (not a ``"shared"``
    one of ``indexer_types``) keeps a key of ``index_head_dim`` values per token in 16 bits; GLM-5-next packs
    a pooling gate as wide and a valid flag beside it (``index_kpool``); Qwen4-Exp keeps its indexer's
    KV heads' keys, and 3 int64 positions per token once; Dots3's are fp32 (below)."""
    types = list(_get(cfg, "layer_types") or ())
    modes = _get(cfg, "indexer_types") or ["full"] * len(types)
    indexed = sum(kind == "indexed_attention" and mode != "shared" for kind, mode in zip(types, modes))
    if not indexed:
        return 0
    width, positions = _require(cfg, "indexer head dim", "index_head_dim", "indexer_head_dim"), 0
    if _get(cfg, "indexer_head_dim") is not None:
        width *= _get(cfg, "indexer_kv_heads") or 1
        positions = 3 * 8
    elif _get(cfg, "index_kpool") is not None:
        width = 2 * width + 1
    # Its modeling code, not its config, rotates the DSA layers in fp32, and the indexer caches its keys so.
    value_bits = 32 if getattr(cfg, "model_type", None) == "dots3_note_text" else 16
    notes.append(f"sparse-attention indexers: {width} values a token in {value_bits} bits in each of "
                 f"{_plural(indexed, 'layer')}" + (f", and {positions // 8} int64 positions once" if positions else "")
                 + ", in every format: kvpass leaves them as the model writes them")  # fmt: skip
    return indexed * value_bits // 8 * width + positions


def _kv_shared_layers(cfg: Any, layers: int) -> list[int]:
    """Layers that read an earlier layer's K/V (transformers' ``kv_sharing_modes``, "reuse"; Gemma 3n and
    Gemma 4 share the last ``num_kv_shared_layers``): the cache keeps them no K/V of their own."""
    modes = getattr(cfg, "kv_sharing_modes", None)
    if modes is None:
        shared = _get(cfg, "num_kv_shared_layers") or 0
        return list(range(layers - shared, layers))
    return [i for i, mode in enumerate(modes) if str(mode).startswith("reuse")]


# ----------------------------------------------------------------------------- table


def estimate_rows(
    source: Any,
    contexts: Iterable[int] = DEFAULT_CONTEXTS,
    batches: Iterable[int] = DEFAULT_BATCHES,
    k_group: int = K_GROUP,
    v_group: int = V_GROUP,
    k_layer_bits: dict[int, int] | None = None,
    kv4_settings: dict | None = None,
) -> list[dict[str, float]]:
    """One row per (context, batch): total cache bytes in every format (kv4's with ``k_layer_bits``
    and ``kv4_settings``)."""
    sizes = kv_sizes(source)
    return [
        {
            "context": c,
            "batch": b,
            **{f: kv_cache_bytes(sizes, f, c, b, k_group, v_group, *((k_layer_bits, kv4_settings) if f == "kv4" else ()))
               for f in FORMATS},
        }
        for c in contexts
        for b in batches
    ]


def human_bytes(n: float) -> str:
    """Binary-unit size: 131072 -> '128.00 KiB'."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def format_table(rows: Sequence[dict[str, float]]) -> str:
    """Fixed-width table: context, batch, the four formats, and kv4's saving vs fp16."""
    header = ["context", "batch", *FORMATS, "saving vs fp16"]
    body = [
        [
            f"{r['context']:,}",
            f"{r['batch']}",
            *(human_bytes(r[f]) for f in FORMATS),
            f"{1 - r['kv4'] / r['fp16']:.1%} ({r['fp16'] / r['kv4']:.2f}x)",
        ]
        for r in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def describe(
    sizes: KVSizes, k_group: int = K_GROUP, v_group: int = V_GROUP, k_layer_bits: dict[int, int] | None = None,
    kv4_settings: dict | None = None,
) -> str:
    """Header lines: the sizes used, per-token bytes per format, and how they were counted."""
    dims = (
        f"head_dim {sizes.k_head_dim}"
        if sizes.k_head_dim == sizes.v_head_dim
        else f"K dim {sizes.k_head_dim}, V dim {sizes.v_head_dim}"
    )
    k_bits, v_bits = element_bits("kv4", sizes, k_group, v_group, kv4_settings)
    k_spec, v_spec = _kv4_specs(sizes, k_group, v_group, kv4_settings)
    k_span = reference.scale_span(k_spec, sizes.kv_heads, sizes.k_head_dim)
    v_span = reference.scale_span(v_spec, sizes.kv_heads, sizes.v_head_dim)
    k_unit = "channels per token" if k_spec.scheme == "token" else "tokens per channel"
    k_scale, v_scale = (reference.scale_bits(spec, sizes.kv_heads, dim) for spec, dim in
                        ((k_spec, sizes.k_head_dim), (v_spec, sizes.v_head_dim)))  # fmt: skip
    extras = "".join(f"{part}; " for part in _kv4_extras(sizes, k_spec, v_spec))
    by_bits: dict[int, list[int]] = {}
    for layer, bits in sorted((k_layer_bits or {}).items()):
        by_bits.setdefault(bits, []).append(layer)
    overrides = [f"kv4 K in int{bits} in layer{'s' if len(layers) > 1 else ''} {index_ranges(layers)} (k_layer_bits)"
                 for bits, layers in by_bits.items()]  # fmt: skip
    if kv4_settings:
        overrides.append("kv4 settings: " + ", ".join(f"{name}={value!r}" for name, value in kv4_settings.items()))
    lines = [
        f"{sizes.name}: {_plural(sizes.layers, 'KV layer')}, "
        f"{_plural(sizes.kv_heads, 'KV head')}, {dims}",
        "per token: "
        + ", ".join(
            f"{f} {human_bytes(kv_bytes_per_token(sizes, f, k_group, v_group, *((k_layer_bits, kv4_settings) if f == 'kv4' else ())))}"
            for f in FORMATS
        ),
        f"kv4: K {k_bits:g} bits/element ({k_scale} scale bits per {k_span} {k_unit}), "
        + ("V is K's tensor, " if sizes.one_tensor else
           f"V {v_bits:g} bits/element ({v_scale} scale bits per {v_span} channels per token), ") + extras
        + "fp8/int8 without scales",  # fmt: skip
        *overrides,
        *sizes.notes,
    ]
    return "\n".join(lines)


def _kv4_extras(sizes: KVSizes, k_spec: QuantSpec, v_spec: QuantSpec) -> list[str]:
    """What kv4 stores beyond one plane of codes and scales, in words, for :func:`describe`."""
    if sizes.k_head_dim < MIN_EXTRAS_HEAD_DIM:
        return [f"no second plane, sinks or offset (heads under {MIN_EXTRAS_HEAD_DIM} channels)"]
    parts = []
    if k_spec.refine or v_spec.refine:
        parts.append(f"the newest min({max(k_spec.refine, v_spec.refine)}, tokens / {REFINE_SHARE}) tokens of each "
                     "layer twice (a second code plane)")  # fmt: skip
    held = [f"K's first {k_spec.sinks} tokens in fp16" if k_spec.sinks else "",
            "an fp16 offset per KV head" if k_spec.center else ""]  # fmt: skip
    if k_spec.sinks or k_spec.center:
        cost = k_spec.plane_cost(k_spec.sinks, k_spec.center, sizes.k_head_dim) if k_spec.refine else 0
        short_cost = k_spec.plane_cost(SHORT_PREFIX_SINKS, False, sizes.k_head_dim) if k_spec.refine else 0
        short = (f"; of {SHORT_PREFIX_MIN_TOKENS}+, the first token, " + (f"for {short_cost}" if short_cost else "unpaid")
                 if k_spec.sinks else "")  # fmt: skip
        parts.append(" and ".join(filter(None, held)) + (f", paid for by {cost} fewer second-plane K tokens" if cost else "")
                     + f" (prompts of {PREFIX_MIN_TOKENS}+ tokens{short})")  # fmt: skip
    if k_spec.query_scaled:
        parts.append(f"an fp16 row of K query scales per KV head (prompts of {PREFIX_MIN_TOKENS}+ tokens)")
    if k_spec.defer_prefix:
        parts.append(f"K in 16 bits until a cache holds {k_spec.prefix_tokens} tokens (defer_prefix)")
    return parts


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _layer_bits(text: str) -> tuple[int, int]:
    """argparse type: ``'11:8'`` -> ``(11, 8)``, a layer index and K bits."""
    layer, _, bits = text.partition(":")
    if not (layer.isdigit() and bits.isdigit()):
        raise argparse.ArgumentTypeError(f"expected LAYER:BITS such as 11:8, got {text!r}")
    return int(layer), int(bits)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvpass estimate``."""
    parser.add_argument(
        "--model",
        default=None,
        help=f"a config directory or config.json, a kvpass.models_zoo name, or a model kvpass eval loads "
        f"({arguments.REAL_MODELS})",
    )
    parser.add_argument("--layers", type=arguments.positive_int, default=None, help="KV layers (instead of --model)")
    parser.add_argument(
        "--kv-heads", dest="kv_heads", type=arguments.positive_int, default=None, help="KV heads (instead of --model)"
    )
    parser.add_argument(
        "--head-dim",
        dest="head_dim",
        type=arguments.positive_int,
        default=None,
        help="head dimension (instead of --model)",
    )
    parser.add_argument(
        "--context",
        type=arguments.tokens,
        nargs="+",
        default=list(DEFAULT_CONTEXTS),
        help="context lengths in tokens; K suffix = x1024 (default: 4K 32K 128K)",
    )
    parser.add_argument(
        "--batch",
        type=arguments.positive_int,
        nargs="+",
        default=list(DEFAULT_BATCHES),
        help="batch sizes (default: 1)",
    )
    parser.add_argument(
        "--k-group", dest="k_group", type=arguments.positive_int, default=K_GROUP, help="kv4 K group: values per scale"
    )
    parser.add_argument(
        "--v-group", dest="v_group", type=arguments.positive_int, default=V_GROUP, help="kv4 V group: values per scale"
    )
    parser.add_argument(
        "--k-layer-bits",
        dest="k_layer_bits",
        type=_layer_bits,
        nargs="+",
        default=[],
        metavar="LAYER:BITS",
        help="kv4 K bits in chosen layers, as kvpass.kv4(k_layer_bits=...) stores them: 11:8 13:8",
    )
    arguments.add_kv4_settings(parser, "the kv4 column (not k_group, v_group or k_layer_bits, options of their own)",
                               taken=_OWN_KV4_OPTIONS)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Print the estimate for ``args`` (fields as :func:`add_arguments` defines). Returns 0."""
    explicit = {k: getattr(args, k, None) for k in ("layers", "kv_heads", "head_dim")}
    given = [k for k, v in explicit.items() if v is not None]
    if args.model is not None and given:
        raise ValueError(
            f"give either model ({args.model!r}) or explicit sizes ({', '.join(given)}), not both"
        )
    if args.model is not None:
        source: Any = args.model
    elif len(given) == 3:
        source = (explicit["layers"], explicit["kv_heads"], explicit["head_dim"])
    else:
        missing = [k for k in explicit if explicit[k] is None]
        raise ValueError(
            f"without a model, layers, kv_heads and head_dim are all needed; missing {missing}"
        )
    # Namespaces built by hand may omit the kv4 group options.
    k_group = getattr(args, "k_group", K_GROUP)
    v_group = getattr(args, "v_group", V_GROUP)
    sizes = kv_sizes(source)
    k_layer_bits = dict(getattr(args, "k_layer_bits", []))
    kv4_settings = dict(getattr(args, "kv4_settings", []))
    rows = estimate_rows(sizes, args.context, args.batch, k_group, v_group, k_layer_bits, kv4_settings)
    print(describe(sizes, k_group, v_group, k_layer_bits, kv4_settings))
    print()
    print(format_table(rows))
    return 0
