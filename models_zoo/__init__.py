"""Tiny random-weight Hugging Face causal LMs, one per architecture family.

Each factory returns a transformers config with the family's real structure (GQA/MQA,
sliding windows, MLA, hybrid layers, norms, biases) at toy size, so the kv4 backend can be
exercised on every cache layout in seconds on a CPU. The real model's sizes are in each
factory's comment for scale. ``build(name)`` turns one into an eval-mode model with
weights that depend only on ``seed``.

Shared toy sizes: 2 layers, hidden 64, vocab 256, 2048 positions. ``eos_token_id`` is
None everywhere so greedy generation always runs to ``max_new_tokens`` and tests can rely
on output lengths; a random model would otherwise stop whenever it happened to emit EOS.
Sliding-window families use a window of 32 so contexts of a few dozen tokens already
evict from the cache.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

logger = logging.getLogger("kvpass")

VOCAB = 256
HIDDEN = 64
LAYERS = 2
POSITIONS = 2048
WINDOW = 32

_TOKENS = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=None, pad_token_id=0)


def _cfg(model_type: str, **kwargs) -> PretrainedConfig:
    return AutoConfig.for_model(model_type, **_TOKENS, **kwargs)


def llama() -> PretrainedConfig:
    # Llama-3.1-8B: 32 layers, hidden 4096, 32 heads, 8 KV heads, head_dim 128, vocab 128256.
    return _cfg(
        "llama", hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=POSITIONS,
    )


def llama_hd128() -> PretrainedConfig:
    # A tiny Llama with Llama-3's real head_dim (128), so per-group scale overhead, and so
    # the stored-bytes ratio, is what it is at scale (the other entries use head_dim 16).
    return _cfg(
        "llama", hidden_size=256, intermediate_size=256, num_hidden_layers=LAYERS,
        num_attention_heads=2, num_key_value_heads=1, head_dim=128,
        max_position_embeddings=POSITIONS,
    )


def mistral() -> PretrainedConfig:
    # Mistral-7B-v0.1: 32 layers, hidden 4096, 32 heads, 8 KV heads, head_dim 128,
    # sliding window 4096 on every layer.
    return _cfg(
        "mistral", hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=POSITIONS, sliding_window=WINDOW,
    )


def qwen2() -> PretrainedConfig:
    # Qwen2.5-7B: 28 layers, hidden 3584, 28 heads, 4 KV heads, head_dim 128, q/k/v biases.
    return _cfg(
        "qwen2", hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=POSITIONS,
    )


def gemma() -> PretrainedConfig:
    # Gemma-2B: 18 layers, hidden 2048, 8 heads, 1 KV head (MQA), head_dim 256.
    # (Gemma-7B is MHA: 28 layers, hidden 3072, 16 heads, head_dim 256.)
    # heads * head_dim != hidden on purpose: the real models do the same.
    return _cfg(
        "gemma", hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        max_position_embeddings=POSITIONS,
    )


def gpt2() -> PretrainedConfig:
    # GPT-2 small: 12 layers, hidden 768, 12 heads (MHA), head_dim 64, 1024 positions.
    return _cfg(
        "gpt2", n_embd=HIDDEN, n_layer=LAYERS, n_head=4, n_positions=POSITIONS,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )


def qwen3() -> PretrainedConfig:
    # Qwen3-8B: 36 layers, hidden 4096, 32 heads, 8 KV heads, head_dim 128, q/k RMSNorm.
    return _cfg(
        "qwen3", hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=POSITIONS,
    )


def gemma2() -> PretrainedConfig:
    # Gemma-2-9B: 42 layers, hidden 3584, 16 heads, 8 KV heads, head_dim 256, sliding
    # window 4096 on alternate layers, attention logit soft-capping 50, final 30.
    return _cfg(
        "gemma2", hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
        max_position_embeddings=POSITIONS, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
    )


def gemma3() -> PretrainedConfig:
    # Gemma-3-1B (text only, Gemma3ForCausalLM): 26 layers, hidden 1152, 4 heads, 1 KV head,
    # head_dim 256, sliding window 512, five local layers per global layer.
    return _cfg(
        "gemma3_text", hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
        max_position_embeddings=POSITIONS, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
    )


def phi3() -> PretrainedConfig:
    # Phi-3-medium: 40 layers, hidden 5120, 40 heads, 10 KV heads, head_dim 128.
    # (Phi-3-mini is MHA: 32 layers, hidden 3072, 32 heads, head_dim 96.)
    return _cfg(
        "phi3", hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=POSITIONS,
        original_max_position_embeddings=POSITIONS,
    )


def gpt_neox() -> PretrainedConfig:
    # Pythia-6.9B: 32 layers, hidden 4096, 32 heads (MHA), head_dim 128, rotary on 25%
    # of each head, parallel residual.
    return _cfg(
        "gpt_neox", hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, max_position_embeddings=POSITIONS,
    )


def falcon() -> PretrainedConfig:
    # Falcon-7B: 32 layers, hidden 4544, 71 heads, multi-query (1 KV head), head_dim 64,
    # parallel attention/MLP.
    return _cfg(
        "falcon", hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
        multi_query=True, new_decoder_architecture=False, parallel_attn=True,
        max_position_embeddings=POSITIONS,
    )


def gpt_neo() -> PretrainedConfig:
    # GPT-Neo-1.3B: 24 layers, hidden 2048, 16 heads (MHA), head_dim 128, alternating global
    # and local (window 256) layers; eager-only attention masked with torch.where, fp32 upcast.
    return _cfg(
        "gpt_neo", hidden_size=HIDDEN, num_layers=LAYERS, num_heads=4, intermediate_size=128,
        attention_types=[[["global", "local"], 1]], window_size=WINDOW, max_position_embeddings=POSITIONS,
    )


def opt() -> PretrainedConfig:
    # OPT-1.3B: 24 layers, hidden 2048, 32 heads (MHA), head_dim 64, learned positions.
    return _cfg(
        "opt", hidden_size=HIDDEN, word_embed_proj_dim=HIDDEN, ffn_dim=128,
        num_hidden_layers=LAYERS, num_attention_heads=4, max_position_embeddings=POSITIONS,
        dropout=0.0,
    )


def olmo2() -> PretrainedConfig:
    # OLMo-2-7B: 32 layers, hidden 4096, 32 heads (MHA), head_dim 128, q/k RMSNorm over
    # the full projection.
    return _cfg(
        "olmo2", hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, max_position_embeddings=POSITIONS,
    )


def starcoder2() -> PretrainedConfig:
    # StarCoder2-7B: 32 layers, hidden 4608, 36 heads, 4 KV heads, head_dim 128, sliding
    # window 4096 on every layer.
    return _cfg(
        "starcoder2", hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=POSITIONS,
        sliding_window=WINDOW, residual_dropout=0.0, embedding_dropout=0.0,
    )


def deepseek_v3() -> PretrainedConfig:
    # DeepSeek-V3: 61 layers, hidden 7168, 128 heads, multi-head latent attention with
    # kv_lora_rank 512 and a shared 64-dim rotary key (qk_nope 128, v_head 128); the cache
    # holds only the 512-dim latent (K slot) and the rotary key (V slot), one "head" each.
    # 256 routed experts, first 3 layers dense.
    return _cfg(
        "deepseek_v3", hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, max_position_embeddings=POSITIONS,
    )


def lfm2() -> PretrainedConfig:
    # LFM2-1.2B: 16 layers (10 short-convolution + 6 attention), hidden 2048, 32 heads,
    # 8 KV heads, head_dim 64. Convolution layers keep a fixed-size state, not a KV cache.
    return _cfg(
        "lfm2", hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=POSITIONS,
        layer_types=["conv", "full_attention"],
    )


def gpt_oss() -> PretrainedConfig:
    # gpt-oss-20b: 24 layers, hidden 2880, 64 heads, 8 KV heads, head_dim 64, sliding window 128 on
    # every other layer, a learned attention-sink logit per head (eager attention only), 32 experts
    # (4 per token). The default positions (131072, YaRN from 4096) keep its rope config consistent.
    return _cfg(
        "gpt_oss", hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
    )


ZOO: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": llama,
    "llama_hd128": llama_hd128,
    "mistral": mistral,
    "qwen2": qwen2,
    "gemma": gemma,
    "gpt2": gpt2,
    "qwen3": qwen3,
    "gemma2": gemma2,
    "gemma3": gemma3,
    "phi3": phi3,
    "gpt_neox": gpt_neox,
    "falcon": falcon,
    "gpt_neo": gpt_neo,
    "opt": opt,
    "olmo2": olmo2,
    "starcoder2": starcoder2,
    "deepseek_v3": deepseek_v3,
    "lfm2": lfm2,
    "gpt_oss": gpt_oss,
}


def config(name: str) -> PretrainedConfig:
    """The tiny config registered under ``name``."""
    try:
        factory = ZOO[name]
    except KeyError:
        raise ValueError(f"unknown models_zoo name {name!r}; accepted: {sorted(ZOO)}") from None
    return factory()


def build(
    name: str,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """An eval-mode ``AutoModelForCausalLM`` for ``ZOO[name]``; weights depend only on ``seed``.

    ``attn_implementation=None`` picks "sdpa" where the model class supports it and "eager"
    otherwise (Gemma-2's logit soft-capping has no SDPA path).
    """
    cfg = config(name)
    if attn_implementation is None:
        model_class = AutoModelForCausalLM._model_mapping[type(cfg)]
        attn_implementation = "sdpa" if model_class._supports_sdpa else "eager"
    # fork_rng keeps the caller's global RNG stream untouched by weight initialisation.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            cfg, dtype=dtype, attn_implementation=attn_implementation
        )
    logger.debug("built models_zoo %s (%s, %s, seed %d)", name, cfg.model_type, dtype, seed)
    return model.eval()
