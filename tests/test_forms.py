"""One tiny real transformers model per attention form the pass accepts beyond plain SDPA.

Each compiles with kv4, prefills, decodes one token and compares the logits with the eager
model reading the same quantized past (:class:`kvpass.simulate.SimulatedKVCache`).
Batch 2, so folding heads into the batch (``[B * H, T, D]``) is checked in the right order.
"""

import logging
import re

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache

import kvpass
from kvpass import models_zoo, packed, passes
from kvpass.cache_argument import cache_arg
from kvpass.packed import PackedKV
from kvpass.simulate import SimulatedKVCache, k_spec_as_stored, observed_queries
from tests.helpers import assert_latent_steps_match_twin, latent_decode

COMMON = {"vocab_size": 256, "eos_token_id": None, "pad_token_id": 0, "bos_token_id": 1}

# model type -> (config class, sizes, forms its sites are found as)
MODELS = {
    # torch.bmm over [B * H, T, D], mask added on a 4-D view, clamped at finfo.min
    "xglm": ("XGLMConfig", {"d_model": 64, "num_layers": 2, "attention_heads": 4, "ffn_dim": 64}, {"bmm"}),
    # ALiBi as baddbmm's input, alpha as the scale
    "bloom": ("BloomConfig", {"hidden_size": 64, "n_layer": 2, "n_head": 4}, {"bmm"}),
    # baddbmm over a zeros input on folded heads, probs @ V back in 4-D
    "gpt_neox_japanese": (
        "GPTNeoXJapaneseConfig",
        {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_multiple_size": 1},
        {"eager"},
    ),
    # scores + ALiBi position bias, masked_fill(causal, finfo.min), .float() before softmax
    "mpt": ("MptConfig", {"d_model": 64, "n_layers": 2, "n_heads": 4, "expansion_ratio": 1}, {"eager"}),
    # keys.repeat(1, top_k, 1, 1): query head h reads KV head h % H_kv
    "jetmoe": (
        "JetMoeConfig",
        {
            "hidden_size": 64, "num_hidden_layers": 1, "num_key_value_heads": 2, "kv_channels": 16,
            "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
        },
        {"sdpa"},
    ),  # fmt: skip
    # V cache also read by dt_proj (its dynamic mask), which gets the dequantized cache
    "doge": (
        "DogeConfig",
        {
            "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
        },
        {"sdpa"},
    ),  # fmt: skip
    # attention sinks: cat([scores, sink]) - row max -> softmax -> probs[..., :-1];
    # sliding-window layers (window 32 < 40 prompt tokens) evict as well
    "gpt_oss": (
        "GptOssConfig",
        {
            "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
            "sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"],
        },
        {"eager"},
    ),  # fmt: skip
    # sinks on sliding layers only, the row-max shift on all; V head_dim != K head_dim
    "mimo_v2_flash": (
        "MiMoV2FlashConfig",
        {
            "hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "v_head_dim": 16,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "sliding_window": 32,
            "layer_types": ["full_attention", "sliding_attention"], "mlp_layer_types": ["dense", "sparse"],
        },
        {"eager"},
    ),  # fmt: skip
    # a sink as a scale of the output, out * sigmoid(logsumexp(scores) - sink); sliding layers too
    "granite_swa": (
        "GraniteSWAConfig",
        {
            "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "sliding_window": 32, "layer_types": ["full_attention", "sliding_attention"],
        },
        {"eager"},
    ),  # fmt: skip
    # differential attention: two SDPAs read one K cache; V is chunk(values, 2, dim=1)[c] tiled back
    "diffllama": (
        "DiffLlamaConfig",
        {"hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
        {"sdpa"},
    ),
    # K and V upcast with .float() before attention; sinks
    "flint": (
        "FlintConfig",
        {
            "hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
            "num_experts_per_tok": 2, "sliding_window": 32, "layer_types": ["full_attention", "sliding_attention"],
        },
        {"eager"},
    ),  # fmt: skip
    # K and V are one sliding-window cache tensor; attention reads cat([cache, compressed KV])
    "deepseek_v4": (
        "DeepseekV4Config",
        {
            "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "sliding_window": 32, "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention"],
        },
        {"eager"},
    ),  # fmt: skip
}


def _model(name, **sizes):
    config_class, default_sizes, _ = MODELS[name]
    config = getattr(transformers, config_class)(**COMMON, **{**default_sizes, **sizes})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        for module in model.modules():
            if getattr(module, "sinks", None) is not None:
                module.sinks.data = torch.randn(module.sinks.shape) + 2.0  # large enough to matter
    return model


def _decode_with_kv4_and_twin(model, backend):
    """One decode step's logits after a 70-token prompt, through ``backend`` and through the eager twin
    reading the past as kv4 stored it; and kv4's cache."""
    # 70 tokens: K takes fp sinks and an offset (a prompt of 64 or more), which sliding windows evict.
    ids = torch.randint(3, 256, (2, 70), generator=torch.Generator().manual_seed(0))
    nxt = torch.randint(3, 256, (2, 1), generator=torch.Generator().manual_seed(1))
    # Row 1 is left-padded, so the decode step's mask hides keys (a dropped mask shows).
    mask = torch.ones(2, 70, dtype=torch.long)
    mask[1, :5] = 0
    inputs = [
        {"input_ids": ids, "attention_mask": mask},
        {"input_ids": nxt, "attention_mask": torch.cat([mask, mask[:, :1]], 1)},
    ]
    # JetMoE's deprecation wrappers share one code object and can use up the default limit of 8,
    # after which the decode step would run uncompiled.
    with torch._dynamo.config.patch(recompile_limit=64):
        step = torch.compile(model, backend=backend)
        cache = DynamicCache(config=model.config)
        # By the name generate passes it: the old one takes another path through Dynamo (below).
        step(**inputs[0], **cache_arg(cache), use_cache=True)
        got = step(**inputs[1], **cache_arg(cache), use_cache=True).logits

    config = backend.config
    k_spec = k_spec_as_stored(config.k, [layer.keys for layer in cache.layers])  # a site without a query: unscaled
    reference = SimulatedKVCache(model.config, k_spec, config.v)
    with observed_queries():
        model(**inputs[0], **cache_arg(reference), use_cache=True)
        expected = model(**inputs[1], **cache_arg(reference), use_cache=True).logits
    return got, expected, cache


@pytest.mark.parametrize("name", sorted(MODELS))
@torch.no_grad()
def test_form_rewritten_and_matches_reference(name):
    torch._dynamo.reset()
    model = _model(name)
    backend = kvpass.kv4()
    got, expected, cache = _decode_with_kv4_and_twin(model, backend)
    sites = [site for graph in backend.graphs for site in graph.sites]
    assert all(site.rewritten for site in sites), [site.reason for site in sites if not site.rewritten]
    assert {site.form for site in sites} == MODELS[name][2]
    layers = model.config.num_hidden_layers
    assert [site.phase for site in sites].count("decode") == layers * (2 if name == "diffllama" else 1)
    assert all(isinstance(t, PackedKV) for layer in cache.layers for t in (layer.keys, layer.values))
    # No fp concatenation of the cache is left: every reader reads the packed past.
    assert not any(re.search(r"torch\.cat\(\[\w*layers_\d+_(keys|values)", graph.after) for graph in backend.graphs)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name, first_sizes", [("diffllama", {"num_key_value_heads": 4}), ("bloom", {"n_head": 8})])
@torch.no_grad()
def test_a_model_compiled_after_one_of_other_sizes_is_rewritten_as_alone(name, first_sizes):
    # Every transformers forward runs inside one deprecate_kwarg wrapper, so Dynamo compiles one code
    # object for both models, and its automatic dynamic shapes make what differs between them a symbol
    # in the second model's graphs. The cache's head count and head_dim were such symbols: DiffLlama's
    # V reads a chunk of its heads, which the rewrite needs as a number, and stayed fp16; BLOOM's K fold
    # [B * H, S, D] could not be proven, and its cache was taken for an MLA latent. (A past_key_values
    # argument hides this: the wrapper's deprecation warning breaks the graph before the model's own forward.)
    torch._dynamo.reset()
    _decode_with_kv4_and_twin(_model(name, **first_sizes), kvpass.kv4())
    backend = kvpass.kv4()
    got, expected, _ = _decode_with_kv4_and_twin(_model(name), backend)
    sites = [site for graph in backend.graphs for site in graph.sites]
    assert all(site.rewritten for site in sites), [site.reason for site in sites if not site.rewritten]
    assert {site.phase for site in sites} == {"prefill", "decode"}
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name, cache", [("mistral", "dynamic"), ("mistral", "static"), ("diffllama", "dynamic")])
@torch.no_grad()
def test_a_model_after_one_of_another_head_dim_reads_no_fp_copy_of_its_cache(name, cache, caplog):
    # Unless a cache's heads and head_dim are marked static (packed._static_heads), automatic dynamic
    # shapes make them symbols in a second model's graphs. HF's read of value.shape[-1] after SDPA then
    # stayed in the graph; of repeat_kv's view (the mask rules out enable_gqa), it kept the fp cat of
    # the int4 cache under that view alive: a dequantized copy of the whole cache each step. DiffLlama's
    # graphs keep that read with the marks too, its value pinned (passes._fold_known_sizes).
    ids = torch.randint(3, 256, (2, 70), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0

    def generate(model, backend):
        model.compile(backend=backend)
        kept = {"cache": kvpass.StaticKVCache(model.config, max_cache_len=80)} if cache == "static" else {}
        return model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, **kept)

    def build():
        return models_zoo.build(name) if name in models_zoo.ZOO else _model(name)

    torch._dynamo.reset()
    alone = generate(build(), kvpass.kv4())
    torch._dynamo.reset()
    generate(models_zoo.build("llama_hd128"), kvpass.kv4())
    backend = kvpass.kv4()
    with caplog.at_level(logging.WARNING, logger="kvpass"):
        after = generate(build(), backend)
    assert "dequantized cache" not in caplog.text
    sites = [site for graph in backend.graphs for site in graph.sites]
    assert sites and all(site.rewritten for site in sites), [site.reason for site in sites if not site.rewritten]
    assert torch.equal(after, alone)


@torch.no_grad()
def test_tiled_query_heads_give_k_query_scales_and_rounding_from_heads_grouped_as_the_op_reads_them():
    """JetMoE's query head ``r * H_kv + g`` reads KV head ``g``: the K write and the twin group the
    query heads by the KV head they read, so both take the same scales and rounding (read in tiled
    order, the twin's logits differ by about 1e-5)."""
    torch._dynamo.reset()
    model = _model("jetmoe", kv_channels=32)  # 32 channels keep K's extras
    backend = kvpass.kv4()
    got, expected, cache = _decode_with_kv4_and_twin(model, backend)
    sites = [site for graph in backend.graphs for site in graph.sites]
    assert sites and all(site.rewritten and not site.reason for site in sites), [site.reason for site in sites]
    assert all(layer.keys.query_scales is not None and layer.keys.spec.query_rounded for layer in cache.layers)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@torch.no_grad()
def test_query_rounded_k_at_a_site_without_a_query_is_stored_and_simulated_rounded_to_nearest(monkeypatch):
    """No rewritten type's site lacks a query now (heads under 32 channels take no extras at all), so a
    site is made to go without one."""
    torch._dynamo.reset()
    monkeypatch.setattr(passes, "_scales_query", lambda *args: (None, "no query in this test"))
    model = _model("jetmoe", kv_channels=32)
    backend = kvpass.kv4(k_query_rounded=True)
    got, expected, cache = _decode_with_kv4_and_twin(model, backend)
    sites = [site for graph in backend.graphs for site in graph.sites]
    assert all(site.rewritten and "K is stored without query scales and query rounding" in site.reason
               for site in sites)  # fmt: skip
    assert all(not layer.keys.spec.query_rounded and layer.keys.spec.query_scaled for layer in cache.layers)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


# Encoder-decoders: BART (SDPA) and T5 (eager, a position bias added to the scores).
SEQ2SEQ = {
    "bart": ("BartConfig", "BartForConditionalGeneration", {
        "d_model": 64, "encoder_layers": 1, "decoder_layers": 2, "encoder_attention_heads": 2,
        "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "max_position_embeddings": 128,
    }),
    "t5": ("T5Config", "T5ForConditionalGeneration", {
        "d_model": 64, "d_kv": 32, "num_heads": 2, "num_layers": 1, "num_decoder_layers": 2, "d_ff": 64,
    }),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SEQ2SEQ))
@torch.no_grad()
def test_an_encoder_decoder_stores_both_caches_int4_and_decodes_as_over_them_dequantized(name):
    """A decoder caches its cross-attention's K/V (the encoder's output), written by the first decoder step
    and read by every later one, beside its self-attention's. That first write's query has other tokens
    than it stores, so its K takes no query scales (asking for them had raised); later steps attend over
    the int4 cache as stored. A later step's logits are the eager model's over the caches dequantized."""
    from transformers import EncoderDecoderCache

    config_class, model_class, sizes = SEQ2SEQ[name]
    torch._dynamo.reset()
    config = getattr(transformers, config_class)(vocab_size=256, **sizes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(transformers, model_class)(config).eval()
    ids = torch.randint(3, 256, (2, 70), generator=torch.Generator().manual_seed(0))
    encoded = model.get_encoder()(input_ids=ids)
    steps = torch.randint(3, 256, (2, 3), generator=torch.Generator().manual_seed(1))
    backend = kvpass.kv4()
    step = torch.compile(model, backend=backend)
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    for i in range(2):
        step(encoder_outputs=encoded, decoder_input_ids=steps[:, i : i + 1], **cache_arg(cache), use_cache=True)
    caches = (cache.self_attention_cache, cache.cross_attention_cache)
    assert all(isinstance(t, PackedKV) for c in caches for layer in c.layers for t in (layer.keys, layer.values))
    assert [layer.keys.shape[2] for layer in cache.cross_attention_cache.layers] == [70, 70]

    dequantized = EncoderDecoderCache(DynamicCache(), DynamicCache())
    for c, twin in zip(caches, (dequantized.self_attention_cache, dequantized.cross_attention_cache)):
        for index, layer in enumerate(c.layers):
            twin.update(layer.keys.dequantize(), layer.values.dequantize(), index)
    dequantized.is_updated = dict.fromkeys(range(2), True)  # cross-attention: read, not written again
    got = step(encoder_outputs=encoded, decoder_input_ids=steps[:, 2:], **cache_arg(cache), use_cache=True).logits
    expected = model(encoder_outputs=encoded, decoder_input_ids=steps[:, 2:], **cache_arg(dequantized),
                     use_cache=True).logits  # fmt: skip
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)  # fp caches: 7e-4 away (BART)
    sites = [site for graph in backend.graphs for site in graph.sites]
    assert all(site.rewritten for site in sites), [site.reason for site in sites if not site.rewritten]
    cross = [site for site in sites if site.module.endswith(("encoder_attn", "EncDecAttention"))]
    assert {site.phase for site in cross} == {"prefill", "read"}
    assert all("its query has other tokens than the write stores" in site.reason
               for site in cross if site.phase == "prefill")  # fmt: skip
    assert not packed.fallback_ops  # no step read an int4 cache dequantized


def _tiny_deepseek_v3(layers=2):
    config = transformers.DeepseekV3Config(
        **COMMON, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
        n_group=1, topk_group=1,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config).eval()


@torch.no_grad()
def test_mla_latent_cache_is_int4_and_attended_directly():
    """DeepSeek-V3 caches a compressed latent and projects K and V from it after the read; kv4's decode
    attends over the int4 latent instead, the projections absorbed into the query and the output."""
    torch._dynamo.reset()
    model = _tiny_deepseek_v3()
    ids = torch.randint(3, 256, (2, 80), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    backend, got = latent_decode(model, ids, cache)
    # the latent and the rope key
    assert (tuple(cache.layers[0].keys.shape), tuple(cache.layers[0].values.shape)) == ((2, 1, 83, 32), (2, 1, 83, 16))
    decode = [graph for graph in backend.graphs if graph.sites[0].phase == "latent"]
    assert decode and all(site.reason.startswith("attends over its int4 latent cache directly")
                          for graph in decode for site in graph.sites)  # fmt: skip
    for graph in decode:  # no latent projected to K and V: kv_b_proj's weight is read only to absorb it
        assert graph.after.count("kvpass_graph_ops_kv4_sdpa(") == 2
        assert "kv_b_proj_parameters_weight_, None)" not in graph.after

    # Both latents are stored with V's spec: nothing attends over them as keys.
    assert_latent_steps_match_twin(model, ids, got, backend.config.v)


@torch.no_grad()
def test_mla_at_a_second_batch_size_attends_as_at_the_first():
    # A second batch size makes Dynamo's batch a symbol, and with it the head count the projection's
    # view infers (-1). The absorbed attention once put that symbol into its graph as a raw value, and
    # the step failed when it ran. One layer, whose latents come from the embeddings alone: a second
    # layer's come from the first's attention, summed in another order than the twin's, and a latent
    # that close to a rounding boundary takes another code (3e-5 at batch 3).
    torch._dynamo.reset()
    model = _tiny_deepseek_v3(layers=1)
    for batch in (1, 3):
        ids = torch.randint(3, 256, (batch, 70), generator=torch.Generator().manual_seed(batch))
        cache = DynamicCache(config=model.config)
        backend, got = latent_decode(model, ids, cache)
    assert_latent_steps_match_twin(model, ids, got, backend.config.v)


@torch.no_grad()
def test_an_mla_layer_without_rope_keeps_its_channel_free_rotary_key_and_attends_over_its_latent():
    """Mistral Large 4's layers without RoPE cache a rotary key of 0 channels beside the latent: nothing to
    quantize, so it stays a plain tensor (packing it had raised), and the decode still attends over the
    int4 latent, its rotary scores all zero."""
    from kvpass.coverage import tiny_config

    torch._dynamo.reset()
    config = tiny_config("mistral_large4")
    assert config.text_config.no_rope_layers == [1, 0]  # layer 1 has no RoPE
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.MistralLarge4ForConditionalGeneration(config).eval()
    ids = torch.randint(3, 200, (2, 80), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    backend, got = latent_decode(model, ids, cache)
    rotary = cache.layers[1].values
    assert type(rotary) is torch.Tensor and tuple(rotary.shape) == (2, 1, 83, 0)
    assert isinstance(cache.layers[1].keys, PackedKV)
    decode = [site for graph in backend.graphs for site in graph.sites if site.phase == "latent"]
    assert {site.index for site in decode} == {0, 1}
    assert all(site.reason.startswith("attends over its int4 latent cache directly") for site in decode)
    assert_latent_steps_match_twin(model, ids, got, backend.config.v)


@torch.no_grad()
def test_k_layer_bits_on_a_latent_cache_say_they_do_not_apply():
    torch._dynamo.reset()
    model = _tiny_deepseek_v3()
    backend = kvpass.kv4(k_layer_bits={1: 8})
    step = torch.compile(model, backend=backend)
    cache = DynamicCache(config=model.config)
    step(input_ids=torch.arange(3, 83)[None], **cache_arg(cache), use_cache=True)
    step(input_ids=torch.tensor([[5]]), **cache_arg(cache), use_cache=True)
    assert {t.spec.bits for layer in cache.layers for t in (layer.keys, layer.values)} == {4}
    latent = {site.module: site.reason for site in backend.graphs[-1].sites}
    assert latent["model.layers.1.self_attn"].endswith("so this layer's K bits do not apply")
    assert "K bits" not in latent["model.layers.0.self_attn"]


class _CacheReader(torch.nn.Module):
    """One cache layer read either by an unrecognised attention (einsum) or through a projection."""

    def __init__(self, projected: bool):
        super().__init__()
        self.proj = torch.nn.Linear(32, 32) if projected else None

    def forward(self, q, k, v, cache):
        k, v = cache.update(k, v, 0)
        if self.proj is not None:  # MLA-like: attention reads projections of the cache
            k, v = self.proj(k), self.proj(v)
        probs = torch.einsum("bhtd,bhsd->bhts", q, k).softmax(-1)
        return torch.einsum("bhts,bhsd->bhtd", probs, v)


@pytest.mark.parametrize("projected", [False, True], ids=["einsum-attention", "projected"])
@torch.no_grad()
def test_only_caches_read_through_projections_become_latent(projected):
    torch._dynamo.reset()
    module = _CacheReader(projected).eval()
    step = torch.compile(module, backend=kvpass.kv4())
    cache = DynamicCache()
    x = torch.randn(1, 2, 70, 32)
    step(x, x, x, cache)
    y = torch.randn(1, 2, 1, 32)
    got = step(y, y, y, cache)
    # An attention form the pass does not know keeps its cache fp16; a projected one is int4.
    assert isinstance(cache.layers[0].keys, PackedKV) == projected
    reference = DynamicCache()
    module(x, x, x, reference)
    if projected:
        spec = kvpass.kv4().config.v
        reference.layers[0].keys = PackedKV.from_float(reference.layers[0].keys, spec).dequantize()
        reference.layers[0].values = PackedKV.from_float(reference.layers[0].values, spec).dequantize()
    torch.testing.assert_close(got, module(y, y, y, reference), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_a_quantized_cache_the_user_chose_is_left_as_it_is(caplog):
    # QuantizedCache keeps its newest tokens in an fp residual: a sequence cat the step only stores, and
    # the next step reads beside its quanto tokens. Taken for a latent, it had been packed int4 (quantized
    # twice, the next step's reads dequantized outside the graph) while every site said it stayed fp16.
    from kvpass.models_zoo import build

    torch._dynamo.reset()
    model = build("llama")
    settings = dict(max_new_tokens=6, do_sample=False, cache_implementation="quantized", return_dict_in_generate=True,
                    cache_config={"backend": "quanto", "nbits": 4, "q_group_size": 16, "residual_length": 3})  # fmt: skip
    ids = torch.arange(3, 43)[None]
    expected = model.generate(ids, **settings)
    backend = kvpass.kv4()
    model.compile(backend=backend)
    with caplog.at_level(logging.WARNING, logger="kvpass"):
        got = model.generate(ids, **settings)
    assert torch.equal(got.sequences, expected.sequences)
    held = [t for layer in got.cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    assert held and not any(isinstance(t, PackedKV) for t in held)
    assert "no int4 implementation" not in caplog.text
    sites = [site for graph in backend.graphs for site in graph.sites]
    assert sites and not any(site.rewritten for site in sites)
    # A decode step's site says why: its K joins the quanto tokens, the residual and the new ones.
    assert any(re.search(r"it is \w+ = cat\(\w+, \w+, \w+\)$", site.reason) for site in sites)


def _gemma2(**attention):
    from kvpass.models_zoo import build

    model = build("gemma2")  # eager attention: scores * self.scaling, soft-capped by attn_logit_softcapping
    for layer in model.model.layers:
        for name, value in attention.items():
            setattr(layer.self_attn, name, value)
    return model


def _bloom(heads):
    config = transformers.BloomConfig(**COMMON, hidden_size=64, n_layer=2, n_head=heads)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize(
    "first, second, unspecialised",
    [
        (_gemma2, lambda: _gemma2(scaling=0.5), "self_attn_scaling.item()"),
        (_gemma2, lambda: _gemma2(attn_logit_softcapping=20.0), "self_attn_attn_logit_softcapping.item()"),
        (lambda: _bloom(4), lambda: _bloom(2), "inv_norm_factor.item()"),  # baddbmm's alpha: 1 / sqrt(head_dim)
    ],
    ids=["scale", "softcap", "baddbmm-alpha"],
)
@torch.no_grad()
def test_a_second_model_whose_constants_dynamo_stops_specialising_is_rewritten(first, second, unspecialised):
    """Two models of one architecture whose attention constants differ (another head_dim), compiled
    in one process: Dynamo passes the second one's floats in as tensors and reads them with
    ``.item()``. The fused op then gets the query scaled by the scale and the soft-cap as given."""
    torch._dynamo.reset()
    ids = torch.randint(3, 200, (2, 20), generator=torch.Generator().manual_seed(0))
    earlier = first()
    torch.compile(earlier, backend=kvpass.kv4())(input_ids=ids, **cache_arg(DynamicCache(config=earlier.config)))
    model = second()
    backend = kvpass.kv4()
    step = torch.compile(model, backend=backend)
    cache = DynamicCache(config=model.config)
    step(input_ids=ids, **cache_arg(cache), use_cache=True)
    got = step(input_ids=ids[:, :1], **cache_arg(cache), use_cache=True).logits
    assert all(unspecialised in graph.before for graph in backend.graphs)  # the case this test is for
    sites = [site for graph in backend.graphs for site in graph.sites]
    assert sites and all(site.rewritten for site in sites), [site.reason for site in sites]

    reference = SimulatedKVCache(model.config, backend.config.k, backend.config.v)
    with observed_queries():
        model(input_ids=ids, **cache_arg(reference), use_cache=True)
        expected = model(input_ids=ids[:, :1], **cache_arg(reference), use_cache=True).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["hy_v4", "deepseek_v32"])  # a sink; an indexer's bool mask
@torch.no_grad()
def test_mla_absorbed_attention_gives_the_expanded_attentions_logits(model_type, monkeypatch):
    """Attending over the latent reorders sums, nothing else: the logits of K and V expanded from the same
    int4 latents, step by step. hy_v4's sink enters as one more zero token, deepseek_v32's sparse
    indexer as a bool mask, and its dynamic-length graphs read the length off K."""
    from kvpass import passes
    from kvpass.coverage import tiny_config

    def generate():
        torch._dynamo.reset()
        passes.counters.clear()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(tiny_config(model_type)).eval()
        model.compile(backend=kvpass.kv4())
        ids = torch.randint(3, model.config.vocab_size, (1, 70), generator=torch.Generator().manual_seed(0))
        out = model.generate(ids, max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
        return out, passes.counters["absorbed_latent_site"], passes.counters["sdpa_latent_site"] + passes.counters[
            "eager_latent_site"]  # fmt: skip

    absorbed, count, latent_sites = generate()
    assert count == latent_sites > 0  # every decode graph's sites: a static-length one, a dynamic-length one
    monkeypatch.setattr(passes, "_absorb_site", lambda *args: None)
    expanded, count, _ = generate()
    assert count == 0
    assert torch.equal(absorbed.sequences, expanded.sequences)
    torch.testing.assert_close(torch.stack(absorbed.scores), torch.stack(expanded.scores), atol=1e-5, rtol=1e-5)


class _ProjectedSdpa(torch.nn.Module):
    """SDPA over K and V projected from a cache layer, not in MLA's form (no split, no K filled by copies)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(32, 32)

    def forward(self, q, k, v, cache):
        k, v = cache.update(k, v, 0)
        return torch.nn.functional.scaled_dot_product_attention(q, self.proj(k), self.proj(v))


@torch.no_grad()
def test_projections_not_in_mlas_form_keep_them_and_say_why(caplog):
    torch._dynamo.reset()
    module = _ProjectedSdpa().eval()
    step = torch.compile(module, backend=kvpass.kv4())
    cache = DynamicCache()
    x, y = torch.randn(1, 2, 70, 32), torch.randn(1, 2, 1, 32)
    step(x, x, x, cache)
    with caplog.at_level(logging.DEBUG, logger="kvpass"):
        got = step(y, y, y, cache)
    assert "expands K and V from its latent each step: V is not the second part of a split" in caplog.text
    assert isinstance(cache.layers[0].keys, PackedKV)
    reference = DynamicCache()
    module(x, x, x, reference)
    spec = kvpass.kv4().config.v
    for name in ("keys", "values"):
        setattr(reference.layers[0], name, PackedKV.from_float(getattr(reference.layers[0], name), spec).dequantize())
    torch.testing.assert_close(got, module(y, y, y, reference), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", ["flint", "xglm"])  # a query cast after the update; split into heads after it
@torch.no_grad()
def test_a_query_cast_or_split_after_the_cache_update_gives_k_its_query_scales(model_type):
    """The views and casts that make the attention's query after the cache update move before it, so the
    K write takes query scales and query rounding (heads of 32 channels: K's spec with its extras)."""
    from kvpass.coverage import tiny_config

    torch._dynamo.reset()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(model_type)).eval()
    backend = kvpass.kv4()
    if model_type == "flint":  # its attention goes through AttentionInterface, so the twin sees its queries
        got, expected, cache = _decode_with_kv4_and_twin(model, backend)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    else:
        cache = DynamicCache(config=model.config)
        ids = torch.randint(3, 256, (1, 70), generator=torch.Generator().manual_seed(0))
        torch.compile(model, backend=backend)(input_ids=ids, **cache_arg(cache), use_cache=True)
    assert all(layer.keys.query_scales is not None for layer in cache.layers)
    reasons = [site.reason for graph in backend.graphs for site in graph.sites]
    assert reasons and not any("query is computed after the cache update" in reason for reason in reasons), reasons
