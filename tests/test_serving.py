"""What serving does with a cache: padded batches, beam search, cropping, fresh prompts.

Each generation with kv4 must give the tokens of the eager model whose cache hands
attention the same quantized past (SimulatedKVCache): kv4 is exact with respect to its
own numerics, so any difference is a bug, not quantization noise.
"""

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import DynamicCache

import kvpass
from kvpass import passes
from kvpass.cache_argument import cache_arg, returned_cache
from kvpass.config import QuantSpec
from kvpass.models_zoo import build
from kvpass.packed import PackedKV
from kvpass.simulate import FpTokens, SimulatedKVCache, observed_queries
from tests.helpers import kv_heavy_llama


def _prompt(batch, length, seed=0):
    return torch.randint(2, 200, (batch, length), generator=torch.Generator().manual_seed(seed))


def _simulated(model):
    config = kvpass.kv4().config
    return SimulatedKVCache(model.config, config.k, config.v)


@pytest.fixture
def compiled_llama():
    torch._dynamo.reset()
    model = build("llama")
    model.compile(backend="kv4")
    return model


def test_left_padded_batch():
    torch._dynamo.reset()
    model = build("llama")
    ids = _prompt(3, 40)
    mask = torch.ones_like(ids)
    mask[0, :9], mask[2, :3] = 0, 0
    ids[mask == 0] = 0
    expected = model.generate(
        ids, attention_mask=mask, max_new_tokens=12, do_sample=False, **cache_arg(_simulated(model))
    )
    model.compile(backend="kv4")
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    assert isinstance(returned_cache(out).layers[0].keys, PackedKV)
    assert torch.equal(out.sequences, expected)


@torch.no_grad()
def test_a_long_left_padding_decodes_as_the_twin_does():
    """With heads wide enough for K's query scales: a row padded by more than K's first 68 tokens. The
    site hands kv4 the mask with the query, and the padded row's offset and query scales come from its
    own 20 tokens, as the twin takes them from the mask its attention gets. Taken over the pads
    (identical keys), its scales were 0/0 and the row decoded NaN logits."""
    torch._dynamo.reset()
    model = kv_heavy_llama(layers=2)
    ids, mask = _prompt(2, 100), torch.ones(2, 100, dtype=torch.long)
    mask[1, :80] = 0
    ids[mask == 0] = 0
    position_ids = (mask.cumsum(-1) - 1).masked_fill_(mask == 0, 1)  # as generate places pads
    nxt, inputs = _prompt(2, 1, seed=1), dict(attention_mask=mask, position_ids=position_ids, use_cache=True)
    step_mask, step_positions = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1), position_ids[:, -1:] + 1
    cache, config = DynamicCache(), kvpass.kv4().config
    step = torch.compile(model, backend="kv4")
    step(input_ids=ids, **cache_arg(cache), **inputs)
    got = step(input_ids=nxt, **cache_arg(cache), attention_mask=step_mask, position_ids=step_positions).logits
    for layer in cache.layers:
        scales = layer.keys.query_scales
        assert isinstance(layer.keys, PackedKV) and scales.isfinite().all() and scales.ne(1).any(-1).all()
        # The padded row's first tokens are copied into its first pads, so K's sinks are its own.
        assert layer.keys.filled_pads.tolist() == layer.values.filled_pads.tolist() == [[0, 4], [80, 4]]
    reference = SimulatedKVCache(model.config, config.k, config.v)
    with observed_queries():
        model(input_ids=ids, **cache_arg(reference), **inputs)
        expected = model(input_ids=nxt, **cache_arg(reference), attention_mask=step_mask,
                         position_ids=step_positions).logits
    assert got.isfinite().all()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@torch.no_grad()
def test_a_left_padded_batch_of_sliding_and_full_layers_generates_as_the_twin_does():
    """Gemma 3 alternates sliding-window layers and full-attention ones; in both a padded row's first
    tokens are copied into its first pads (K's sinks its own), and a sliding layer's eviction drops
    the copies one step at a time, the tokens then read from their own slots. A 28-token prompt under
    the 32-token window, so the copies leave while generating; K waits for its prefix (64 tokens),
    which the full layers reach. The twin stores and reads both as kv4 does."""
    torch._dynamo.reset()
    model = build("gemma3")
    ids, mask = _prompt(2, 28), torch.ones(2, 28, dtype=torch.long)
    mask[1, :12] = 0
    ids[mask == 0] = 0
    settings = dict(attention_mask=mask, max_new_tokens=50, do_sample=False, return_dict_in_generate=True,
                    output_logits=True)  # fmt: skip
    with observed_queries():
        expected = model.generate(ids, **cache_arg(_simulated(model)), **settings)
    model.compile(backend="kv4")
    out = model.generate(ids, **settings)
    sliding, full = returned_cache(out).layers[:2]
    assert full.keys.filled_pads.tolist() == full.values.filled_pads.tolist() == [[0, 4], [12, 4]]
    assert sliding.keys.filled_pads.tolist() == sliding.values.filled_pads.tolist() == [[0, 0], [12, 0]]
    assert full.keys.n_head == 4 and isinstance(sliding.values, PackedKV)
    assert torch.equal(out.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(expected.logits), rtol=0, atol=1e-5)


@torch.no_grad()
def test_a_chunked_prefill_generates_as_the_twin_does():
    """generate's ``prefill_chunk_size`` feeds the prompt through the cache in chunks (the way to a lower
    peak, docs/bench-memory.md): chunks of 70 tokens, so K's codes are rounded against each chunk's
    queries and its sinks, offset and query scales come from the first; the last chunk is 10 tokens.
    Heads of 64 channels, wide enough for every extra of K's spec. One layer: a second layer's keys come
    from the first's attention, which kv4 and the twin sum in other orders, and a key that close to a
    rounding boundary takes another code (2e-5 in the logits on an AMD EPYC, none on an Intel VM)."""
    torch._dynamo.reset()
    model = kv_heavy_llama(layers=1)
    ids = _prompt(1, 150)
    settings = dict(max_new_tokens=10, do_sample=False, prefill_chunk_size=70, return_dict_in_generate=True,
                    output_logits=True)  # fmt: skip
    with observed_queries():
        expected = model.generate(ids, **cache_arg(_simulated(model)), **settings)
    model.compile(backend="kv4")
    out = model.generate(ids, **settings)
    keys = returned_cache(out).layers[0].keys
    assert isinstance(keys, PackedKV) and keys.shape[2] == 159 and keys.n_head == 4 and keys.spec.query_rounded
    assert torch.equal(out.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(expected.logits), rtol=0, atol=1e-5)


def test_beam_search_reorders_the_packed_cache():
    torch._dynamo.reset()
    model = build("llama")
    ids = _prompt(1, 30)
    expected = model.generate(ids, num_beams=3, max_new_tokens=10, do_sample=False, **cache_arg(_simulated(model)))
    model.compile(backend="kv4")
    out = model.generate(ids, num_beams=3, max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
    assert returned_cache(out).layers[0].keys.shape[0] == 3
    assert isinstance(returned_cache(out).layers[0].keys, PackedKV)
    assert torch.equal(out.sequences, expected)


def test_kivi_residual_group_boundary_crossed_during_generation():
    """K per-channel groups of 64: the residual fills and flushes while generating."""
    torch._dynamo.reset()
    model = build("llama")
    backend = kvpass.kv4(k_scheme="channel", k_group=64, k_rotate=False)
    ids = _prompt(1, 56)
    expected = model.generate(
        ids, max_new_tokens=12, do_sample=False,
        **cache_arg(SimulatedKVCache(model.config, backend.config.k, backend.config.v)),
    )  # fmt: skip
    model.compile(backend=backend)
    out = model.generate(ids, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    keys = returned_cache(out).layers[0].keys
    assert keys.codes.shape[2] == 64 and keys.residual.shape[2] == 67 - 64
    assert torch.equal(out.sequences, expected)


def test_assisted_decoding_crops_the_packed_cache():
    torch._dynamo.reset()
    model, draft = build("llama"), build("llama", seed=1)
    ids = _prompt(1, 30)
    expected = model.generate(ids, max_new_tokens=12, do_sample=False, **cache_arg(_simulated(model)))
    model.compile(backend="kv4")
    counters.clear()
    out = model.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=draft)
    assert torch.equal(out, expected)
    # Crops change the cache length by the accepted-token count every step; one dynamic
    # graph must serve them all (a graph per length would hit Dynamo's recompile limit).
    assert counters["stats"]["unique_graphs"] <= 4


def test_prompt_lookup_on_sliding_layers_reads_their_window_of_the_packed_cache():
    """Prompt lookup and assisted decoding make a sliding layer keep its past until generate crops it, and
    attend over the newest window of it: after each crop the whole cache and the new tokens. kv4 reads
    that window of the packed cache (the three calls apart: the appends store all of it); those layers
    had stayed fp16."""
    torch._dynamo.reset()
    model = build("mistral")  # every layer sliding, a window of 32
    ids = torch.randint(2, 60, (1, 70), generator=torch.Generator().manual_seed(0))  # repeats, for lookups to hit
    with observed_queries():
        expected = model.generate(ids, max_new_tokens=30, do_sample=False, prompt_lookup_num_tokens=3,
                                  **cache_arg(_simulated(model)))  # fmt: skip
    backend = kvpass.kv4()
    model.compile(backend=backend)
    apart_before = passes.counters["decode_appends_apart"]
    out = model.generate(ids, max_new_tokens=30, do_sample=False, prompt_lookup_num_tokens=3,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert all(isinstance(layer.keys, PackedKV) and isinstance(layer.values, PackedKV)
               for layer in returned_cache(out).layers)  # fmt: skip
    assert not [site.reason for graph in backend.graphs for site in graph.sites if site.left_fp16]
    assert passes.counters["decode_appends_apart"] > apart_before


def test_new_prompt_on_the_same_compiled_model_starts_clean(compiled_llama):
    long_prompt, short_prompt = _prompt(1, 70), _prompt(1, 20, seed=3)
    first = compiled_llama.generate(long_prompt, max_new_tokens=6, do_sample=False)
    compiled_llama.generate(short_prompt, max_new_tokens=6, do_sample=False)
    again = compiled_llama.generate(long_prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(first, again)


def test_fp_window_decode_matches_its_simulation_across_flushes():
    torch._dynamo.reset()
    model = kv_heavy_llama()
    spec = QuantSpec(4, "token", 32, rotate=True, window=64, clip=True)
    sim = SimulatedKVCache(model.config, spec, spec, FpTokens(window=64, flush=64))
    step = torch.compile(model, backend=kvpass.kv4(window=64, k_group=32, v_group=32))
    cache, ids = DynamicCache(), _prompt(1, 150)
    with torch.no_grad():
        ref, out = model(ids, **cache_arg(sim), use_cache=True), step(input_ids=ids, **cache_arg(cache))
        residuals = set()
        for _ in range(70):  # 150 -> 220 tokens: the window flushes 64 tokens on the way
            tok = ref.logits[:, -1:].argmax(-1)
            ref, out = model(tok, **cache_arg(sim)), step(input_ids=tok, **cache_arg(cache))
            torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=1e-5)
            residuals.add(cache.layers[0].keys.residual.shape[2])
    torch._dynamo.reset()
    assert min(residuals) >= 64 and max(residuals) <= 127 and len(residuals) > 60
