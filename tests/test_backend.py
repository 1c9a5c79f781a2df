"""The kv4 backend end to end on unmodified HF models."""

import copy
import dataclasses
import logging
import re
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from transformers import DynamicCache

import kvpass
from kvpass import debug, packed, passes, reference
from kvpass.cache_argument import cache_arg, returned_cache
from kvpass.config import KVConfig, QuantSpec
from kvpass.models_zoo import build
from kvpass.packed import PackedKV
from kvpass.simulate import SimulatedKVCache, observed_queries
from tests.helpers import (cache_tensors, greedy_forward_loop, kv_heavy_llama, packed_and_fp16_bytes, same_stored_bits,
                           sliding_mistral)


def _ids(n, batch=1, seed=0):
    return torch.randint(2, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def test_generate_stores_every_layer_packed_in_under_030_of_fp16():
    torch._dynamo.reset()
    model = kv_heavy_llama()
    backend = kvpass.kv4()
    model.compile(backend=backend)
    out = model.generate(_ids(200), max_new_tokens=120, do_sample=False, return_dict_in_generate=True)
    cache = returned_cache(out)
    assert cache.get_seq_length() == 319  # the last generated token is never written back
    stored, fp16 = packed_and_fp16_bytes(cache)
    assert stored <= 0.30 * fp16, f"stored {stored} bytes = {stored / fp16:.3f} of fp16"
    assert all(site.rewritten for g in backend.graphs for site in g.sites)
    phases = [site.phase for g in backend.graphs for site in g.sites]
    assert "prefill" in phases and "decode" in phases


@pytest.mark.parametrize(
    "head_dim, kv_heads, ratio, note",
    [(8, 2, 0.3125, "one fp16 scale per 16 values (whole heads)"), (16, 2, 0.3125, "one fp16 scale per 16 values"),
     (8, 1, 0.3125, "one 8-bit scale per 8 values (whole heads)"), (32, 2, None, None)],
)  # fmt: skip
def test_small_heads_store_plain_groups_and_say_so(head_dim, kv_heads, ratio, note):
    # A 70-token prompt takes sinks and an offset where the head is wide enough to pay for them.
    torch._dynamo.reset()
    model = kv_heavy_llama(head_dim=head_dim, kv_heads=kv_heads)
    backend = kvpass.kv4()
    model.compile(backend=backend)
    out = model.generate(_ids(70), max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    stored, fp16 = packed_and_fp16_bytes(returned_cache(out))
    notes = [site.reason for g in backend.graphs for site in g.sites]
    if ratio is None:
        assert any(t.n_head for t in cache_tensors(returned_cache(out)))
        assert not any("no bytes" in note for note in notes)
    else:
        # int4 codes and an fp16 scale per 16 values (at head_dim 8, one token's channels in both KV
        # heads) or, with one KV head of 8, an 8-bit scale per 8 values; nothing else: 5 bits of 16.
        assert stored == ratio * fp16
        assert all(f"K and V head_dim {head_dim}: {note} leaves no bytes" in reason for reason in notes)


@pytest.mark.parametrize(
    "k_spec, v_spec",
    [
        (QuantSpec(4, "channel", 64), QuantSpec(4, "token", 128)),
        (QuantSpec(4, "token", 64, rotate=True), QuantSpec(4, "token", 64, rotate=True)),
        (QuantSpec(4, "channel", 64, symmetric=False), QuantSpec(4, "token", 64, rotate=True, symmetric=False)),
        (QuantSpec(4, "channel", 64, rotate=True), QuantSpec(4, "token", 64, rotate=True)),
        (KVConfig().k, KVConfig().v),
        (QuantSpec(4, "token", 64, rotate=True, clip=True, refine=64),) * 2,
        (dataclasses.replace(KVConfig().k, query_scaled=False), KVConfig().v),
        (dataclasses.replace(KVConfig().k, query_rounded=True), KVConfig().v),
    ],
    ids=["kivi", "rotated", "asym", "kivi-rotated", "default", "refined", "previous-default", "query-rounded"],
)
@torch.no_grad()
def test_first_decode_logits_equal_eager_model_with_same_quantizer(k_spec, v_spec):
    """The rewrite is exact with respect to the spec: same numbers as an eager model whose
    cache hands attention ``quantize_dequantize(past)`` followed by the exact new token."""
    torch._dynamo.reset()
    model = kv_heavy_llama()
    ids, nxt = _ids(100, batch=2), _ids(1, batch=2, seed=1)

    reference = SimulatedKVCache(model.config, k_spec, v_spec)
    with observed_queries():
        model(input_ids=ids, **cache_arg(reference), use_cache=True)
        expected = model(input_ids=nxt, **cache_arg(reference), use_cache=True).logits

    unquantized = DynamicCache()
    model(input_ids=ids, **cache_arg(unquantized), use_cache=True)
    fp_logits = model(input_ids=nxt, **cache_arg(unquantized), use_cache=True).logits

    backend = kvpass.kv4(
        k_scheme=k_spec.scheme, k_group=k_spec.group, k_rotate=k_spec.rotate, k_symmetric=k_spec.symmetric,
        v_scheme=v_spec.scheme, v_group=v_spec.group, v_rotate=v_spec.rotate, v_symmetric=v_spec.symmetric,
        clip=k_spec.clip, refine=k_spec.refine, k_sinks=k_spec.sinks, k_center=k_spec.center,
        k_query_scaled=k_spec.query_scaled, k_query_rounded=k_spec.query_rounded,
    )  # fmt: skip
    assert backend.config.k == k_spec and backend.config.v == v_spec
    step = torch.compile(model, backend=backend)
    cache = DynamicCache()
    step(input_ids=ids, **cache_arg(cache), use_cache=True)
    assert isinstance(cache.layers[0].keys, PackedKV)
    got = step(input_ids=nxt, **cache_arg(cache), use_cache=True).logits

    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    # and the check has teeth: quantization moved the logits measurably
    assert (got - fp_logits).abs().max() > 1e-3


@torch.no_grad()
def test_keys_rounded_from_n_tokens_are_read_as_their_twin_reads_them_after_short_and_long_appends():
    """``k_query_rounded=4``: a prompt and a 4-token append rounded against their queries, a 2-token
    append and decode steps to nearest; the twin, told the same, reads every step's past as kv4 does."""
    torch._dynamo.reset()
    model = kv_heavy_llama()
    k_spec = dataclasses.replace(KVConfig().k, query_rounded=4)
    appends = [_ids(100, batch=2), *(_ids(n, batch=2, seed=n) for n in (2, 4, 1, 1))]
    twin = SimulatedKVCache(model.config, k_spec, KVConfig().v)
    with observed_queries():
        expected = [model(input_ids=ids, **cache_arg(twin), use_cache=True).logits for ids in appends]
    backend = kvpass.kv4(k_query_rounded=4)
    assert backend.config.k == k_spec
    step, cache = torch.compile(model, backend=backend), DynamicCache()
    got = [step(input_ids=ids, **cache_arg(cache), use_cache=True).logits for ids in appends]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=2e-5, rtol=2e-5)
    assert all(layer.keys.spec.tag.endswith(":qr4") for layer in cache.layers)


@torch.no_grad()
def test_forward_loop_route_gives_the_same_tokens_as_generate_route():
    torch._dynamo.reset()
    ids = _ids(110)  # generating past 128 tokens: where the second plane stops growing
    model = kv_heavy_llama()
    loop_tokens, cache = greedy_forward_loop(torch.compile(model, backend="kv4"), ids, 20)
    assert isinstance(cache.layers[-1].values, PackedKV)

    torch._dynamo.reset()
    model = kv_heavy_llama()
    model.compile(backend="kv4")
    generated = model.generate(ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(loop_tokens, generated)


# Dynamo's own config.patch, not monkeypatch.setattr: the config module keeps its values outside its
# __dict__, so pytest 9.2's undo takes them for absent and deletes them, hiding them from later tests.
@torch._dynamo.config.patch(recompile_limit=4)
def test_varied_generate_calls_keep_compiling_past_dynamos_default_limit(caplog):
    # Prompts of 5, 40, 100 and 300 tokens (no sinks, one, four and an offset, K's second plane too)
    # and 30 new tokens compile more graphs than a limit of 4 (Dynamo's default of 8 too, before second
    # planes' lengths were unbacked); every step must still run in kv4 graphs, never eagerly on a
    # dequantized cache.
    torch._dynamo.reset()
    model = kv_heavy_llama(head_dim=128)
    backend = kvpass.kv4()
    model.compile(backend=backend)
    with caplog.at_level(logging.WARNING, logger="kvpass"):
        for n in (5, 40, 100, 300):
            model.generate(_ids(n), max_new_tokens=30, do_sample=False)
    assert len(backend.graphs) > 4
    assert "no int4 implementation" not in caplog.text and "recompile_limit" not in caplog.text
    assert torch._dynamo.config.recompile_limit == kvpass.backend.RECOMPILE_LIMIT


@pytest.fixture
def dynamo_default_recompile_limit():
    """Dynamo's default limit, for every thread that sets none, lowered from 8 to 2: four calls hold fewer
    graphs of one frame than 8 (benchmarks/varied_generates.py's twelve, each in a thread, reached it)."""
    limit = torch._dynamo.config._config["recompile_limit"]
    saved, limit.default = limit.default, 2
    yield
    limit.default = saved


def test_generate_calls_each_in_a_thread_of_their_own_keep_compiling(dynamo_default_recompile_limit, caplog):
    # Dynamo's settings are per thread: the limit kv4 raised in the thread that compiled did not reach a
    # request's thread (transformers' streaming recipe runs generate in one), which stopped compiling
    # the model once it held the default's count of graphs.
    torch._dynamo.reset()
    model = kv_heavy_llama(head_dim=128)
    backend = kvpass.kv4()
    model.compile(backend=backend)
    returned = []

    def generate(n):
        out = model.generate(_ids(n), max_new_tokens=30, do_sample=False, return_dict_in_generate=True)
        returned.append(returned_cache(out))

    with caplog.at_level(logging.WARNING, logger="kvpass"):
        for n in (5, 40, 100, 300):
            thread = threading.Thread(target=generate, args=(n,))
            thread.start()
            thread.join()
    assert len(returned) == 4 and all(isinstance(t, PackedKV) for cache in returned for t in cache_tensors(cache))
    assert len(backend.graphs) > 4 and "recompile_limit" not in caplog.text


@torch._dynamo.config.patch(recompile_limit=1)
def test_a_recompile_limit_still_hit_is_explained_in_kvpass_log(monkeypatch, caplog):
    # Past the limit Dynamo runs new shapes uncompiled, and caches those calls create stay fp16: the
    # user must hear it from kvpass, not only as Dynamo's generic warning.
    # A prompt then decode steps: two graphs, one more than the limit.
    monkeypatch.setattr(kvpass.backend, "RECOMPILE_LIMIT", 1)
    torch._dynamo.reset()
    model = kv_heavy_llama()
    model.compile(backend="kv4")
    with caplog.at_level(logging.WARNING, logger="kvpass"):
        model.generate(_ids(40), max_new_tokens=4, do_sample=False)
    assert "uncompiled" in caplog.text and "hit config.recompile_limit (1)" in caplog.text


def test_unsupported_site_is_left_unchanged_with_a_reason(caplog):
    torch._dynamo.reset()
    backend = kvpass.kv4()

    def attention_without_cache(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    def attention_with_dropout(q, k_past, k_new, v):
        k = torch.cat([k_past, k_new], dim=-2)
        vv = torch.cat([v, k_new], dim=-2)
        return torch.nn.functional.scaled_dot_product_attention(q, k, vv, dropout_p=0.5), k, vv

    q = torch.randn(1, 2, 3, 16)
    left_before = passes.counters["site_left_fp16"]
    with caplog.at_level(logging.INFO, logger="kvpass"):
        out = torch.compile(attention_without_cache, backend=backend)(q, q, q)
        torch.compile(attention_with_dropout, backend=backend)(q, q, q, q)
    torch.testing.assert_close(out, attention_without_cache(q, q, q))
    (plain, dropout) = backend.graphs
    assert plain.before == plain.after and dropout.before == dropout.after
    assert "does not come from a cache write" in plain.sites[0].reason
    assert plain.sites[0].reason in caplog.text
    assert dropout.sites[0].reason == "dropout_p=0.5 (only inference attention, dropout 0, is rewritten)"
    assert passes.counters["site_left_fp16"] == left_before + 2


def test_an_attention_over_a_window_of_a_cache_write_without_a_stored_token_stays_fp16_and_says_why():
    """A sliding layer that keeps its past until generate crops it attends over the newest window, which kv4
    reads from the packed cache where the window holds every new token and more (tests/test_serving.py);
    a window of the new tokens alone, or of some of them, is not that."""
    torch._dynamo.reset()
    backend = kvpass.kv4()

    def new_token_window(q, k_past, k_new, v_past, v_new):
        k, v = torch.cat([k_past, k_new], dim=-2), torch.cat([v_past, v_new], dim=-2)
        return torch.nn.functional.scaled_dot_product_attention(q, k[:, :, -1:], v[:, :, -1:]), k, v

    q, past, new = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 7, 16), torch.randn(1, 2, 1, 16)
    out, k, _ = torch.compile(new_token_window, backend=backend)(q, past, new, past, new)
    torch.testing.assert_close(out, new_token_window(q, past, new, past, new)[0], rtol=0, atol=0)
    assert type(k) is torch.Tensor
    ((site,),) = [graph.sites for graph in backend.graphs]
    assert site.left_fp16 and site.reason == (
        "K is the window k[:, :, -1:] of its cache write, which need not hold every new token and a stored one: kv4 "
        "attends over stored tokens and all new ones"
    )


@torch.no_grad()
def test_a_flex_attention_model_keeps_fp16_caches_and_says_why():
    """attn_implementation="flex_attention": no attention form read the prompt's cache writes, so they were
    packed as an MLA latent, and the next step's trace failed at flex_attention over a PackedKV."""
    torch._dynamo.reset()
    model = build("llama", attn_implementation="flex_attention")
    expected = model.generate(_ids(70), max_new_tokens=4, do_sample=False)
    backend = kvpass.kv4()
    model.compile(backend=backend)
    out = model.generate(_ids(70), max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert all(type(t) is torch.Tensor for t in cache_tensors(returned_cache(out)))
    with_sites = [graph for graph in backend.graphs if graph.sites]  # the prompt's graph, then decode steps'
    assert len(with_sites) >= 2 and all(len(graph.sites) == model.config.num_hidden_layers for graph in with_sites)
    sites = [site for graph in with_sites for site in graph.sites]
    assert all(site.form == "flex" and site.left_fp16 for site in sites)
    assert sites[0].reason.startswith("flex_attention (attn_implementation='flex_attention'): its score_mod and block")


def test_a_graph_break_between_cache_write_and_attention_leaves_both_fp16_and_says_so(caplog):
    """transformers' warning under output_attentions=True breaks every attention's graph after the cache
    update: the write's graph has no attention to rewrite, the attention's graph no write. Each says so,
    and the result is the eager one (nothing was quantized)."""
    torch._dynamo.reset()
    backend = kvpass.kv4()

    def write_then_attend(q, k_past, k_new, v_past, v_new):
        k, v = torch.cat([k_past, k_new], dim=-2), torch.cat([v_past, v_new], dim=-2)
        torch._dynamo.graph_break()
        return torch.nn.functional.scaled_dot_product_attention(q, k, v), k, v

    q, past, new = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 7, 16), torch.randn(1, 2, 1, 16)
    with caplog.at_level(logging.INFO, logger="kvpass"):
        out, k, _ = torch.compile(write_then_attend, backend=backend)(q, past, new, past, new)
    torch.testing.assert_close(out, write_then_attend(q, past, new, past, new)[0], rtol=0, atol=0)
    assert type(k) is torch.Tensor
    write, attention = backend.graphs
    assert write.sites == [] and write.before == write.after
    assert caplog.text.count("stays fp16: no attention in this graph reads it") == 2
    (site,) = attention.sites
    assert site.left_fp16 and "across a graph break say, stays fp16" in site.reason and site.reason in caplog.text


@torch.no_grad()
def test_an_mla_latent_expanded_before_a_graph_break_is_int4_and_its_attention_says_it_may_be(caplog):
    """GLM-5-next's indexer breaks the graph of each layer that runs it, between the latent's write and
    the attention: the write's graph stores the latent int4 and expands K and V from it, the attention's
    graph takes them in. Its site had said the cache stays fp16 (a WARNING, "keeps the caches ... fp16")."""
    from tests.helpers import glm5_next_dsa

    torch._dynamo.reset()
    model, backend = glm5_next_dsa(), kvpass.kv4()
    cache = DynamicCache(config=model.config)
    with caplog.at_level(logging.INFO, logger="kvpass"):
        torch.compile(model, backend=backend)(input_ids=torch.randint(3, 200, (1, 70)), **cache_arg(cache),
                                              use_cache=True)
    assert all(isinstance(layer.keys, PackedKV) for layer in cache.layers)
    left = [site for graph in backend.graphs for site in graph.sites if site.left_fp16]
    assert len(left) == 1 and "unless that graph expands K and V from it there as an MLA latent" in left[0].reason
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert re.match(r"kvpass: graph_\d+ leaves 1 of its 1 attention sites fp16; site 0 \(\?\): K does not", warning)


@torch.no_grad()
def test_a_model_under_autocast_generates_with_int4_caches():
    """CPU autocast in bf16 around a kv4 model: the caches are int4 and no step reads them dequantized (a
    first append under autocast raised; tests/test_packed.py checks that autocast changes none of kv4's numbers)."""
    torch._dynamo.reset()
    model = kv_heavy_llama()
    model.compile(backend="kv4")
    ids = torch.randint(0, model.config.vocab_size, (1, 70), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert out.sequences.shape[1] == 74
    assert all(isinstance(t, PackedKV) for t in cache_tensors(returned_cache(out)))
    assert not packed.fallback_ops


def test_an_attention_over_no_cache_is_no_site_left_fp16(caplog):
    """Inkling2 attends over its layers' outputs, per token: K and V descend from nothing a cache could
    hold, so no cache write is missed there, and the site says so rather than "left fp16"; so does a ViT's
    over its patches, a convolution of a 4-D input. K computed from a 4-D input otherwise, or from a cache
    write through an op that is no view, keeps the cache's reason."""
    torch._dynamo.reset()
    backend = kvpass.kv4()
    weights = torch.randn(3, 16, 16)

    def over_layer_outputs(x):  # x [B, S, 16]; attends over three "layers" of each token
        blocks = torch.stack([torch.tanh(x @ w) for w in weights], -2)  # [B, S, 3, 16]
        k = torch.nn.functional.rms_norm(blocks, (16,))
        return torch.nn.functional.scaled_dot_product_attention(x[:, :, None], k, k)

    def over_image_patches(pixels):  # a ViT: a 4-D input, made patches by a convolution
        patches = torch.conv2d(pixels, torch.ones(16, 3, 4, 4), stride=4).flatten(2).transpose(1, 2)[:, None]
        return torch.nn.functional.scaled_dot_product_attention(patches, patches, patches)

    def over_an_input(q, k_in):
        return torch.nn.functional.scaled_dot_product_attention(q, k_in * 2, k_in)

    def over_a_cache_write_scaled(q, k_past, k_new):
        k = torch.cat([k_past, k_new], dim=-2)
        return torch.nn.functional.scaled_dot_product_attention(q, k * 2, k), k

    x, q = torch.randn(2, 5, 16), torch.randn(1, 2, 3, 16)
    without_before, left_before = passes.counters["site_without_cache"], passes.counters["site_left_fp16"]
    with caplog.at_level(logging.INFO, logger="kvpass"):
        torch.compile(over_layer_outputs, backend=backend)(x)
        torch.compile(over_image_patches, backend=backend)(torch.randn(1, 3, 8, 8))
        torch.compile(over_an_input, backend=backend)(q, q)
        torch.compile(over_a_cache_write_scaled, backend=backend)(q, q, q)
    (no_cache,), (patches,), (an_input,), (scaled,) = (graph.sites for graph in backend.graphs)
    for site in (no_cache, patches):
        assert site.phase == passes.NO_CACHE and not site.rewritten and not site.left_fp16
        assert site.reason.startswith("reads no KV cache") and site.reason not in caplog.text
    assert "none" in debug.site_table([no_cache]).splitlines()[1].split()
    for site in (an_input, scaled):
        assert site.left_fp16 and "does not come from a cache write" in site.reason and site.reason in caplog.text
    assert passes.counters["site_without_cache"] == without_before + 2
    assert passes.counters["site_left_fp16"] == left_before + 2


def test_backend_string_works_in_a_process_that_never_imports_kvpass():
    script = textwrap.dedent(
        """
        import sys, torch
        from transformers import AutoModelForCausalLM, LlamaConfig
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, eos_token_id=None)
        model = AutoModelForCausalLM.from_config(cfg).eval()
        model.compile(backend="kv4")
        out = model.generate(torch.ones(1, 8, dtype=torch.long), max_new_tokens=3, do_sample=False,
                             return_dict_in_generate=True)
        assert "kvpass" in sys.modules  # loaded by Dynamo through the entry point, not by us
        cache = out.cache if hasattr(out, "cache") else out.past_key_values  # older releases name it so
        print(type(cache.layers[0].keys).__name__)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "PackedKV"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"bits": 5}, r"bits must be one of \[2, 4, 8\], got 5"),
        ({"k_scheme": "head"}, r"scheme must be one of \['channel', 'token'\], got 'head'"),
        # QuantSpec's message names its field (group); which cache's, K or V, is said before it
        ({"v_group": 100}, "^V spec: group must be a power of two >= 2, got 100$"),
        ({"k_group": 48}, "^K spec: group must be a power of two >= 2, got 48$"),
        ({"inner": "cudagraphs"}, r"inner must be one of \['eager', 'aot_eager', 'inductor'\], got 'cudagraphs'"),
        ({"v_scheme": "channel"}, "v_scheme='channel' is not supported"),
        ({"symmetric": "no"}, "symmetric must be True or False, got 'no'"),
        ({"symmetric": False, "clip": True}, "clip=True needs symmetric=True"),
        ({"clip": "mse"}, "clip must be True or False, got 'mse'"),
        ({"refine": -1}, "refine must be an int >= 0"),
        ({"window": 64, "refine": 8}, "refine=8 needs scheme='token' and window=0"),
        # equal to an accepted value, but not of its type: bits=4.0 failed at the first compile, on the spec's tag
        ({"bits": 4.0}, r"bits must be one of \[2, 4, 8\], got 4.0"),
        ({"k_sinks": True}, "sinks must be an int >= 0 .*, got True"),
        ({"debug": "yes"}, "debug must be True or False, got 'yes'"),
        ({"k_layer_bits": [(3, 8)]},
         r"k_layer_bits must be a dict of layer index to K bits \(\{11: 8\}\), got \[\(3, 8\)\]"),
    ],
)
def test_invalid_settings_name_the_setting_and_accepted_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        kvpass.kv4(**kwargs)


def test_asymmetric_grids_leave_the_default_clipping_off():
    config = kvpass.kv4(k_symmetric=False).config
    assert not config.k.clip and config.v.clip == KVConfig().v.clip


def test_debug_env_logs_diff_and_site_table_and_saves_files(tmp_path, caplog, monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setenv("KVPASS_DEBUG", "1")
    backends = []
    with caplog.at_level(logging.INFO, logger="kvpass"):
        for layers in (1, 2):  # two models, each with a backend of its own, saving into one folder
            model = kv_heavy_llama(layers=layers)
            backends.append(kvpass.kv4(debug_dir=str(tmp_path)))
            model.compile(backend=backends[-1])
            model.generate(_ids(10), max_new_tokens=3, do_sample=False)
    assert "+++ graph_" in caplog.text and "kv4_decode" in caplog.text
    assert "model.layers.1.self_attn" in caplog.text and "int4" in caplog.text
    names = [graph.name for backend in backends for graph in backend.graphs]
    assert len(backends[0].graphs) >= 2 and len(set(names)) == len(names)
    for ending in ("before.py", "after.py", "diff", "sites.txt"):
        assert sorted(p.name for p in tmp_path.glob(f"*.{ending}")) == sorted(f"{name}.{ending}" for name in names)
    assert (tmp_path / f"{backends[0].graphs[0].name}.diff").read_text() == backends[0].graphs[0].diff
    shown = repr(backends[1].graphs)  # names and sites; the code is .before/.after, too long to print
    assert "def forward" not in shown and "module='model.layers.1.self_attn'" in shown


def test_a_debug_folder_alone_saves_each_graph_and_a_bad_one_is_refused(tmp_path, monkeypatch):
    torch._dynamo.reset()
    monkeypatch.delenv("KVPASS_DEBUG", raising=False)
    monkeypatch.delenv("KVPASS_DEBUG_DIR", raising=False)
    backend = kvpass.kv4(debug_dir=tmp_path / "graphs")  # an os.PathLike, debug left off
    model = kv_heavy_llama(layers=1)
    model.compile(backend=backend)
    model.generate(_ids(10), max_new_tokens=2, do_sample=False)
    saved = sorted(p.name for p in (tmp_path / "graphs").glob("*.diff"))
    assert saved == sorted(f"{g.name}.diff" for g in backend.graphs)
    with pytest.raises(ValueError, match=r"debug_dir must be a folder's path \(a str or os.PathLike\) or None, got 1"):
        kvpass.kv4(debug_dir=1)


# inductor compiles C++ on CPU: about 20 s on 2 cores, worth it for the default GPU inner compiler.
# (aot_eager, the same AOT graphs without code generation, runs in tests/test_static.py.)
@torch.no_grad()
def test_inductor_inner_compiler_gives_the_eager_inner_tokens():
    ids = _ids(70)
    results = []
    for name in ("eager", "inductor"):
        torch._dynamo.reset()
        model = kv_heavy_llama(layers=1)
        tokens, cache = greedy_forward_loop(torch.compile(model, backend=kvpass.kv4(inner=name)), ids, 8)
        assert isinstance(cache.layers[0].keys, PackedKV)
        results.append(tokens)
    assert torch.equal(*results)


def test_an_ignored_compile_mode_is_warned_about_once_per_mode(caplog):
    """The eager inner compiler cannot run CUDA graphs: a user asking for them learns so, once."""
    def step(x):
        x = x.sin()
        torch._dynamo.graph_break()  # two graphs, each handed the mode
        return x + 1

    torch._dynamo.reset()
    kvpass.backend._warn_ignored.cache_clear()  # another test may have been warned already
    with caplog.at_level(logging.WARNING, logger="kvpass"):
        torch.compile(step, backend="kv4", mode="reduce-overhead")(torch.randn(3))
        torch.compile(step, backend="kv4", mode="max-autotune")(torch.randn(3))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "eager inner compiler ignores mode='reduce-overhead'" in warnings[0]
    assert "kv4(inner='inductor')" in warnings[0]
    assert "mode='max-autotune'" in warnings[1]


@torch.no_grad()
def test_compile_options_set_kv4s_settings():
    """``torch.compile(..., backend="kv4", options=...)`` is how a registered backend takes settings (and
    ``CompileConfig(backend="kv4", options=...)`` generate's compile route): the same caches and logits
    as the ``kvpass.kv4(...)`` backend with those settings, recorded in that configuration's backend."""
    settings = {"bits": 8, "k_layer_bits": {0: 4}}
    recorded, recorded_by_default = len(kvpass.default_backend(**settings).graphs), len(kvpass.default_backend().graphs)
    results = []
    for backend, options in (("kv4", settings), (kvpass.kv4(**settings), None)):
        torch._dynamo.reset()
        model = kv_heavy_llama()
        out = torch.compile(model, backend=backend, options=options)(input_ids=_ids(70), use_cache=True)
        results.append(out)
    cache = returned_cache(results[0])
    assert [(layer.keys.spec.bits, layer.values.spec.bits) for layer in cache.layers] == [(4, 8), (8, 8)]
    assert torch.equal(results[0].logits, results[1].logits)
    assert all(same_stored_bits(*pair) for pair in zip(*map(cache_tensors, map(returned_cache, results))))
    assert len(kvpass.default_backend(**settings).graphs) == recorded + 1
    assert len(kvpass.default_backend().graphs) == recorded_by_default


@pytest.mark.parametrize(
    "backend, options, says",
    [("kv4", {"k_layer_bit": {0: 8}}, r"options \['k_layer_bit'\] are not kv4 settings.*'k_layer_bits'"),
     ("kv4", {"trace.enabled": True}, r"the eager inner compiler takes no options.*need inner='inductor'"),
     ("kv4", {"bits": 3}, r"bits must be one of \[2, 4, 8\], got 3"),
     (kvpass.kv4(), {"bits": 8}, r"options \['bits'\] are kv4 settings.*kvpass.kv4\(bits=...\)")],
)  # fmt: skip
def test_compile_options_kv4_cannot_take_are_refused(backend, options, says):
    """A misspelt setting applied to nothing but a warning before options carried settings."""
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=says):
        torch.compile(lambda x: x.sin(), backend=backend, options=options)(torch.randn(3))


@pytest.mark.parametrize("prompt", [5, 200])
@torch.no_grad()
def test_second_plane_adds_no_graph_to_a_generate(prompt):
    """The plane's length follows the cache's; kept sequence-major, built from at most ``refine``
    new rows and marked unbacked by the append that makes it, it costs no graph, though a short
    prompt's plane grows 0 -> 1 -> 2 (a backed length would be a graph at each: Dynamo specialises 0
    and 1). With a plane or without: the prompt's graph and one decode graph, the cache's length a
    symbol from the first."""
    counts = []
    for refine in (0, 64):
        torch._dynamo.reset()
        model = kv_heavy_llama(layers=1)
        backend = kvpass.kv4(refine=refine)
        model.compile(backend=backend)
        model.generate(_ids(prompt), max_new_tokens=30, do_sample=False)
        counts.append(len(backend.graphs))
    assert counts == [2, 2]


@pytest.mark.parametrize("prompt", [200, 520])
@torch.no_grad()
def test_the_decode_graph_takes_only_the_lengths_appends_change_as_symbols(prompt):
    """Each symbol costs the trace (``benchmarks/decode_compiles.py``): the decode graph takes the codes'
    and scales' lengths as symbols, and K's sinks, offset and query scales as constants, as it does
    a second plane once it holds as many rows as every longer cache's (from 512 tokens)."""
    torch._dynamo.reset()
    model = kv_heavy_llama(layers=1)
    backend, caches = kvpass.kv4(), []

    def keeping_caches(gm, example_inputs, **options):
        traced = (node.meta.get("example_value") for node in gm.graph.find_nodes(op="placeholder"))
        caches.append([x for x in traced if isinstance(x, PackedKV)])
        return backend(gm, example_inputs, **options)

    model.compile(backend=keeping_caches)
    model.generate(_ids(prompt), max_new_tokens=3, do_sample=False)
    assert [len(graph_caches) for graph_caches in caches] == [0, 2]  # the prompt's graph, one decode graph
    keys, values = sorted(caches[1], key=lambda cache: not cache.spec.sinks)

    def symbolic(t):
        return isinstance(t.shape[2], torch.SymInt)

    assert all(symbolic(t) for t in (keys.codes, keys.scales, values.codes, values.scales))
    assert not any(symbolic(t) for t in (keys.head, keys.offset, keys.query_scales))
    assert [symbolic(t) for t in (keys.fine_codes, keys.fine_scales, values.fine_codes, values.fine_scales)] == [
        prompt < 512
    ] * 4


@pytest.mark.parametrize("prompt, graphs", [(5, 4), (8, 4), (200, 2)])
@torch.no_grad()
def test_a_deferred_k_prefix_adds_a_graph_while_waiting_and_one_where_it_ends(prompt, graphs):
    """K's deferred prefix (the default): a short prompt's decode compiles its waiting steps, the step
    that reaches 64 tokens, then the usual decode graph; a long prompt never waits, and compiles one
    decode graph."""
    torch._dynamo.reset()
    model = kv_heavy_llama(layers=1)
    backend = kvpass.kv4()
    model.compile(backend=backend)
    out = model.generate(_ids(prompt), max_new_tokens=80, do_sample=False, return_dict_in_generate=True)
    assert len(backend.graphs) == graphs
    keys = returned_cache(out).layers[0].keys
    assert keys.n_head == 4 and keys.query_scales.shape[2] == 1 and keys.residual.shape[2] == 0


@torch.no_grad()
def test_k_layer_bits_stores_the_named_layers_keys_with_those_bits():
    model = kv_heavy_llama()
    ids = _ids(70)
    caches = {}
    backends = {"default": kvpass.kv4(), "k8": kvpass.kv4(k_bits=8), "mixed": kvpass.kv4(k_layer_bits={0: 8})}
    for name, backend in backends.items():
        torch._dynamo.reset()
        step = torch.compile(model, backend=backend)
        out = step(input_ids=ids, **cache_arg(DynamicCache()), use_cache=True)
        for token in (5,):  # a decode step, fed the same token in every run
            out = step(input_ids=torch.tensor([[token]]), **cache_arg(returned_cache(out)), use_cache=True)
        caches[name] = returned_cache(out).layers
        assert all(site.rewritten for g in backend.graphs for site in g.sites)
    mixed, default, k8 = caches["mixed"], caches["default"], caches["k8"]
    assert [layer.keys.spec.bits for layer in mixed] == [8, 4]
    assert [layer.values.spec.bits for layer in mixed] == [4, 4]
    # Layer 0 sees the same inputs in every run: its keys are k8's, bit for bit, its values the default's.
    for got, want in [(mixed[0].keys, k8[0].keys), (mixed[0].values, default[0].values)]:
        assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)
        assert torch.equal(got.dequantize(), want.dequantize())


@torch.no_grad()
def test_a_cache_keeps_the_settings_it_was_made_with_under_a_model_compiled_again():
    # README: compiled again with other settings, a model appends to an existing cache under its own
    # settings (no number read under the wrong ones) and makes new caches with the new ones.
    torch._dynamo.reset()
    model = kv_heavy_llama()
    ids = _ids(70)
    made = returned_cache(torch.compile(model, backend=kvpass.kv4())(input_ids=ids, **cache_arg(DynamicCache()),
                                                                        use_cache=True))  # fmt: skip
    expected = [layer.keys.dequantize() for layer in made.layers]
    token = torch.tensor([[5]])
    default_step = torch.compile(model, backend=kvpass.kv4())
    same_settings = default_step(input_ids=token, **cache_arg(copy.deepcopy(made)), use_cache=True)
    step = torch.compile(model, backend=kvpass.kv4(bits=8))
    out = step(input_ids=token, **cache_arg(made), use_cache=True)
    assert torch.equal(out.logits, same_settings.logits)
    for layer, before in zip(returned_cache(out).layers, expected):
        assert layer.keys.spec.bits == 4 and layer.values.spec.bits == 4
        assert torch.equal(layer.keys.dequantize()[:, :, :70], before)
    fresh = returned_cache(step(input_ids=ids, **cache_arg(DynamicCache()), use_cache=True))
    assert {(layer.keys.spec.bits, layer.values.spec.bits) for layer in fresh.layers} == {(8, 8)}


@torch.no_grad()
def test_query_scaled_keys_take_their_scales_from_the_sites_query():
    """Query-scaled K (the default): the prefill graph hands each K cache its site's query (a decode
    step reading them is checked against the eager twin above, "default")."""
    torch._dynamo.reset()
    model = kv_heavy_llama()
    backend = kvpass.kv4(k_query_scaled=True)
    assert backend.config.k.query_scaled and not backend.config.v.query_scaled
    step = torch.compile(model, backend=backend)
    ids = _ids(100, batch=2)
    cache = DynamicCache()
    step(input_ids=ids, **cache_arg(cache), use_cache=True)
    heads, head_dim = model.config.num_key_value_heads, model.config.head_dim
    for layer in cache.layers:
        assert layer.keys.query_scales.shape == (2, heads, 1, head_dim) and layer.values.query_scales is None
        assert layer.keys.query_scales.float().std() > 0.01  # not all ones: the queries set them
    assert all(site.rewritten and not site.reason for g in backend.graphs for site in g.sites)
    prefill = next(g for g in backend.graphs if any(site.phase == "prefill" for site in g.sites))
    packs = [line for line in prefill.after.splitlines() if "kv4_pack(" in line]
    assert sorted("query = " in line for line in packs) == [False, False, True, True]  # K's packs only
    # Heads under 32 channels keep plain groups, and say that K has no query scales.
    torch._dynamo.reset()
    narrow = kvpass.kv4(k_query_scaled=True)
    cache = DynamicCache()
    torch.compile(kv_heavy_llama(head_dim=16), backend=narrow)(input_ids=ids, **cache_arg(cache), use_cache=True)
    assert cache.layers[0].keys.query_scales is None
    assert all("K head_dim 16: stored without query scales" in site.reason for g in narrow.graphs for site in g.sites)


@torch.no_grad()
def test_query_rounded_keys_are_handed_their_sites_query_at_every_write():
    """Query-rounded K: each K write, decode steps' too, gets its site's query; the cache stores the
    scales and bytes of rounding to nearest, with other codes (which: PackedKV's tests, and the twin
    above, "query-rounded")."""
    model, ids = kv_heavy_llama(), _ids(100, batch=2)
    caches = {}
    for rounded in (False, True):
        torch._dynamo.reset()
        backend = kvpass.kv4(k_query_rounded=rounded)
        step, cache = torch.compile(model, backend=backend), DynamicCache()
        step(input_ids=ids, **cache_arg(cache), use_cache=True)
        for seed in (1, 2, 3):
            step(input_ids=_ids(1, batch=2, seed=seed), **cache_arg(cache), use_cache=True)
        caches[rounded] = cache
    assert backend.config.k.query_rounded and not backend.config.v.query_rounded
    assert all(site.rewritten and not site.reason for g in backend.graphs for site in g.sites)
    writes = [line for g in backend.graphs for line in g.after.splitlines() if "kv4_pack(" in line or "kv4_append(" in line]
    k_writes = [line for line in writes if ":qr'" in line]
    assert len(k_writes) == len(writes) / 2 and all("query = " in line for line in k_writes)
    decodes = [line for g in backend.graphs for line in g.after.splitlines() if "kv4_decode(" in line]
    assert decodes and all("query = " in line for line in decodes)  # decode steps too
    assert all(layer.keys.spec.query_rounded and not layer.values.spec.query_rounded for layer in caches[True].layers)
    # Layer 0 reads the same tokens either way (later layers read what K's codes changed).
    near, rounded = caches[False].layers[0], caches[True].layers[0]
    assert torch.equal(near.keys.scales, rounded.keys.scales) and torch.equal(near.values.codes, rounded.values.codes)
    assert near.keys.stored_bytes() == rounded.keys.stored_bytes()
    assert not torch.equal(near.keys.codes, rounded.keys.codes)
    # Heads under 32 channels keep plain groups, and say that K is rounded to nearest.
    torch._dynamo.reset()
    narrow = kvpass.kv4(k_query_rounded=True)
    torch.compile(kv_heavy_llama(head_dim=16), backend=narrow)(input_ids=ids, **cache_arg(DynamicCache()), use_cache=True)
    assert all("K head_dim 16: stored without query scales and query rounding" in site.reason
               for g in narrow.graphs for site in g.sites)  # fmt: skip


def test_k_layer_bits_names_a_bad_layer_or_bits():
    with pytest.raises(ValueError, match=r"k_layer_bits: layer '1' is not a layer index"):
        kvpass.kv4(k_layer_bits={"1": 8})
    with pytest.raises(ValueError, match=r"k_layer_bits\[3\]: bits must be one of \[2, 4, 8\], got 5"):
        kvpass.kv4(k_layer_bits={3: 5})


@torch.no_grad()
@pytest.mark.parametrize("model_name, k_layer_bits, unknown", [
    ("llama", {2: 8}, "layer(s) 2, where no compiled graph has an attention site (the sites are in layers 0-1)"),
    ("llama", {1: 8}, None),
    ("lfm2", {0: 8, 1: 8}, "layer(s) 0, where no compiled graph has an attention site (the sites are in layers 1)"),
], ids=["past-the-last-layer", "a-layer-of-the-model", "a-convolution-layer"])  # fmt: skip
def test_k_layer_bits_naming_a_layer_without_attention_says_so(model_name, k_layer_bits, unknown, caplog):
    # The backend sees graphs, not the model: a layer past the last (counted from 1), or a hybrid model's
    # convolution layer, would otherwise take the bits without a word.
    torch._dynamo.reset()
    model = build(model_name)
    model.compile(backend=kvpass.kv4(k_layer_bits=k_layer_bits))
    with caplog.at_level(logging.WARNING, logger="kvpass"):
        model.generate(_ids(20), max_new_tokens=3, do_sample=False)
    warnings = [r.getMessage() for r in caplog.records if "k_layer_bits" in r.getMessage()]
    said = (f"kvpass: k_layer_bits names {unknown}: their bits apply to nothing. A layer's index is the number in "
            "its module path, from 0 (model.layers.0.self_attn)")  # fmt: skip
    assert warnings == ([] if unknown is None else [said])


def test_layer_index_is_the_last_number_in_the_module_path():
    assert passes.layer_index("model.layers.11.self_attn") == 11
    assert passes.layer_index("transformer.h.3.attn") == 3
    assert passes.layer_index("model.decoder.layers.2.blocks.0.attn") == 0
    assert passes.layer_index("attn") is None


@torch.no_grad()
def test_a_cache_shared_by_later_layers_is_read_with_its_writers_k_bits(caplog):
    from transformers import AutoModelForCausalLM

    from kvpass.coverage import tiny_config

    config = tiny_config("gemma3n_text")  # layers 2 and 3 read the caches of layers 0 and 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    torch._dynamo.reset()
    caplog.set_level(logging.DEBUG, logger="kvpass")
    backend = kvpass.kv4(k_layer_bits={0: 8})
    step = torch.compile(model, backend=backend)
    out = step(input_ids=_ids(70), **cache_arg(DynamicCache(config=config)), use_cache=True)
    out = step(input_ids=_ids(1), **cache_arg(returned_cache(out)), use_cache=True)
    assert [layer.keys.spec.bits for layer in returned_cache(out).layers[:2]] == [8, 4]
    decode = backend.graphs[-1]
    reads = [line for line in decode.after.splitlines() if "kv4_sdpa(" in line and "layers_0_keys" in line]
    assert len(reads) == 2 and all("k_spec = 'int8:" in line for line in reads)  # layers 0 and 2
    # The writers' appends stay apart from their attention, as other layers read what they write.
    assert "kv4_decode(" not in decode.after
    assert re.search(r"appends apart from its attention: cache write \w+ has other readers", caplog.text)
    notes = {site.module: site.reason for site in decode.sites}
    assert "keeps its K spec int8:" in notes["model.layers.2.self_attn"]
    # The readers' queries come after the writes, which their writers stored with query scales already.
    assert reference.fixed_or_none(returned_cache(out).layers[1].keys.query_scales) is not None
    assert not any("K is stored without" in why for why in notes.values())
    # Layer 0 keeps its own spec; its window (31 tokens kept) is under the 64 a short prompt's K waits for.
    assert notes["model.layers.0.self_attn"] == ("K's sliding window keeps 31 tokens, under the 64 its prefix "
                                                 "waits for: from a shorter prompt on, its K stays unquantized")


@torch.no_grad()
def test_a_sliding_window_shorter_than_k_prefix_tokens_is_named_where_k_would_wait_for_good():
    model = sliding_mistral()
    config = model.config
    note = "K's sliding window keeps 99 tokens, under the 128 its prefix waits for"
    for prefix_tokens in (64, 128):
        torch._dynamo.reset()
        backend = kvpass.kv4(k_prefix_tokens=prefix_tokens)
        step = torch.compile(model, backend=backend)
        out = step(input_ids=_ids(90), **cache_arg(DynamicCache(config=config)), use_cache=True)
        for _ in range(10):  # to 100 tokens seen, 99 kept
            out = step(input_ids=_ids(1), **cache_arg(returned_cache(out)), use_cache=True)
        keys = returned_cache(out).layers[0].keys
        assert keys.waiting == (prefix_tokens == 128) and keys.shape[2] == 99
        assert (note in backend.graphs[-1].sites[0].reason) == (prefix_tokens == 128)


@torch.no_grad()
def test_a_sliding_layers_decode_steps_share_graphs_and_dequantize_nothing():
    """HF's sliding layer slices its cache to the window every update; a slice that specialised the
    graph on the cache's length would recompile every decode step until the window is full (Gemma
    3's 512 tokens). The prompt's graph and one decode graph serve until the window is full, then
    the first eviction's graph and one more for every count of sinks left (4, 3, 2, 1, 0; each was
    a graph before). Every decode step's appends are one call with its attention: the eviction slices
    move after it, and the cache length HF reads for repeat_kv's view goes with that view."""
    torch._dynamo.reset()
    counted = dict(passes.counters)
    model = sliding_mistral()
    ids = _ids(130, seed=5)
    backend = kvpass.kv4()
    step = torch.compile(model, backend=backend)
    cache = DynamicCache(config=model.config)
    step(input_ids=ids[:, :70], **cache_arg(cache), use_cache=True)
    graphs = {}
    for token in range(70, 130):
        step(input_ids=ids[:, token : token + 1], **cache_arg(cache), use_cache=True)
        graphs[token] = len(backend.graphs)
    assert cache.layers[0].keys.shape[2] == 99 and isinstance(cache.layers[0].keys, PackedKV)
    assert (graphs[70], graphs[98], graphs[99], graphs[100], graphs[129]) == (2, 2, 3, 4, 4)
    assert all(".dequantize()" not in graph.after for graph in backend.graphs)
    assert all("kv4_decode(" in graph.after and "kv4_append" not in graph.after for graph in backend.graphs[1:])
    assert passes.counters["decode_appends_with_attention"] - counted.get("decode_appends_with_attention", 0) == 3


@torch.no_grad()
@pytest.mark.parametrize("head_dim, settings", [(16, {}), (64, {"refine": 0})], ids=["head-dim-16", "refine-0"])
def test_caches_without_a_second_plane_decode_in_one_op_a_layer(monkeypatch, head_dim, settings):
    """Per-token caches without a second code plane (heads under 32 channels, or refine=0) take one
    kv4::decode_step a layer too, storing what the three calls store."""
    from kvpass import cpu_steps

    k_specs = []
    decode_step = cpu_steps.decode_step

    def counted(*args):
        k_specs.append(args[11])  # the op's K spec
        return decode_step(*args)

    monkeypatch.setattr(cpu_steps, "decode_step", counted)
    model, ids = kv_heavy_llama(head_dim=head_dim), _ids(73, seed=2)
    runs = {}
    for one_op in (True, False):
        if not one_op:
            monkeypatch.setattr(packed, "_steps_as_one", lambda *args: False)
        torch._dynamo.reset()
        step, cache = torch.compile(model, backend=kvpass.kv4(**settings)), DynamicCache()
        logits = [step(input_ids=ids[:, :70], **cache_arg(cache), use_cache=True).logits]
        for token in range(70, 73):
            logits.append(step(input_ids=ids[:, token : token + 1], **cache_arg(cache), use_cache=True).logits)
        runs[one_op] = logits, cache
    assert len(k_specs) == 2 * 3 and not any(spec.refine for spec in k_specs)  # 3 decode steps of 2 layers
    (logits, cache), (apart_logits, apart_cache) = runs[True], runs[False]
    assert all(torch.equal(a, b) for a, b in zip(logits, apart_logits))
    for one, three in zip(cache.layers, apart_cache.layers):
        assert same_stored_bits(one.keys, three.keys) and same_stored_bits(one.values, three.values)


class _AttentionWithLogSumExp(torch.nn.Module):
    """Eager attention over a cache layer that also returns its scores' log-sum-exp (as flash-attention
    APIs do), which kvpass reads as an attention sink only where it scales the output."""

    def forward(self, q, k, v, cache):
        k, v = cache.update(k, v, 0)
        scores = q @ k.transpose(-2, -1) / 8.0
        return scores.softmax(-1) @ v, torch.logsumexp(scores, -1)


@torch.no_grad()
def test_an_attention_whose_scores_are_read_elsewhere_keeps_its_appends_apart(caplog):
    """The attention's nodes, the cache's views among them, outlive the fused op when its scores are read
    elsewhere too, so its appends cannot be one call with it; that read gets the cache dequantized."""
    torch._dynamo.reset()
    caplog.set_level(logging.DEBUG, logger="kvpass")
    module, backend = _AttentionWithLogSumExp(), kvpass.kv4()
    step, cache, twin = torch.compile(module, backend=backend), DynamicCache(), DynamicCache()
    x, y = (torch.randn(1, 2, n, 64, generator=torch.Generator().manual_seed(n)) for n in (70, 1))
    step(x, x, x, cache)
    module(x, x, x, twin)  # the past as the decode step reads it
    layer = cache.layers[0]
    twin.layers[0].keys, twin.layers[0].values = layer.keys.dequantize(), layer.values.dequantize()
    got = step(y, y, y, cache)
    assert isinstance(cache.layers[0].keys, PackedKV) and all(site.rewritten for site in backend.graphs[-1].sites)
    assert "kv4_append(" in backend.graphs[-1].after and "kv4_decode(" not in backend.graphs[-1].after
    assert re.search(r"appends apart from its attention: \w+, of its attention, is read elsewhere too", caplog.text)
    assert re.search(r"log-sum-exp of scores \w+ is read as no sink: \w+ is not read as logsumexp", caplog.text)
    assert packed.fallback_ops  # the log-sum-exp's read of the int4 cache
    torch.testing.assert_close(got[0], module(y, y, y, twin)[0], atol=1e-5, rtol=1e-5)
