"""Every models_zoo family through the kv4 backend: sites, stored bytes, logits, generation."""

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

import kvpass
from kvpass.cache_argument import cache_arg, returned_cache
from kvpass.models_zoo import ZOO, build
from kvpass.packed import PackedKV
from kvpass.simulate import SimulatedKVCache, observed_queries

# MLA: the cache holds the compressed latent; K and V are projected from it after the cache
# read, so the latent is stored int4 and read dequantized ("latent" sites).
LATENT = {"deepseek_v3"}
# Families that need eager attention (no SDPA path in transformers).
EAGER_ONLY = {"gemma2", "gpt_neo", "gpt_oss"}


def _attention_layers(cache):
    return [layer for layer in cache.layers if isinstance(layer, DynamicLayer)]


@pytest.mark.parametrize("name", sorted(ZOO))
@torch.no_grad()
def test_family_compiles_rewrites_and_matches_reference(name):
    torch._dynamo.reset()
    model = build(name)
    config = kvpass.kv4().config
    ids = torch.randint(2, 200, (2, 70), generator=torch.Generator().manual_seed(0))
    nxt = torch.randint(2, 200, (2, 1), generator=torch.Generator().manual_seed(1))

    backend = kvpass.kv4()
    step = torch.compile(model, backend=backend)
    cache = DynamicCache(config=model.config)
    step(input_ids=ids, **cache_arg(cache), use_cache=True)
    got = step(input_ids=nxt, **cache_arg(cache), use_cache=True).logits
    sites = [site for graph in backend.graphs for site in graph.sites]
    assert sites, "no attention site found"

    assert all(site.rewritten for site in sites), [site.reason for site in sites if not site.rewritten]
    assert ("latent" in {site.phase for site in sites}) == (name in LATENT)
    if name in EAGER_ONLY:
        assert {site.form for site in sites} == {"eager"}
    layers = _attention_layers(cache)
    assert layers and all(isinstance(t, PackedKV) for layer in layers for t in (layer.keys, layer.values))

    # A latent cache is stored with V's spec: nothing attends over it as keys.
    reference = SimulatedKVCache(model.config, config.v if name in LATENT else config.k, config.v)
    with observed_queries():
        model(input_ids=ids, **cache_arg(reference), use_cache=True)
        expected = model(input_ids=nxt, **cache_arg(reference), use_cache=True).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama", "gpt2", "mistral", "qwen2", "gemma"])
def test_issue_families_generate_with_model_compile(name):
    torch._dynamo.reset()
    model = build(name)
    model.compile(backend="kv4")
    ids = torch.randint(2, 200, (1, 40), generator=torch.Generator().manual_seed(0))
    out = model.generate(ids, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    assert out.sequences.shape == (1, 48)
    assert all(isinstance(layer.keys, PackedKV) for layer in _attention_layers(returned_cache(out)))


# kv4 and the simulation round differently only at the model dtype's precision: bf16 keeps
# 8 mantissa bits (logits ~1, so ~4e-3 per rounding), fp16 11 bits.
HALF_TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@torch.no_grad()
def test_half_precision_model_matches_reference(dtype):
    torch._dynamo.reset()
    model = build("llama_hd128", dtype=dtype)
    ids = torch.randint(2, 200, (2, 70), generator=torch.Generator().manual_seed(0))
    nxt = ids[:, :1]
    backend = kvpass.kv4()
    step = torch.compile(model, backend=backend)
    cache = DynamicCache()
    step(input_ids=ids, **cache_arg(cache), use_cache=True)
    got = step(input_ids=nxt, **cache_arg(cache), use_cache=True).logits.float()
    assert cache.layers[0].keys.dtype == dtype and cache.layers[0].keys.residual.dtype == dtype

    reference = SimulatedKVCache(model.config, backend.config.k, backend.config.v)
    with observed_queries():
        model(input_ids=ids, **cache_arg(reference), use_cache=True)
        expected = model(input_ids=nxt, **cache_arg(reference), use_cache=True).logits.float()
    unquantized = DynamicCache()
    model(input_ids=ids, **cache_arg(unquantized), use_cache=True)
    fp = model(input_ids=nxt, **cache_arg(unquantized), use_cache=True).logits.float()

    tolerance = HALF_TOLERANCE[dtype]
    assert (got - expected).abs().max() <= tolerance
    assert (got - fp).abs().max() > 2 * tolerance  # quantization shows above the rounding noise
