"""``kvpass coverage``: the support matrix over every causal-LM type in the installed transformers.

For each model type: shrink its default config to a tiny random-weight model, generate
eagerly, then run the same prompt through ``torch.compile(backend=kvpass.kv4())`` and
compare the first decode step with :class:`kvpass.simulate.SimulatedKVCache` (the eager
model reading the same quantized past). Each type runs in its own subprocess with a time
limit, so one model's crash or hang costs only its own row.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import difflib
import json
import logging
import math
import re
import subprocess
import sys
import time
from pathlib import Path

from kvpass import arguments, cpu_steps, version
from kvpass.cache_argument import cache_arg, returned_cache

log = logging.getLogger("kvpass")

# The sizes every tiny config gets, where its class declares the field (attribute_map
# translates the standard names, e.g. n_layer for GPT-2). Besides the common sizes: MLA
# ranks and head dims (K and V head dims stay unequal, as in the real models), partial
# rotary dims, sparse-attention indexers, linear-attention and SSM mixers, MoE routing.
TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 256,
    "unpadded_vocab_size": 256,
    "max_position_embeddings": 1024,
    "sliding_window": 32,
    # encoder-decoder (BART family) names
    "decoder_layers": 2,
    "encoder_layers": 2,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_ffn_dim": 128,
    "encoder_ffn_dim": 128,
    "num_decoder_layers": 2,
    "num_encoder_layers": 2,
    "num_decoder_attention_heads": 4,
    "num_encoder_attention_heads": 4,
    "num_local_experts": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "n_routed_experts": 4,
    "moe_topk": 2,
    "zero_expert_num": 2,
    "ffn_hidden_size": 128,
    "expert_ffn_hidden_size": 32,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 32,
    "q_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "rotary_dim": 16,
    "index_n_heads": 2,
    "index_head_dim": 32,
    "index_topk": 16,
    "linear_num_heads": 4,
    "linear_head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "mamba_d_state": 16,
    "hidden_size_per_layer_input": 16,
    "vocab_size_per_layer_input": 256,
    "attn_layer_period": 2,
    "attn_layer_offset": 1,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
    "mamba_chunk_size": 32,
    "mamba_dt_rank": 16,
}
# Fields that hold the same size as one of these in the real config keep doing so, where
# their name says they are that kind of size (rwkv's attention_hidden_size, xlstm's
# embedding_dim, inkling2's swa_num_attention_heads, per-layer head counts).
TIED = {
    "hidden_size": re.compile(r"hidden_size|embed|model_dim|adapter_in"),
    "intermediate_size": re.compile(r"intermediate|ffn"),
    "head_dim": re.compile(r"head_dim"),
    "num_attention_heads": re.compile(r"attention_heads"),
    "num_key_value_heads": re.compile(r"key_value_heads|kv_heads"),
    "num_hidden_layers": re.compile(r"layers"),
}
# Sizes models read as is where the default config leaves them None (checkpoints set them);
# the expert ones only in MoE configs.
UNSET = {"head_dim": 32, "num_key_value_heads": 2, "num_experts_per_tok": 2, "num_local_experts": 4, "n_shared_experts": 1}
# (heads, head dim, expand) fields of SSM mixers, whose heads x head dim must equal expand x hidden.
SSM_HEADS = (
    ("num_heads", "head_dim", "expand"),
    ("mamba_num_heads", "mamba_head_dim", "expand"),
    ("mamba_n_heads", "mamba_d_head", "mamba_expand"),
    ("n_mamba_heads", "mamba_headdim", "mamba_expand"),
)
SSM_HEAD_DIM = 32
SUB_TIED = re.compile(r"_size$|_dim$")
KIND_PATTERNS = ("layer_types", "layers_block_type", "block_types")
# Mixed per-layer kinds (attention / linear attention / MoE ...) get one layer each, up to this depth.
MAX_LAYERS = 4

QWEN4_QSA = {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 32, "indexer_budget": 16, "indexer_compress_ratio": 4}
DOTS3_TEXT = {"swa_num_attention_heads": 4, "swa_num_key_value_heads": 4, "swa_q_lora_rank": 64,
              "swa_kv_lora_rank": 32, "swa_head_dim": 48, "swa_qk_nope_head_dim": 32, "swa_v_head_dim": 32}  # fmt: skip
# Gemma 3n's last layers read the K/V of the last earlier layer of their kind (15 of 35 in the checkpoints'):
# 2 of 4 here, a sliding and a full layer each side. Gemma 4's config shares them the same way
# (num_kv_shared_layers), which its default leaves off.
SHARED_KV = {"num_hidden_layers": 4, "num_kv_shared_layers": 2,
             "layer_types": ["sliding_attention", "full_attention"] * 2}  # fmt: skip
GEMMA3N_TEXT = {**SHARED_KV, "intermediate_size": [TINY["intermediate_size"]] * 4,
                "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0]}  # fmt: skip
PROMPT_TOKENS = 70
# The most a rewritten type's decode logits may differ from its eager twin's (tests/test_zoo_e2e.py's
# bound): beyond it, or not finite, kv4 computed something else and the row must not count as rewritten.
TWIN_TOLERANCE = 1e-4
# Types this check cannot run at all, and why (the row says so instead of a misleading error).
ASSISTANT = "a draft model: every layer reads the K/V its target model shares, it has no cache of its own to generate alone"
MUSICGEN = ("an audio-codebook LM: its causal-LM class takes only the decoder config, and with that its own generate() "
            "needs a checkpoint's generation config (decoder start token, codebook delay pattern)")
CANNOT_RUN = {
    "gemma4_assistant": ASSISTANT,
    "gemma4_unified_assistant": ASSISTANT,
    "musicgen": MUSICGEN,
    "musicgen_melody": MUSICGEN,
    "minimax": "MiniMax accepts only its own MiniMaxCache (not compilable: _can_compile_fullgraph=False); "
    "this check drives a DynamicCache",
}

# Values no generic rule can derive, by model type; each says why.
PER_TYPE: dict[str, dict] = {
    # default configs with no attention layer at all (checkpoints list theirs)
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    # input, recurrent and output blocks must add up to the depth
    "dory": {"num_hidden_layers": 3, "n_input_layers": 1, "n_output_layers": 1,
             "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]},  # fmt: skip
    # DbrxAttentionConfig declares no rope_theta, which the model reads (checkpoints carry it)
    # and its default clip_qkv=None makes the model call clamp() with no bounds (checkpoints clip at 8)
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 500000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}},  # fmt: skip
    # the default config has no RoPE parameters for its layer types
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "gemma3n_text": GEMMA3N_TEXT,
    "gemma3n": {"text_config": GEMMA3N_TEXT},
    "gemma4_text": SHARED_KV,
    "gemma4": {"text_config": SHARED_KV},
    "gemma4_unified_text": SHARED_KV,
    "gemma4_unified": {"text_config": SHARED_KV},
    # the LM head model must be a decoder; axial positions must multiply to the positions and add up to the width
    "reformer": {"is_decoder": True, "axial_pos_shape": [32, 32], "axial_pos_embds_dim": [64, 64]},
    # the default config names no language for its per-language adapters
    "xmod": {"default_language": "en_XX"},
    # the shared transformer block of the first hybrid layer is tied to later ones: two hybrid layers
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
    # the default config has no layer_types, which the model indexes
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # the default config leaves the QSA indexer of its indexed_attention layers unset
    "qwen4_exp_text": QWEN4_QSA,
    "qwen4_exp": {"text_config": QWEN4_QSA},
    # the sliding layers' sizes are constructor-only swa_* arguments
    "dots3_note_text": DOTS3_TEXT,
    "dots3_note": {"text_config": DOTS3_TEXT},
    # the default config fails its own validator: an assistant has no per-layer inputs
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},  # must spell out every layer
    "zaya": {"num_experts_per_tok": 1},  # the only value ZAYA supports
    # Image-text models (benchmarks/image_text_generate.py) split the rotary pairs in 3 M-RoPE sections (time,
    # height, width) sized for the real head: their modeling code's default, or their config's, which must add
    # up to the tiny head's.
    **{model_type: {"text_config": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                         "mrope_section": sections}}}
       for model_type, sections in {"qwen2_vl": [4, 6, 6], "qwen2_5_vl": [4, 6, 6], "paddleocr_vl": [4, 6, 6],
                                    "glm4v": [4, 6, 6], "glm46v": [4, 6, 6], "glm_ocr": [4, 6, 6], "glmga": [4, 6, 6],
                                    "glm4v_moe": [2, 3, 3], "cosmos3_edge": [6, 5, 5], "hy_v4_vl": [3, 3, 2]}.items()},
    "glm5_next": {"text_config": {"qk_rope_head_dim": 0}},  # its DSA layers must use no RoPE
}  # fmt: skip


def set_head_dim(head_dim: int) -> None:
    """Tiny configs with heads of ``head_dim`` channels (and a hidden size of 4 such heads) instead of 32."""
    if not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be an even int >= 2 (int4 codes pack two per byte), got {head_dim!r}")
    TINY.update(head_dim=head_dim, hidden_size=TINY["num_attention_heads"] * head_dim)
    UNSET["head_dim"] = head_dim


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted({*MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, *_unmapped_causal_lms()})


def _unmapped_causal_lms() -> dict[str, str]:
    """Model types whose ``*ForCausalLM`` class another auto mapping names and the causal-LM one does not
    (transformers 5.24 maps Mistral 4's as image-text-to-text only), with that class's name."""
    import transformers.models.auto.modeling_auto as auto

    return {model_type: name for mapping_name, mapping in vars(auto).items()
            if mapping_name.startswith("MODEL_") and mapping_name.endswith("_MAPPING_NAMES")
            for model_type, name in mapping.items()
            if isinstance(name, str) and name.endswith("ForCausalLM")
            and model_type not in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES}  # fmt: skip


def causal_lm(config):
    """An untrained causal LM of ``config``: ``AutoModelForCausalLM``'s, or the class another auto mapping
    names for its type (:func:`causal_lm_types`); for a type with neither, its image-text-to-text model,
    which generates from text alone (``benchmarks/image_text_generate.py``)."""
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )  # fmt: skip

    unmapped = _unmapped_causal_lms().get(config.model_type)
    if unmapped is None and config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        unmapped = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(config.model_type)
    if unmapped is None:
        return transformers.AutoModelForCausalLM.from_config(config)
    return getattr(transformers, unmapped)._from_config(config)


def tiny_config(model_type: str):
    """The default config of ``model_type`` shrunk consistently.

    Shrunk values go to the config constructor, never onto a built config, so values the
    constructor derives (MLA's qk_head_dim, Falcon's head_dim property, per-layer configs,
    layer_types from the depth) follow them. Only declared fields are passed.
    """
    from huggingface_hub.errors import StrictDataclassClassValidationError
    from transformers import PreTrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"unknown model type {model_type!r}")
    cls = CONFIG_MAPPING[model_type]
    extra = PER_TYPE.get(model_type, {})
    subs = dict(cls.sub_configs or {})
    try:
        default = cls()
    except StrictDataclassClassValidationError:  # the default fails its own validator: build it with the fixes
        default = cls(**{key: value for key, value in extra.items() if key in subs})
    text = default.get_text_config(decoder=True)
    # text-only (the text config is the config itself, or for encoder-decoders a view of it)
    top = {} if any(getattr(default, key, None) is text for key in subs) else tiny_fields(default)
    # Sub-configs that size themselves after the text model (e.g. a vision adapter's output)
    text_hidden = getattr(text, "hidden_size", None)
    ties = {(SUB_TIED, text_hidden): TINY["hidden_size"]} if isinstance(text_hidden, int) else {}
    built = {}
    for key in subs:
        if isinstance(sub := getattr(default, key, None), PreTrainedConfig):
            spec = (cls.sub_configs_defaults or {}).get(key)
            init = spec.init_kwargs if spec else {}
            fields = tiny_fields(sub, ties, grow=sub is text)
            built[key] = type(sub)(**{**init, **fields, **extra.get(key, {})})
    return _finish(cls(**{**top, **extra, **built}))


def _finish(config):
    text = config.get_text_config(decoder=True)
    if not any(getattr(config, key, None) is text for key in config.sub_configs):
        text = config  # an encoder-decoder's decoder view is a copy
    text.eos_token_id = None
    text.pad_token_id = 0
    return config


def tiny_fields(config, ties: dict | None = None, grow: bool = True) -> dict:
    """Constructor arguments that shrink ``config`` (a built default config).

    ``ties`` maps (field name pattern, real size) to the tiny size, on top of :data:`TIED`.
    ``grow=False`` keeps sizes already under the tiny ones (vision, audio, codec sub-configs
    the text prompt never runs, e.g. a VQ model's single attention head).
    """
    import dataclasses

    cls = type(config)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    config.allow_global_per_layer_attribute_access = True  # read-only use of the default

    def field(name: str) -> str | None:
        # attribute_map points either way: n_layer for num_hidden_layers, or num_experts (the field) for num_local_experts
        return next((n for n in (cls.attribute_map.get(name, name), name) if n in fields), None)

    def value(name: str):
        return getattr(config, name, None)

    out = {}
    for name, size in TINY.items():
        if (f := field(name)) and isinstance(value(f), int) and not isinstance(value(f), bool):
            out[f] = size if grow else min(size, value(f))
    moe = isinstance(value("moe_intermediate_size"), int)
    for name, size in UNSET.items():
        if (f := field(name)) and value(f) is None and (moe or "expert" not in name):
            out[f] = size
    # MLA expands its latent K/V to every query head: as many K/V heads as heads
    if "kv_lora_rank" in fields and (heads := field("num_attention_heads")) in out and (kv := field("num_key_value_heads")):
        out[kv] = out[heads]
        # and some read the rotary width from head_dim where the real config has it equal to qk_rope_head_dim
        if (f := field("head_dim")) and "qk_rope_head_dim" in out and value(f) == value("qk_rope_head_dim"):
            out[f] = out["qk_rope_head_dim"]
    ties = dict(ties or {})  # (name pattern, real size) -> tiny size
    for name, pattern in TIED.items():
        if (f := field(name)) and f in out:
            ties[pattern, value(f)] = out[f]

    def tie(name: str, size):
        return next((tiny for (pattern, real), tiny in ties.items() if pattern.search(name) and size == real), size)

    for other in sorted(fields - out.keys()):
        if type(value(other)) is int and tie(other, value(other)) != value(other):
            out[other] = tie(other, value(other))
    # a K/V head count whose query head count shrank keeps its group size where it divides (inkling's swa_*)
    for kv in sorted(f for f in fields - out.keys() if "key_value_heads" in f and type(value(f)) is int):
        heads = kv.replace("key_value_heads", "attention_heads")
        if heads in out and value(heads) and value(heads) % value(kv) == 0:
            out[kv] = max(1, out[heads] * value(kv) // value(heads))
    hidden = out.get(field("hidden_size") or "")
    for heads, head_dim, expand in SSM_HEADS:
        if hidden and {heads, head_dim, expand} <= fields and isinstance(value(expand), int):
            inner = value(expand) * hidden
            out[heads] = inner // SSM_HEAD_DIM
            if isinstance(value("n_groups"), int):  # each group shares B and C over a whole number of heads
                out["n_groups"] = math.gcd(value("n_groups"), out[heads])
            if isinstance(value(head_dim), int):  # else "auto": derived from the heads
                out[head_dim] = SSM_HEAD_DIM
            if isinstance(value("mamba_d_ssm"), int):
                out["mamba_d_ssm"] = inner
    depth_field = field("num_hidden_layers")
    depth = value(depth_field) if depth_field else None
    # per-layer lists, and layer-kind patterns that the model cycles through (recurrent_gemma's block_types)
    lists = {
        f: value(f)
        for f in fields
        if isinstance(value(f), list) and depth and (len(value(f)) == depth > 1 or (f in KIND_PATTERNS and len(value(f)) > 1))
    }
    if lists:
        kinds = {f: list(dict.fromkeys(v)) for f, v in lists.items()}
        layers = min(MAX_LAYERS, max([TINY["num_hidden_layers"]] + [len(k) for f, k in kinds.items() if isinstance(lists[f][0], str)]))
        out[depth_field] = layers
        for f, k in kinds.items():
            out[f] = [TINY[f]] * layers if f in TINY else [tie(f, v) for v in (k * layers)[:layers]]
    return out


@cpu_steps.reference_attention()
def check_one(model_type: str, routes: bool = False, settings: dict | None = None) -> dict:
    """The row of one model type; runs in a subprocess (see :func:`run`). ``routes``: also
    :func:`check_routes` once the type is fully rewritten. ``settings``: ``kvpass.kv4``'s keyword
    arguments, checked instead of its defaults."""
    settings = settings or {}
    import torch
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    import kvpass
    from kvpass import packed as packed_module
    from kvpass.packed import PackedKV
    from kvpass.simulate import QueriesNotObserved, k_spec_as_stored

    row = {"model_type": model_type}
    if model_type in CANNOT_RUN:
        return {**row, "status": "cannot run", "reason": CANNOT_RUN[model_type]}
    try:
        config = tiny_config(model_type)
        torch.manual_seed(0)
        model = causal_lm(config).eval()
    except Exception as err:  # noqa: BLE001 - any failure is this row's finding
        return {**row, "status": "no tiny model", "reason": _short(err)}
    vocab = min(model.config.get_text_config(decoder=True).vocab_size or 256, 256)
    ids = torch.randint(3, vocab, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    nxt = torch.randint(3, vocab, (1, 1), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=4, do_sample=False)
            cache = DynamicCache(config=model.config)
    except Exception as err:  # noqa: BLE001
        return {**row, "status": "eager generation fails", "reason": _short(err)}
    phase = "prompt"
    try:
        with torch.no_grad():
            model(input_ids=ids, **cache_arg(cache), use_cache=True)
            # The decode step kv4 is checked on, eagerly first (cpmant fails here without kv4).
            phase = "decode step"
            model(input_ids=nxt, **cache_arg(copy.deepcopy(cache)), use_cache=True)
    except Exception as err:  # noqa: BLE001
        # xLSTM keeps a recurrent state of its own class and XLM wants an encoder-decoder pair; kv4 works on
        # the DynamicCache transformers gives most models, which these (and cpmant's decode step) fail on.
        return {**row, "status": "fails on a DynamicCache",
                "reason": f"it generates, but its {phase} fails on a transformers DynamicCache: {_short(err)}"}  # fmt: skip
    if not any(isinstance(layer, DynamicLayer) for layer in cache.layers) or cache.get_seq_length() == 0:
        return {**row, "status": "no attention KV cache", "reason": "the cache holds no growing K/V tensors"}

    backend, checked_unscaled = kvpass.kv4(**settings), False
    packed_module.fallback_ops.clear()
    try:
        with torch.no_grad():
            step = torch.compile(model, backend=backend)
            cache = DynamicCache(config=model.config)
            step(input_ids=ids, **cache_arg(cache), use_cache=True)
            got = step(input_ids=nxt, **cache_arg(cache), use_cache=True).logits
            defaults = backend.config
            # K as kv4 stored it: with V's spec in an MLA latent cache, which nothing attends over as keys.
            # Specs are compared per head width: heads under 32 channels store K and V alike.
            keys = [t for layer in cache.layers if isinstance(t := getattr(layer, "keys", None), PackedKV)]
            latent = any(t.spec == defaults.v.for_head_dim(t.shape[-1]) != defaults.k.for_head_dim(t.shape[-1])
                         for t in keys)  # fmt: skip
            twin_k = k_spec_as_stored(defaults.v if latent else defaults.k, keys)
            # A latent cache is stored with V's settings in every layer, k_layer_bits' too.
            twin_layers = {} if latent else {layer: k_spec_as_stored(spec, keys) for layer, spec in defaults.k_layers}
            try:
                expected = _twin_logits(model, ids, nxt, twin_k, defaults.v, twin_layers)
            except QueriesNotObserved:
                # Attention outside transformers' AttentionInterface hands the twin no queries: check
                # kv4's numbers without what it takes from them (its sites and bytes above are the default's).
                checked_unscaled = True
                torch._dynamo.reset()
                unscaled = kvpass.kv4(**{**settings, "k_query_scaled": False, "k_query_rounded": False})
                check_step, check = torch.compile(model, backend=unscaled), DynamicCache(config=model.config)
                check_step(input_ids=ids, **cache_arg(check), use_cache=True)
                got = check_step(input_ids=nxt, **cache_arg(check), use_cache=True).logits
                expected = _twin_logits(model, ids, nxt, unscaled.config.v if latent else unscaled.config.k,
                                        unscaled.config.v,
                                        {} if latent else dict(unscaled.config.k_layers))  # fmt: skip
            # generate's graphs from a fresh Dynamo, as in a process of its own: the steps above recompiled
            # frames generate shares (longcat_flash's reached Dynamo's recompile_limit, and generate ran eagerly).
            torch._dynamo.reset()
            model.compile(backend=kvpass.kv4(**settings))
            model.generate(ids, max_new_tokens=4, do_sample=False)
    except Exception as err:  # noqa: BLE001
        return {**row, "status": "kv4 fails", "reason": _short(err)}

    sites = [site for graph in backend.graphs for site in graph.sites]
    # A tensor of no values stores nothing to quantize (a layer without RoPE's rotary key, in MLA).
    tensors = [t for layer in cache.layers if isinstance(layer, DynamicLayer) for t in (layer.keys, layer.values)
               if t is None or t.numel()]  # fmt: skip
    packed = [t for t in tensors if isinstance(t, PackedKV)]
    status, reasons = site_status(sites, len(tensors), len(packed))
    if checked_unscaled and packed:
        unused = " and ".join(what for what, used in (("query scales", defaults.k.query_scaled),
                                                       ("query rounding", defaults.k.query_rounded)) if used)  # fmt: skip
        reasons.append(f"logits checked without {unused}: attention outside transformers' AttentionInterface "
                       "hands the eager twin no queries")  # fmt: skip
    if packed_module.fallback_ops and status == "rewritten":
        # Exact, but an fp copy of the cache each step: neither kv4's memory nor its speed.
        status = "read dequantized"
        ops = ", ".join(sorted(packed_module.fallback_ops))
        reasons.append(f"kv4's steps ran {ops} on the int4 cache dequantized (a read the rewrite left, or a step "
                       "Dynamo ran uncompiled)")  # fmt: skip
    logits_error = float((got - expected).abs().max()) if packed else None
    if logits_error is not None and not logits_error <= TWIN_TOLERANCE:  # NaN too
        status = "wrong logits"
        reasons.append(f"the decode step's logits differ from the eager twin's by {logits_error:.3g} "
                       f"(at most {TWIN_TOLERANCE:g} expected)")  # fmt: skip
    if routes and status == "rewritten":
        row["routes"] = check_routes(model, settings)
    return {
        **row,
        "status": status,
        "sites": f"{sum(site.rewritten for site in sites)}/{sum(site.reads_cache for site in sites)}",
        "bytes_ratio": round(_fp16_ratio(packed), 3) if packed else None,
        "logits_error": logits_error,
        "reason": "; ".join(reasons),
    }


def _twin_logits(model, ids, nxt, k_spec, v_spec, k_layer_specs):
    """The decode step's logits over :class:`kvpass.simulate.SimulatedKVCache` after prompt ``ids``."""
    from kvpass.simulate import SimulatedKVCache, observed_queries

    reference = SimulatedKVCache(model.config, k_spec, v_spec, k_layer_specs=k_layer_specs)
    with observed_queries():
        model(input_ids=ids, **cache_arg(reference), use_cache=True)
        return model(input_ids=nxt, **cache_arg(reference), use_cache=True).logits


def site_status(sites, n_tensors: int, n_packed: int) -> tuple[str, list[str]]:
    """A model type's status and reasons from the attention sites its graphs held and how many of its
    cache's ``n_tensors`` K/V tensors ended up packed. An attention that reads no KV cache is no site to
    rewrite; the reasons count them."""
    without_cache = sum(not site.reads_cache for site in sites)
    sites = [site for site in sites if site.reads_cache]
    rewritten = sum(site.rewritten for site in sites)
    reasons = sorted({site.reason for site in sites if not site.rewritten})
    if n_packed < n_tensors and rewritten == len(sites):
        reasons.append(f"{n_tensors - n_packed} of {n_tensors} cache tensors stayed fp16 with every site seen "
                       "rewritten: their layers ran outside kv4 graphs")  # fmt: skip
    if without_cache:
        reasons.append(f"{without_cache} attentions read no KV cache, left as they are (nothing to store)")
    if not sites:
        return "no site found", [*reasons, "no SDPA or eager attention found in the graphs"]
    if rewritten == len(sites) and n_packed == n_tensors:
        return "rewritten", reasons
    if n_packed == n_tensors:
        # Every cache int4, yet sites attend over K/V computed from it: an MLA latent expanded before a graph
        # break (GLM-5-next's indexer breaks each graph it runs in), or a join with it that is not stored.
        return "read dequantized", [*reasons, "every cache tensor is int4; the sites left read K/V computed from it "
                                              "dequantized"]  # fmt: skip
    return ("partly rewritten" if rewritten else "left fp16"), reasons


# generate's options for each route a user takes on a kv4-compiled model, on a left-padded batch.
ROUTES = {
    "beam search": {"num_beams": 2},
    "padded batch": {},
    "static cache": {"cache_implementation": "static"},
}


def check_routes(model, settings: dict | None = None) -> dict[str, str]:
    """Each of :data:`ROUTES` through ``model.compile(backend=kvpass.kv4(**settings))`` and ``generate``: ``"int4
    0.317"`` (every attention cache tensor packed; stored / fp16 bytes), ``"fp16 n/m: reason"``
    (n of m tensors left fp16, and the first unrewritten site's reason) or ``"fails: error"``."""
    import torch
    from torch._dynamo.utils import counters

    import kvpass
    from kvpass.packed import PackedKV

    text = model.config.get_text_config(decoder=True)
    vocab = min(text.vocab_size or 256, 256)
    ids = torch.randint(3, vocab, (2, PROMPT_TOKENS), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    pad = model.generation_config.pad_token_id
    pad = pad if isinstance(pad, int) and 0 <= pad < vocab else 0
    ids[0, :7] = pad
    results = {}
    for route, options in ROUTES.items():
        torch._dynamo.reset()
        counters["graph_break"].clear()
        backend = kvpass.kv4(**(settings or {}))
        model.compile(backend=backend)
        try:
            with torch.no_grad():
                # use_cache: some configs turn the cache off (MPT's), and without one there is nothing to check
                out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=pad,
                                     use_cache=True, return_dict_in_generate=True, **options)  # fmt: skip
        except Exception as err:  # noqa: BLE001 - the route's finding
            results[route] = f"fails: {_short(err)}"
            continue
        cache = returned_cache(out)
        tensors = [t for layer in cache.layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                   if isinstance(t, torch.Tensor) and t.dim() == 4 and t.numel()]  # fmt: skip
        packed = [t for t in tensors if isinstance(t, PackedKV)]
        if tensors and len(packed) == len(tensors):
            results[route] = f"int4 {_fp16_ratio(packed):.3f}"
        else:
            why = next((site.reason for graph in backend.graphs for site in graph.sites if site.left_fp16), "")
            results[route] = f"fp16 {len(tensors) - len(packed)}/{len(tensors)}: {(why or _outside_kv4_graphs())[:160]}"
    return results


def _outside_kv4_graphs() -> str:
    """Why cache tensors stayed fp16 where no site refused: no kv4 graph held their layers' attention."""
    from torch._dynamo.utils import counters

    first = next(iter(counters["graph_break"]), None)
    return "no kv4 graph held their attention" + (f"; Dynamo broke the graph: {first.splitlines()[0]}" if first else "")


def _fp16_ratio(packed: list) -> float:
    """Bytes the PackedKV tensors ``packed`` store, over what fp16 copies of them would."""
    return sum(t.stored_bytes() for t in packed) / sum(t.numel() * 2 for t in packed)


def _short(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]  # ImportError text starts blank
    # A strict dataclass's validation error says which validator on its first line, the cause on its last.
    said = lines[-1] if len(lines) > 1 and lines[0].endswith(":") else lines[0] if lines else ""
    return f"{type(err).__name__}: {said[:200]}"


def _run_isolated(model_type: str, timeout: float, head_dim: int, routes: bool = False,
                  settings: dict | None = None) -> dict:  # fmt: skip
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kvpass.coverage", "--one", model_type, "--head-dim", str(head_dim),
             "--settings", json.dumps(arguments.kv4_settings_as_literals(settings or {})),
             *(["--routes"] if routes else [])],
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"model_type": model_type, "status": "timed out", "reason": f"over {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return {"model_type": model_type, "status": "crashed", "reason": tail}
    row = json.loads(lines[-1])
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def rows_file_of(output: str) -> Path:
    """Where a run writes each row as it lands (a JSON line; the first holds the run's settings), so
    that a run stopped after an hour keeps what it found; removed once the matrix is written."""
    return Path(output).with_name(Path(output).name + ".rows.jsonl")


def rows_so_far(rows_file: Path, settings: dict) -> list[dict]:
    """The rows an interrupted run wrote to ``rows_file``, which must have had these ``settings``."""
    if not rows_file.exists():
        raise FileNotFoundError(f"--resume found no rows of an interrupted run at {rows_file}; run without --resume")
    lines = rows_file.read_text().splitlines()
    header = json.loads(lines[0]) if lines else {}
    rows = []
    for line in lines[1:]:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # the row being written when the run was stopped: run it again
            break
    if header.get("settings") != settings:
        raise ValueError(f"the rows in {rows_file} were checked with {header.get('settings')}, not {settings}; "
                         "rerun with those settings or without --resume")  # fmt: skip
    return rows


def summarize(rows: list[dict]) -> dict:
    with_cache = [r for r in rows if r["status"] in ("rewritten", "partly rewritten", "left fp16", "no site found", "kv4 fails",
                                                     "wrong logits", "read dequantized")]  # fmt: skip
    rewritten = [r for r in with_cache if r["status"] == "rewritten"]
    return {
        "types": len(rows),
        "with_attention_cache_running_eagerly": len(with_cache),
        "fully_rewritten": len(rewritten),
        "fraction": round(len(rewritten) / len(with_cache), 3) if with_cache else None,
    }


def _check_updatable(saved: dict) -> None:
    if "commands" not in saved:
        raise ValueError("this JSON does not name the command that made it (written before --update existed); "
                         "rerun the whole matrix or add its command as a \"commands\" list")  # fmt: skip


def merged(saved: dict, rerun: list[dict], command: str) -> tuple[list[dict], list[str]]:
    """A saved matrix (``--json``'s content) with the ``rerun`` rows in place of its rows of the same
    types and added where it has none, and the commands that made it, ``command`` last."""
    _check_updatable(saved)
    by_type = {r["model_type"]: r for r in saved["rows"]} | {r["model_type"]: r for r in rerun}
    return list(by_type.values()), [*saved["commands"], command]


# How a page :func:`markdown` writes begins, and its line naming the commands: :func:`page_notes` reads between.
PAGE_TITLE, MADE_BY = "# Support matrix", "Made by `"


def markdown(rows: list[dict], summary: dict, commands: list[str], notes: str = "") -> str:
    """The support matrix page; ``commands`` made its rows, each later one rerunning the types it names.
    ``notes``: paragraphs for the top of the page (what each rerun was for, :func:`page_notes`)."""
    import torch
    import transformers

    made_by = "`, then `".join(commands)
    share = "" if summary["fraction"] is None else f" ({summary['fraction']:.0%})"
    reruns = " (each later command ran the types it names, replacing or adding their rows)" if len(commands) > 1 else ""
    lines = [
        PAGE_TITLE,
        "",
        *([notes, ""] if notes else []),
        f"{MADE_BY}{made_by}`{reruns} with torch {torch.__version__} and transformers {transformers.__version__}.",
        "Each model type's default config shrunk to 2 layers (one per kind, up to 4, where layers mix kinds;",
        f"hidden {TINY['hidden_size']}, head_dim {TINY['head_dim']} where the config has these), "
        f"a {PROMPT_TOKENS}-token prompt, one decode step compared with the eager model",
        f"reading the same quantized past (`logits error`, max abs; over {TWIN_TOLERANCE:g} or not finite, the",
        "status is `wrong logits`); `read dequantized`: every site rewritten, but a step ran an op on the int4",
        "cache dequantized (an fp copy: a read the rewrite left, or a step Dynamo ran uncompiled); `bytes` is",
        "stored / fp16 bytes of the packed layers. Rows are this machine's findings, not claims about the real models.",
        "",
        f"**{summary['fully_rewritten']} of {summary['with_attention_cache_running_eagerly']}** types that have an "
        f"attention KV cache and run eagerly are fully rewritten{share}; "
        f"{summary['types']} causal-LM types in all.",
        "",
    ]
    routes = list(ROUTES) if any("routes" in r for r in rows) else []
    if routes:
        lines += [
            "Route columns: `generate` on the kv4-compiled model with a left-padded batch of 2 (6 new tokens):",
            "`int4` and stored / fp16 bytes of every attention cache tensor, or what stayed fp16 and why.",
            "",
        ]
    header = ["model type", "status", "sites", "bytes", "logits error", *routes, "reason"]
    lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for r in rows:
        err = f"{r['logits_error']:.1e}" if r.get("logits_error") is not None else ""
        ratio = f"{r['bytes_ratio']:.3f}" if r.get("bytes_ratio") is not None else ""
        cells = [r["model_type"], r["status"], r.get("sites", ""), ratio, err,
                 *(r.get("routes", {}).get(route, "") for route in routes), r.get("reason", "")]  # fmt: skip
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def page_notes(page: Path) -> str:
    """The paragraphs a page written by :func:`markdown` has between its title and "Made by": notes
    added by hand on what each rerun was for, which an ``--update`` keeps."""
    if not page.exists():
        return ""
    text = page.read_text()
    title, made_by = f"{PAGE_TITLE}\n", f"\n{MADE_BY}"
    if not text.startswith(title) or made_by not in text:
        return ""
    return text[len(title) : text.index(made_by)].strip()


# The whole matrix's page, which a run of named types writes only as --update.
DEFAULT_PAGE = "docs/coverage.md"


def add_arguments(parser) -> None:
    parser.add_argument("model_types", nargs="*", help="model types to check (default: every causal-LM type)")
    parser.add_argument("--timeout", type=arguments.positive_float, default=120.0, help="seconds per model type")
    parser.add_argument("--jobs", type=arguments.positive_int, default=2, help="model types checked at once")
    parser.add_argument("--output", default=DEFAULT_PAGE, help=f"markdown file to write (default {DEFAULT_PAGE})")
    parser.add_argument("--json", help="also write the rows as JSON here")
    parser.add_argument(
        "--routes", action="store_true",
        help="also generate through kv4 with beam search, a padded batch and a static cache (per fully rewritten type)",
    )  # fmt: skip
    parser.add_argument(
        "--update", action="store_true",
        help="run only the named model types and replace or add their rows in the --json file (and --output)",
    )  # fmt: skip
    parser.add_argument(
        "--resume", action="store_true",
        help="keep the rows an interrupted run with the same settings wrote (--output's .rows.jsonl) and run only the rest",
    )  # fmt: skip
    parser.add_argument(
        "--head-dim", type=int, default=TINY["head_dim"],
        help=f"channels per head of the tiny configs, hidden 4x that (default {TINY['head_dim']})",
    )  # fmt: skip
    parser.add_argument(
        "--k-query-rounded", action="store_true",
        help="check kvpass.kv4(k_query_rounded=True) instead of the default (K's codes rounded against every "
        "append's queries, where the default rounds appends of 64 tokens or more)",
    )  # fmt: skip
    arguments.add_kv4_settings(parser, "the backend each type is checked with")


def _check_types(model_types: list[str]) -> None:
    """Refuse a type no causal LM of transformers has before the run, which would report it as a row."""
    import transformers

    known = causal_lm_types() if model_types else []
    unknown = {t: difflib.get_close_matches(t, known, n=3) for t in model_types if t not in known}
    if unknown:
        hints = "; ".join(f"{t!r}" + (f" (close: {', '.join(close)})" if close else "") for t, close in unknown.items())
        raise ValueError(f"not a causal-LM model type of transformers {transformers.__version__}: {hints}; "
                         "`kvpass coverage` with no types checks all of them")  # fmt: skip


def run(args) -> int:
    from tqdm import tqdm

    from kvpass.backend import check_settings

    kv4_settings = {**dict(args.kv4_settings), **({"k_query_rounded": True} if args.k_query_rounded else {})}
    check_settings(kv4_settings, "kvpass coverage")
    if args.update and not (args.json and args.model_types):
        raise ValueError("--update reruns the named model types into an existing --json file: give both")
    saved = json.loads(Path(args.json).read_text()) if args.update else None
    if saved is not None:
        _check_updatable(saved)  # before the run, which may take an hour
    types = args.model_types or causal_lm_types()
    _check_types(args.model_types)
    if args.model_types and not args.update and args.output == DEFAULT_PAGE and Path(DEFAULT_PAGE).exists():
        raise ValueError(f"{DEFAULT_PAGE} exists, and a run of named types would replace it with their rows "
                         "alone: give --output PATH for a page of their own, or --update --json PATH to rerun them "
                         "into it")  # fmt: skip
    rows_file = rows_file_of(args.output)
    # Values as literals, as the rows file's JSON compares them on --resume.
    settings = {"head_dim": args.head_dim, "routes": args.routes, **arguments.kv4_settings_as_literals(kv4_settings)}
    rows = [r for r in rows_so_far(rows_file, settings) if r["model_type"] in types] if args.resume else []
    set_head_dim(args.head_dim)
    if rows:
        log.info("resuming: %d rows from %s", len(rows), rows_file)
    done = {r["model_type"] for r in rows}
    todo = [t for t in types if t not in done]
    rows_file.parent.mkdir(parents=True, exist_ok=True)
    with open(rows_file, "w") as rows_out:
        rows_out.writelines(json.dumps(line) + "\n" for line in [{"settings": settings}, *rows])
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = [pool.submit(_run_isolated, t, args.timeout, args.head_dim, args.routes, kv4_settings) for t in todo]
            for future in tqdm(concurrent.futures.as_completed(futures), total=len(todo), desc="model types"):
                rows.append({**future.result(), "kvpass": version.describe()})  # which code checked the row
                rows_out.write(json.dumps(rows[-1]) + "\n")
                rows_out.flush()
    command = "kvpass " + " ".join(sys.argv[sys.argv.index("coverage"):]) if "coverage" in sys.argv else "kvpass coverage"
    commands = [command]
    if args.update:
        rows, commands = merged(saved, rows, command)
    rows.sort(key=lambda r: r["model_type"])
    summary = summarize(rows)
    text = markdown(rows, summary, commands, page_notes(Path(args.output)) if args.update else "")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "commands": commands, "rows": rows}, indent=1))
    rows_file.unlink()
    print(text)
    return 0


if __name__ == "__main__":
    # One model type, in the subprocess _run_isolated starts.
    one = argparse.ArgumentParser()
    one.add_argument("--one", required=True)
    one.add_argument("--head-dim", type=int, required=True)
    one.add_argument("--settings", type=lambda text: arguments.kv4_settings_from_literals(json.loads(text)), default={})
    one.add_argument("--routes", action="store_true")
    one_args = one.parse_args()
    logging.basicConfig(level=logging.ERROR)
    set_head_dim(one_args.head_dim)
    print(json.dumps(check_one(one_args.one, routes=one_args.routes, settings=one_args.settings)))
